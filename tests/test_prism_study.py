"""benchmarks/prism_study.py: schedule names per size, the smallest detectable difference, the decision
rule and the paired analysis on hand-made run records (no training)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import load_benchmark


@pytest.fixture(scope="module")
def study():
    return load_benchmark("prism_study")


def test_schedules_resolve_per_size(study):
    assert study.study_schedules("cpu-tiny") == ["uniform", "prism", "reverse", "uniform@128", "late_dim_decay:0.75"]
    assert study.study_schedules("cpu-small")[3] == "uniform@256"  # prism's widest head at cpu-small
    # cpu-mid (the second size): every schedule but the budgeted one has uniform's attention budget D (heads x dim)
    from headbudget.schedule_spec import schedule_from_spec

    mid = [schedule_from_spec(s, "cpu-mid") for s in study.study_schedules("cpu-mid")]
    assert mid[1].heads == (1, 1, 2, 2, 2, 4, 4, 4) and mid[1].head_dims == (128, 128, 64, 64, 64, 32, 32, 32)
    assert {sum(h * d for h, d in zip(s.heads, s.head_dims)) for s in mid[:4]} == {8 * 128}
    assert sum(h * d for h, d in zip(mid[4].heads, mid[4].head_dims)) < 8 * 128


def test_min_detectable_difference_has_the_asked_power(study):
    mdd = study.min_detectable_difference(1.0, 5)
    assert mdd == pytest.approx(1.682, abs=1e-3)
    assert study.min_detectable_difference(0.02, 5) == pytest.approx(0.02 * mdd, rel=1e-6)  # scales with sd
    # Monte Carlo: 5 paired differences ~ N(mdd, 1), two-sided t-test at 5%: rejects 80% of the time
    rng = np.random.default_rng(0)
    d = rng.normal(mdd, 1.0, size=(200_000, 5))
    t = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(5))
    assert np.mean(np.abs(t) > 2.7764451051977987) == pytest.approx(0.80, abs=0.005)
    # many seeds: the normal approximation (z_0.975 + z_0.8) / sqrt(n) = 2.8016 / sqrt(n)
    assert study.min_detectable_difference(1.0, 400) == pytest.approx(2.8016 / 20, rel=5e-3)


def test_decision_rule(study):
    assert study._decide([-0.03, -0.01], 0.02) == "beats"
    assert study._decide([0.001, 0.05], 0.02) == "loses to"
    assert study._decide([-0.015, 0.012], 0.02) == "equivalent within ±0.0200"
    assert study._decide([-0.03, 0.01], 0.02) == "inconclusive"
    assert study._decide([-0.015, 0.012], None) == "inconclusive"
    assert study._decide(None, 0.02).startswith("not decidable")


def _records(study, offsets):
    """5 seeds per schedule and size; loss = 5 + 0.1 x seed + offsets[(size, schedule)][seed]."""
    texts = ["movie_reviews_heldout", *study.OOD_TEXTS]
    recs = []
    for size in study.SIZES:
        for sched in study.study_schedules(size):
            for seed in range(5):
                loss = 5 + 0.1 * seed + offsets.get((size, sched), [0.0] * 5)[seed]
                recs.append({"size": size, "schedule": sched, "seed": seed, "params": 1, "flat_at_end": True,
                             "tokens": 1000 if size == "cpu-tiny" else 2000,
                             "tokens_per_s": 1000.0 + (10.0 * seed if sched == "prism" else 0.0),
                             "texts": {t: {"loss": loss} for t in texts},
                             "attention": {"mean_distance": [5, 9, 20, 30] if sched == "prism" else [8, 9, 9, 10]}})
    return recs


def test_analysis_pairs_by_seed_and_applies_the_rule(study):
    prism_tiny = [-0.01, -0.02, -0.03, -0.02, -0.02]  # mean -0.02, sd 0.00707
    prism_small = [-0.05, -0.06, -0.04, -0.05, -0.05]  # mean -0.05, sd 0.00707
    recs = _records(study, {("cpu-tiny", "prism"): prism_tiny, ("cpu-small", "prism"): prism_small,
                            ("cpu-tiny", "uniform@128"): [-0.02] * 5})
    a = study.analyse(recs, ["cpu-tiny", "cpu-small"], {"cpu-tiny": 0.04, "cpu-small": 0.04})
    p1 = a["cpu-tiny"]["comparisons"]["prism - uniform"]["movie_reviews_heldout"]
    assert p1["diffs"] == pytest.approx(prism_tiny, abs=1e-12) and p1["mean"] == pytest.approx(-0.02, abs=1e-12)
    half = 2.7764451051977987 * np.std(prism_tiny, ddof=1) / math.sqrt(5)
    assert p1["ci"] == pytest.approx([-0.02 - half, -0.02 + half], abs=1e-9) and p1["decision"] == "beats"
    p2 = a["cpu-tiny"]["comparisons"]["prism - uniform@128"]["movie_reviews_heldout"]
    assert p2["mean"] == pytest.approx(0.0, abs=1e-12) and p2["decision"] == "equivalent within ±0.0400"
    # out of domain: no registered MDD, so an interval around 0 is inconclusive, not equivalent
    assert a["cpu-tiny"]["comparisons"]["prism - uniform@128"]["wikitext2_valid"]["decision"] == "inconclusive"
    speed = a["cpu-tiny"]["comparisons"]["prism - uniform"]["tokens_per_s_ratio"]
    assert speed["mean"] == pytest.approx(np.mean([0.0, 0.01, 0.02, 0.03, 0.04]), abs=1e-12)
    rise = a["cpu-tiny"]["comparisons"]["prism - uniform"]["distance_rises_with_depth"]
    assert rise["prism"] == [True] * 5 and rise["rise_minus_uniform"] == [23] * 5
    g = a["growth_with_size"]
    assert g["difference"] == pytest.approx(-0.03, abs=1e-12) and g["decision"] == "grows"
    se = math.sqrt(2 * np.var(prism_tiny, ddof=1) / 5)  # equal variances: Welch df = 8
    assert g["df"] == pytest.approx(8.0) and g["ci"][1] == pytest.approx(-0.03 + 2.306004135204166 * se, abs=1e-9)


def test_finished_runs_are_restored_from_the_results_file(study, tmp_path):
    """A new machine has no run folders; the committed results file brings back every finished run."""
    import json

    curve = [{"step": 10, "tokens": 100, "train_loss": 6.0, "val_loss": 5.9}]
    saved = {"runs": [{"size": "cpu-tiny", "schedule": "uniform@128", "seed": 1, "steps": 489}],
             "curves": {"cpu-tiny/uniform@128/seed1": curve}}
    results = tmp_path / "prism_study.json"
    results.write_text(json.dumps(saved))
    out = tmp_path / "runs"
    assert study.restore_finished_runs(results, out) == 1
    (done,) = out.rglob("run.json")
    assert json.loads(done.read_text()) == {**saved["runs"][0], "curve": curve}
    assert study.restore_finished_runs(results, out) == 0      # already there: left alone
    assert study.restore_finished_runs(tmp_path / "none.json", out) == 0


def test_a_run_another_process_trains_is_skipped_not_trained_twice(study, tmp_path):
    """Two processes share a study: the run one of them holds (flock) is None for the other."""
    import argparse

    args = argparse.Namespace(threads=1, cache_dir=None, attn_seqs=1, heldout_tokens=None)
    run_dir = tmp_path / "cpu-tiny" / "uniform-seed3"
    with study.run_lock(run_dir) as mine:
        assert mine is True
        with study.run_lock(run_dir) as other:  # a second open file: what another process would get
            assert other is False
        assert study.run_one("cpu-tiny", "uniform", 3, 1_001_472, tmp_path, None, None, args) is None
    with study.run_lock(run_dir) as again:  # released with its holder
        assert again is True
    assert not (run_dir / "checkpoints").exists()


def test_results_writes_keep_the_other_processs_runs(study, tmp_path):
    import json

    def rec(seed, loss):
        return {"size": "cpu-tiny", "schedule": "prism", "seed": seed, "loss": loss}

    path = tmp_path / "prism_study.json"
    study.write_results(path, {"status": "a", "runs": [rec(0, 5.0)], "curves": {"cpu-tiny/prism/seed0": [1]},
                               "tokens_per_run": {"cpu-tiny": 1000}})
    study.write_results(path, {"status": "b", "runs": [rec(4, 5.5)], "curves": {"cpu-tiny/prism/seed4": [2]},
                               "tokens_per_run": {"cpu-mid": 2000}})
    study.write_results(path, {"status": "c", "runs": [rec(0, 5.1)], "curves": {"cpu-tiny/prism/seed0": [3]}})
    saved = json.loads(path.read_text())
    assert saved["status"] == "c"
    assert sorted((r["seed"], r["loss"]) for r in saved["runs"]) == [(0, 5.1), (4, 5.5)]
    assert saved["curves"] == {"cpu-tiny/prism/seed0": [3], "cpu-tiny/prism/seed4": [2]}
    assert saved["tokens_per_run"] == {"cpu-tiny": 1000, "cpu-mid": 2000}  # another process's sizes are kept


def test_verdicts_follow_the_registered_rules(study):
    """Prism beats uniform, ties the wide control, and the wide control beats uniform: the gain is the wide
    heads' (verdict 2); speed inside ±5% (5); distances rise more than uniform's at every seed (6)."""
    prism = [-0.01, -0.02, -0.03, -0.02, -0.02]
    recs = _records(study, {("cpu-tiny", "prism"): prism, ("cpu-tiny", "uniform@128"): prism,
                            ("cpu-tiny", "late_dim_decay:0.75"): [0.05] * 5})
    recs[0]["flat_at_end"] = False  # one run not flat: listed, but not yet "possibly under-trained"
    mdd = {"cpu-tiny": 0.04, "cpu-mid": 0.0042}
    a = study.analyse(recs, ["cpu-tiny", "cpu-mid"], mdd)
    v = study.verdicts(a, recs, ["cpu-tiny", "cpu-mid"], mdd)
    tiny = v["cpu-tiny"]
    assert tiny["runs"] == tiny["runs_expected"] == 25
    assert tiny["not_flat"] == ["cpu-tiny/uniform/seed0"] and tiny["possibly_under_trained"] is False
    assert tiny["1_progression_vs_uniform"]["decision"] == "beats"
    assert tiny["2_progression_vs_wide"]["decision"] == "equivalent within ±0.0400"
    assert tiny["2_progression_vs_wide"]["gain_from_wide_heads"] is True
    assert tiny["3_neither"]["holds"] is False
    assert tiny["5_zero_overhead"]["supported"] is True          # ratio - 1 = 0.02 [0.0004, 0.0396]
    assert tiny["6_local_to_global"]["seeds_supporting"] == 5 and tiny["6_local_to_global"]["supported"]
    assert tiny["7_budgeted_non_inferior"]["holds"] is False     # +0.05 every seed: upper end > +MDD
    mid = v["cpu-mid"]  # every schedule identical to uniform: equivalent within cpu-mid's MDD, "neither"
    assert mid["1_progression_vs_uniform"]["statement"].startswith("null result")
    assert mid["3_neither"]["holds"] is True and mid["7_budgeted_non_inferior"]["holds"] is True
    assert v["4_grows_with_size"]["decision"] == "shrinks"  # -0.02 at cpu-tiny, 0 at cpu-mid
    recs[1]["flat_at_end"] = False
    assert study.verdicts(a, recs, ["cpu-tiny"], mdd)["cpu-tiny"]["possibly_under_trained"] is True


def test_report_waits_for_every_run_then_writes_verdicts_and_plots(study, tmp_path, capsys):
    import json

    recs = _records(study, {("cpu-tiny", "prism"): [-0.01, -0.02, -0.03, -0.02, -0.02]})
    recs = [r for r in recs if r["size"] in ("cpu-tiny", "cpu-mid")]
    curves = {study.run_key(r): [{"step": 1, "tokens": 2048, "train_loss": 6.0, "val_loss": 5.9}] for r in recs}
    results = tmp_path / "prism_study.json"
    results.write_text(json.dumps({"status": "partial", "runs": recs[:-1], "curves": curves}))
    args = ["--report", "--results", str(results), "--sizes", "cpu-tiny,cpu-mid"]
    assert study.main(args) == 1                          # 49 of 50: no analysis, nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prism_study.json"]
    results.write_text(json.dumps({"status": "partial", "runs": recs, "curves": curves}))
    capsys.readouterr()
    assert study.main(args) == 0
    summary = capsys.readouterr().out.split("\n\n## ", 1)[1]  # the verdicts printed after the table
    assert "- 1. prism beats uniform" in summary and "`uniform`:" not in summary  # no descriptive list lines
    saved = json.loads(results.read_text())
    assert saved["status"] == "complete" and len(saved["runs"]) == 50
    assert saved["tokens_per_run"] == {"cpu-tiny": 1000, "cpu-mid": 2000}  # from the runs, not the last writer
    assert saved["verdicts"]["cpu-tiny"]["1_progression_vs_uniform"]["decision"] == "beats"
    report = (tmp_path / "prism_study_report.md").read_text()
    assert "- 1. prism beats uniform: -0.0200 [" in report and "## cpu-mid" in report
    assert report.count("Descriptive, not registered (`training_tail`)") == 2  # one per size, after its verdicts
    assert saved["training_tail"]["cpu-mid"]["drop_over_tail"]["uniform"]["mean"] == 0.0  # one eval: no fall
    for png in ("prism_study_attention.png", "prism_study_curves_cpu-tiny.png", "prism_study_curves_cpu-mid.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_report_of_one_complete_size_leaves_the_results_file_alone(study, tmp_path):
    """cpu-tiny's 25 runs are in while cpu-mid still trains: its analysis goes to files of its own, and the
    results file (which the training processes keep rewriting) is not touched."""
    import json

    recs = _records(study, {("cpu-tiny", "prism"): [-0.01, -0.02, -0.03, -0.02, -0.02]})
    tiny = [r for r in recs if r["size"] == "cpu-tiny"]
    curves = {study.run_key(r): [{"step": 1, "tokens": 2048, "train_loss": 6.0, "val_loss": 5.9}] for r in tiny}
    results = tmp_path / "prism_study.json"
    results.write_text(json.dumps({"status": "partial", "runs": tiny, "curves": curves}))
    before = results.read_bytes()
    assert study.main(["--report", "--results", str(results), "--sizes", "cpu-mid"]) == 1  # none of cpu-mid in
    assert study.main(["--report", "--results", str(results), "--sizes", "cpu-tiny"]) == 0
    assert results.read_bytes() == before
    saved = json.loads((tmp_path / "prism_study_analysis_cpu-tiny.json").read_text())
    assert saved["sizes"] == ["cpu-tiny"] and saved["runs"] == 25
    assert saved["verdicts"]["cpu-tiny"]["1_progression_vs_uniform"]["decision"] == "beats"
    assert "4_grows_with_size" not in saved["verdicts"]  # needs both sizes
    assert "- 1. prism beats uniform: -0.0200 [" in (tmp_path / "prism_study_report_cpu-tiny.md").read_text()
    assert (tmp_path / "prism_study_attention_cpu-tiny.png").read_bytes()[:4] == b"\x89PNG"


def test_paired_curves_subtract_uniform_at_the_same_seed_and_step(study):
    recs = _records(study, {})
    for r in recs:  # uniform: 6.0 then 5.0; prism: 0.1 above at seed 0, 0.3 below at seed 1 (second eval)
        up = {("prism", 0): 0.1, ("prism", 1): -0.3}.get((r["schedule"], r["seed"]), 0.0)
        r["curve"] = [{"step": 10, "tokens": 100, "val_loss": 6.0}, {"step": 20, "tokens": 200, "val_loss": 5.0 + up}]
    d = study.paired_curves(recs, "cpu-tiny")
    assert list(d) == ["prism", "reverse", "uniform@128", "late_dim_decay:0.75"]
    assert d["prism"]["tokens"] == [100, 200] and d["prism"]["per_seed"][0] == [0.0, pytest.approx(0.1)]
    assert d["prism"]["mean"] == [0.0, pytest.approx((0.1 - 0.3) / 5)]
    assert d["reverse"]["mean"] == [0.0, 0.0]


def test_training_tail_measures_the_fall_over_the_last_fifth_and_the_paired_drift(study):
    recs = _records(study, {})
    for r in recs:  # evals at steps 10..100; uniform falls 0.01 a step-10 eval, prism 0.02 above it at the end
        extra = {"prism": 0.02}.get(r["schedule"], 0.0)
        r["curve"] = [{"step": st, "tokens": 10 * st, "val_loss": 6.0 - 0.001 * st + extra * (st / 100) ** 2}
                      for st in range(10, 101, 10)]
    t = study.training_tail(recs, "cpu-tiny")
    # uniform: step 80 -> 100 (the first eval at >= 80% of 100) falls 0.02
    assert t["drop_over_tail"]["uniform"] == pytest.approx({"mean": 0.02, "min": 0.02, "max": 0.02, "n": 5})
    assert t["drop_over_tail"]["prism"]["mean"] == pytest.approx(0.02 - 0.02 * (1 - 0.64))
    # paired to uniform: 0.02 x 0.5^2 at half the tokens (step 50), 0.02 at the end
    assert t["paired_second_half"]["prism"] == {"tokens": [500, 1000], "mean_diff": [pytest.approx(0.005),
                                                                                   pytest.approx(0.02)]}
    assert t["paired_second_half"]["reverse"]["mean_diff"] == [0.0, 0.0]
    lines = study.tail_markdown(t)
    assert "- `uniform`: +0.0200 (+0.0200 to +0.0200)" in lines
    assert "- `prism`: +0.0050 -> +0.0200 (500 -> 1,000 tokens)" in lines
