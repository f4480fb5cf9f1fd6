"""Train several head schedules x seeds on identical data and compare them.

Every run of seed ``s`` sees the same batches, so each schedule's difference to the reference is paired by
seed (:func:`paired_differences`).  Runs train ``train.steps``, or with ``until_flat`` as many steps as the
reference at the first seed takes to go flat (:func:`is_flat`), all with the learning-rate schedule of
``train.steps``.  See docs/training.md ("compare and the quickstart").

    >>> from headbudget.train.compare import run_compare
    >>> from headbudget.train.config import CompareConfig, load_config
    >>> settings = CompareConfig.from_run(load_config("configs/cpu-small.yaml"),
    ...                                   schedules="uniform,prism,uniform@128", seeds=3)
    >>> # summary = run_compare(settings, "runs/cmp")
    >>> # summary["schedules"]["prism"]["val_loss_mean"]
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats  # a dependency of scikit-learn, which headbudget requires

from headbudget.data.prepare import PreparedData
from headbudget.io import atomic_write_text
from headbudget.train.compare_plots import plot_curves, plot_paired_curves, plot_paired_differences
from headbudget.train.config import CompareConfig, RunConfig
from headbudget.train.loop import distributed_env
from headbudget.train.paired import decide, min_detectable_difference, paired_differences, sample_std
from headbudget.train.records import TrainResult, finished_result
from headbudget.train.setup import build_schedule, prepare_shared
from headbudget.train.trainer import Trainer


def parse_schedules(text: str | Sequence[str]) -> list[str]:
    """``"uniform,prism,uniform@128"`` -> list; a comma list of head counts must be written with ``;``
    between schedules or given as separate items (``"3,3,6,6;prism"``)."""
    if not isinstance(text, str):
        return [s.strip() for s in text if s.strip()]
    sep = ";" if ";" in text else ","
    items = [s.strip() for s in text.split(sep) if s.strip()]
    if not items:
        raise ValueError("--schedules is empty; e.g. --schedules uniform,prism,reverse,uniform@128")
    if len(set(items)) != len(items):
        raise ValueError(f"--schedules lists a schedule twice: {text!r}")
    return items


#: the stopping rule of ``until_flat``: the last 20% of the steps so far, a spread under 1%
FLAT_WINDOW, FLAT_TOLERANCE = 0.2, 0.01


def is_flat(history: Sequence[dict[str, Any]], *, window: float = FLAT_WINDOW, tolerance: float = FLAT_TOLERANCE,
            min_step: int = 0) -> bool:
    """Is the validation loss flat at the newest eval point ``s`` of ``history`` (metrics.jsonl records)?

    The val losses at steps >= ``s - floor(window * s)`` must be at least two and span less than ``tolerance``
    of the newest, and ``s`` must exceed ``min_step`` (the warmup); with evaluations every E steps, possible
    from ``s = 5E`` on.

    >>> is_flat([{"step": 80, "val_loss": 2.00}, {"step": 100, "val_loss": 1.99}])
    True
    """
    evals = [(int(r["step"]), float(r["val_loss"])) for r in history if r.get("val_loss") is not None]
    if not evals:
        return False
    last_step, last = evals[-1]
    start = last_step - math.floor(window * last_step + 1e-9)
    recent = [v for st, v in evals if st >= start]
    return last_step > min_step and len(recent) >= 2 and max(recent) - min(recent) < tolerance * abs(last)


def default_reference(schedules: Sequence[str], reference: str | None = None) -> str:
    """The schedule differences are taken to: ``reference`` if given (it must be compared), else
    ``uniform`` when compared, else the first schedule."""
    if reference is not None:
        if reference not in schedules:
            raise ValueError(f"--reference {reference!r} is not among --schedules ({', '.join(schedules)})")
        return reference
    return "uniform" if "uniform" in schedules else schedules[0]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9@._-]+", "_", name)


def run_compare(settings: CompareConfig, out: str | os.PathLike, *, data: PreparedData | None = None,
                on_run: Callable[[str, int, TrainResult], None] | None = None, plot: bool = True,
                resume: bool = False) -> dict[str, Any]:
    """Train every schedule x seed of ``settings``; returns the ``compare.json`` content (also written to ``out``).

    Every run starts from ``settings.run_config()``; its ``compare:`` section names the schedules, the seeds
    (a count: ``seed .. seed+N-1``), the ``reference`` (default: :func:`default_reference`, trained first at
    every seed), ``until_flat``, ``save_models`` and the equivalence ``margin`` (nats/token) of :func:`decide`.
    ``resume`` reads finished runs back and continues the others from their checkpoints (none without
    ``save_models``), giving the result of an uninterrupted comparison.
    """
    if not isinstance(settings, CompareConfig):
        raise TypeError(f"run_compare takes a CompareConfig (CompareConfig.from_run(run_config, schedules=..., "
                        f"seeds=...)), not a {type(settings).__name__}")
    cfg, c = settings.run_config(), settings.compare
    schedules = parse_schedules(c.schedules)
    reference = default_reference(schedules, c.reference)
    order = [reference] + [s for s in schedules if s != reference]
    seed_list = list(range(cfg.seed, cfg.seed + c.seeds))
    save_models, until_flat, margin = c.save_models, c.until_flat, c.margin  # checked by CompareSection
    for s in schedules:  # fail before training anything
        build_schedule(cfg.replace(model={"schedule": s}))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    is_main = distributed_env()[0] == 0  # under torchrun every run trains on all processes (DDP/FSDP2)
    data = data or prepare_shared(cfg)
    runs: list[dict[str, Any]] = []
    histories: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in schedules}
    t0 = time.perf_counter()
    max_steps = cfg.train.steps
    run_steps: int | None = None if until_flat else max_steps  # until_flat: set by the first run
    for seed in seed_list:  # seed-major: a partial comparison still has every schedule at seed 0
        for sched in order:
            run_cfg = cfg.replace(seed=seed, name=f"{cfg.name}-{sched}-s{seed}", model={"schedule": sched})
            if not save_models:  # no optimizer checkpoints either: --resume starts such a run over
                run_cfg = run_cfg.replace(train={"ckpt_every": 0})
            run_dir = out / f"{_safe(sched)}-seed{seed}"
            result = _finished_run(run_dir, run_cfg, run_steps) if resume else None
            if result is None:  # a run as long as the flat reference keeps the lr schedule of train.steps
                result = Trainer(run_cfg, run_dir, data=data, save_model=save_models,
                                 resume=resume and run_dir.is_dir(), stop_at_step=run_steps,
                                 callbacks=[] if run_steps else [_flat_rule(cfg.train.warmup_steps)]).run()
            if run_steps is None:
                run_steps = result.steps
            runs.append(_run_record(sched, seed, build_schedule(run_cfg), result, run_dir))
            histories[sched].append(result.history)
            if on_run is not None and is_main:
                on_run(sched, seed, result)
    summary = {
        "config": cfg.to_dict(), "data": data.meta, "baseline": reference, "reference": reference,
        "margin": margin, "seeds": seed_list, "steps_per_run": run_steps,
        "tokens_per_run": run_steps * cfg.train.batch_size * cfg.train.context,
        "until_flat": None if not until_flat else {
            "rule": f"val loss spread < {FLAT_TOLERANCE:.0%} of the newest over the last {FLAT_WINDOW:.0%} of "
                    "the steps so far, at eval points after the warmup",
            "decided_by": {"schedule": reference, "seed": seed_list[0]},
            "flat_at_step": run_steps if run_steps < max_steps else None, "max_steps": max_steps},
        "schedules": summarize_runs(runs, schedules, reference, margin), "runs": runs,
        "wall_s": time.perf_counter() - t0,
        "curves": {s: [[{k: rec[k] for k in ("step", "tokens", "train_loss", "val_loss")} for rec in h]
                       for h in hs] for s, hs in histories.items()},
    }
    if is_main:  # one writer of the comparison's files
        write_outputs(summary, out, plot)
    return summary


def _run_record(sched: str, seed: int, schedule: Any, result: TrainResult, run_dir: Path) -> dict[str, Any]:
    return {"schedule": sched, "seed": seed, "params": result.params, "steps": result.steps,
            "heads": list(schedule.heads), "head_dims": list(schedule.head_dims),
            "final_val_loss": result.final_val_loss, "final_train_loss": result.final_train_loss,
            "tokens_per_s": result.tokens_per_s, "peak_memory_mb": result.peak_memory_mb,
            "wall_s": result.wall_s, "run_dir": run_dir.name}  # inside the comparison's folder, wherever it moves


def write_outputs(summary: dict[str, Any], out: Path, plot: bool = True) -> None:
    """``compare.json``, ``report.md`` and (``plot``) the figures of a comparison's summary into ``out``."""
    atomic_write_text(out / "compare.json", json.dumps(summary, indent=2))
    atomic_write_text(out / "report.md", render_report(summary))
    if not plot:
        return
    plot_curves(summary, out / "loss_curves.png")
    if len(summary["schedules"]) > 1:
        curves = {s: dict(zip(summary["seeds"], hs)) for s, hs in summary["curves"].items()}
        plot_paired_curves(paired_curves(curves, summary["reference"]), summary["reference"],
                           out / "paired_curves.png")
        if len(summary["seeds"]) > 1:
            plot_paired_differences(summary, out / "paired_differences.png")


def _finished_run(run_dir: Path, cfg: RunConfig, run_steps: int | None) -> TrainResult | None:
    """The recorded result of a finished run of this comparison, for ``resume`` (None: train it); with
    ``run_steps`` None (the run whose flat point decides the others' length) any finished run stands."""
    result = finished_result(run_dir, cfg, steps=0 if run_steps is None else run_steps)
    if result is not None and run_steps is not None and result.steps > run_steps:
        raise ValueError(f"{run_dir} finished {result.steps} steps, but this comparison trains {run_steps}: "
                         "resume it with the settings it was made with, or use --overwrite or another --out")
    return result


def _flat_rule(warmup: int) -> Callable[[Trainer, int, dict | None], None]:
    """Trainer callback: stop at the first flat eval point (:func:`is_flat`) of ``trainer.history`` (a resumed
    run's includes the records before its checkpoint, so it stops where an uninterrupted run would)."""

    def callback(trainer: Trainer, step: int, record: dict | None) -> None:
        if record is not None and record.get("val_loss") is not None:
            trainer.stop_requested = is_flat(trainer.history, min_step=warmup)

    return callback


def summarize_runs(runs: Sequence[dict[str, Any]], schedules: Sequence[str], reference: str,
                   margin: float | None = None) -> dict[str, Any]:
    """Per schedule: layout, mean/std of the final val loss, tokens/s, peak memory, and ``paired``: the
    :func:`paired_differences` to ``reference`` with the ``decision`` of :func:`decide` and ``mdd_80``."""
    ref = {r["seed"]: r["final_val_loss"] for r in runs if r["schedule"] == reference}
    by_sched: dict[str, Any] = {}
    for sched in schedules:
        rs = [r for r in runs if r["schedule"] == sched]
        vals, tps = [r["final_val_loss"] for r in rs], [r["tokens_per_s"] for r in rs]
        paired = paired_differences({r["seed"]: r["final_val_loss"] for r in rs}, ref)
        paired["decision"] = "identical" if paired["n"] and not any(paired["diffs"]) else decide(paired["ci"], margin)
        paired["mdd_80"] = min_detectable_difference(paired["std"], paired["n"]) if paired["n"] >= 2 else None
        by_sched[sched] = {
            "heads": rs[0]["heads"], "head_dims": rs[0]["head_dims"], "params": rs[0]["params"],
            "n_runs": len(rs), "val_loss_mean": float(np.mean(vals)), "val_loss_std": sample_std(vals),
            "delta_vs_baseline_mean": paired["mean"], "delta_vs_baseline_std": paired["std"],
            "paired": paired, "tokens_per_s_mean": float(np.mean(tps)), "tokens_per_s_std": sample_std(tps),
            "peak_memory_mb_mean": float(np.mean([r["peak_memory_mb"] for r in rs])),
        }
    return by_sched


def _pm(mean: float, std: float, n: int, digits: int = 4) -> str:
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if n > 1 else f"{mean:.{digits}f}"


def render_report(summary: dict[str, Any]) -> str:
    """Markdown report of a comparison (the table, paired deltas, and what the data supports)."""
    cfg, meta, seeds = summary["config"], summary["data"], summary["seeds"]
    n, t, flat = len(seeds), cfg["train"], summary.get("until_flat")
    steps = summary.get("steps_per_run") or t["steps"]
    how = "" if not flat else (
        f" ({flat['decided_by']['schedule']} seed {flat['decided_by']['seed']} was flat at step "
        f"{flat['flat_at_step']}: {flat['rule']}; the learning-rate schedule is that of "
        f"{flat['max_steps']} steps)" if flat["flat_at_step"] else
        f" (--until-flat: {flat['decided_by']['schedule']} seed {flat['decided_by']['seed']} was not "
        f"flat within train.steps={flat['max_steps']}; raise it)")
    lines = [
        f"# Schedule comparison: {cfg['name']}", "",
        f"Preset `{cfg['model']['preset']}`; data `{meta['source']}` tokenized with `{meta['tokenizer']}` "
        f"({meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens); {steps} steps x "
        f"{t['batch_size']} x {t['context']} tokens = {steps * t['batch_size'] * t['context']:,} tokens "
        f"per run{how}; seeds {seeds}. Val loss is the mean cross-entropy (nats/token) on "
        f"{t['eval_batches']} fixed validation batches at the last step. Δ is the schedule's val loss minus "
        f"{summary['baseline']}'s at the same seed (same batches), "
        + ("mean ± std over seeds and its 95% Student-t interval." if n > 1 else "from one seed: no spread."),
        "",
        f"| schedule | heads per layer | params | val loss{' (mean ± std)' if n > 1 else ''} | "
        f"Δ vs {summary['baseline']} (paired) | 95% CI of Δ | tokens/s | peak MB |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    best = min(summary["schedules"].items(), key=lambda kv: kv[1]["val_loss_mean"])[0]
    for name, s in summary["schedules"].items():
        delta = "—" if name == summary["baseline"] else _pm(s["delta_vs_baseline_mean"], s["delta_vs_baseline_std"], n)
        ci = (s.get("paired") or {}).get("ci")
        ci_text = "—" if name == summary["baseline"] or not ci else f"[{ci[0]:+.4f}, {ci[1]:+.4f}]"
        lines.append(f"| {'**' + name + '**' if name == best else name} | {','.join(map(str, s['heads']))} | "
                     f"{s['params']:,} | {_pm(s['val_loss_mean'], s['val_loss_std'], n)} | {delta} | "
                     f"{ci_text} | {s['tokens_per_s_mean']:,.0f} | {s['peak_memory_mb_mean']:,.0f} |")
    lines += ["", "## Reading", "", *verdicts(summary), "",
              "Tokens/s is each run's mean over its logged steps, the runs trained one after another: on a "
              "machine shared with other work it measures the load as much as the schedule (for a speed "
              "comparison, `python benchmarks/throughput.py --loop` times the schedules interleaved). "
              "Peak memory is the CUDA allocator peak on GPU; on CPU it is the process RSS sampled every "
              "50 ms (approximate, includes the Python runtime and the data memmaps).",
              "", "![loss curves](loss_curves.png)", ""]
    if len(summary["schedules"]) > 1:
        if n > 1:
            lines += ["The final paired differences, per seed and with their 95% intervals"
                      + (f" against the ±{summary['margin']:g} margin" if summary.get("margin") else "") + ":", "",
                      "![paired differences at the end](paired_differences.png)", ""]
        lines += [f"Each schedule's validation loss minus {summary['baseline']}'s at the same seed, over training "
                  "(is a difference still moving at the end?):", "", "![paired differences](paired_curves.png)", ""]
    return "\n".join(lines)


def verdicts(summary: dict[str, Any]) -> list[str]:
    """One sentence per non-baseline schedule: is its paired difference larger than the seed noise?

    A paired t-test over seeds at 95% (two-sided); with 2 seeds only very consistent differences pass."""
    out, n, base = [], len(summary["seeds"]), summary["baseline"]
    for name, s in summary["schedules"].items():
        if name == base:
            continue
        d, sd = s["delta_vs_baseline_mean"], s["delta_vs_baseline_std"]
        ref = summary["schedules"][base]
        if s.get("heads") is not None and (s.get("heads"), s.get("head_dims")) == (ref.get("heads"), ref.get("head_dims")):
            out.append(f"- {name} vs {base}: the same layout (heads {','.join(map(str, s['heads']))}, head dims "
                       f"{','.join(map(str, s['head_dims']))}), so the same model trained on the same batches: "
                       f"Δ = {d:+.4f}" + ("." if d == 0 and sd == 0 else " (not 0: the runs are not deterministic)."))
            continue
        if n >= 2 and d == 0 and sd == 0:  # no spread to test against: identical results, not a difference
            out.append(f"- {name} vs {base}: Δ = 0 at every one of {n} seeds: identical results.")
            continue
        if n < 2:
            out.append(f"- {name} vs {base}: Δ = {d:+.4f} from one seed; run --seeds 3 or more to tell it "
                       "from seed noise.")
            continue
        se = sd / math.sqrt(n)
        t = abs(d) / se if se > 0 else math.inf
        crit = float(stats.t.ppf(0.975, n - 1))
        sig, ci = t >= crit, [d - crit * se, d + crit * se]
        verdict = ("lower than" if d < 0 else "higher than") if sig else "not distinguishable from"
        extra = (f" (paired t = {t:.1f} >= {crit:.2f}, 95% two-sided)" if sig
                 else f" (paired t = {t:.1f} < {crit:.2f} needed at 95% with {n} seeds)")
        line = (f"- {name} vs {base}: Δ = {d:+.4f} ± {sd:.4f} over {n} paired seeds, 95% CI "
                f"[{ci[0]:+.4f}, {ci[1]:+.4f}]: {verdict} {base}{extra}.")
        margin = summary.get("margin")
        if margin is not None and not sig:
            line += (f" Equivalent to {base} within ±{margin:.4f}: the whole interval lies inside the margin."
                     if decide(ci, margin) == "equivalent" else
                     f" Not shown equivalent within ±{margin:.4f}: the interval reaches past the margin.")
        if sd > 0:
            line += (f" These {n} seeds detect a true difference of {min_detectable_difference(sd, n):.4f} with "
                     "80% power.")
        out.append(line)
    return out


def paired_curves(curves: dict[str, dict[int, Sequence[dict[str, Any]]]], reference: str) -> dict[str, dict[str, Any]]:
    """Each schedule's validation loss minus ``reference``'s at the same seed and eval step, over training.

    ``curves`` maps schedule -> seed -> eval records (``step``, ``tokens``, ``val_loss``). Returns, per
    schedule but the reference, ``{"tokens": [...], "per_seed": {seed: [...]}, "mean": [...]}`` over the
    steps every seed shares.

        >>> c = {"uniform": {0: [{"step": 1, "tokens": 8, "val_loss": 5.0}]},
        ...      "prism": {0: [{"step": 1, "tokens": 8, "val_loss": 4.5}]}}
        >>> paired_curves(c, "uniform")["prism"]["mean"]
        [-0.5]
    """
    ref = {seed: {r["step"]: r["val_loss"] for r in h if r.get("val_loss") is not None}
           for seed, h in curves.get(reference, {}).items()}
    out: dict[str, dict[str, Any]] = {}
    for name, by_seed in curves.items():
        if name == reference:
            continue
        per = {seed: {r["step"]: (r["tokens"], r["val_loss"] - ref[seed][r["step"]]) for r in h
                      if r.get("val_loss") is not None and r["step"] in ref[seed]}
               for seed, h in by_seed.items() if seed in ref}
        steps = sorted(set.intersection(*(set(v) for v in per.values()))) if per else []
        if not steps:
            continue
        first = next(iter(per.values()))
        out[name] = {"tokens": [first[st][0] for st in steps],
                     "per_seed": {seed: [v[st][1] for st in steps] for seed, v in per.items()},
                     "mean": [float(np.mean([v[st][1] for v in per.values()])) for st in steps]}
    return out
