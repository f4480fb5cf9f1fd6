"""benchmarks/gpu_check.py --smoke: the prepared GPU script runs end to end on CPU and writes its JSON."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_gpu_check_smoke_runs_and_writes_json(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", BENCH)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "gpu_check.json"
    returned = gpu_check.main(["--smoke", "--out", str(out)])
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(returned))
    assert set(data) == {"meta", "throughput", "prism_over_uniform", "training", "goals", "wall_s"}
    assert data["meta"]["smoke"] is True and data["meta"]["device"] == "cpu" and data["meta"]["peak_flops"] is None
    uni, pri = data["throughput"]
    assert (uni["schedule"], pri["schedule"]) == ("uniform", "prism") and uni["params"] == pri["params"]
    for row in (uni, pri):
        assert row["tokens_per_s"] == row["batch_size"] * row["context"] / row["step_s_median"] > 0
        assert row["fwd_flops_per_token"] > 0 and row["mfu"] is None and row["peak_memory_mb"] > 0
    assert data["prism_over_uniform"] == pri["tokens_per_s"] / uni["tokens_per_s"]
    train = data["training"]
    assert [r["schedule"] for r in train["runs"]] == ["uniform", "prism", "uniform@32"]
    assert train["steps"] >= 3 and all(math.isfinite(r["final_val_loss"]) for r in train["runs"])
    assert set(data["goals"]) == {"prism_over_uniform_ge_0.98", "mfu_ge_0.45"} and data["goals"]["mfu_ge_0.45"] is None
    assert "prism / uniform tokens/s" in printed and "uniform@32" in printed
