"""`headbudget prune --task lm`: label-free head pruning of causal LMs, metric = held-out perplexity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

TEXT = Path(__file__).resolve().parent / "fixtures" / "lm" / "tiny_corpus.txt"
COMMON = ["--context", "32", "--calib-windows", "8", "--pool-size", "8", "--batch-size", "4", "--no-progress",
          "--device", "cpu"]


def _tiny_headbudget(path: Path, with_tokenizer: bool) -> Path:
    """A `headbudget train`-style run folder: run/model (weights) and, optionally, run/tokenizer (byte)."""
    from headbudget.data.tokenizers import ByteTokenizer
    from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    from headbudget.schedules import prism

    torch.manual_seed(0)
    cfg = HeadBudgetConfig(schedule=prism(3, 64, 32, 8), vocab_size=257, n_positions=64, dropout=0.0)
    model = HeadBudgetForCausalLM(cfg).eval()
    model.save_pretrained(path / "model")
    if with_tokenizer:
        ByteTokenizer().save(path / "tokenizer")
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return _tiny_headbudget(tmp_path_factory.mktemp("lm") / "run", with_tokenizer=True)


def test_prune_lm_cahp_cli_end_to_end(run_dir, tmp_path, capsys):
    from headbudget.cli.main import main
    from headbudget.data.tokenizers import ByteTokenizer
    from headbudget.models import HeadBudgetForCausalLM
    from headbudget.pruning.lm import lm_data, lm_perplexity, resolve_lm_tokenizer
    from headbudget.pruning.report import METRIC_KEYS, REPORT_KEYS

    out = tmp_path / "cahp"
    rc = main(["prune", str(run_dir), "--task", "lm", "--data", str(TEXT), "--method", "cahp", "--keep", "6",
               "--out", str(out), *COMMON])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "perplexity dense" in printed
    rep = json.loads((out / "report.json").read_text())
    assert tuple(rep) == REPORT_KEYS and tuple(rep["metric"]) == METRIC_KEYS
    assert rep["method"] == "cahp" and rep["heads_total"] == 2 + 4 + 8
    assert rep["heads_kept"] == 6 == sum(len(v) for v in rep["kept"].values())
    assert all(len(rep["kept"][str(layer)]) >= 1 for layer in range(3))
    assert rep["metric"]["finetuned"] is None  # lm default: no fine-tuning
    assert rep["metric"]["dense"] > 1 and rep["metric"]["pruned"] > 1
    details = json.loads((out / "details.json").read_text())
    assert details["metric_name"] == "perplexity" and details["calib_windows"] == 8
    assert "Perplexity (lower is better)" in (out / "report.md").read_text()

    # the saved model reloads with the pruned head counts and reproduces the reported perplexity
    model = HeadBudgetForCausalLM.from_pretrained(out / "model").eval()
    assert [model.transformer.h[i].attn.n_heads for i in range(3)] == [len(rep["kept"][str(i)]) for i in range(3)]
    assert list(model.config.head_schedule.heads) == [len(rep["kept"][str(i)]) for i in range(3)]
    kept_file = json.loads((out / "model" / "kept_heads.json").read_text())
    assert kept_file["kept"] == rep["kept"]
    tok, where = resolve_lm_tokenizer(out / "model")
    assert isinstance(tok, ByteTokenizer) and where.endswith("tokenizer")
    data = lm_data(tok, TEXT, context=32, calib_windows=8, vocab_size=257)
    ppl = lm_perplexity(model, data)["ppl"]
    assert ppl == pytest.approx(rep["metric"]["pruned"], rel=1e-4)
    dense = HeadBudgetForCausalLM.from_pretrained(run_dir / "model").eval()
    assert lm_perplexity(dense, data)["ppl"] == pytest.approx(rep["metric"]["dense"], rel=1e-4)


def test_prune_lm_baseline_with_tokenizer_flag_and_finetuning(tmp_path, capsys):
    """A model folder without a tokenizer takes --tokenizer byte; --finetune-epochs trains on the
    calibration windows and the fine-tuned perplexity is measured."""
    from headbudget.cli.main import main

    bare = _tiny_headbudget(tmp_path / "bare", with_tokenizer=False) / "model"
    out = tmp_path / "mag"
    rc = main(["prune", str(bare), "--task", "lm", "--data", str(TEXT), "--tokenizer", "byte", "--method",
               "magnitude", "--keep", "5", "--finetune-epochs", "3", "--lr", "3e-3", "--out", str(out), *COMMON])
    assert rc == 0, capsys.readouterr().err
    rep = json.loads((out / "report.json").read_text())
    assert rep["heads_kept"] == 5 and rep["knee_k"] is None
    m = rep["metric"]
    assert m["finetuned"] is not None and m["finetuned"] < m["pruned"]
    assert (out / "model" / "tokenizer" / "tokenizer_spec.json").is_file()


def test_prune_compare_lm_on_tiny_gpt2(tmp_path):
    """prune-compare with --task lm on a Hugging Face GPT-2: every method keeps CAHP's head count."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from headbudget.cli.prune_cmd import PruneJob, run_compare
    from headbudget.pruning.adapters import load_pruned

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=257, n_embd=32, n_layer=2, n_head=4, n_positions=64)).save_pretrained(
        tmp_path / "gpt2")
    job = PruneJob(str(tmp_path / "gpt2"), "lm", None, str(tmp_path / "cmp"), data=str(TEXT), tokenizer="byte",
                   context=32, calib_windows=8, pool_size=8, batch_size=4, keep=4, finetune_epochs=0,
                   progress=False, device="cpu")
    summary = run_compare(job, "cahp,random")
    assert summary["metric_name"] == "perplexity"
    assert [r["heads_kept"] for r in summary["rows"]] == [4, 4]
    model = load_pruned(tmp_path / "cmp" / "random" / "model")
    assert sum(m.attn.num_heads for m in model.transformer.h) == 4
    assert "lower is better" in (tmp_path / "cmp" / "compare.md").read_text()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "--task lm needs --data TEXT_FILE"),
        (["--data", str(TEXT), "--curve", "accuracy"], "--curve accuracy is for classification tasks"),
        (["--data", str(TEXT), "--context", "999"], "--context 999 exceeds the model's 64 positions"),
    ],
)
def test_prune_lm_one_line_errors(run_dir, tmp_path, capsys, extra, message):
    from headbudget.cli.main import main

    rc = main(["prune", str(run_dir), "--task", "lm", "--out", str(tmp_path / "o"), "--no-progress", *extra])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.startswith("headbudget prune: error:")]
    assert len(lines) == 1 and message in lines[0], err


def test_prune_lm_model_without_tokenizer_needs_flag(tmp_path, capsys):
    from headbudget.cli.main import main

    bare = _tiny_headbudget(tmp_path / "bare", with_tokenizer=False) / "model"
    rc = main(["prune", str(bare), "--task", "lm", "--data", str(TEXT), "--keep", "5", "--out", str(tmp_path / "o"),
               "--no-progress"])
    assert rc == 2
    assert "the model folder has no tokenizer; give --tokenizer" in capsys.readouterr().err
