"""lm-eval tasks through headbudget's scorer: same numbers as lm-eval's hf backend, batch-size
independent, acc_norm by characters, lm-eval's output schema, the `headbudget` lm-eval model, and
the built-in tasks without lm-eval.  Local YAML tasks + JSONL data in tests/fixtures/lm_eval, offline."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.test_eval_zeroshot import FIXTURES, byte_tokenizer

from conftest import assert_names, error_line
from headbudget.cli.main import main

lm_eval = pytest.importorskip("lm_eval")

TASKS_DIR = Path(__file__).resolve().parent / "fixtures" / "lm_eval"


@pytest.fixture(autouse=True)
def _offline_one_thread(monkeypatch):
    """No hub access (datasets reads the flags from its config module), one thread, run in the
    fixture folder so that the YAML files' relative data_files resolve."""
    import datasets
    import huggingface_hub.constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.chdir(TASKS_DIR)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random GPT-2 with a 48-token context: long few-shot prompts get cut from the left
    and the rolling task needs several windows per text."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny48")
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=48, vocab_size=257,
                               bos_token_id=256, eos_token_id=256)).save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    return d


def _task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def _run(model, tasks, num_fewshot=None, model_args=None):
    """lm_eval.simple_evaluate on local tasks, samples logged, no bootstrap."""
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks,
                                   num_fewshot=num_fewshot, task_manager=_task_manager(),
                                   log_samples=True, bootstrap_iters=0)


def _lls(res, task):
    """Per document: the log-likelihood of each request, by doc id."""
    out = []
    for s in sorted(res["samples"][task], key=lambda s: s["doc_id"]):
        out.append([r[0] if isinstance(r, (list, tuple)) else r for r in s["filtered_resps"]])
    return out


@pytest.mark.parametrize("num_fewshot", [None, 2])
def test_same_results_as_lm_eval_hf_backend(model_dir, num_fewshot):
    """The registered `headbudget` model and lm-eval's HFLM give the same log-likelihood for every
    request, hence the same predictions and metrics (multiple choice, zero- and few-shot, and
    loglikelihood_rolling over texts longer than the context)."""
    from lm_eval.models.huggingface import HFLM

    tasks = ["hb_mc", "hb_rolling"]
    ref = _run(HFLM(pretrained=str(model_dir), batch_size=1, device="cpu"), tasks, num_fewshot)
    ours = _run("headbudget", tasks, num_fewshot, model_args=f"pretrained={model_dir},batch_size=7")
    ours32 = _run("headbudget", ["hb_mc"], num_fewshot, model_args=f"pretrained={model_dir},batch_size=32")
    for task in tasks:
        a, b = _lls(ours, task), _lls(ref, task)
        assert len(a) == len(b) == (11 if task == "hb_mc" else 4)
        np.testing.assert_allclose(np.concatenate(a), np.concatenate(b), rtol=1e-5, atol=1e-4)
    assert [int(np.argmax(x)) for x in _lls(ours, "hb_mc")] == [int(np.argmax(x)) for x in _lls(ref, "hb_mc")]
    for m in ("acc,none", "acc_norm,none"):
        assert ours["results"]["hb_mc"][m] == ref["results"]["hb_mc"][m]
        assert ours32["results"]["hb_mc"][m] == ref["results"]["hb_mc"][m]
    for m in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["hb_rolling"][m] == pytest.approx(ref["results"]["hb_rolling"][m], rel=1e-5)
    if num_fewshot:  # the few-shot contexts are lm-eval's, hence identical prompts
        assert [s["arguments"] for s in ours["samples"]["hb_mc"]] == \
            [s["arguments"] for s in ref["samples"]["hb_mc"]]
        assert ours["n-shot"]["hb_mc"] == 2


def test_fixed_few_shot_context_shared_across_documents(tmp_path):
    """MMLU-style few-shot (description + the same first-n shots for every document): the documents
    share rows under one copy of the context; log-likelihoods equal lm-eval's hf backend's."""
    from lm_eval.models.huggingface import HFLM
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=512, vocab_size=257,
                               bos_token_id=256, eos_token_id=256)).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    ref = _run(HFLM(pretrained=str(tmp_path), batch_size=4, device="cpu"), ["hb_mc_fixed"], 3)
    ours = _run("headbudget", ["hb_mc_fixed"], 3, model_args=f"pretrained={tmp_path},batch_size=4")
    a, b = _lls(ours, "hb_mc_fixed"), _lls(ref, "hb_mc_fixed")
    assert len(a) == 11
    np.testing.assert_allclose(np.concatenate(a), np.concatenate(b), rtol=1e-5, atol=1e-4)
    prompts = [s["arguments"][0][0] for s in sorted(ours["samples"]["hb_mc_fixed"], key=lambda s: s["doc_id"])]
    shared = len(os.path.commonprefix(prompts[4:]))  # documents 0-3 skip themselves among the shots
    assert shared > 100 and ours["results"]["hb_mc_fixed"]["acc,none"] == ref["results"]["hb_mc_fixed"]["acc,none"]


def test_loglikelihood_task_type_equals_hf_backend(model_dir):
    """output_type ``loglikelihood`` (lambada's shape: perplexity of the last word, acc = greedy):
    the same log-likelihoods and is_greedy flags as lm-eval's hf backend, so the same metrics."""
    from lm_eval.models.huggingface import HFLM

    ref = _run(HFLM(pretrained=str(model_dir), batch_size=1, device="cpu"), ["hb_lambada"])
    ours = _run("headbudget", ["hb_lambada"], model_args=f"pretrained={model_dir},batch_size=3")

    def resps(res):
        return [s["filtered_resps"][0] for s in sorted(res["samples"]["hb_lambada"], key=lambda s: s["doc_id"])]

    a, b = resps(ours), resps(ref)
    assert len(a) == 4 and [g for _, g in a] == [g for _, g in b]
    np.testing.assert_allclose([x for x, _ in a], [x for x, _ in b], rtol=1e-5, atol=1e-4)
    assert ours["results"]["hb_lambada"]["acc,none"] == ref["results"]["hb_lambada"]["acc,none"]
    assert ours["results"]["hb_lambada"]["perplexity,none"] == pytest.approx(
        ref["results"]["hb_lambada"]["perplexity,none"], rel=1e-5)


def test_hub_task_offline_is_one_line(model_dir, capsys):
    """A task whose dataset is on the hub, run offline: exit 2 and one line naming the task and the
    way out (a local YAML), no traceback."""
    from headbudget.cli.main import main

    rc = main(["eval", str(model_dir), "--tasks", "hb_hub", "--include-path", str(TASKS_DIR), "--quiet"])
    assert rc == 2
    assert_names(error_line(capsys.readouterr().err, "eval"), "hb_hub", "--include-path")


def test_predictions_do_not_depend_on_batch_size(model_dir):
    """Built-in and lm-eval tasks, zero- and few-shot: identical predictions (and log-likelihoods
    to float rounding) at batch sizes 1, 7 and 32."""
    from headbudget.evaluation.suite import SuiteSettings, evaluate_suite
    from headbudget.loading import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(str(model_dir))
    runs = {}
    for bs in (1, 7, 32):
        rep = evaluate_suite(model, tok, SuiteSettings(tasks=("piqa", "arc_easy", "hb_mc", "hb_rolling"),
                                                       data_dir=str(FIXTURES), include_path=str(TASKS_DIR),
                                                       batch_size=bs, log_samples=True, bootstrap_iters=0),
                             progress=False)
        few = evaluate_suite(model, tok, SuiteSettings(tasks=("hb_mc",), include_path=str(TASKS_DIR),
                                                       num_fewshot=3, batch_size=bs, log_samples=True,
                                                       bootstrap_iters=0), progress=False)
        runs[bs] = (rep, few)
    base, base_few = runs[1]
    assert set(base["predictions"]) == {"piqa", "arc_easy", "hb_mc"}
    for bs in (7, 32):
        rep, few = runs[bs]
        assert rep["predictions"] == base["predictions"]
        assert few["predictions"] == base_few["predictions"]
        for task in ("piqa", "arc_easy", "hb_mc", "hb_rolling"):
            np.testing.assert_allclose(np.concatenate(_lls(rep, task)), np.concatenate(_lls(base, task)),
                                       rtol=1e-5, atol=1e-4)
            if task == "hb_rolling":
                _assert_metrics_close(rep["results"][task], base["results"][task])
            else:  # accuracies are counts of identical predictions: exact
                assert rep["results"][task] == base["results"][task]


# Why this tolerance: a batch of another shape runs the same fp32 matmuls with another blocking, so each
# token's log-probability moves by float rounding (measured up to 4.2e-05 on SmolLM2, ~1e-6 here).  Rolling
# metrics are exp(-sum/words) of such sums, so they move by about the per-token error times tokens per word,
# relatively; 1e-4 covers that with room on any CPU while still catching a lost or double-counted window
# (which moves word_perplexity by whole percents).  Text fields (aliases) must be equal.
ROLLING_REL_TOL = 1e-4


def _assert_metrics_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, w in want.items():
        g = got[key]
        if isinstance(w, (int, float)) and not isinstance(w, bool) and isinstance(g, (int, float)):
            assert math.isclose(g, w, rel_tol=ROLLING_REL_TOL, abs_tol=1e-9), f"{key}: {g!r} vs {w!r}"
        else:
            assert g == w, f"{key}: {g!r} vs {w!r}"


def test_acc_norm_divides_by_characters_through_the_cli(model_dir, tmp_path, capsys):
    """`headbudget eval --include-path` on non-ASCII choices: acc_norm is the argmax of
    log-likelihood / len(choice) in characters (not bytes, not tokens), as lm-eval computes it."""
    out = tmp_path / "r.json"
    assert main(["eval", str(model_dir), "--tasks", "hb_mc", "--include-path", str(TASKS_DIR),
                 "--batch-size", "7", "--log-samples", "--bootstrap-iters", "0",
                 "--json", str(out), "--threads", "1"]) == 0  # not --quiet: the table is read below
    r = json.loads(out.read_text())
    docs = [json.loads(line) for line in (TASKS_DIR / "mc.jsonl").read_text(encoding="utf-8").splitlines()]
    (samples_file,) = tmp_path.glob("samples_hb_mc_*.jsonl")  # lm-eval's samples file, next to the JSON
    samples = sorted(map(json.loads, samples_file.read_text(encoding="utf-8").splitlines()),
                     key=lambda s: s["doc_id"])
    by_chars, by_bytes = [], []
    for doc, s in zip(docs, samples, strict=True):
        lls = np.array([float(x[0]) for x in s["filtered_resps"]])
        chars = np.array([len(c) for c in doc["choices"]], dtype=float)
        nbytes = np.array([len(c.encode("utf-8")) for c in doc["choices"]], dtype=float)
        by_chars.append(float(np.argmax(lls / chars) == doc["label"]))
        by_bytes.append(float(np.argmax(lls / nbytes) == doc["label"]))
        assert s["acc_norm"] == by_chars[-1]
    assert r["results"]["hb_mc"]["acc_norm,none"] == np.mean(by_chars)
    assert by_chars != by_bytes  # the data tells the two normalisations apart
    # lm-eval's schema, headbudget's own fields under "headbudget"
    assert r["n-shot"] == {"hb_mc": 0} and r["versions"]["hb_mc"] == 1.0
    assert r["configs"]["hb_mc"]["output_type"] == "multiple_choice"
    assert r["results"]["hb_mc"]["sample_len"] == 11 and len(r["headbudget"]["predictions"]["hb_mc"]) == 11
    assert torch.get_num_threads() == 1  # --threads applied by cli.main
    printed = capsys.readouterr().out
    assert "|hb_mc" in printed and "acc_norm" in printed


def test_generation_tasks_and_bad_flags_are_one_line_errors(model_dir, capsys):
    assert main(["eval", str(model_dir), "--tasks", "hb_gen", "--include-path", str(TASKS_DIR)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("headbudget eval: error: "), err
    assert_names(err[-1], "hb_gen", "generate_until")
    for flags, values in ((["--seed", "1,2"], ("--seed", 1, 4)),
                          (["--num-fewshot", "-1"], ("--num-fewshot", 0, -1)),
                          (["--include-path", "/nonexistent"], ("--include-path", "/nonexistent")),
                          (["--threads", "-2"], ("--threads", -2))):
        assert main(["eval", str(model_dir), "--tasks", "hb_mc", "--include-path", str(TASKS_DIR), *flags]
                    if "--include-path" not in flags else
                    ["eval", str(model_dir), "--tasks", "hb_mc", *flags]) == 2
        assert_names(error_line(capsys.readouterr().err, "eval"), *values)


def test_headbudget_is_registered_without_hiding_lm_eval_models():
    from lm_eval.api.registry import get_model

    import headbudget  # noqa: F401
    from headbudget.evaluation.harness import HeadBudgetLM

    assert get_model("headbudget") is HeadBudgetLM
    assert get_model("hf").__name__ == "HFLM"


def test_builtin_tasks_work_without_lm_eval(model_dir, tmp_path):
    """With lm-eval unimportable, `import headbudget` and the built-in tasks work; an lm-eval task
    name says which extra to install."""
    code = f"""
import sys
sys.modules["lm_eval"] = None  # as if the extra were not installed
import torch; torch.set_num_threads(1)
import headbudget
from headbudget.cli.main import main
rc = main(["eval", {str(model_dir)!r}, "--tasks", "piqa", "--data-dir", {str(FIXTURES)!r}, "--quiet",
           "--json", {str(tmp_path / 'r.json')!r}])
assert rc == 0, rc
assert main(["eval", {str(model_dir)!r}, "--tasks", "hb_mc"]) == 2
# lm-eval's per-document records need lm-eval: refused before the model loads (no such model here)
assert main(["eval", "/no/such/model", "--tasks", "piqa", "--log-samples", "--output-path", {str(tmp_path / 'o')!r}]) == 2
"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("headbudget eval: error: ")]
    assert_names(next(ln for ln in errors if "hb_mc" in ln), '"headbudget[lmeval]"')
    assert_names(next(ln for ln in errors if "--log-samples" in ln), '"headbudget[lmeval]"')
    assert not (tmp_path / "o").exists()
    assert json.loads((tmp_path / "r.json").read_text())["results"]["piqa"]["sample_len"] == 3


def test_rolling_metric_comparison_fails_cleanly_on_real_differences():
    """The batch-invariance comparison: rounding-sized moves pass, a percent-sized move fails with a
    plain AssertionError naming the metric (pytest.approx's repr crashed on the string alias field)."""
    want = {"alias": "hb_rolling", "word_perplexity,none": 41.25, "bits_per_byte,none": 2.5}
    _assert_metrics_close({**want, "word_perplexity,none": 41.25 * (1 + 2e-5)}, want)
    with pytest.raises(AssertionError, match="word_perplexity"):
        _assert_metrics_close({**want, "word_perplexity,none": 41.25 * 1.01}, want)
    with pytest.raises(AssertionError, match="alias"):
        _assert_metrics_close({**want, "alias": "other"}, want)
