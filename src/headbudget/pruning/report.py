"""Pruning reports: ``report.json`` (fixed schema), ``report.md`` and plots (matplotlib, Agg).

``report.json`` is exactly::

    {"method", "heads_total", "heads_kept", "kept": {"<layer>": [heads]}, "mean_depth",
     "middle_third_share", "knee_k", "k_source", "mss": [[k, value], ...], "metric": {"dense", "pruned", "finetuned"},
     "seconds": {...},
     "cost": {"params": {"before", "after"}, "flops_per_token": {"before", "after"}, "context",
              "kv_cache_bytes_per_token": {"before", "after"}, "gguf_kv_cache_bytes_per_token": {"before", "after"}}}

The KV-cache sizes are for decoders only (the GGUF one for those llama.cpp runs); ``metric`` (the primary
split's accuracy, task lm: perplexity) is ``null`` where a stage did not run; everything else goes to
``details.json``.  See docs/pruning.md, "Commands" and "Granularity on grouped-query models".

    >>> rep = build_report("cahp", 72, {0: [1, 4], 1: [0]}, knee_k=3, mss=[(2, 0.5), (3, 0.7)],
    ...                    metric={"dense": 0.5, "pruned": 0.3, "finetuned": 0.45}, seconds={"total": 9.0})
    >>> rep["heads_kept"], rep["kept"]
    (3, {'0': [1, 4], '1': [0]})
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from headbudget.io import atomic_write_text, new_figure, save_figure

__all__ = ["REPORT_KEYS", "build_report", "compare_markdown", "depth_profile", "describe_k", "k_source_of",
           "plot_accuracy_vs_heads", "plot_embedding", "plot_heads_per_layer", "plot_mss", "report_markdown",
           "write_json"]

REPORT_KEYS = ("method", "heads_total", "heads_kept", "kept", "mean_depth", "middle_third_share", "knee_k", "k_source",
               "mss", "metric", "seconds", "cost")
METRIC_KEYS = ("dense", "pruned", "finetuned")
#: report.json's ``cost`` entries and their labels in report.md, compare.md and the printed summary
COST_LABELS = {"params": "params", "flops_per_token": "FLOPs / token",
               "kv_cache_bytes_per_token": "KV-cache bytes / token",
               "gguf_kv_cache_bytes_per_token": "KV-cache bytes / token (llama.cpp GGUF, f16)"}


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    return obj


def write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(_jsonable(obj), indent=1) + "\n")


def depth_profile(kept: Mapping[int | str, Sequence[int]], n_layers: int) -> tuple[float, float]:
    """``(mean_depth, middle_third_share)`` of the kept heads (proximity bias): the mean normalised depth
    ``l / (n_layers - 1)`` (0 with one layer) and the share with depth in [1/3, 2/3] (docs/pruning.md,
    "Commands").

        >>> depth_profile({0: [0, 1], 1: [2], 2: [], 3: [0]}, 4)
        (0.3333333333333333, 0.25)
    """
    if n_layers < 1:
        raise ValueError(f"depth_profile needs at least one layer, got {n_layers}")
    layers = [int(layer) for layer, hs in kept.items() for _ in hs]
    if not layers:
        return 0.0, 0.0
    span = n_layers - 1
    depth = [layer / span if span else 0.0 for layer in layers]
    middle = [layer for layer in layers if span and span <= 3 * layer <= 2 * span]
    return float(sum(depth) / len(depth)), len(middle) / len(layers)


def build_report(method: str, heads_total: int, kept: Mapping[int | str, Sequence[int]], knee_k: int | None,
                 mss: Sequence[tuple[int, float]] | None, metric: Mapping[str, float | None],
                 seconds: Mapping[str, float], cost: Mapping[str, Mapping[str, int]] | None = None,
                 n_layers: int | None = None, k_source: str | None = None) -> dict[str, Any]:
    """The ``report.json`` dict, keys in the fixed order (``kept`` keyed by layer as strings).  ``n_layers``
    (default: the highest layer in ``kept`` + 1) normalises the depths of :func:`depth_profile`; ``cost`` is
    ``{"before": model_cost(dense), "after": model_cost(pruned)}``
    (:func:`headbudget.evaluation.cost.model_cost`)."""
    kept_json = {str(int(layer)): sorted(int(h) for h in hs) for layer, hs in sorted(kept.items(), key=lambda kv: int(kv[0]))}
    mean_depth, middle = depth_profile(kept_json, n_layers if n_layers is not None
                                       else max((int(k) for k in kept_json), default=0) + 1)

    def pair(key: str) -> dict[str, int]:
        return {"before": int(cost["before"][key]), "after": int(cost["after"][key])}  # type: ignore[index]

    return {
        "method": method,
        "heads_total": int(heads_total),
        "heads_kept": int(sum(len(v) for v in kept_json.values())),
        "kept": kept_json,
        "mean_depth": mean_depth,
        "middle_third_share": middle,
        "knee_k": None if knee_k is None else int(knee_k),
        "k_source": None if knee_k is None else (k_source or "knee"),
        "mss": [[int(k), float(v)] for k, v in (mss or [])],
        "metric": {k: (None if metric.get(k) is None else float(metric[k])) for k in METRIC_KEYS},  # type: ignore[arg-type]
        "seconds": {k: round(float(v), 3) for k, v in seconds.items()},
        "cost": None if cost is None else {
            "params": pair("params"), "flops_per_token": pair("flops_per_token"),
            "context": int(cost["before"]["context"]),
            # llama.cpp runs only some pruned decoders: its cache size is left out when either side lacks it
            **{k: pair(k) for k in ("kv_cache_bytes_per_token", "gguf_kv_cache_bytes_per_token")
               if cost["before"].get(k) is not None
               and (k == "kv_cache_bytes_per_token" or cost["after"].get(k) is not None)},
        },
    }


def k_source_of(knee_source: str | None) -> str | None:
    """``report.json``'s ``k_source`` of CAHP's ``knee_source`` (``details.json``): ``"mss"`` / ``"accuracy"`` ->
    ``"knee"``, ``"keep"`` -> ``"forced"``, ``"fallback-max-*"`` -> ``"fallback"`` (a ``k_source`` maps to itself)."""
    if knee_source is None:
        return None
    if knee_source.startswith("fallback"):
        return "fallback"
    return {"mss": "knee", "accuracy": "knee", "keep": "forced"}.get(knee_source, knee_source)


def describe_k(k: int | None, knee_source: str | None, keep: int | None = None,
               keep_ratio: float | None = None) -> str | None:
    """What CAHP's k is, in words, for report.md, the printed summary and the MSS plot: a forced head count
    sets the cluster count without any knee, and calling it a knee misleads.

        >>> describe_k(30, "keep", keep_ratio=0.5)
        'clusters k = 30, forced by --keep-ratio 0.5; no knee computed'
    """
    if k is None:
        return None
    source = k_source_of(knee_source)
    if source == "forced":
        by = (f"--keep {keep}" if keep is not None else f"--keep-ratio {keep_ratio:g}" if keep_ratio is not None
              else "a forced head count")
        return f"clusters k = {k}, forced by {by}; no knee computed"
    if source == "fallback":
        curve = "accuracy" if "accuracy" in str(knee_source) else "MSS"
        return f"clusters k = {k}, no knee found: the k of the highest {curve}"
    return f"knee k = {k}"


def _fmt(v: Any) -> str:
    return "–" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)


def report_markdown(report: Mapping[str, Any], details: Mapping[str, Any] | None = None, plots: Sequence[str] = ()) -> str:
    """Human-readable summary of one pruning run."""
    lines = [f"# Head pruning: {report['method']}", ""]
    if report.get("warning"):
        lines += [f"**Warning:** {report['warning']}", ""]
    details = details or {}
    job = details.get("job") or {}
    k_text = describe_k(report.get("knee_k"), details.get("knee_source") or report.get("k_source"),
                        keep=job.get("keep"), keep_ratio=job.get("keep_ratio"))
    lines.append(f"Kept **{report['heads_kept']} / {report['heads_total']}** heads"
                 + (f" ({k_text})" if k_text else "") + ".")
    if details.get("knee_source"):
        lines.append(f"Head count from: {details['knee_source']}.")
    if details.get("rescued"):
        lines.append(f"Rescued (at least one head per layer): {details['rescued']}.")
    mname = str(details.get("metric_name", "accuracy"))
    lines += ["", f"## {mname.capitalize()}" + (" (lower is better)" if mname == "perplexity" else ""), "",
              "| split | dense | pruned | fine-tuned |", "| --- | --- | --- | --- |"]
    lines += [f"| {split} | " + " | ".join(_fmt(row.get(k)) for k in METRIC_KEYS) + " |"
              for split, row in (details.get(mname) or {"primary": report["metric"]}).items()]
    if report.get("cost"):
        c = report["cost"]
        lines += ["", f"## Size (forward FLOPs per token at context {c['context']})", "",
                  "| | before | after | ratio |", "| --- | --- | --- | --- |"]
        for key, label in COST_LABELS.items():
            if key in c:  # encoders have no KV cache
                b, a = c[key]["before"], c[key]["after"]
                lines.append(f"| {label} | {b:,} | {a:,} | {a / b:.3f} |")
    lines += ["", "## Heads kept per layer", ""]
    if report.get("mean_depth") is not None:
        lines += [f"Mean normalised depth of the kept heads {report['mean_depth']:.3f} (0 first layer, 1 last); "
                  f"share in the middle third of the layers {report['middle_third_share']:.3f}.", ""]
    lines += ["| layer | kept | heads |", "| --- | --- | --- |"]
    lines += [f"| {layer} | {len(hs)} | {', '.join(map(str, hs))} |" for layer, hs in report["kept"].items()]
    lines += ["", "## Wall time (s)", "", "| stage | seconds |", "| --- | --- |"]
    lines += [f"| {k} | {v:.1f} |" for k, v in report["seconds"].items()]
    if report.get("mss"):
        best = max(report["mss"], key=lambda kv: kv[1])
        lines += ["", f"MSS computed for k = {report['mss'][0][0]}..{report['mss'][-1][0]}; "
                  f"maximum {best[1]:.4f} at k = {best[0]}."]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines) + "\n"


def compare_markdown(rows: Sequence[Mapping[str, Any]], splits: Sequence[str]) -> str:
    """Table of several methods at one head count: ``rows`` have method, heads_kept, accuracy
    ({split: {dense, pruned, finetuned}}), seconds, kept."""
    has_from = any("count_from" in r for r in rows)
    head = ["method", "heads"] + (["count from"] if has_from else [])
    head += [f"{s} {stage}" for s in splits for stage in ("pruned", "fine-tuned")]
    has_depth = any("mean_depth" in r for r in rows)
    head += (["mean depth", "middle third"] if has_depth else []) + ["select s", "finetune s"]
    cost_keys = [k for k in COST_LABELS if any(k in (r.get("cost") or {}) for r in rows)]
    head += [COST_LABELS[k] for k in cost_keys]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [str(r["method"]), str(r["heads_kept"])] + ([str(r.get("count_from", ""))] if has_from else [])
        metric = r.get("accuracy") or r.get("metric") or {}
        cells += [_fmt(metric.get(s, {}).get(k)) for s in splits for k in ("pruned", "finetuned")]
        sec = r.get("seconds") or {}
        if has_depth:
            cells += [_fmt(r.get("mean_depth")), _fmt(r.get("middle_third_share"))]
        cells += [_fmt(sec.get("select")), _fmt(sec.get("finetune"))]
        cost = r.get("cost") or {}
        cells += [f"{cost[k]['before']:,} → {cost[k]['after']:,}" if k in cost else "–" for k in cost_keys]
        lines.append("| " + " | ".join(cells) + " |")
    if rows:
        dense = (rows[0].get("accuracy") or rows[0].get("metric") or {})
        lines += ["", "Dense: " + ", ".join(f"{s} {_fmt(dense.get(s, {}).get('dense'))}" for s in splits)]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- plots
def plot_mss(mss: Sequence[tuple[int, float]], knee_k: int | None, path: str | os.PathLike[str],
             title: str = "Mean Simplified Silhouette") -> Path:
    """MSS vs k with the chosen k marked."""
    fig, ax = new_figure(figsize=(6, 3.6))
    ax.plot([k for k, _ in mss], [v for _, v in mss], marker=".", lw=1)
    if knee_k is not None:
        ax.axvline(knee_k, color="tab:red", ls="--", lw=1, label=f"k = {knee_k}")
        ax.legend()
    ax.set(xlabel="clusters k", ylabel="MSS", title=title)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)  # atomic, follows the umask, no temp file left on failure; closes fig


def plot_embedding(embedding: np.ndarray, labels: Sequence[int], heads: Sequence[tuple[int, int]],
                   kept: Sequence[int], path: str | os.PathLike[str]) -> Path:
    """2-D t-SNE embedding of the heads, coloured by cluster (left) and by layer (right); kept
    heads ringed in black."""
    emb = np.asarray(embedding)
    layers = np.array([layer for layer, _ in heads])
    fig, axes = new_figure(1, 2, figsize=(11, 4.8))
    kept_mask = np.zeros(len(heads), dtype=bool)
    kept_mask[list(kept)] = True
    for ax, colour, title, cmap in (
        (axes[0], np.asarray(labels), f"clusters (k = {len(set(np.asarray(labels).tolist()))})", "tab20"),
        (axes[1], layers, "layers", "viridis"),
    ):
        sc = ax.scatter(emb[:, 0], emb[:, 1], c=colour, cmap=cmap, s=28)
        ax.scatter(emb[kept_mask, 0], emb[kept_mask, 1], facecolors="none", edgecolors="black", s=90, lw=1.2,
                   label="kept")
        ax.set(title=f"t-SNE of head signatures: {title}", xticks=[], yticks=[])
        if colour is layers:
            from matplotlib.ticker import MaxNLocator

            cb = fig.colorbar(sc, ax=ax, label="layer")
            cb.locator = MaxNLocator(integer=True)
            cb.update_ticks()
        ax.legend(loc="best", fontsize=8)
    return save_figure(fig, path)  # atomic, follows the umask, no temp file left on failure; closes fig


def plot_heads_per_layer(kept_by_method: Mapping[str, Mapping[Any, Sequence[int]]], n_layers: int,
                         path: str | os.PathLike[str]) -> Path:
    """Grouped bars: heads kept in each layer by each method (the "proximity bias" figure)."""
    methods = list(kept_by_method)
    fig, ax = new_figure(figsize=(max(6, n_layers * 0.6 * max(1, len(methods)) / 2), 3.8))
    width = 0.8 / max(1, len(methods))
    x = np.arange(n_layers)
    for i, m in enumerate(methods):
        kept = {int(k): v for k, v in kept_by_method[m].items()}
        ax.bar(x + (i - (len(methods) - 1) / 2) * width, [len(kept.get(layer, [])) for layer in range(n_layers)],
               width, label=m)
    ax.set(xticks=x, xlabel="layer", ylabel="heads kept", title="Heads kept per layer")
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)  # atomic, follows the umask, no temp file left on failure; closes fig


def plot_accuracy_vs_heads(points: Mapping[str, Sequence[tuple[int, float]]], path: str | os.PathLike[str],
                           dense: tuple[int, float] | None = None,
                           curve: Sequence[tuple[int, float]] | None = None, ylabel: str = "dev accuracy",
                           title: str = "Accuracy vs heads kept") -> Path:
    """Accuracy vs heads kept: one marker series per label (e.g. "cahp pruned"), the dense model
    as a star, and an optional measured curve (``--curve accuracy``)."""
    fig, ax = new_figure(figsize=(6, 4))
    if curve:
        cs = sorted(curve)
        ax.plot([c[0] for c in cs], [c[1] for c in cs], color="0.6", lw=1, marker=".", label="CAHP sweep (pruned)")
    markers = "osD^v<>ph"
    for i, (label, pts) in enumerate(points.items()):
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % len(markers)], s=40, label=label)
    if dense is not None:
        ax.scatter([dense[0]], [dense[1]], marker="*", s=160, color="black", label="dense")
    ax.set(xlabel="heads kept", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)  # atomic, follows the umask, no temp file left on failure; closes fig
