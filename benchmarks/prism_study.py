"""The pre-registered Prism study (protocol: docs/prism_study.md): prism against uniform, the
reverse schedule, the all-wide control ``uniform@W`` (W = prism's widest head) and the budgeted
``late_dim_decay:0.75``, 5 seeds each with identical batches per seed, at two CPU sizes.

Data: movie reviews (``../shared/data/text/movie_reviews.txt``, the largest text there, split into
reviews at blank lines) with the GPT-2 BPE (``../shared/data/tokenizers/gpt2``); the last 5% of the
reviews are held out.  Each run is trained by the library's :class:`~headbudget.train.trainer.Trainer`
(the loop ``headbudget compare`` uses; same seeds -> same batches) and then measured:

* the primary endpoint: the loss (nats/token) on the whole held-out tail, non-overlapping windows of
  the context (:func:`headbudget.evaluation.perplexity.perplexity`);
* out of domain: the same on the first ``--ood-tokens`` tokens of WikiText-2 valid and tinyshakespeare;
* training tokens/s (the trainer's measurement; the zero-overhead claim);
* the per-layer mean attention distance on held-out sequences (:mod:`headbudget.analysis.attention`;
  the local-to-global claim);
* whether the run's own val loss was flat at its end (:func:`headbudget.train.compare.is_flat`).

Resumable: one folder per (size, schedule, seed) under ``--out``; a run whose ``run.json`` exists is
read back, not retrained; a killed run continues from its newest checkpoint.  The results file is
rewritten after every finished run, and a new machine (no run folders) restores the finished runs from it,
so the study continues across sessions from what was committed.  Two processes may share a study (one per
core, ``--seed-order descending`` for the second): a run being trained holds a lock (``train.lock``, released
when its process ends) that the other process skips, and each rewrite of the results file keeps the runs the
other process recorded; a last plain invocation then reads every run back and analyses.  After the runs it writes
``benchmarks/results/prism_study.json`` (every run, paired differences to uniform and to the wide
control with 95% intervals per size and text, the verdicts of the decision rule) and the loss curves
``benchmarks/results/prism_study_curves_<size>.png``, and prints the paired table.

Pilot (step 1 of the protocol: tokens per run, seed spread, smallest detectable difference)::

    nice -n 10 python benchmarks/prism_study.py --pilot --sizes cpu-tiny --seeds 3 --tokens 1M \\
        --threads 1 --out runs/prism_pilot

Main runs (after the pilot's numbers are registered there and in REGISTERED_TOKENS / REGISTERED_MDD)::

    nice -n 10 python benchmarks/prism_study.py --sizes cpu-tiny,cpu-mid --threads 1 --out runs/prism_study
    nice -n 10 python benchmarks/prism_study.py --sizes cpu-tiny --threads 1 --out runs/prism_study \
        --seed-order descending    # beside it, on the second core
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

# the paired test's power at level 0.05 and power 0.80, as registered; shared with ``headbudget compare``
from headbudget.train.paired import min_detectable_difference

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
MOVIE_REVIEWS = SHARED / "text" / "movie_reviews.txt"
OOD_TEXTS = {"wikitext2_valid": SHARED / "text" / "wikitext2_valid.tokens",
             "tinyshakespeare": SHARED / "text" / "tinyshakespeare.txt"}
GPT2_DIR = SHARED / "tokenizers" / "gpt2"
RESULTS = ROOT / "benchmarks" / "results"

#: the sizes and their context (each preset's n_positions); batch 16 sequences a step
SIZES = {"cpu-tiny": 128, "cpu-mid": 128, "cpu-small": 256}
BATCH = 16
#: "uniform@W" and "late_dim_decay" are resolved per size (:func:`study_schedules`)
SCHEDULES = ("uniform", "prism", "reverse", "uniform@W", "late_dim_decay")
BUDGET_FRACTION = 0.75
#: tokens per run and the smallest detectable paired difference of the held-out loss (nats/token),
#: registered in docs/prism_study.md after the pilot (None: not measured yet)
REGISTERED_TOKENS: dict[str, int | None] = {"cpu-tiny": 1_001_472, "cpu-mid": 1_001_472, "cpu-small": None}  # amendments 2026-12-02, -03
REGISTERED_MDD: dict[str, float | None] = {"cpu-tiny": 0.0220, "cpu-mid": 0.0042, "cpu-small": None}
SEEDS = 5
STUDY_SIZES = ("cpu-tiny", "cpu-mid")  # the registered sizes (cpu-small fell back to cpu-mid, amendment of session 5)


def study_schedules(size: str, names: list[str] | tuple[str, ...] = SCHEDULES) -> list[str]:
    """Schedule specs for a size: ``uniform@W`` -> ``uniform@<prism's widest head>``, ``late_dim_decay``
    -> ``late_dim_decay:0.75`` (the allocation theory's budgeted schedule at 75% of the attention
    budget; at 100% it is uniform).

    >>> study_schedules("cpu-tiny")
    ['uniform', 'prism', 'reverse', 'uniform@128', 'late_dim_decay:0.75']
    """
    from headbudget.schedule_spec import schedule_from_spec

    widest = max(schedule_from_spec("prism", size).head_dims)
    out = []
    for n in names:
        if n == "uniform@W":
            n = f"uniform@{widest}"
        elif n == "late_dim_decay":
            n = f"late_dim_decay:{BUDGET_FRACTION:g}"
        schedule_from_spec(n, size)  # an unknown name fails here, before any training
        out.append(n)
    return out


def run_config(size: str, schedule: str, seed: int, tokens: int, threads: int, cache_dir: str | None):
    """The registered training recipe (docs/prism_study.md) for one run."""
    from headbudget.train import RunConfig
    from headbudget.train.config import steps_for_tokens

    context = SIZES[size]
    steps = steps_for_tokens(tokens, BATCH, context)
    eval_every = max(1, steps // 20)  # 20 evaluations: the last-20% window holds about 4-5 of them
    return RunConfig.from_dict({
        "name": f"prism-study-{size}", "seed": seed,
        "model": {"preset": size, "schedule": schedule},
        "data": {"source": str(MOVIE_REVIEWS), "tokenizer": f"gpt2:{GPT2_DIR}", "split_blank_lines": True,
                 "val_fraction": 0.05, "cache_dir": cache_dir},
        "train": {"steps": steps, "batch_size": BATCH, "context": context, "lr": 2e-3, "min_lr_ratio": 0.1,
                  "warmup_steps": max(1, steps // 20), "weight_decay": 0.1, "grad_clip": 1.0,
                  "eval_every": eval_every, "eval_batches": 8, "log_every": eval_every,
                  "ckpt_every": eval_every, "keep_last": 1, "threads": threads, "progress": False,
                  "device": "cpu", "precision": "fp32"},
    })


def _token_ids(tokenizer, path: Path, limit: int) -> list[int]:
    text = path.read_text(encoding="utf-8")
    ids = tokenizer.encode(text[: 16 * limit])  # >= limit tokens: GPT-2 BPE averages ~4 characters a token
    return ids[:limit]


def measure(model, data, size: str, ood: dict[str, list[int]], attn_seqs: int,
            heldout_tokens: int | None = None) -> dict[str, Any]:
    """The endpoints of one trained model (see the module docstring)."""
    import torch

    from headbudget.analysis.attention import attention_summary
    from headbudget.evaluation.perplexity import perplexity

    context = SIZES[size]
    texts: dict[str, Any] = {}
    val_ids = torch.as_tensor(data.val[: heldout_tokens].astype("int64"))
    for name, ids in [("movie_reviews_heldout", val_ids), *ood.items()]:
        r = perplexity(model, None, input_ids=ids, context=context, stride=context, progress=False)
        texts[name] = {k: r[k] for k in ("loss", "ppl", "tokens_scored", "seconds")}
    n = min(attn_seqs, len(val_ids) // context)
    attn = attention_summary(model, val_ids[: n * context].view(n, context), local_window=8, batch_size=4)
    return {"texts": texts, "attention": {"n_sequences": n, "local_window": 8,
                                          "mean_distance": attn["mean_distance"],
                                          "mean_local_share": attn["mean_local_share"]}}


@contextlib.contextmanager
def run_lock(run_dir: Path):
    """Yield whether this process holds ``run_dir``'s training lock (False: another process trains it).

    An ``flock`` on ``run_dir/train.lock``: the kernel drops it when its process ends, killed or not, so a
    stale lock never blocks a resumed study."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "train.lock", "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def run_one(size: str, schedule: str, seed: int, tokens: int, out: Path, data, ood, args) -> dict[str, Any] | None:
    """Train (or resume, or read back) one run and measure it; ``run.json`` marks it done. None: another
    process holds the run's lock (:func:`run_lock`) and trains it."""
    from headbudget.train.compare import _safe

    run_dir = out / size / f"{_safe(schedule)}-seed{seed}"
    done = run_dir / "run.json"
    cfg = run_config(size, schedule, seed, tokens, args.threads, args.cache_dir)
    if done.is_file():
        rec = json.loads(done.read_text())
        if rec["steps"] != cfg.train.steps:
            raise SystemExit(f"{done}: trained {rec['steps']} steps, this study asks for {cfg.train.steps} "
                             f"({tokens:,} tokens); use another --out")
        return rec
    with run_lock(run_dir) as mine:
        if not mine:
            return None
        if done.is_file():  # the other process finished it between the check above and taking the lock
            return json.loads(done.read_text())
        return _train_and_measure(cfg, run_dir, size, schedule, seed, data, ood, args)


def _train_and_measure(cfg, run_dir: Path, size: str, schedule: str, seed: int, data, ood, args) -> dict[str, Any]:
    from headbudget.devices import cpu_description
    from headbudget.io import atomic_write_json
    from headbudget.loading import load_model
    from headbudget.train.compare import is_flat
    from headbudget.train.records import read_metrics
    from headbudget.train.setup import build_schedule
    from headbudget.train.trainer import Trainer

    done = run_dir / "run.json"
    # a killed run continues from its newest checkpoint; a new one starts (without resume's notice)
    trainer = Trainer(cfg, run_dir, resume=(run_dir / "checkpoints").is_dir() or (run_dir / "summary.json").is_file(),
                      data=data)
    result = trainer.run()
    model = trainer.model if trainer.model is not None else load_model(run_dir / "model")
    t0 = time.perf_counter()
    measured = measure(model, data, size, ood, args.attn_seqs, args.heldout_tokens)
    history = read_metrics(run_dir / "metrics.jsonl")  # every logged step, before and after any resume
    evals = [r for r in history if r.get("val_loss") is not None]
    rec = {
        "size": size, "schedule": schedule, "seed": seed, "steps": result.steps, "tokens": result.tokens,
        "params": result.params, "heads": list(build_schedule(cfg).heads), "warmup_steps": cfg.train.warmup_steps,
        "final_val_loss_8_batches": result.final_val_loss, "tokens_per_s": result.tokens_per_s,
        "train_wall_s": result.wall_s, "measure_wall_s": time.perf_counter() - t0, "cpu": cpu_description(),
        "flat_at_end": is_flat(evals, min_step=cfg.train.warmup_steps),
        "curve": [{k: r[k] for k in ("step", "tokens", "train_loss", "val_loss")} for r in evals],
        **measured,
    }
    atomic_write_json(done, rec)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the run is done; model/ stays
    return rec


# --------------------------------------------------------------------------- analysis
def _by(records, size, schedule):
    return {r["seed"]: r for r in records if r["size"] == size and r["schedule"] == schedule}


def _endpoint(rec: dict[str, Any], text: str) -> float:
    return rec["texts"][text]["loss"]


def _decide(ci: list[float] | None, mdd: float | None) -> str:
    """The registered decision rule on one paired 95% interval of (schedule - control): the rule of
    ``headbudget compare`` (:func:`headbudget.train.paired.decide`, margin = MDD), in the protocol's words."""
    from headbudget.train.paired import decide

    return {"undecided": "not decidable (fewer than 2 paired seeds)", "lower": "beats", "higher": "loses to",
            "equivalent": f"equivalent within ±{mdd or 0:.4f}", "inconclusive": "inconclusive"}[decide(ci, mdd)]


def analyse(records: list[dict[str, Any]], sizes: list[str], mdd: dict[str, float | None]) -> dict[str, Any]:
    """Paired differences per size, text and comparison; tokens/s ratios; attention profiles; verdicts."""
    import numpy as np

    from headbudget.train.paired import paired_differences

    texts = ["movie_reviews_heldout", *OOD_TEXTS]
    out: dict[str, Any] = {}
    for size in sizes:
        scheds = study_schedules(size)
        uniform, prism, wide = scheds[0], scheds[1], scheds[3]
        per: dict[str, Any] = {"schedules": {}, "comparisons": {}}
        for s in scheds:
            runs = _by(records, size, s)
            if not runs:
                continue
            per["schedules"][s] = {
                "n_runs": len(runs), "params": next(iter(runs.values()))["params"],
                "loss_mean": {t: float(np.mean([_endpoint(r, t) for r in runs.values()])) for t in texts},
                "tokens_per_s_mean": float(np.mean([r["tokens_per_s"] for r in runs.values()])),
                "mean_distance_per_layer": np.mean([r["attention"]["mean_distance"] for r in runs.values()],
                                                   axis=0).tolist(),
                "all_flat_at_end": all(r["flat_at_end"] for r in runs.values()),
            }
        pairs = [(s, uniform) for s in scheds[1:]] + [(prism, wide)]
        for a, b in pairs:
            ra, rb = _by(records, size, a), _by(records, size, b)
            if not ra or not rb:
                continue
            comp: dict[str, Any] = {}
            for t in texts:
                d = paired_differences({k: _endpoint(v, t) for k, v in ra.items()},
                                       {k: _endpoint(v, t) for k, v in rb.items()})
                d["decision"] = _decide(d["ci"], mdd.get(size) if t == "movie_reviews_heldout" else None)
                comp[t] = d
            comp["tokens_per_s_ratio"] = paired_differences(
                {k: v["tokens_per_s"] / rb[k]["tokens_per_s"] for k, v in ra.items() if k in rb},
                {k: 1.0 for k in rb})
            comp["distance_rises_with_depth"] = {
                "seeds": sorted(set(ra) & set(rb)),
                a: [ra[k]["attention"]["mean_distance"][-1] > ra[k]["attention"]["mean_distance"][0]
                    for k in sorted(set(ra) & set(rb))],
                f"rise_minus_{b}": [
                    (ra[k]["attention"]["mean_distance"][-1] - ra[k]["attention"]["mean_distance"][0])
                    - (rb[k]["attention"]["mean_distance"][-1] - rb[k]["attention"]["mean_distance"][0])
                    for k in sorted(set(ra) & set(rb))]}
            per["comparisons"][f"{a} - {b}"] = comp
        out[size] = per
    if len(sizes) == 2:  # does prism's paired difference to uniform grow with size? (Welch interval)
        out["growth_with_size"] = growth(out, sizes[0], sizes[1])
    return out


def growth(analysis: dict[str, Any], small: str, large: str, text: str = "movie_reviews_heldout") -> dict[str, Any]:
    """Mean(prism - uniform at ``large``) - mean(at ``small``) with a Welch 95% interval (the two sizes'
    runs are independent); negative = prism's advantage grows with size."""
    from scipy import stats

    key = "prism - uniform"
    if key not in analysis[small]["comparisons"] or key not in analysis[large]["comparisons"]:
        return {"decision": "not decidable (prism - uniform missing at a size)"}
    a, b = analysis[small]["comparisons"][key][text], analysis[large]["comparisons"][key][text]
    if a["n"] < 2 or b["n"] < 2:
        return {"decision": "not decidable (fewer than 2 seeds at a size)"}
    va, vb = a["std"] ** 2 / a["n"], b["std"] ** 2 / b["n"]
    diff, se = b["mean"] - a["mean"], math.sqrt(va + vb)
    df = (va + vb) ** 2 / ((va ** 2 / (a["n"] - 1) + vb ** 2 / (b["n"] - 1)) or math.inf) if se > 0 else a["n"] - 1
    crit = float(stats.t.ppf(0.975, df))
    ci = [diff - crit * se, diff + crit * se]
    decision = "grows" if ci[1] < 0 else "shrinks" if ci[0] > 0 else "no detectable change"
    return {"text": text, "small": small, "large": large, "difference": diff, "ci": ci, "df": df,
            "decision": decision}


def print_table(analysis: dict[str, Any]) -> None:
    header = f"{'size':<10} {'comparison':<34} {'text':<22} {'Δ loss (mean)':>13} {'95% CI':>22} {'n':>2}  decision"
    print("\n" + header + "\n" + "-" * len(header))
    for size, per in analysis.items():
        if size == "growth_with_size":
            continue
        for name, comp in per["comparisons"].items():
            for text, d in comp.items():
                if text in ("tokens_per_s_ratio", "distance_rises_with_depth"):
                    continue
                ci = f"[{d['ci'][0]:+.4f}, {d['ci'][1]:+.4f}]" if d["ci"] else "—"
                print(f"{size:<10} {name:<34} {text:<22} {d['mean']:>+13.4f} {ci:>22} {d['n']:>2}  {d['decision']}")
            r = comp["tokens_per_s_ratio"]
            ci = f"[{r['ci'][0]:+.4f}, {r['ci'][1]:+.4f}]" if r["ci"] else "—"
            print(f"{size:<10} {name:<34} {'tokens/s ratio - 1':<22} {r['mean']:>+13.4f} {ci:>22} {r['n']:>2}")
    g = analysis.get("growth_with_size")
    if g and "ci" in g:
        print(f"\nprism - uniform, {g['large']} minus {g['small']}: {g['difference']:+.4f} "
              f"[{g['ci'][0]:+.4f}, {g['ci'][1]:+.4f}] (Welch 95%): {g['decision']}")
    elif g:
        print(f"\ngrowth with size: {g['decision']}")


OVERHEAD_BAND = 0.05  # verdict 5: zero overhead if the 95% interval of tokens/s(prism)/tokens/s(uniform) - 1 is inside ±5%
LOCAL_TO_GLOBAL_SEEDS = 4  # verdict 6: of 5 seeds


def _interval(d: dict[str, Any]) -> str:
    return f"{d['mean']:+.4f} [{d['ci'][0]:+.4f}, {d['ci'][1]:+.4f}]" if d.get("ci") else f"{d['mean']:+.4f} (n={d['n']})"


def verdicts(analysis: dict[str, Any], records: list[dict[str, Any]], sizes: list[str],
             mdd: dict[str, float | None]) -> dict[str, Any]:
    """The registered verdicts (docs/prism_study.md, *Comparisons and the decision rule*, 1-7) as data and one
    sentence each, from :func:`analyse`'s output: nothing here is chosen after seeing the numbers."""
    out: dict[str, Any] = {}
    text = "movie_reviews_heldout"
    for size in sizes:
        per, scheds = analysis[size], study_schedules(size)
        uniform, prism, wide, budgeted = scheds[0], scheds[1], scheds[3], scheds[4]
        comps = per["comparisons"]
        runs = [r for r in records if r["size"] == size]
        not_flat = sorted(run_key(r) for r in runs if not r["flat_at_end"])
        v: dict[str, Any] = {"runs": len(runs), "runs_expected": len(scheds) * SEEDS, "not_flat": not_flat,
                             "possibly_under_trained": len(not_flat) > 1, "mdd": mdd.get(size)}
        need = [f"{prism} - {uniform}", f"{prism} - {wide}", f"{wide} - {uniform}", f"{budgeted} - {uniform}"]
        if any(k not in comps for k in need):
            v["missing"] = [k for k in need if k not in comps]
            out[size] = v
            continue
        p1, p2 = comps[need[0]][text], comps[need[1]][text]
        w, b = comps[need[2]][text], comps[need[3]][text]
        say = {"beats": "beats", "loses to": "loses to", "inconclusive": "is inconclusive against"}
        # 1. progression vs uniform
        if p1["decision"].startswith("equivalent"):
            s1 = f"null result: prism - uniform {_interval(p1)}, no difference larger than the MDD ({mdd[size]:.4f})"
        else:
            s1 = f"prism {say.get(p1['decision'], p1['decision'])} uniform: {_interval(p1)}"
        v["1_progression_vs_uniform"] = {"decision": p1["decision"], "statement": s1}
        # 2. progression vs the all-wide control
        s2 = f"prism {say.get(p2['decision'], p2['decision'] + ' against')} {wide}: {_interval(p2)}"
        attributed = p1["decision"] == "beats" and p2["decision"] != "beats" and w["decision"] == "beats"
        if attributed:
            s2 += f"; {wide} - uniform beats too ({_interval(w)}): the gain is attributed to wide heads, not progression"
        v["2_progression_vs_wide"] = {"decision": p2["decision"], "gain_from_wide_heads": attributed,
                                      "statement": s2}
        # 3. neither
        neither = all(d["decision"].startswith(("equivalent", "inconclusive")) for d in (p1, p2))
        v["3_neither"] = {"holds": neither, "statement": "neither: P1 and P2 are both equivalent or inconclusive"
                          if neither else "not 'neither': P1 or P2 has a direction"}
        # 5. zero overhead (tokens/s ratio, paired by seed)
        r = comps[need[0]]["tokens_per_s_ratio"]
        inside = bool(r.get("ci")) and -OVERHEAD_BAND < r["ci"][0] and r["ci"][1] < OVERHEAD_BAND
        v["5_zero_overhead"] = {"supported": inside, "statement": (
            f"tokens/s(prism)/tokens/s(uniform) - 1 = {_interval(r)}: "
            + ("inside ±5%, zero overhead supported" if inside else "not inside ±5%, zero overhead not shown"))}
        # 6. local to global
        rise = comps[need[0]]["distance_rises_with_depth"]
        both = [up and more > 0 for up, more in zip(rise[prism], rise[f"rise_minus_{uniform}"])]
        v["6_local_to_global"] = {"seeds_supporting": int(sum(both)), "seeds": len(both),
                                  "supported": sum(both) >= LOCAL_TO_GLOBAL_SEEDS, "statement": (
            f"{sum(both)} of {len(both)} seeds: prism's last layer attends farther than its first, by more than "
            f"uniform's rise; " + ("supported" if sum(both) >= LOCAL_TO_GLOBAL_SEEDS else "not supported"))}
        # 7. the budgeted schedule: non-inferiority at 75% of the attention budget
        ok = bool(b.get("ci")) and mdd.get(size) is not None and b["ci"][1] < mdd[size]
        v["7_budgeted_non_inferior"] = {"holds": ok, "statement": (
            f"{budgeted} - uniform {_interval(b)}: " + (
                f"no worse than uniform at 75% of the attention budget (upper end < +MDD {mdd[size]:.4f})" if ok
                else "non-inferiority not shown"))}
        out[size] = v
    g = analysis.get("growth_with_size")
    if g:
        out["4_grows_with_size"] = {"decision": g["decision"], "statement": (
            f"prism - uniform at {g['large']} minus at {g['small']}: {g['difference']:+.4f} "
            f"[{g['ci'][0]:+.4f}, {g['ci'][1]:+.4f}] (Welch 95%): {g['decision']}" if "ci" in g else g["decision"])}
    return out


def report_markdown(analysis: dict[str, Any], verdict: dict[str, Any],
                    tails: dict[str, dict[str, Any]] | None = None) -> str:
    """The study's tables and verdicts as Markdown (benchmarks/results/prism_study_report.md), with each
    size's descriptive :func:`training_tail` after its verdicts where ``tails`` has it."""
    lines = ["# Prism study: results (generated by benchmarks/prism_study.py; protocol docs/prism_study.md)", ""]
    for size, per in analysis.items():
        if size == "growth_with_size":
            continue
        v = verdict.get(size, {})
        flag = " **possibly under-trained**" if v.get("possibly_under_trained") else ""
        lines += [f"## {size}{flag}", "",
                  f"Runs: {v.get('runs')} of {v.get('runs_expected')}; not flat at their end: "
                  f"{', '.join(v.get('not_flat', [])) or 'none'}; registered MDD {v.get('mdd')}.", "",
                  "| schedule | params | held-out | WikiText-2 | tinyshakespeare | tokens/s | attention distance per layer |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for s, m in per["schedules"].items():
            lm = m["loss_mean"]
            dist = ", ".join(f"{x:.1f}" for x in m["mean_distance_per_layer"])
            lines.append(f"| `{s}` | {m['params']:,} | {lm['movie_reviews_heldout']:.4f} | {lm['wikitext2_valid']:.4f} "
                         f"| {lm['tinyshakespeare']:.4f} | {m['tokens_per_s_mean']:,.0f} | {dist} |")
        lines += ["", "Paired differences (A - B, nats/token; mean [95% t interval], 5 seeds):", "",
                  "| comparison | held-out | WikiText-2 | tinyshakespeare | tokens/s ratio - 1 |", "|---|---|---|---|---|"]
        for name, comp in per["comparisons"].items():
            cells = [f"{_interval(comp[t])} {comp[t]['decision']}" if t == "movie_reviews_heldout"
                     else _interval(comp[t]) for t in ("movie_reviews_heldout", *OOD_TEXTS)]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {_interval(comp['tokens_per_s_ratio'])} |")
        lines += ["", "Verdicts:", ""]
        lines += [f"- {k.split('_', 1)[0]}. {d['statement']}" for k, d in v.items()
                  if isinstance(d, dict) and "statement" in d]
        lines.append("")
        if size in (tails or {}):
            lines += tail_markdown(tails[size])
    if "4_grows_with_size" in verdict:
        lines += ["## Across sizes", "", f"- 4. {verdict['4_grows_with_size']['statement']}", ""]
    return "\n".join(lines)


def plot_attention_distance(analysis: dict[str, Any], records: list[dict[str, Any]], path: Path) -> Path:
    """Per size, each schedule's mean attention distance by layer: thin lines per seed, thick the mean."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from headbudget.io import save_figure

    sizes = [s for s in analysis if s != "growth_with_size"]
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        for k, s in enumerate(analysis[size]["schedules"]):
            for r in _by(records, size, s).values():
                d = r["attention"]["mean_distance"]
                ax.plot(range(len(d)), d, color=f"C{k}", alpha=0.25, lw=0.8)
            mean = analysis[size]["schedules"][s]["mean_distance_per_layer"]
            ax.plot(range(len(mean)), mean, "-o", color=f"C{k}", lw=2, label=s)
        # a plain average over the causal prefix puts query i at mean distance i / 2: (context - 1) / 4 overall
        ax.axhline((SIZES[size] - 1) / 4, ls="--", color="gray", lw=1, label="plain average over the prefix")
        ax.set(title=size, xlabel="layer", ylabel="mean attention distance (tokens)",
               xticks=range(len(analysis[size]["schedules"][study_schedules(size)[0]]["mean_distance_per_layer"])))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def paired_curves(records: list[dict[str, Any]], size: str) -> dict[str, dict[str, Any]]:
    """Per schedule, validation loss minus uniform's at the same seed and eval step, over training
    (:func:`headbudget.train.compare.paired_curves` on this size's runs)."""
    from headbudget.train.compare import paired_curves as by_step

    scheds = study_schedules(size)
    return by_step({s: {seed: r["curve"] for seed, r in _by(records, size, s).items()} for s in scheds}, scheds[0])


def training_tail(records: list[dict[str, Any]], size: str, tail: float = 0.2) -> dict[str, Any]:
    """Descriptive, not registered: is training still moving at its end? Per schedule, how much each run's
    validation loss fell over the last ``tail`` of its steps (the eval at the first step >= (1 - tail) x
    the last step, minus the last eval; positive = still falling), and how the mean paired difference to
    uniform moved over the second half (at the first shared eval >= half the tokens, and at the end).

        tail = training_tail(records, "cpu-mid")   # records: the results file's runs, each with its curve
        tail["drop_over_tail"]["prism"]["mean"]    # > 0: prism's runs were still improving at their end
    """
    import numpy as np

    drops: dict[str, Any] = {}
    for sched in study_schedules(size):
        per = []
        for rec in _by(records, size, sched).values():
            evals = [r for r in rec.get("curve", []) if r.get("val_loss") is not None]
            if not evals:
                continue
            start = next(r for r in evals if r["step"] >= (1 - tail) * evals[-1]["step"])
            per.append(start["val_loss"] - evals[-1]["val_loss"])
        if per:
            drops[sched] = {"mean": float(np.mean(per)), "min": float(min(per)), "max": float(max(per)), "n": len(per)}
    moves = {}
    for sched, d in paired_curves(records, size).items():
        half = next(i for i, t in enumerate(d["tokens"]) if t >= d["tokens"][-1] / 2)
        moves[sched] = {"tokens": [d["tokens"][half], d["tokens"][-1]], "mean_diff": [d["mean"][half], d["mean"][-1]]}
    return {"tail": tail, "drop_over_tail": drops, "paired_second_half": moves}


def tail_markdown(t: dict[str, Any]) -> list[str]:
    """:func:`training_tail` of one size as Markdown list lines (the report puts them after its verdicts)."""
    lines = [f"Descriptive, not registered (`training_tail`): validation loss fall over the last "
             f"{t['tail']:.0%} of the steps (mean, min-max over seeds; positive = still falling):", ""]
    lines += [f"- `{s}`: {d['mean']:+.4f} ({d['min']:+.4f} to {d['max']:+.4f})" for s, d in t["drop_over_tail"].items()]
    lines += ["", "Mean paired validation-loss difference to uniform, at half the tokens -> at the end:", ""]
    lines += [f"- `{s}`: {m['mean_diff'][0]:+.4f} -> {m['mean_diff'][1]:+.4f} ({m['tokens'][0]:,} -> {m['tokens'][1]:,} "
              f"tokens)" for s, m in t["paired_second_half"].items()]
    return lines + [""]


def plot_paired_curves(records: list[dict[str, Any]], size: str, path: Path) -> Path:
    from headbudget.train.compare_plots import plot_paired_curves as plot

    return plot(paired_curves(records, size), study_schedules(size)[0], path,
                title=f"{size}: validation loss minus uniform's, paired by seed")


def pilot_report(records: list[dict[str, Any]], size: str, schedules: list[str]) -> dict[str, Any]:
    """Flatness, seed spread and the smallest detectable difference (paired, 5 seeds, 80% power)."""
    import numpy as np

    from headbudget.train.compare import is_flat
    from headbudget.train.paired import paired_differences

    rep: dict[str, Any] = {"size": size, "schedules": schedules, "per_schedule": {}}
    for s in schedules:
        runs = _by(records, size, s)
        first_flat = {}
        for seed, r in runs.items():
            first_flat[seed] = next((c["step"] for i, c in enumerate(r["curve"])
                                     if is_flat(r["curve"][: i + 1], min_step=r["warmup_steps"])), None)
        losses = [_endpoint(r, "movie_reviews_heldout") for r in runs.values()]
        sd = float(np.std(losses, ddof=1)) if len(losses) > 1 else None
        rep["per_schedule"][s] = {
            "seeds": sorted(runs), "heldout_loss": losses, "heldout_loss_std": sd,
            "flat_at_end": {k: r["flat_at_end"] for k, r in runs.items()},
            "first_flat_step": first_flat, "steps": next(iter(runs.values()))["steps"] if runs else None,
            "tokens_per_s": [r["tokens_per_s"] for r in runs.values()],
            # unpaired spread: paired differences of two schedules have sd <= sqrt(2) x this (correlation >= 0)
            "mdd_5_seeds_from_sqrt2_sd": min_detectable_difference(math.sqrt(2) * sd, SEEDS) if sd else None,
        }
    if len(schedules) >= 2:
        a, b = _by(records, size, schedules[1]), _by(records, size, schedules[0])
        d = paired_differences({k: _endpoint(v, "movie_reviews_heldout") for k, v in a.items()},
                               {k: _endpoint(v, "movie_reviews_heldout") for k, v in b.items()})
        d["mdd_5_seeds"] = min_detectable_difference(d["std"], SEEDS) if d["n"] > 1 else None
        rep["paired"] = {f"{schedules[1]} - {schedules[0]}": d}
    return rep


def run_key(run: dict[str, Any]) -> str:
    """``size/schedule/seedN``: how the results file names a run (its key in ``curves``)."""
    return f"{run['size']}/{run['schedule']}/seed{run['seed']}"


def restore_finished_runs(results_path: Path, out: Path) -> int:
    """Write ``run.json`` under ``out`` for every run recorded in ``results_path`` whose folder lacks one.

    Run folders (weights, checkpoints) do not outlive a machine; the committed results file does, so a
    study spread over several sessions continues from it. A restored run is read back, not retrained
    (``run_one`` still refuses one trained for another number of steps). Returns how many were written."""
    from headbudget.io import atomic_write_json
    from headbudget.train.compare import _safe

    if not results_path.is_file():
        return 0
    saved = json.loads(results_path.read_text())
    n = 0
    for r in saved.get("runs", []):
        key = run_key(r)
        done = out / r["size"] / f"{_safe(r['schedule'])}-seed{r['seed']}" / "run.json"
        if done.is_file() or key not in saved.get("curves", {}):
            continue
        atomic_write_json(done, {**r, "curve": saved["curves"][key]})
        n += 1
    return n


def write_results(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` to ``path``, keeping the runs (and curves) that ``path`` already holds and ``record``
    lacks: another process of the same study may have recorded them (see :func:`run_lock`)."""
    from headbudget.io import atomic_write_json

    if path.is_file():
        saved = json.loads(path.read_text())
        mine = {run_key(r) for r in record["runs"]}
        theirs = [r for r in saved.get("runs", []) if run_key(r) not in mine]
        keys = {run_key(r) for r in theirs}
        curves = {k: v for k, v in saved.get("curves", {}).items() if k in keys}
        record = {**record, "runs": record["runs"] + theirs, "curves": {**curves, **record["curves"]},
                  # one process's command names its sizes only: the budgets of the other's runs stay recorded
                  "tokens_per_run": {**saved.get("tokens_per_run", {}), **record.get("tokens_per_run", {})}}
    atomic_write_json(path, record)


def analyse_and_report(records: list[dict[str, Any]], sizes: list[str], results_path: Path,
                       suffix: str = "") -> dict[str, Any]:
    """The registered analysis of every run: paired differences, verdicts, the Markdown report and the
    attention-distance plot beside ``results_path`` (``prism_study_report{suffix}.md``,
    ``prism_study_attention{suffix}.png``). Returns the keys it adds to the results record."""
    import numpy as np

    mdd, observed = {}, {}
    for size in sizes:  # the registered one decides; the one the main runs imply is recorded beside it
        ref = _by(records, size, study_schedules(size)[0])
        observed[size] = None
        if len(ref) > 1:
            sd = float(np.std([_endpoint(r, "movie_reviews_heldout") for r in ref.values()], ddof=1))
            observed[size] = min_detectable_difference(math.sqrt(2) * sd, len(ref))
        mdd[size] = REGISTERED_MDD.get(size)
    analysis = analyse(records, sizes, mdd)
    verdict = verdicts(analysis, records, sizes, mdd)
    print_table(analysis)
    tails = {size: training_tail(records, size) for size in sizes}  # descriptive; decides nothing
    report = report_markdown(analysis, verdict, tails)
    from headbudget.io import atomic_write_text

    atomic_write_text(results_path.with_name(f"{results_path.stem}_report{suffix}.md"), report + "\n")
    plot_attention_distance(analysis, records, results_path.with_name(f"{results_path.stem}_attention{suffix}.png"))
    verdict_line = re.compile(r"^(- \d\. |## )")  # the verdicts under each size, not the descriptive lists
    print("\n" + "\n".join(line for line in report.splitlines() if verdict_line.match(line)))
    return {"mdd_registered": mdd, "mdd_from_main_uniform_spread": observed, "analysis": analysis,
            "verdicts": verdict, "training_tail": tails}


def write_size_analysis(records: list[dict[str, Any]], sizes: list[str], results_path: Path) -> Path:
    """The registered analysis of some of the study's sizes, each with all its runs in (amendment of session 7),
    in files of their own (``prism_study_analysis_SIZE.json``, ``_report_SIZE.md``, ``_attention_SIZE.png``):
    the processes still training the other size rewrite the results file and would drop it from there."""
    from headbudget.io import atomic_write_json

    suffix = "_" + "_".join(sizes)
    out = results_path.with_name(f"{results_path.stem}_analysis{suffix}.json")
    atomic_write_json(out, {"sizes": sizes, "results": results_path.name, "runs": len(records),
                            **analyse_and_report(records, sizes, results_path, suffix)})
    print(f"\nwrote {out}")
    return out


def missing_runs(records: list[dict[str, Any]], sizes: list[str], n_seeds: int = SEEDS) -> list[str]:
    """``size/schedule/seedN`` of every registered run not in ``records``."""
    have = {run_key(r) for r in records}
    return [f"{size}/{s}/seed{seed}" for size in sizes for seed in range(n_seeds) for s in study_schedules(size)
            if f"{size}/{s}/seed{seed}" not in have]


def report_only(args: argparse.Namespace) -> int:
    """``--report``: the registered analysis from the results file alone (no shared data, no run folders)."""
    from headbudget.train.compare_plots import plot_curves

    results_path = Path(args.results) if args.results else RESULTS / "prism_study.json"
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if unknown := [s for s in sizes if s not in SIZES]:
        print(f"prism_study: unknown size {unknown[0]!r}; choose from {', '.join(SIZES)}", file=sys.stderr)
        return 2
    if not results_path.is_file():
        print(f"prism_study: {results_path} not found", file=sys.stderr)
        return 2
    saved = json.loads(results_path.read_text())
    records = [{**r, "curve": saved.get("curves", {}).get(run_key(r), [])}
               for r in saved.get("runs", []) if r["size"] in sizes]
    missing = missing_runs(records, sizes, args.seeds or SEEDS)
    if missing:  # registered: the analysis is made once, when every run is in
        print(f"prism_study: {len(records)} of {len(records) + len(missing)} runs are in {results_path}; the "
              f"registered analysis waits for all (missing: {', '.join(missing[:3])}"
              f"{', ...' if len(missing) > 3 else ''})", file=sys.stderr)
        return 1
    for size in sizes:
        curves = {s: [r["curve"] for r in _by(records, size, s).values()] for s in study_schedules(size)}
        plot_curves({"curves": curves}, results_path.with_name(f"prism_study_curves_{size}.png"))
        plot_paired_curves(records, size, results_path.with_name(f"prism_study_paired_curves_{size}.png"))
    if set(sizes) != set(STUDY_SIZES):
        write_size_analysis(records, sizes, results_path)
        print("(the results file is unchanged)")
        return 0
    record = {**saved, "status": "complete", "tokens_per_run": {r["size"]: r["tokens"] for r in records},
              **analyse_and_report(records, sizes, results_path)}
    write_results(results_path, record)
    print(f"\nwrote {results_path}")
    return 0


def _parse_tokens(text: str | None, sizes: list[str]) -> dict[str, int]:
    from headbudget.train.config import parse_token_count

    if not text:
        missing = [s for s in sizes if REGISTERED_TOKENS.get(s) is None]
        if missing:
            raise SystemExit(f"no registered tokens per run for {', '.join(missing)}: run the pilot and register "
                             "them in docs/prism_study.md, or pass --tokens")
        return {s: int(REGISTERED_TOKENS[s]) for s in sizes}
    if "=" not in text:
        return {s: parse_token_count(text) for s in sizes}
    out = {}
    for item in text.split(","):
        k, _, v = item.partition("=")
        out[k.strip()] = parse_token_count(v)
    if set(sizes) - set(out):
        raise SystemExit(f"--tokens names no budget for {', '.join(sorted(set(sizes) - set(out)))}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pilot", action="store_true", help="protocol step 1: one schedule, one size, 2-3 seeds")
    ap.add_argument("--sizes", default=",".join(STUDY_SIZES))
    ap.add_argument("--schedules", help="comma list (default: all five of the study; the pilot: uniform)")
    ap.add_argument("--seeds", type=int, help=f"seeds 0..N-1 (default {SEEDS}; the pilot 3)")
    ap.add_argument("--tokens", help="tokens per run: one value (2M) or per size (cpu-tiny=2M,cpu-small=4M); "
                    "default: the registered numbers")
    ap.add_argument("--ood-tokens", type=int, default=65536, help="tokens scored of each out-of-domain text")
    ap.add_argument("--heldout-tokens", type=int, help="score only the first N held-out tokens (default: all; "
                    "for smoke tests)")
    ap.add_argument("--attn-seqs", type=int, default=16, help="held-out sequences for the attention distance")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed-order", default="ascending", choices=["ascending", "descending"],
                    help="descending: for a second process beside the first (runs in training are locked)")
    ap.add_argument("--cache-dir", help="prepared-data cache (default: headbudget's)")
    ap.add_argument("--out", default="runs/prism_study")
    ap.add_argument("--results", default=None, help="results JSON (default benchmarks/results/prism_study.json, "
                    "the pilot prism_study_pilot_SIZE.json)")
    ap.add_argument("--report", action="store_true", help="train nothing: analyse the runs in --results (every "
                    "registered run must be in), write the report, the verdicts and the plots")
    args = ap.parse_args(argv)
    if args.report:
        return report_only(args)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    from headbudget.train.compare_plots import plot_curves
    from headbudget.train.setup import prepare_for

    hf_logging.disable_progress_bar()
    import torch

    torch.set_num_threads(args.threads)  # the measurements after training too (the trainer restores threads)
    for p in (MOVIE_REVIEWS, GPT2_DIR, *OOD_TEXTS.values()):
        if not p.exists():
            print(f"prism_study: {p} not found (the shared data)", file=sys.stderr)
            return 2
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if unknown := [s for s in sizes if s not in SIZES]:
        print(f"prism_study: unknown size {unknown[0]!r}; choose from {', '.join(SIZES)}", file=sys.stderr)
        return 2
    if args.pilot and len(sizes) != 1:
        print("prism_study: --pilot runs one size (--sizes cpu-tiny)", file=sys.stderr)
        return 2
    names = [s.strip() for s in (args.schedules or ("uniform" if args.pilot else ",".join(SCHEDULES))).split(",")]
    n_seeds = args.seeds or (3 if args.pilot else SEEDS)
    tokens = _parse_tokens(args.tokens, sizes)
    out = Path(args.out)
    results_path = Path(args.results) if args.results else RESULTS / (
        f"prism_study_pilot_{sizes[0]}.json" if args.pilot else "prism_study.json")

    records: list[dict[str, Any]] = []
    skipped: list[str] = []  # runs another process held
    t0 = time.perf_counter()
    restored = restore_finished_runs(results_path, out)
    if restored:
        print(f"restored {restored} finished run(s) from {results_path} into {out}", flush=True)

    def snapshot(status: str) -> dict[str, Any]:
        return {"status": status, "command": " ".join([sys.executable, *sys.argv]), "protocol": "docs/prism_study.md",
                "tokens_per_run": tokens, "seeds": list(range(n_seeds)), "threads": args.threads,
                "wall_s": time.perf_counter() - t0,
                "runs": [{k: v for k, v in r.items() if k != "curve"} for r in records],
                "curves": {run_key(r): r["curve"] for r in records}}
    for size in sizes:
        scheds = study_schedules(size, names)
        cfg = run_config(size, scheds[0], 0, tokens[size], args.threads, args.cache_dir)
        data = prepare_for(cfg, progress=False)
        tok = data.tokenizer
        ood = {name: torch.tensor(_token_ids(tok, path, args.ood_tokens), dtype=torch.long)
               for name, path in OOD_TEXTS.items()}
        print(f"== {size}: {len(scheds)} schedules x {n_seeds} seeds, {cfg.train.steps} steps x {BATCH} x "
              f"{SIZES[size]} = {cfg.train.steps * BATCH * SIZES[size]:,} tokens a run "
              f"({data.meta['train_tokens']:,} train / {data.meta['val_tokens']:,} held-out tokens)", flush=True)
        seeds = range(n_seeds) if args.seed_order == "ascending" else range(n_seeds - 1, -1, -1)
        for seed in seeds:  # seed-major: a partial study has every schedule at the first seeds
            for s in scheds:
                rec = run_one(size, s, seed, tokens[size], out, data, ood, args)
                if rec is None:
                    skipped.append(f"{size}/{s}/seed{seed}")
                    print(f"   {s:>20} seed {seed}: trained by another process (locked); skipped", flush=True)
                    continue
                records.append(rec)
                # every finished run is in the results file at once: a later session restores it from there
                write_results(results_path, snapshot("partial: runs finished so far, no analysis"))
                print(f"   {s:>20} seed {seed}: held-out {rec['texts']['movie_reviews_heldout']['loss']:.4f}  "
                      f"wt2 {rec['texts']['wikitext2_valid']['loss']:.4f}  "
                      f"shakespeare {rec['texts']['tinyshakespeare']['loss']:.4f}  "
                      f"{rec['tokens_per_s']:,.0f} tok/s  flat {rec['flat_at_end']}", flush=True)
        curves = {s: [[{**c} for c in r["curve"]] for r in _by(records, size, s).values()] for s in scheds}
        if not args.pilot:
            plot_curves({"curves": curves}, results_path.with_name(f"prism_study_curves_{size}.png"))

    if skipped:  # not every run is in: no analysis yet (a last plain invocation reads them all back)
        write_results(results_path, snapshot(f"partial: {len(skipped)} run(s) trained by another process"))
        print(f"\n{len(skipped)} run(s) were trained by another process ({', '.join(skipped)}): rerun this "
              f"command when it is done to analyse every run; wrote {results_path}")
        return 0
    record = snapshot("complete")
    if args.pilot:
        record["pilot"] = pilot_report(records, sizes[0], study_schedules(sizes[0], names))
        print(json.dumps(record["pilot"], indent=2))
    elif set(sizes) != set(STUDY_SIZES):  # one size's runs: its own files, the study stays partial
        write_results(results_path, snapshot(f"partial: {', '.join(sizes)} complete, analysed in its own files"))
        write_size_analysis(records, sizes, results_path)
        return 0
    else:
        record.update(analyse_and_report(records, sizes, results_path))
    write_results(results_path, record)
    print(f"\nwrote {results_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
