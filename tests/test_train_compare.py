"""`compare`: schedules x seeds on identical data, deterministic numbers, report files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import assert_names, error_line, names
from headbudget.cli.main import main
from headbudget.train import RunConfig
from headbudget.train.compare import parse_schedules, run_compare
from headbudget.train.config import CompareConfig
from headbudget.train.trainer import Trainer


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
    with pytest.raises(ValueError, match=names("--schedules", "prism,prism")):
        parse_schedules("prism,prism")


def test_compare_is_deterministic_and_writes_reports(tmp_path):
    scheds = ["uniform", "prism", "uniform@32"]
    settings = CompareConfig.from_run(tiny(tmp_path).replace(train={"ckpt_every": 2}), schedules=",".join(scheds),
                                      seeds=2, save_models=False)
    a = run_compare(settings, tmp_path / "a")
    # --no-save-models keeps what was asked for: no model/, no optimizer checkpoints per run
    run_dirs = [p for p in (tmp_path / "a").iterdir() if p.is_dir()]
    assert len(run_dirs) == 6 and all((d / "metrics.jsonl").is_file() for d in run_dirs)
    assert not [p for d in run_dirs for p in d.iterdir() if p.name in ("model", "checkpoints")]
    b = run_compare(settings, tmp_path / "b", plot=False)
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
    assert (tmp_path / "a" / "paired_curves.png").read_bytes()[:4] == b"\x89PNG" and "paired_curves.png" in report
    assert not (tmp_path / "b" / "paired_curves.png").exists()  # plot=False


def test_paired_curves_subtract_the_reference_at_the_same_seed_and_step():
    from headbudget.train.compare import paired_curves

    def h(*vals, steps=(10, 20)):
        return [{"step": st, "tokens": st * 8, "val_loss": v} for st, v in zip(steps, vals)]

    curves = {"uniform": {0: h(6.0, 5.0), 1: h(6.2, 5.2)},
              "prism": {0: h(6.1, 4.9), 1: h(6.0, 5.0), 2: h(1.0, 1.0)},  # seed 2: no reference, left out
              "wide": {0: h(6.0, 5.0, steps=(10, 30)), 1: h(6.0, 5.0)}}  # step 30: not in the reference
    d = paired_curves(curves, "uniform")
    assert d["prism"]["tokens"] == [80, 160] and sorted(d["prism"]["per_seed"]) == [0, 1]
    assert d["prism"]["per_seed"][1] == [pytest.approx(-0.2), pytest.approx(-0.2)]
    assert d["prism"]["mean"] == [pytest.approx(-0.05), pytest.approx(-0.15)]
    assert d["wide"]["tokens"] == [80]  # only the steps every seed shares with the reference


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    cfgfile = tmp_path / "c.yaml"
    cfgfile.write_text(tiny(tmp_path).to_yaml())
    assert main(["compare", str(cfgfile), "--set", "train.lrate=1", "--out", str(tmp_path / "x")]) == 2
    assert_names(error_line(capsys.readouterr().err, "compare"), "train.lrate")
    assert main(["compare", str(cfgfile), "--schedules", "uniform,wide", "--out", str(tmp_path / "x")]) == 2
    assert_names(error_line(capsys.readouterr().err, "compare"), "wide")
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert_names(error_line(capsys.readouterr().err, "train"), tmp_path / "missing.yaml")


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


def test_paired_differences_hand_example():
    from headbudget.train.paired import paired_differences

    # diffs per seed: -0.1, -0.2, -0.3 -> mean -0.2, std 0.1, se 0.1/sqrt(3).  With 2 degrees of freedom the
    # t quantile has a closed form: t(p) = (2p - 1) / sqrt(2p(1 - p)); t(0.975) = 0.95 / sqrt(0.04875) = 4.3027
    t975 = 0.95 / 0.04875 ** 0.5
    d = paired_differences({0: 2.9, 1: 3.0, 2: 3.1, 7: 9.9}, {0: 3.0, 1: 3.2, 2: 3.4})
    assert d["seeds"] == [0, 1, 2] and d["n"] == 3  # seed 7 has no reference run: not paired
    assert d["diffs"] == pytest.approx([-0.1, -0.2, -0.3], abs=1e-12)
    assert d["mean"] == pytest.approx(-0.2, abs=1e-12) and d["std"] == pytest.approx(0.1, abs=1e-12)
    half = t975 * 0.1 / 3 ** 0.5
    assert d["t_crit"] == pytest.approx(t975, abs=1e-9)
    assert d["ci"] == pytest.approx([-0.2 - half, -0.2 + half], abs=1e-12)
    assert d["ci"] == pytest.approx([-0.448414, 0.048414], abs=1e-6)
    assert d["t"] == pytest.approx(-0.2 / (0.1 / 3 ** 0.5), abs=1e-9)
    one = paired_differences({0: 2.5}, {0: 3.0})
    assert one["mean"] == -0.5 and one["ci"] is None and one["std"] == 0.0


#: a synthetic validation curve, evaluated every 10 steps
CURVE = {10: 5.0, 20: 4.0, 30: 3.5, 40: 3.2, 50: 3.1, 60: 3.05, 70: 3.03, 80: 3.02, 90: 3.01, 100: 3.005}


def _first_stop(min_step):
    """Drive compare's stopping callback through CURVE; the step at which it asks the trainer to stop."""
    from types import SimpleNamespace

    from headbudget.train.compare import _flat_rule

    trainer, rule = SimpleNamespace(stop_requested=False, history=[]), _flat_rule(min_step)
    for step in range(1, 101):
        record = {"step": step, "val_loss": CURVE[step]} if step in CURVE else None
        if record is not None:  # the trainer's metrics logger appends before the callbacks run
            trainer.history.append(record)
        rule(trainer, step, record)
        if trainer.stop_requested:
            return step
    return None


def test_until_flat_stops_at_the_first_flat_eval_point():
    from headbudget.train.compare import is_flat

    # window = the last 20% of the steps: at 50 it holds 40,50 (spread 0.1 >= 1% of 3.1); at 60 it holds
    # 50,60 (0.05 >= 0.0305); at 70 it holds 60,70 (0.02 < 0.0303): flat.  Before 50 it holds one point.
    assert _first_stop(min_step=0) == 70
    # not during the warmup: at 80 the window holds 70,80 (0.01 < 0.0302)
    assert _first_stop(min_step=70) == 80
    hist = [{"step": s, "val_loss": v} for s, v in CURVE.items() if s <= 60]
    assert not is_flat(hist) and not is_flat(hist[:1]) and not is_flat([])
    assert is_flat(hist, tolerance=0.0165) and not is_flat(hist, tolerance=0.0163)  # 0.05 / 3.05 = 0.01639


def test_steps_for_tokens():
    from headbudget.train.config import steps_for_tokens

    assert steps_for_tokens(1_000_000, 16, 128) == 489  # 2,048 a step: 488.28 rounded up
    assert steps_for_tokens(2048 * 10, 16, 128) == 10
    assert steps_for_tokens(2048 * 10 + 1, 16, 128) == 11
    with pytest.raises(ValueError, match=names("tokens", 0)):
        steps_for_tokens(0, 16, 128)


def test_until_flat_trains_every_run_as_long_as_the_reference(tmp_path, monkeypatch):
    import headbudget.train.compare as compare
    from headbudget.train.setup import lr_at

    # the reference (uniform, trained first although listed second) is "flat" from step 4 on
    monkeypatch.setattr(compare, "is_flat", lambda history, **kw: history[-1]["step"] >= 4)
    cfg = tiny(tmp_path).replace(train={"steps": 8})
    settings = CompareConfig.from_run(cfg, schedules="prism,uniform", save_models=False, until_flat=True)
    a = run_compare(settings, tmp_path / "a", plot=False)
    assert [(r["schedule"], r["steps"]) for r in a["runs"]] == [("uniform", 4), ("prism", 4)]
    assert a["steps_per_run"] == 4 and a["tokens_per_run"] == 4 * 4 * 32
    assert a["until_flat"]["flat_at_step"] == 4 and a["until_flat"]["max_steps"] == 8
    assert a["reference"] == "uniform" and a["schedules"]["prism"]["paired"]["seeds"] == [0]
    for sched in ("uniform", "prism"):
        recs = [json.loads(x) for x in (tmp_path / "a" / f"{sched}-seed0" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in recs] == [2, 4]
        # the lr schedule is that of 8 steps (cosine not finished at step 4), identical across schedules
        assert recs[-1]["lr"] == lr_at(3, cfg) and lr_at(3, cfg) != lr_at(3, cfg.replace(train={"steps": 4}))
        run = next(r for r in a["runs"] if r["schedule"] == sched)
        assert run["final_val_loss"] == recs[-1]["val_loss"]
        assert json.loads((tmp_path / "a" / f"{sched}-seed0" / "summary.json").read_text())["steps"] == 4
    report = (tmp_path / "a" / "report.md").read_text()
    assert "4 steps x 4 x 32 tokens = 512 tokens per run (uniform seed 0 was flat at step 4" in report


def test_trainer_stop_between_eval_points_validates_and_records_the_steps_done(tmp_path):
    from headbudget.train.trainer import Trainer

    def stop_at_3(trainer, step, record):
        trainer.stop_requested = step == 3

    cfg = tiny(tmp_path).replace(train={"steps": 6})
    result = Trainer(cfg, tmp_path / "r", callbacks=[stop_at_3], save_model=False).run()
    assert (result.steps, result.tokens) == (3, 3 * 4 * 32)
    assert result.final_val_loss is not None and result.final_val_loss != result.history[-1]["val_loss"]
    assert [r["step"] for r in result.history] == [2]  # step 3 was not a logged step
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps"] == 3


def test_cli_compare_tokens_reference_and_paired_report(tmp_path, capsys):
    cfgfile = tmp_path / "c.yaml"
    cfgfile.write_text(tiny(tmp_path).to_yaml())
    out = tmp_path / "cmp"
    # 300 tokens at 4 x 32 = 128 a step: 3 steps (rounded up)
    assert main(["compare", str(cfgfile), "--schedules", "uniform,prism", "--seeds", "2", "--tokens", "300",
                 "--reference", "prism", "--no-save-models", "--out", str(out)]) == 0
    summary = json.loads((out / "compare.json").read_text())
    assert summary["steps_per_run"] == 3 and summary["reference"] == "prism"
    runs = {(r["schedule"], r["seed"]): r["final_val_loss"] for r in summary["runs"]}
    u = summary["schedules"]["uniform"]["paired"]
    assert u["diffs"] == [runs[("uniform", s)] - runs[("prism", s)] for s in (0, 1)]
    report = (out / "report.md").read_text()
    lo, hi = u["ci"]
    assert f"[{lo:+.4f}, {hi:+.4f}]" in report and "95% CI of Δ" in report
    capsys.readouterr()
    assert main(["compare", str(cfgfile), "--tokens", "lots", "--out", str(tmp_path / "x")]) == 2
    assert_names(error_line(capsys.readouterr().err, "compare"), "train.tokens", "--tokens", "lots")
    assert main(["compare", str(cfgfile), "--reference", "reverse", "--out", str(tmp_path / "y")]) == 2
    assert_names(error_line(capsys.readouterr().err, "compare"), "--reference", "reverse", "--schedules")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


class _Kill(Exception):
    pass


def _kill_run_at(monkeypatch, run_name: str, step: int):
    """Make the Trainer of the run folder ``run_name`` raise _Kill after ``step`` (a crash mid-comparison)."""
    import headbudget.train.compare as compare

    real = compare.Trainer

    def trainer(cfg, out_dir, **kw):
        t = real(cfg, out_dir, **kw)
        if out_dir.name == run_name:
            def kill(trainer, done, record):
                if done == step:
                    raise _Kill
            t.callbacks.append(kill)
        return t

    monkeypatch.setattr(compare, "Trainer", trainer)


def _outcome(summary):
    return [(r["schedule"], r["seed"], r["steps"], r["final_val_loss"], r["final_train_loss"]) for r in summary["runs"]]


def test_resume_continues_an_interrupted_comparison_exactly(tmp_path, monkeypatch, capsys):
    """Killed in prism's seed-0 run at step 3 (checkpoint at 2): --resume reads uniform's finished run back
    (not retrained), continues prism from its checkpoint and trains the rest; every number equals an
    uninterrupted comparison's."""
    cfg = tiny(tmp_path).replace(train={"steps": 6, "ckpt_every": 2})
    settings = CompareConfig.from_run(cfg, schedules="uniform,prism", seeds=2)
    straight = run_compare(settings, tmp_path / "straight", plot=False)
    _kill_run_at(monkeypatch, "prism-seed0", 3)
    with pytest.raises(_Kill):
        run_compare(settings, tmp_path / "cmp", plot=False)
    monkeypatch.undo()
    uniform_metrics = (tmp_path / "cmp" / "uniform-seed0" / "metrics.jsonl").stat().st_mtime_ns
    capsys.readouterr()
    resumed = run_compare(settings, tmp_path / "cmp", plot=False, resume=True)
    out = capsys.readouterr()
    assert _outcome(resumed) == _outcome(straight)
    assert resumed["schedules"]["prism"]["paired"] == straight["schedules"]["prism"]["paired"]
    assert resumed["curves"] == straight["curves"]  # the resumed run's curve is whole, once per step
    assert (tmp_path / "cmp" / "uniform-seed0" / "metrics.jsonl").stat().st_mtime_ns == uniform_metrics
    assert out.out.count("resuming from") == 1 and "prism-seed0/checkpoints/step_000002" in out.out


def test_resume_with_until_flat_keeps_the_flat_length_and_refuses_a_longer_run(tmp_path, monkeypatch):
    """The reference stopped flat at step 4 of 8; a resume must not train it on to 8 (its summary has fewer
    steps than train.steps), and trains the killed run to exactly 4 steps from its checkpoint."""
    import headbudget.train.compare as compare

    monkeypatch.setattr(compare, "is_flat", lambda history, **kw: history[-1]["step"] >= 4)
    cfg = tiny(tmp_path).replace(train={"steps": 8, "ckpt_every": 2})
    settings = CompareConfig.from_run(cfg, schedules="uniform,prism", until_flat=True)
    straight = run_compare(settings, tmp_path / "straight", plot=False)
    assert [r["steps"] for r in straight["runs"]] == [4, 4]
    _kill_run_at(monkeypatch, "prism-seed0", 3)
    with pytest.raises(_Kill):
        run_compare(settings, tmp_path / "cmp", plot=False)
    monkeypatch.setattr(compare, "Trainer", Trainer)
    resumed = run_compare(settings, tmp_path / "cmp", plot=False, resume=True)
    assert _outcome(resumed) == _outcome(straight)
    assert resumed["until_flat"]["flat_at_step"] == 4
    # a run that trained longer than this comparison asks is refused, in one line naming it: a comparison
    # flat at step 2 whose prism run is replaced by the 4-step one
    monkeypatch.setattr(compare, "is_flat", lambda history, **kw: history[-1]["step"] >= 2)
    run_compare(settings, tmp_path / "cmp2", plot=False)
    shutil.rmtree(tmp_path / "cmp2" / "prism-seed0")
    shutil.copytree(tmp_path / "cmp" / "prism-seed0", tmp_path / "cmp2" / "prism-seed0")
    with pytest.raises(ValueError, match=names(tmp_path / "cmp2" / "prism-seed0", 4, 2)):
        run_compare(settings, tmp_path / "cmp2", plot=False, resume=True)


def test_cli_compare_resume(tmp_path, capsys):
    cfgfile = tmp_path / "c.yaml"
    cfgfile.write_text(tiny(tmp_path).to_yaml())
    out = tmp_path / "cmp"
    args = ["compare", str(cfgfile), "--schedules", "uniform,prism", "--seeds", "1", "--out", str(out)]
    assert main(args) == 0
    first = json.loads((out / "compare.json").read_text())
    capsys.readouterr()
    assert main(args) == 2  # an existing comparison is not overwritten silently
    assert_names(error_line(capsys.readouterr().err, "compare"), "--resume")
    assert main(args + ["--resume"]) == 0
    assert _outcome(json.loads((out / "compare.json").read_text())) == _outcome(first)
    printed = capsys.readouterr().out
    assert "[1/2] uniform seed 0: val loss" in printed and printed.count("(finished earlier: read back)") == 2


def test_decide_states_a_null_result_only_inside_the_margin():
    from headbudget.train.paired import decide

    assert decide([-0.03, -0.001]) == "lower" and decide([0.001, 0.02]) == "higher"
    assert decide([-0.01, 0.02]) == "inconclusive"  # no margin: a straddling interval decides nothing
    assert decide([-0.01, 0.02], margin=0.022) == "equivalent"
    assert decide([-0.01, 0.02], margin=0.02) == "inconclusive"  # the interval must lie strictly inside
    assert decide([-0.03, 0.01], margin=0.022) == "inconclusive"
    assert decide(None, margin=0.1) == "undecided"


def test_min_detectable_difference_has_the_stated_power():
    """At the returned difference, a two-sided paired t-test at 5% over n seeds rejects in 80% of simulated
    comparisons (400,000 draws: standard error of the rate 0.0006)."""
    import numpy as np
    from scipy import stats

    from headbudget.train.paired import min_detectable_difference

    for n, sd in ((5, 0.0093), (3, 0.02)):
        mdd = min_detectable_difference(sd, n)
        rng = np.random.default_rng(0)
        diffs = rng.normal(mdd, sd, size=(400_000, n))
        t = diffs.mean(1) / (diffs.std(1, ddof=1) / np.sqrt(n))
        rate = float(np.mean(np.abs(t) >= stats.t.ppf(0.975, n - 1)))
        assert rate == pytest.approx(0.80, abs=0.003), (n, rate)
    assert min_detectable_difference(0.0, 5) == 0.0
    assert round(min_detectable_difference(1.0, 5), 3) == 1.682


def test_cli_compare_margin_reports_equivalence_and_what_the_seeds_detect(tmp_path, capsys):
    from headbudget.train.paired import min_detectable_difference

    cfgfile = tmp_path / "c.yaml"
    cfgfile.write_text(tiny(tmp_path).to_yaml())
    args = ["compare", str(cfgfile), "--schedules", "uniform,prism", "--seeds", "3", "--no-save-models"]
    for margin, decision in ((0.01, "equivalent"), (0.001, "inconclusive")):  # prism - uniform: [-0.0019, +0.0015]
        out = tmp_path / f"cmp{margin}"
        capsys.readouterr()
        assert main(args + ["--margin", str(margin), "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        summary = json.loads((out / "compare.json").read_text())
        p = summary["schedules"]["prism"]["paired"]
        assert summary["margin"] == margin and p["decision"] == decision, p
        assert p["ci"][0] < 0 < p["ci"][1] and -0.01 < p["ci"][0] and p["ci"][1] < 0.01
        assert p["mdd_80"] == pytest.approx(min_detectable_difference(p["std"], 3))
        report = (out / "report.md").read_text()
        said = (f"Equivalent to uniform within ±{margin:.4f}" if decision == "equivalent" else
                f"Not shown equivalent within ±{margin:.4f}")
        assert said in report and said in printed  # the verdict reaches the terminal, not only the report
        assert f"These 3 seeds detect a true difference of {p['mdd_80']:.4f} with 80% power" in report
        assert (out / "paired_differences.png").read_bytes()[:4] == b"\x89PNG"
        assert "![paired differences at the end](paired_differences.png)" in report
        assert "paired_differences.png" in printed
    assert main(["compare", str(cfgfile), "--margin", "-1", "--out", str(tmp_path / "bad")]) == 2
    assert_names(error_line(capsys.readouterr().err, "compare"), "--margin", "-1.0")
    assert not (tmp_path / "bad").exists()


def test_paired_differences_plot_draws_each_seed_interval_and_margin(tmp_path, monkeypatch):
    import headbudget.train.compare_plots as compare_plots

    summary = {"baseline": "uniform", "margin": 0.02, "seeds": [0, 1, 2], "schedules": {
        "uniform": {}, "prism": {"paired": {"diffs": [0.01, -0.005, 0.004], "mean": 0.003, "ci": [-0.016, 0.022]}},
        "reverse": {"paired": {"diffs": [0.02, 0.03, 0.025], "mean": 0.025, "ci": [0.013, 0.037]}}}}
    figs = []
    monkeypatch.setattr(compare_plots, "save_figure", lambda fig, path: figs.append(fig) or Path(path))
    compare_plots.plot_paired_differences(summary, tmp_path / "d.png")
    ax = figs[0].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["reverse - uniform", "prism - uniform"]
    bars = {tuple(line.get_ydata()): list(line.get_xdata()) for line in ax.lines if line.get_linewidth() == 2.5}
    assert bars == {(1, 1): [-0.016, 0.022], (0, 0): [0.013, 0.037]}  # prism on top (y 1), reverse below
    seeds = sorted(tuple(off) for c in ax.collections if len(c.get_offsets()) == 3 for off in c.get_offsets())
    assert seeds == sorted([(0.01, 1), (-0.005, 1), (0.004, 1), (0.02, 0), (0.03, 0), (0.025, 0)])
    band = [p for p in ax.patches]  # the ±margin band
    assert len(band) == 1 and band[0].get_x() == pytest.approx(-0.02) and band[0].get_width() == pytest.approx(0.04)


def test_a_schedule_identical_to_the_reference_is_not_reported_higher():
    """uniform@32 at d_model 64 with 2 heads is uniform's layout: every paired Δ is exactly 0, sd 0. The t-test
    branch read that as t = inf and printed "higher than uniform"."""
    from headbudget.train.compare import verdicts

    lay = {"heads": [2, 2, 2], "head_dims": [32, 32, 32]}
    summary = {"seeds": [0, 1, 2], "baseline": "uniform", "schedules": {
        "uniform": dict(lay), "uniform@32": {**lay, "delta_vs_baseline_mean": 0.0, "delta_vs_baseline_std": 0.0},
        "other": {"heads": [2, 4, 8], "head_dims": [32, 16, 8], "delta_vs_baseline_mean": 0.0,
                  "delta_vs_baseline_std": 0.0}}}
    same, other = verdicts(summary)
    assert "higher" not in same and "the same layout (heads 2,2,2, head dims 32,32,32)" in same
    assert "higher" not in other and "Δ = 0 at every one of 3 seeds: identical results" in other


def test_run_compare_marks_an_identical_layout_as_identical(tmp_path):
    settings = CompareConfig.from_run(tiny(tmp_path), schedules="uniform,uniform@32,prism", seeds=2,
                                      save_models=False, margin=0.5)
    a = run_compare(settings, tmp_path / "a", plot=False)
    assert a["schedules"]["uniform@32"]["paired"]["diffs"] == [0.0, 0.0]
    assert a["schedules"]["uniform@32"]["paired"]["decision"] == "identical"
    assert a["schedules"]["prism"]["paired"]["decision"] == "equivalent"
    assert "higher than uniform" not in (tmp_path / "a" / "report.md").read_text()


def test_one_seed_report_shows_no_spread(tmp_path):
    """One seed has no spread: the report gives each value alone, never "± 0.0000" (which reads as "no
    variation")."""
    settings = CompareConfig.from_run(tiny(tmp_path), schedules="uniform,prism", seeds=1, save_models=False)
    s = run_compare(settings, tmp_path / "one", plot=False)
    md = (tmp_path / "one" / "report.md").read_text()
    assert "±" not in md
    assert "same seed (same batches), from one seed: no spread." in md
    prism = s["schedules"]["prism"]
    assert f"| {prism['val_loss_mean']:.4f} | {prism['delta_vs_baseline_mean']:.4f} |" in md


def test_paired_differences_pair_by_seed_whatever_the_order_or_the_gaps():
    from headbudget.train.paired import paired_differences

    # the reference lists its seeds in another order and has seed 1, which the schedule lacks; the
    # schedule has seed 9, which the reference lacks: only seeds 0, 2 and 3 pair, each with its own
    values = {3: 3.3, 0: 3.0, 9: 1.0, 2: 3.2}
    reference = {0: 3.5, 1: 7.0, 2: 3.4, 3: 3.4}
    d = paired_differences(values, reference)
    assert d["seeds"] == [0, 2, 3] and d["n"] == 3
    assert d["diffs"] == pytest.approx([-0.5, -0.2, -0.1], abs=1e-12)
    assert d["mean"] == pytest.approx(-0.8 / 3, abs=1e-12)
    # swapping the arguments negates every difference, seed by seed
    back = paired_differences(reference, values)
    assert back["seeds"] == [0, 2, 3] and back["diffs"] == pytest.approx([0.5, 0.2, 0.1], abs=1e-12)


def test_a_comparison_is_one_compare_config(tmp_path, capsys):
    """run_compare takes the CompareConfig whole (a RunConfig alone: a TypeError naming what to build);
    from_run takes the schedules as a list too, a head-count list kept whole; headbudget prepare with
    data.tokenizer=model names the model.init it needs instead of an unknown tokenizer 'model'."""
    with pytest.raises(TypeError, match="CompareConfig"):
        run_compare(RunConfig(), tmp_path / "never")
    settings = CompareConfig.from_run(RunConfig(seed=4), schedules=["uniform", "3,3,6,6"], seeds=2)
    assert parse_schedules(settings.compare.schedules) == ["uniform", "3,3,6,6"]
    assert (settings.seed, settings.compare.seeds) == (4, 2)
    assert main(["prepare", "quickstart", "--set", "data.tokenizer=model"]) == 2
    assert_names(error_line(capsys.readouterr().err, "prepare"), "data.tokenizer=model", "model.init")
