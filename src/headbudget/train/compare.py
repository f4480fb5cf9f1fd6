"""Train several head schedules x seeds on identical data and compare them.

Every run of seed ``s`` sees the same batches in the same order (data order is a function of
(seed, step) only), so differences between schedules at one seed are paired.  Writes into ``out``:
``compare.json`` (per run and per schedule), ``report.md`` and ``loss_curves.png``.

    >>> from headbudget.train import load_config
    >>> from headbudget.train.compare import run_compare
    >>> # summary = run_compare(load_config("configs/cpu-small.yaml"), ["uniform", "prism", "uniform@128"],
    >>> #                       seeds=3, out="runs/cmp")
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

from headbudget.data.prepare import PreparedData, prepare_data
from headbudget.io import atomic_write_text, follow_umask
from headbudget.train.config import RunConfig
from headbudget.train.trainer import Trainer, TrainResult, build_schedule


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


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9@._-]+", "_", name)


def _std(values: list[float]) -> float:
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def prepare_for(cfg: RunConfig, progress: bool = True) -> PreparedData:
    d = cfg.data
    return prepare_data(d.source, d.tokenizer, d.cache_dir, seed=d.seed, val_fraction=d.val_fraction,
                        max_chars=d.max_chars, split_blank_lines=d.split_blank_lines, progress=progress)


def run_compare(
    cfg: RunConfig,
    schedules: Sequence[str],
    seeds: int | Sequence[int],
    out: str | os.PathLike,
    *,
    data: PreparedData | None = None,
    save_models: bool = True,
    on_run: Callable[[str, int, TrainResult], None] | None = None,
    plot: bool = True,
) -> dict[str, Any]:
    """Train every schedule x seed; returns the ``compare.json`` content (also written to ``out``).

    ``seeds`` is a count (seeds ``cfg.seed .. cfg.seed+N-1``) or an explicit list.
    """
    schedules = list(schedules)
    seed_list = list(range(cfg.seed, cfg.seed + seeds)) if isinstance(seeds, int) else list(seeds)
    if not seed_list:
        raise ValueError("--seeds must be at least 1")
    for s in schedules:  # fail before training anything
        build_schedule(cfg.replace(model={"schedule": s}))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = data or prepare_for(cfg, cfg.train.progress)
    runs: list[dict[str, Any]] = []
    histories: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in schedules}
    t0 = time.perf_counter()
    for seed in seed_list:  # seed-major: a partial comparison still has every schedule at seed 0
        for sched in schedules:
            run_cfg = cfg.replace(seed=seed, name=f"{cfg.name}-{sched}-s{seed}", model={"schedule": sched})
            if not save_models:  # compare cannot resume a run, so its optimizer checkpoints are dead weight
                run_cfg = run_cfg.replace(train={"ckpt_every": 0})
            run_dir = out / f"{_safe(sched)}-seed{seed}"
            result = Trainer(run_cfg, run_dir, data=data, save_model=save_models).run()
            sch = build_schedule(run_cfg)
            runs.append({
                "schedule": sched, "seed": seed, "params": result.params,
                "heads": list(sch.heads), "head_dims": list(sch.head_dims),
                "final_val_loss": result.final_val_loss, "final_train_loss": result.final_train_loss,
                "tokens_per_s": result.tokens_per_s, "peak_memory_mb": result.peak_memory_mb,
                "wall_s": result.wall_s, "run_dir": str(run_dir),
            })
            histories[sched].append(result.history)
            if on_run is not None:
                on_run(sched, seed, result)
    baseline = schedules[0]
    by_sched: dict[str, Any] = {}
    for sched in schedules:
        rs = [r for r in runs if r["schedule"] == sched]
        vals = [r["final_val_loss"] for r in rs]
        deltas = []
        for r in rs:
            base = next(b for b in runs if b["schedule"] == baseline and b["seed"] == r["seed"])
            deltas.append(r["final_val_loss"] - base["final_val_loss"])
        by_sched[sched] = {
            "heads": rs[0]["heads"], "head_dims": rs[0]["head_dims"], "params": rs[0]["params"],
            "n_runs": len(rs), "val_loss_mean": float(np.mean(vals)), "val_loss_std": _std(vals),
            "delta_vs_baseline_mean": float(np.mean(deltas)), "delta_vs_baseline_std": _std(deltas),
            "tokens_per_s_mean": float(np.mean([r["tokens_per_s"] for r in rs])),
            "peak_memory_mb_mean": float(np.mean([r["peak_memory_mb"] for r in rs])),
        }
    summary = {
        "config": cfg.to_dict(), "data": data.meta, "baseline": baseline, "seeds": seed_list,
        "schedules": by_sched, "runs": runs, "wall_s": time.perf_counter() - t0,
        "curves": {s: [[{k: rec[k] for k in ("step", "tokens", "train_loss", "val_loss")} for rec in h]
                       for h in hs] for s, hs in histories.items()},
    }
    atomic_write_text(out / "compare.json", json.dumps(summary, indent=2))
    atomic_write_text(out / "report.md", render_report(summary))
    if plot:
        plot_curves(summary, out / "loss_curves.png")
    return summary




def _pm(mean: float, std: float, n: int, digits: int = 4) -> str:
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if n > 1 else f"{mean:.{digits}f}"


def render_report(summary: dict[str, Any]) -> str:
    """Markdown report of a comparison (the table, paired deltas, and what the data supports)."""
    cfg, meta = summary["config"], summary["data"]
    seeds = summary["seeds"]
    n = len(seeds)
    t = cfg["train"]
    lines = [
        f"# Schedule comparison: {cfg['name']}",
        "",
        f"Preset `{cfg['model']['preset']}`; data `{meta['source']}` tokenized with `{meta['tokenizer']}` "
        f"({meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens); {t['steps']} steps x "
        f"{t['batch_size']} x {t['context']} tokens = {t['steps'] * t['batch_size'] * t['context']:,} tokens "
        f"per run; seeds {seeds}. Val loss is the mean cross-entropy (nats/token) on "
        f"{t['eval_batches']} fixed validation batches at the last step.",
        "",
        f"| schedule | heads per layer | params | val loss{' (mean ± std)' if n > 1 else ''} | "
        f"Δ vs {summary['baseline']} (paired) | tokens/s | peak MB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    best = min(summary["schedules"].items(), key=lambda kv: kv[1]["val_loss_mean"])
    for name, s in summary["schedules"].items():
        delta = "—" if name == summary["baseline"] else _pm(s["delta_vs_baseline_mean"], s["delta_vs_baseline_std"], n)
        lines.append(
            f"| {'**' + name + '**' if name == best[0] else name} | {','.join(map(str, s['heads']))} | "
            f"{s['params']:,} | {_pm(s['val_loss_mean'], s['val_loss_std'], n)} | {delta} | "
            f"{s['tokens_per_s_mean']:,.0f} | {s['peak_memory_mb_mean']:,.0f} |"
        )
    lines += ["", "## Reading", ""]
    lines += verdicts(summary)
    lines += ["", "Peak memory is the CUDA allocator peak on GPU; on CPU it is the process RSS sampled every "
              "50 ms (approximate, includes the Python runtime and the data memmaps)."]
    lines += ["", "![loss curves](loss_curves.png)", ""]
    return "\n".join(lines)


#: two-sided 95% critical values of Student's t by degrees of freedom (paired seeds - 1)
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23,
        15: 2.13, 20: 2.09, 30: 2.04}


def verdicts(summary: dict[str, Any]) -> list[str]:
    """One sentence per non-baseline schedule: is its paired difference larger than the seed noise?

    A paired t-test over seeds at 95% (two-sided); with 2 seeds only very consistent differences pass."""
    out = []
    n = len(summary["seeds"])
    base = summary["baseline"]
    for name, s in summary["schedules"].items():
        if name == base:
            continue
        d, sd = s["delta_vs_baseline_mean"], s["delta_vs_baseline_std"]
        if n < 2:
            out.append(f"- {name} vs {base}: Δ = {d:+.4f} from one seed; run --seeds 3 or more to tell it "
                       "from seed noise.")
            continue
        se = sd / math.sqrt(n)
        t = abs(d) / se if se > 0 else math.inf
        crit = _T95[max(k for k in _T95 if k <= n - 1)] if n - 1 <= 30 else 1.96
        sig = t >= crit
        verdict = ("lower than" if d < 0 else "higher than") if sig else "not distinguishable from"
        extra = (f" (paired t = {t:.1f} >= {crit:.2f}, 95% two-sided)" if sig
                 else f" (paired t = {t:.1f} < {crit:.2f} needed at 95% with {n} seeds)")
        out.append(f"- {name} vs {base}: Δ = {d:+.4f} ± {sd:.4f} over {n} paired seeds: "
                   f"{verdict} {base}{extra}.")
    return out


def plot_curves(summary: dict[str, Any], path: str | os.PathLike) -> Path:
    """Validation (left) and training (right) loss against tokens: per-seed thin, mean thick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, curves) in enumerate(summary["curves"].items()):
        c = colors[i % len(colors)]
        for ax, key in zip(axes, ("val_loss", "train_loss")):
            series = []
            for h in curves:
                pts = [(r["tokens"], r[key]) for r in h if r[key] is not None]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, color=c, alpha=0.25, lw=0.8)
                    series.append((xs, ys))
            if series and all(len(s[1]) == len(series[0][1]) for s in series):
                ax.plot(series[0][0], np.mean([s[1] for s in series], axis=0), color=c, lw=2, label=name)
    for ax, title in zip(axes, ("validation loss", "training loss")):
        ax.set_xlabel("tokens")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.png")
    try:
        fig.savefig(tmp, dpi=120)
        follow_umask(tmp)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)  # a failed write leaves no temp file
    return path
