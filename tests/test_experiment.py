"""Synthetic experiments at tiny sizes: results structure, real measured values, CLI outputs, and the ``out`` /
``progress`` a config file gives."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import assert_names, error_line, names
from headbudget.cli.main import main
from headbudget.experiments.ngram import NgramConfig, OneLayerAttention, _batch, run_ngram
from headbudget.experiments.saturation import SaturationConfig, SingleHead, _saturation_dim, run_saturation


def test_saturation_tiny_student_at_teacher_width_beats_narrow():
    cfg = SaturationConfig(seq_lens=(8, 16), student_dims=(1, 8), d_model=8, teacher_dim=8, steps=60,
                           lrs=(0.1,), tokens_per_step=256, eval_tokens=512, threads=1)
    r = run_saturation(cfg, progress=False)
    assert set(r["results"]) == {"8", "16"}
    for L in ("8", "16"):
        errs = r["results"][L]
        # a student as wide as the teacher can represent it exactly; rank 1 cannot
        assert errs["8"]["normalised_error"] < 0.5 * errs["1"]["normalised_error"]
        assert 0 < errs["1"]["normalised_error"] < 2
        st = r["teacher_logits"][L]
        assert st["logit_std"] == pytest.approx(2.0, rel=0.35)  # logit_scale
        assert 0 < st["attention_entropy_normalised"] <= 1
    assert r["summary"]["verdict"].split(":")[0] in ("agrees", "partly agrees", "disagrees")
    assert torch.get_num_threads() >= 1  # restored


def test_saturation_helpers():
    assert _saturation_dim({1: 1.0, 2: 0.5, 4: 0.1, 8: 0.0}) == 4
    assert _saturation_dim({1: 0.2, 2: 0.3}) == 1
    g = torch.Generator().manual_seed(0)
    head = SingleHead(4, 2, 3, 0.5, g)
    x = torch.randn(2, 5, 4, generator=g)
    y = head(x)
    p = torch.softmax((x @ head.wq.T) @ (x @ head.wk.T).transpose(-1, -2) * 0.5, -1)
    assert torch.allclose(y, p @ (x @ head.wv.T))


def test_ngram_targets_and_model_shapes():
    cfg = NgramConfig(budget=8, offsets=(1, 3), vocab=5, seq_len=10, d_model=8)
    tokens, targets = _batch(cfg, 4, torch.Generator().manual_seed(0))
    assert targets.shape == (4, 7, 2)
    assert torch.equal(targets[:, :, 0], tokens[:, 2:9]) and torch.equal(targets[:, :, 1], tokens[:, 0:7])
    m = OneLayerAttention(cfg, 4, torch.Generator().manual_seed(0))
    assert m(tokens).shape == (4, 10, 2, 5) and m.head_dim == 2
    # causal: changing a later token does not change earlier outputs
    t2 = tokens.clone()
    t2[:, -1] = (t2[:, -1] + 1) % 5
    assert torch.allclose(m(tokens)[:, :-1], m(t2)[:, :-1])
    with pytest.raises(ValueError, match=names("--heads", 3, "--budget", 8)):
        NgramConfig(budget=8, head_counts=(3,)).splits()


def test_ngram_tiny_learns_single_offset():
    cfg = NgramConfig(budget=16, head_counts=(1, 2), offsets=(1,), vocab=4, seq_len=8, d_model=16, steps=150,
                      batch=32, lr=1e-2, eval_batch=64, seeds=(0,), threads=1)
    r = run_ngram(cfg, progress=False)
    assert set(r["results"]) == {"1", "2"}
    # copying the previous token is learnable: far below chance (0.75 error)
    assert min(e["error_mean"] for e in r["results"].values()) < 0.3
    assert r["results"]["2"]["head_dim"] == 8
    assert r["summary"]["n_offsets"] == 1


def test_experiment_cli_tiny(tmp_path, capsys):
    rc = main(["experiment", "saturation", "--seq-lens", "8", "--dims", "1,4", "--d-model", "8",
               "--teacher-dim", "4", "--steps", "3", "--lrs", "0.1", "--tokens-per-step", "64",
               "--out", str(tmp_path / "sat"), "--no-progress"])
    assert rc == 0
    data = json.loads((tmp_path / "sat" / "saturation.json").read_text())
    assert data["config"]["student_dims"] == [1, 4] and data["config"]["steps"] == 3
    assert all(math.isfinite(v["normalised_error"]) for v in data["results"]["8"].values())
    assert (tmp_path / "sat" / "saturation.png").stat().st_size > 1000
    rc = main(["experiment", "ngram", "--budget", "8", "--heads", "1,2", "--offsets", "1,2", "--vocab", "4",
               "--seq-len", "8", "--d-model", "8", "--steps", "3", "--batch", "4", "--seeds", "0",
               "--out", str(tmp_path / "ng"), "--no-progress"])
    assert rc == 0
    data = json.loads((tmp_path / "ng" / "ngram.json").read_text())
    assert sorted(data["results"]) == ["1", "2"] and data["config"]["offsets"] == [1, 2]
    assert (tmp_path / "ng" / "ngram.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "verdict:" in out and "wrote" in out
    assert main(["experiment", "ngram", "--budget", "8", "--heads", "3", "--out", str(tmp_path / "x")]) == 2
    assert_names(error_line(capsys.readouterr().err, "experiment"), "--heads", 3, "--budget", 8)
    assert main(["experiment", "saturation", "--dims", "0,2", "--out", str(tmp_path / "x")]) == 2
    assert_names(error_line(capsys.readouterr().err, "experiment"), "--dims", "0,2")


# ------------------------------------------------------------------ out / progress from a config file
_NGRAM_TINY = ["--budget", "8", "--heads", "1,2", "--offsets", "1", "--vocab", "4", "--seq-len", "8", "--d-model", "8",
               "--steps", "2", "--batch", "4", "--eval-batch", "8", "--seeds", "0"]


def test_experiment_runs_into_the_out_of_its_config_file(tmp_path, capsys):
    f = tmp_path / "cfg.yaml"
    f.write_text(f"out: {tmp_path / 'from_file'}\nprogress: false\n")
    capsys.readouterr()
    assert main(["experiment", "ngram", *_NGRAM_TINY, "--config", str(f), "--threads", "1"]) == 0
    captured = capsys.readouterr()
    result = json.loads((tmp_path / "from_file" / "ngram.json").read_text())
    assert "out" not in result["config"] and "progress" not in result["config"]  # where it reports: not a result
    assert "ngram:" not in captured.err  # progress: false in the file silenced the bar
