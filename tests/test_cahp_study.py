"""benchmarks/cahp_study.py (the registered CAHP-vs-baselines design, docs/cahp_study.md): Holm, the decision rule,
stability and depth with and without the floor on hand-made cell records, the extension trigger, the report, and
the worker-safe cell store."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from headbudget.train.paired import holm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cahp_study as cs  # noqa: E402

COUNTS = [12] * 6  # all-MiniLM-L6-v2


def test_holm_step_down() -> None:
    adj = holm([0.01, 0.04, 0.03, None])
    assert adj[3] is None and adj[:3] == pytest.approx([0.03, 0.06, 0.06])
    # monotone: a larger raw p never gets a smaller adjusted one; capped at 1
    assert holm([0.5, 0.001, 0.2]) == pytest.approx([0.5, 0.003, 0.4])
    assert holm([0.9, 0.3]) == pytest.approx([0.9, 0.6]) and holm([0.9, 0.8]) == [1.0, 1.0]
    assert holm([]) == [] and holm([None]) == [None]


def test_pvalues_match_the_95_interval_rule() -> None:
    # diffs 0.1, 0.2, 0.0: mean 0.1, sd 0.1 -> 95% CI [-0.148, 0.348] inside +-1, excludes nothing
    p_diff, p_eq = cs.test_pvalues(0.1, 0.1, 3)
    assert p_diff == pytest.approx(0.225403, abs=1e-6)
    assert p_eq == pytest.approx(0.0040900, abs=1e-6) and p_eq < 0.05
    # mean 0.9, sd 0.1: the CI [0.652, 1.148] crosses +1 -> not equivalent at 95%
    assert cs.test_pvalues(0.9, 0.1, 3)[1] > 0.05
    assert cs.test_pvalues(-2.0, 0.0, 3) == (0.0, 1.0)  # no spread: certainly nonzero, certainly outside
    assert cs.test_pvalues(0.5, 0.0, 3) == (0.0, 0.0)
    assert cs.test_pvalues(0.5, 0.3, 1) == (None, None)


def test_decision_order() -> None:
    assert cs.decision(3, -5.0, 0.01, 0.9) == "CAHP better"
    assert cs.decision(3, 5.0, 0.01, 0.9) == "baseline better"
    assert cs.decision(3, 0.2, 0.01, 0.02) == "equivalent"  # significant but inside the margin
    assert cs.decision(3, 0.2, 0.3, 0.2) == "inconclusive"
    assert cs.decision(1, 0.2, None, None) == "undecided"


CAHP_ACC = {0: 0.47, 1: 0.48, 2: 0.49}
DIFFS = {  # baseline - CAHP, accuracy points, per seed
    "joint-dsp": [0.1, 0.2, 0.0],       # equivalent
    "fisher": [-10.0, -10.5, -9.5],     # CAHP better
    "pass": [10.0, 10.5, 9.5],          # baseline better
    "random": [-3.0, 2.0, -1.0],        # inconclusive
    "pipelined-dsp": [-4.0, -6.0, -5.0],
    "attattr": [1.0, -1.0],             # two seeds only
    "michel": [0.5],                    # one seed: undecided, outside Holm's family
}


def _kept(flat: list[int]) -> dict[str, list[int]]:
    return cs.by_layer(flat, COUNTS)


def _rec(method: str, seed: int, acc: float, kept: list[int], scores=None, count: int = 14) -> dict:
    return {"key": f"{method}/k{count}/s{seed}", "method": method, "count": count, "seed": seed,
            "heads_kept": len(kept), "kept": _kept(kept), "scores": scores, "head_counts": COUNTS,
            "accuracy": {"test": {"dense": 0.5, "pruned": acc - 0.1, "finetuned": acc}}}


FLOOR = [0, 12, 24, 36, 48, 60, 1, 2, 3, 4, 5, 6, 7, 8]  # one per layer, then layer 0
LAST = list(range(60, 72))  # the floor-less scores prefer layer 5, then layer 4


def _scores(seed: int) -> list[float]:
    s = np.zeros(72)
    s[60:72] = 10 + np.arange(12)       # layer 5 best
    s[48:60] = 5 + 0.1 * np.arange(12)  # then layer 4
    s[0] = 1 + seed                     # layer 0's head 0 is the floor's pick there
    return s.tolist()


def _cells(diffs=DIFFS) -> dict[str, dict]:
    recs = [_rec("cahp", s, a, FLOOR) for s, a in CAHP_ACC.items()]
    for m, ds in diffs.items():
        sc = (lambda s: _scores(s)) if m in cs.FROM_SCORES else (lambda s: None)
        recs += [_rec(m, s, CAHP_ACC[s] + d / 100, FLOOR, sc(s)) for s, d in enumerate(ds)]
    recs += [_rec(cs.NOFLOOR, 0, 0.3, [*range(58, 72)])]
    return {r["key"]: r for r in recs}


def test_compare_to_reference_on_hand_made_cells() -> None:
    rows = {r["method"]: r for r in cs.compare_to_reference(list(_cells().values()), 14)}
    assert list(rows) == list(cs.BASELINES)
    j = rows["joint-dsp"]
    assert j["n"] == 3 and j["mean"] == pytest.approx(0.1) and j["std"] == pytest.approx(0.1)
    assert j["ci"] == pytest.approx([-0.148414, 0.348414], abs=1e-5)
    assert j["p_eq"] == pytest.approx(0.0040900, abs=1e-6)
    # Holm over the 6 testable comparisons (michel has one seed): joint-dsp's equivalence p is the smallest
    assert j["p_eq_holm"] == pytest.approx(6 * 0.0040900, abs=1e-5) and j["decision"] == "equivalent"
    f = rows["fisher"]
    assert f["mean"] == pytest.approx(-10.0) and f["p_diff"] == pytest.approx(0.000833, abs=2e-6)
    assert f["decision"] == "CAHP better" and rows["pass"]["decision"] == "baseline better"
    assert f["p_diff_holm"] == pytest.approx(6 * f["p_diff"], rel=1e-6)  # tied smallest with pass: both x6
    assert rows["random"]["decision"] == "inconclusive"
    assert rows["pipelined-dsp"]["p_diff"] == pytest.approx(0.0132, abs=1e-3)
    assert rows["pipelined-dsp"]["p_diff_holm"] == pytest.approx(4 * rows["pipelined-dsp"]["p_diff"], rel=1e-6)
    assert rows["pipelined-dsp"]["decision"] == "inconclusive"  # 0.013 alone, 0.053 after Holm
    assert rows["pipelined-dsp"]["unadjusted"] == "lower"       # what paired.decide says without the correction
    assert rows["attattr"]["n"] == 2 and rows["michel"]["decision"] == "undecided"
    assert rows["michel"]["p_diff_holm"] is None


def test_stability_and_depth_with_and_without_floor() -> None:
    cells = _cells()
    h = cs.stability_and_depth(list(cells.values()), 14)
    assert "no_floor" not in h["cahp"]  # CAHP keeps its floor
    assert h["cahp"]["floor"]["jaccard"] == 1.0
    assert h["cahp"]["floor"]["heads_per_layer"] == [9.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    nf = h["fisher"]["no_floor"]  # from the saved scores: layer 5's 12 heads, then layer 4's best two
    assert nf["heads_per_layer"] == [0.0, 0.0, 0.0, 0.0, 2.0, 12.0] and nf["jaccard"] == 1.0
    assert nf["empty_layers"] == [4, 4, 4]
    assert cs.kept_without_floor(cells["fisher/k14/s0"], list(cells.values()), COUNTS) == {
        "0": [], "1": [], "2": [], "3": [], "4": [10, 11], "5": list(range(12))}
    # michel: its floor-less selection is the michel-nofloor cell of the same seed (only seed 0 here)
    assert h["michel"]["no_floor"]["heads_per_layer"] == [0.0, 0.0, 0.0, 0.0, 2.0, 12.0]
    assert h["attattr"]["seeds"] == [0, 1] and h["attattr"]["no_floor"]["empty_layers"] == [4, 4]
    rec = _rec("random", 0, 0.4, FLOOR, None)
    assert cs.kept_without_floor(rec, [], COUNTS) is None  # no saved scores: nothing to read off


def test_jaccard_across_seeds_counts_changed_heads() -> None:
    recs = [_rec("random", s, 0.4, FLOOR if s < 2 else [*FLOOR[:13], 9]) for s in range(3)]
    recs += [_rec("cahp", s, 0.4, FLOOR) for s in range(3)]
    h = cs.stability_and_depth(recs, 14)
    # pairs: identical (1), and twice 13 shared of 15 -> (1 + 13/15 + 13/15) / 3
    assert h["random"]["floor"]["jaccard"] == pytest.approx((1 + 2 * 13 / 15) / 3)


def test_extension_trigger_and_plan() -> None:
    cells = _cells()
    assert not cs.extension_needed(cells, 14)  # attattr and michel lack seeds: the primary cells are not all in
    full = dict(DIFFS, attattr=[1.0, -1.0, 0.0], michel=[0.5, 0.0, -0.5])
    assert not cs.extension_needed(_cells(full), 14)  # joint-dsp equivalent
    noisy = dict(full, **{"joint-dsp": [-3.0, 2.0, -1.0]})
    assert cs.extension_needed(_cells(noisy), 14)
    keys = [c.key for c in cs.plan(_cells(noisy))]
    assert keys[:8] == [f"{m}/k14/s0" for m in cs.METHODS]
    assert keys[24:27] == ["michel-nofloor/k14/s0", "michel-nofloor/k14/s1", "michel-nofloor/k14/s2"]
    assert keys[27:] == ["cahp/k14/s3", "joint-dsp/k14/s3", "cahp/k14/s4", "joint-dsp/k14/s4"]
    assert len(cs.plan(_cells(full))) == 27


def test_report_and_figures(tmp_path) -> None:
    results = {"cells": _cells(), "settings": {"device": "cpu", "weights": "fp32", "finetune_epochs": 3}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results))
    md, figs = cs.write_report(path)
    text = md.read_text()
    assert "## 14 heads kept (INCOMPLETE (21/24 primary cells): not a verdict)" in text
    assert "| fisher | 3 | -10.00 | [-11.24, -8.76] | 0.005 | 1.000 | CAHP better |" in text
    assert "| joint-dsp | 3 | +0.10 | [-0.15, +0.35] | 0.676 | 0.025 | equivalent |" in text
    assert "| fisher | without | 1.000 | 0.0 0.0 0.0 0.0 2.0 12.0 | 4,4,4 |" in text
    assert [f.name for f in figs] == ["r_stability.png", "r_depth.png"] and all(f.stat().st_size > 0 for f in figs)


# --------------------------------------------------------------------------- the worker-safe store
def test_claims_are_exclusive_and_done_is_per_settings(tmp_path) -> None:
    store = cs.CellStore(tmp_path)
    cell = cs.StudyCell("fisher", 14, 0)
    assert store.claim(cell, "w0") and not store.claim(cell, "w1")
    assert store.claimed() == {"fisher/k14/s0"}
    store.finish(cell, {"method": "fisher", "settings": {"lr": 2e-5}})
    assert store.claimed() == set() and list(store.done({"lr": 2e-5})) == ["fisher/k14/s0"]
    assert store.done({"lr": 1e-4}) == {}  # another setting: pending again
    other = cs.StudyCell("pass", 14, 0)
    assert store.claim(other, "w0")
    store.fail(other, "RuntimeError: boom")
    assert store.failed() == {"pass/k14/s0": "RuntimeError: boom"} and store.claimed() == set()
    assert store.claim(other, "w1")
    store.reset()  # a new launch: stale claims and failures go, finished cells stay
    assert store.claimed() == set() and store.failed() == {} and len(store.done()) == 1


class _FakeWorkload:
    def __init__(self, job) -> None:
        self.job = job


def test_two_workers_share_one_out_without_running_a_cell_twice(tmp_path, monkeypatch) -> None:
    ran: list[str] = []
    lock = threading.Lock()

    def fake_cell(cell, loaded, base, out):
        with lock:
            ran.append(cell.key)
        acc = 0.45 + (0.02 if cell.method == "cahp" else 0.0) + cell.seed / 1000
        kept = FLOOR if cell.method != cs.NOFLOOR else list(range(58, 72))
        return {"report": {"heads_kept": 14, "kept": _kept(kept), "seconds": {"select": 0.1}},
                "details": {"accuracy": {"test": {"dense": 0.5, "pruned": 0.3, "finetuned": acc}},
                            "scores": _scores(cell.seed) if cell.method in cs.FROM_SCORES else None}}

    monkeypatch.setattr(cs, "run_study_cell", fake_cell)
    monkeypatch.setattr(cs, "load_workload", _FakeWorkload)
    args = cs.parse_args(["--model", "m", "--out", str(tmp_path / "out"), "--results", str(tmp_path / "r.json"),
                          "--data-dir", str(tmp_path), "--no-progress"])
    settings = {"lr": 2e-5}
    threads = [threading.Thread(target=cs.worker_loop, args=(args, tmp_path / "out", settings, f"w{i}"))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # 24 primary + 3 floor-less Michel; every baseline 2 points behind CAHP at every seed: CAHP better everywhere,
    # so the extension is not triggered
    assert sorted(ran) == sorted({c.key for c in cs.plan({})}) and len(ran) == 27
    res = json.loads((tmp_path / "r.json").read_text())
    assert len(res["cells"]) == 27 and res["pending"] == [] and res["failed"] == {}
    rows = {r["method"]: r for r in res["analysis"]["counts"]["14"]["endpoints"]["finetuned"]}
    assert rows["joint-dsp"]["mean"] == pytest.approx(-2.0) and rows["joint-dsp"]["decision"] == "CAHP better"
    assert {r["worker"] for r in res["cells"].values()} <= {"w0", "w1"}
    ran.clear()
    assert cs.worker_loop(args, tmp_path / "out", settings, "w2") == 0 and ran == []  # nothing left
