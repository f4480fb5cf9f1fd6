"""`headbudget quickstart` end to end at tiny size (hidden --tiny flag)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from conftest import assert_names, error_line
from headbudget.cli.main import main
from headbudget.cli.quickstart_cmd import quickstart_config
from headbudget.train.config import RunConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"  # the checkout's link to the package's configs


def test_quickstart_config_is_the_bundled_file():
    from_file = RunConfig.load(CONFIGS / "quickstart.yaml")
    assert from_file == quickstart_config()
    assert yaml.safe_load((CONFIGS / "quickstart.yaml").read_text())["model"]["preset"] == "cpu-tiny"
    assert quickstart_config(["train.steps=7"], tiny=True).train.steps == 7


def test_tiny_quickstart_writes_report_and_timings(tmp_path, capsys):
    out = tmp_path / "qs"
    assert main(["quickstart", "--tiny", "--out", str(out), "--set", "train.threads=1"]) == 0
    printed = capsys.readouterr().out
    assert "[1/4] preparing synthetic:20000" in printed and "stage times:" in printed
    assert f"report: {out / 'report.md'}" in printed
    cmp = json.loads((out / "compare.json").read_text())
    assert [r["schedule"] for r in cmp["runs"]] == ["uniform", "prism"]
    assert cmp["runs"][0]["params"] == cmp["runs"][1]["params"]
    timings = json.loads((out / "timings.json").read_text())
    assert {"prepare data", "train uniform", "train prism", "total"} <= set(timings)
    assert timings["total"] >= timings["train uniform"] + timings["train prism"]
    report = (out / "report.md").read_text()
    assert "| uniform | 2,2,2 |" in report and "| prism" in report and "Quickstart stage times" in report
    for name in ("uniform", "prism"):
        assert (out / f"{name}-seed0" / "model" / "model.safetensors").is_file()
    if (out / "attention.json").exists():  # headbudget.analysis.attention is installed
        att = json.loads((out / "attention.json").read_text())
        assert [r["n_heads"] for r in att["prism"]["layers"]] == [2, 4, 8]
        assert "## Attention distance" in report
    # a second run into the same folder is refused in one line, the results untouched ...
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(["quickstart", "--tiny", "--out", str(out), "--set", "train.threads=1"]) == 2
    assert_names(error_line(capsys.readouterr().err, "quickstart"), "--out", out, "--overwrite")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # ... and with --overwrite replaces them, reusing the prepared data (data-cache/ is kept)
    assert main(["quickstart", "--tiny", "--out", str(out), "--set", "train.threads=1", "--overwrite"]) == 0
    assert "(cached)" in capsys.readouterr().out


def test_quickstart_flags_are_run_config_fields_and_print_config_round_trips(tmp_path, capsys):
    assert main(["quickstart", "--tiny", "--out", "runs/q", "--cache-dir", "c", "--set", "train.steps=9",
                 "--print_config"]) == 0
    first = capsys.readouterr().out
    d = yaml.safe_load(first)
    assert (d["out"], d["data"]["cache_dir"], d["train"]["steps"], d["data"]["source"]) == \
        ("runs/q", "c", 9, "synthetic:20000")  # --out, --cache-dir, --set over --tiny over the bundled file
    cfg = tmp_path / "q.yaml"
    cfg.write_text(first)
    assert main(["quickstart", "--config", str(cfg), "--print_config"]) == 0
    assert capsys.readouterr().out == first
    assert main(["train", str(cfg), "--print_config"]) == 0  # the same run config train reads
    assert capsys.readouterr().out == first
    assert main(["quickstart", "--set", "train.stpes=3"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "headbudget quickstart: error: --set 'train.stpes=3': unknown key 'train.stpes' (did you mean 'train.steps'?)"]
