"""`compare`: schedules x seeds on identical data, deterministic numbers, report files."""

from __future__ import annotations

import json

import pytest

from headbudget.cli.main import main
from headbudget.train import RunConfig
from headbudget.train.compare import parse_schedules, run_compare


def tiny(tmp_path) -> RunConfig:
    return RunConfig.from_dict({
        "name": "tinycmp",
        "model": {"preset": "cpu-tiny", "n_layers": 3, "d_model": 64, "n_heads": 2,
                  "prism_max_head_dim": 32, "prism_min_head_dim": 8},
        "data": {"source": "synthetic:20000", "tokenizer": "byte", "cache_dir": str(tmp_path / "cache")},
        "train": {"steps": 4, "batch_size": 4, "context": 32, "eval_every": 2, "eval_batches": 2,
                  "log_every": 2, "warmup_steps": 1, "lr": 3e-3, "progress": False, "threads": 1},
    })


def test_parse_schedules():
    assert parse_schedules("uniform, prism,uniform@32") == ["uniform", "prism", "uniform@32"]
    assert parse_schedules("2,2,4;prism") == ["2,2,4", "prism"]
    with pytest.raises(ValueError, match="twice"):
        parse_schedules("prism,prism")


def test_compare_is_deterministic_and_writes_reports(tmp_path):
    cfg = tiny(tmp_path).replace(train={"ckpt_every": 2})
    scheds = ["uniform", "prism", "uniform@32"]
    a = run_compare(cfg, scheds, 2, tmp_path / "a", save_models=False)
    # --no-save-models keeps what was asked for: no model/, no optimizer checkpoints per run
    run_dirs = [p for p in (tmp_path / "a").iterdir() if p.is_dir()]
    assert len(run_dirs) == 6 and all((d / "metrics.jsonl").is_file() for d in run_dirs)
    assert not [p for d in run_dirs for p in d.iterdir() if p.name in ("model", "checkpoints")]
    b = run_compare(cfg, scheds, 2, tmp_path / "b", save_models=False, plot=False)
    key = [(r["schedule"], r["seed"], r["params"], r["final_val_loss"], r["final_train_loss"]) for r in a["runs"]]
    assert key == [(r["schedule"], r["seed"], r["params"], r["final_val_loss"], r["final_train_loss"])
                   for r in b["runs"]]
    assert [(r["schedule"], r["seed"]) for r in a["runs"]] == [(s, seed) for seed in (0, 1) for s in scheds]
    assert len({r["params"] for r in a["runs"]}) == 1  # neutral schedules: identical parameter counts
    runs = {(r["schedule"], r["seed"]): r["final_val_loss"] for r in a["runs"]}
    assert runs[("uniform", 0)] != runs[("uniform", 1)]  # seeds differ
    p = a["schedules"]["prism"]
    vals = [runs[("prism", 0)], runs[("prism", 1)]]
    assert p["val_loss_mean"] == pytest.approx(sum(vals) / 2)
    assert p["val_loss_std"] == pytest.approx(abs(vals[0] - vals[1]) / 2 ** 0.5)
    assert p["delta_vs_baseline_mean"] == pytest.approx(
        (vals[0] - runs[("uniform", 0)] + vals[1] - runs[("uniform", 1)]) / 2)
    assert a["schedules"]["uniform@32"]["heads"] == [2, 2, 2] and p["heads"] == [2, 4, 8]
    on_disk = json.loads((tmp_path / "a" / "compare.json").read_text())
    assert on_disk["runs"][0]["final_val_loss"] == a["runs"][0]["final_val_loss"]
    for r in on_disk["runs"]:
        assert {"schedule", "seed", "params", "final_val_loss", "tokens_per_s", "peak_memory_mb"} <= set(r)
    report = (tmp_path / "a" / "report.md").read_text()
    assert "| uniform@32 | 2,2,2 |" in report and "paired seeds" in report
    assert (tmp_path / "a" / "loss_curves.png").stat().st_size > 10_000


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    cfgfile = tmp_path / "c.yaml"
    cfgfile.write_text(tiny(tmp_path).to_yaml())
    assert main(["compare", str(cfgfile), "--set", "train.lrate=1", "--out", str(tmp_path / "x")]) == 2
    assert "unknown key 'train.lrate'" in capsys.readouterr().err
    assert main(["compare", str(cfgfile), "--schedules", "uniform,wide", "--out", str(tmp_path / "x")]) == 2
    assert "unknown schedule 'wide'" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "not found" in capsys.readouterr().err


def test_cli_prepare(tmp_path, capsys):
    assert main(["prepare", "--source", "synthetic:1000", "--tokenizer", "byte",
                 "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "prepared" in out and '"dtype": "uint16"' in out
    assert main(["prepare", "--source", "synthetic:1000", "--tokenizer", "byte", "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("reused")


def test_verdicts_use_a_paired_t_test():
    from headbudget.train.compare import verdicts

    def summary(mean, std, n):
        return {"seeds": list(range(n)), "baseline": "uniform",
                "schedules": {"uniform": {}, "prism": {"delta_vs_baseline_mean": mean, "delta_vs_baseline_std": std}}}

    assert "lower than uniform (paired t = 17.3 >= 4.30" in verdicts(summary(-0.1, 0.01, 3))[0]
    assert "not distinguishable" in verdicts(summary(-0.1, 0.1, 3))[0]  # t = 1.7
    assert "not distinguishable" in verdicts(summary(-0.1, 0.015, 2))[0]  # t = 9.4 < 12.71
    assert "one seed" in verdicts(summary(-0.1, 0.0, 1))[0]
