"""The figures of a comparison (``headbudget compare``): loss curves, paired differences over training and
at the end.

    >>> from headbudget.train.compare_plots import plot_paired_differences
    >>> # plot_paired_differences(json.load(open("runs/cmp/compare.json")), "runs/cmp/paired_differences.png")
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from headbudget.io import new_figure, save_figure

__all__ = ["plot_curves", "plot_paired_curves", "plot_paired_differences"]


def plot_curves(summary: dict[str, Any], path: str | os.PathLike) -> Path:
    """Validation (left) and training (right) loss against tokens: per-seed thin, mean thick."""
    from matplotlib import rcParams

    fig, axes = new_figure(1, 2, figsize=(11, 4.2))
    colors = rcParams["axes.prop_cycle"].by_key()["color"]
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
    return save_figure(fig, path)  # atomic, follows the umask, a failed write leaves no temp file; closes fig


def plot_paired_differences(summary: dict[str, Any], path: str | os.PathLike) -> Path:
    """The final paired differences as a forest plot: per schedule its per-seed differences (dots), their mean
    and 95% interval (bar), zero (the reference) and the ``--margin`` band when one was set."""
    from matplotlib.ticker import MaxNLocator

    base, margin = summary["baseline"], summary.get("margin")
    rows = [(name, s["paired"]) for name, s in summary["schedules"].items() if name != base]
    fig, ax = new_figure(figsize=(7, 1.4 + 0.55 * len(rows)))
    if margin is not None:
        ax.axvspan(-margin, margin, color="C2", alpha=0.12, label=f"±{margin:g} margin")
    ax.axvline(0.0, color="C0", lw=1)
    for y, (_, p) in enumerate(reversed(rows)):
        ax.scatter(p["diffs"], [y] * len(p["diffs"]), s=14, color="0.5", zorder=2)
        if p["ci"] is not None:
            ax.plot(p["ci"], [y, y], color="C3", lw=2.5, zorder=3)
        ax.scatter([p["mean"]], [y], s=40, color="C3", zorder=4)
    ax.set_yticks(range(len(rows)), [f"{name} - {base}" for name, _ in reversed(rows)])
    ax.set(xlabel="final val loss difference (nats/token); dots: seeds, bar: 95% interval",
           title=f"paired by seed, {len(summary['seeds'])} seeds")
    ax.xaxis.set_major_locator(MaxNLocator(6))  # tick labels of 4-digit losses overlap
    ax.grid(axis="x", alpha=0.3)
    if margin is not None:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return save_figure(fig, path)


def plot_paired_curves(paired: dict[str, dict[str, Any]], reference: str, path: str | os.PathLike,
                       title: str | None = None) -> Path:
    """:func:`paired_curves` as a figure: thin lines per seed, thick the mean, zero is the reference."""
    fig, ax = new_figure(figsize=(6.5, 4))
    for k, (name, d) in enumerate(paired.items(), start=1):
        for v in d["per_seed"].values():
            ax.plot(d["tokens"], v, color=f"C{k}", alpha=0.25, lw=0.8)
        ax.plot(d["tokens"], d["mean"], color=f"C{k}", lw=2, label=f"{name} - {reference}")
    ax.axhline(0.0, color="C0", lw=1)
    ax.set(title=title or f"validation loss minus {reference}'s, paired by seed", xlabel="tokens",
           ylabel="difference (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)
