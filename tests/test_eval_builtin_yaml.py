"""The built-in zero-shot tasks as lm-eval YAML files (headbudget/evaluation/lm_eval_tasks): with lm-eval
installed `headbudget eval --tasks piqa` runs them through lm-eval's task system, and they score every
document exactly as the built-in path without lm-eval does (same prompts, same tokenization, same scorer).
Offline: the rows come from tests/fixtures/zeroshot."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest
from tests.test_eval_zeroshot import FIXTURES, byte_tokenizer, tiny_gpt2

from conftest import assert_names, error_line
from headbudget.cli.main import main
from headbudget.evaluation.tasks import TASKS, load_examples

lm_eval = pytest.importorskip("lm_eval")

from tests.test_eval_harness import _offline_one_thread  # noqa: E402, F401  (autouse: offline, one thread)

ROOT = Path(__file__).resolve().parents[1]
TASK_FILES = ROOT / "src" / "headbudget" / "evaluation" / "lm_eval_tasks"


def test_every_builtin_task_has_a_yaml_file_and_a_fixture():
    assert sorted(p.stem for p in TASK_FILES.glob("*.yaml")) == sorted(TASKS)
    assert all((FIXTURES / spec.local_file).is_file() for spec in TASKS.values())


def test_yaml_tasks_score_every_document_as_the_builtin_path():
    """Same (context, continuation) pairs, per-document log-likelihoods equal to 1e-5 relative, same
    predictions and the same acc/acc_norm, for all seven tasks."""
    from headbudget.evaluation.harness import evaluate_harness
    from headbudget.evaluation.zeroshot import evaluate_tasks

    model, tok = tiny_gpt2(), byte_tokenizer()
    tasks = sorted(TASKS)
    scores: dict[str, list[list[float]]] = {}
    builtin = evaluate_tasks(model, tok, tasks, data_dir=str(FIXTURES), progress=False, scores_out=scores)
    out = evaluate_harness(model, tok, tasks, data_dir=str(FIXTURES), log_samples=True, progress=False)
    for task in tasks:
        samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        examples = load_examples(task, FIXTURES)
        assert len(samples) == len(examples) == len(scores[task]) >= 2
        for s, ex, lls in zip(samples, examples, scores[task], strict=True):
            assert [tuple(a) for a in s["arguments"]] == list(zip(ex.contexts, ex.continuations, strict=True))
            got = [r[0][0] for r in s["resps"]]
            # the two paths batch the documents differently (lm-eval groups all tasks' requests): float32
            # sums in another order; measured 1.2e-7 here, 2.4e-6 on SmolLM2 -- 1e-5 leaves room for
            # another CPU's kernels (the batch-size-1 comparison below is exact)
            assert got == pytest.approx(lls, rel=1e-5, abs=0)
        assert out["predictions"][task] == builtin["predictions"][task]
        for metric in TASKS[task].metrics:
            assert out["results"][task][f"{metric},none"] == builtin["results"][task][metric], (task, metric)

    # one row per pass, so no batch layout differs: bit-identical
    scores.clear()
    evaluate_tasks(model, tok, tasks, data_dir=str(FIXTURES), batch_size=1, progress=False, scores_out=scores)
    out = evaluate_harness(model, tok, tasks, data_dir=str(FIXTURES), batch_size=1, log_samples=True,
                           progress=False)
    for task in tasks:
        samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        assert [[r[0][0] for r in s["resps"]] for s in samples] == scores[task], task


def test_eval_reads_the_packaged_yaml_with_the_data_dir(tmp_path, capsys):
    model_dir = tmp_path / "m"
    tiny_gpt2().save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "r.json"
    assert main(["eval", str(model_dir), "--tasks", "piqa,copa", "--data-dir", str(FIXTURES), "--json", str(out)]) \
        == 0  # not --quiet: the timing lines are printed
    r = json.loads(out.read_text())
    for task, split, rows in (("piqa", "validation", 3), ("copa", "validation", 2)):
        cfg = r["configs"][task]
        assert cfg["metadata"]["task_file"] == str(TASK_FILES / f"{task}.yaml")
        assert cfg["dataset_path"] == "json" and cfg.get("training_split") is None
        assert cfg["dataset_kwargs"]["data_files"] == {split: str(FIXTURES / f"{task}_validation.jsonl")}
        assert r["n-samples"][task] == {"original": rows, "effective": rows}
    assert "lm-eval tasks piqa,copa:" in capsys.readouterr().out


def test_a_bad_row_is_one_line_before_the_model_loads(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    good = (FIXTURES / "piqa_validation.jsonl").read_text().splitlines()
    (data / "piqa_validation.jsonl").write_text(good[0] + "\n" + good[1].replace('"sol2"', '"sol_2"') + "\n")
    rc = main(["eval", str(tmp_path / "no-such-model"), "--tasks", "piqa", "--data-dir", str(data)])
    assert rc == 2
    assert_names(error_line(capsys.readouterr().err, "eval"), f"{data / 'piqa_validation.jsonl'}:2", "sol2")


def test_the_task_files_are_package_data():
    """A wheel carries every file of lm_eval_tasks (the YAML files and the prompts they call)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["headbudget"]
    files = [f"evaluation/lm_eval_tasks/{p.name}" for p in TASK_FILES.iterdir() if p.is_file()]
    assert len(files) == len(TASKS) + 2  # and prompts.py, __init__.py
    assert [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)] == []


def test_a_builtin_task_offline_without_data_dir_points_at_data_dir(tmp_path, monkeypatch, capsys):
    import datasets
    import huggingface_hub.constants

    # empty caches: the hub's piqa is never found locally, whatever this machine downloaded before
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"), raising=False)
    rc = main(["eval", str(tmp_path / "no-such-model"), "--tasks", "piqa", "--limit", "2"])
    assert rc == 2
    # was: "point a task YAML at local files and pass its folder with --include-path" (the built-in file exists)
    assert_names(error_line(capsys.readouterr().err, "eval"), "piqa", "--data-dir")
