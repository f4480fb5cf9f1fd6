"""`headbudget finetune` / `prune` argument handling on a tiny random BERT and the fixture data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import assert_names, error_line

FIX = Path(__file__).resolve().parent / "fixtures" / "cahp"
DATA = FIX / "sst5"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    tok = BertTokenizerFast(vocab_file=str(FIX / "vocab.txt"))
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=32,
                                                     max_position_embeddings=64, num_labels=5))
    out = tmp_path_factory.mktemp("cli") / "tiny"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_finetune_command_writes_model_and_history(tiny, tmp_path, capsys):
    from headbudget.cli.main import main

    out = tmp_path / "ft"
    rc = main(["finetune", str(tiny), "--task", "sst5", "--data-dir", str(DATA), "--out", str(out),
               "--epochs", "1", "--max-steps", "2", "--batch-size", "8", "--no-progress"])
    assert rc == 0
    hist = json.loads((out / "finetune.json").read_text())
    assert hist["steps"] == 2 and set(hist["final"]) == {"dev", "test"}
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    assert "fine-tuned" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "values"),
    [
        (["--epochs", "0"], ("--epochs", 1, 0)),
    ],
)
def test_finetune_bad_flags(tiny, tmp_path, capsys, extra, values):
    from headbudget.cli.main import main

    rc = main(["finetune", str(tiny), "--task", "sst5", "--data-dir", str(DATA), "--out", str(tmp_path / "o"), *extra])
    assert rc == 2
    assert_names(error_line(capsys.readouterr().err, "finetune"), *values)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--keep", "2", "--keep-ratio", "0.5"], "give a head count (keep) or a ratio (keep_ratio), not both"),
        (["--keep-ratio", "1.5"], "keep_ratio must be in (0, 1), got 1.5"),
        (["--pool-size", "1"], "pool_size must be >= 2, got 1"),
        (["--limit-train", "0"], "limit_train must be >= 1, got 0"),
        (["--keep", "4"], "cannot keep 4 heads: this model has 4 heads in 2 layers"),
        (["--method", "random"], "method random needs a head count (keep or keep_ratio)"),
    ],
)
def test_prune_bad_flags_one_line_errors(tiny, tmp_path, capsys, extra, message):
    from headbudget.cli.main import main

    rc = main(["prune", str(tiny), "--task", "sst5", "--data-dir", str(DATA), "--out", str(tmp_path / "o"),
               "--no-progress", "--finetune-epochs", "0", *extra])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.startswith("headbudget prune: error:")]
    assert len(lines) == 1 and message in lines[0]


def test_prune_missing_data_dir_is_an_error(tiny, tmp_path, capsys):
    from headbudget.cli.main import main

    rc = main(["prune", str(tiny), "--task", "sst5", "--data-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert rc == 2
    assert_names(error_line(capsys.readouterr().err, "prune"), tmp_path / "nope")
