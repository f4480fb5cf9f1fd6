"""Several pruning methods at one head count (:func:`run_prune_compare`), optionally once per LM calibration seed
with the per-seed values aggregated and ranked; each method runs through :func:`headbudget.pruning.pipeline.run_prune`.

    >>> from headbudget.pruning.compare import run_prune_compare
    >>> run_prune_compare(PruneCompareJob("runs/ft", "sst5", "../shared/data/classification/sst5", "runs/cmp",
    ...                                   methods="cahp@2,cahp@6,michel,fisher,magnitude,random"))  # doctest: +SKIP
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from headbudget.io import atomic_write_text
from headbudget.progress import quiet_unless_progress
from headbudget.pruning import pipeline
from headbudget.pruning import report as rpt
from headbudget.pruning.job import PruneCompareJob, PruneJob
from headbudget.pruning.methods import get_importance
from headbudget.pruning.pipeline import _job_fingerprint, check_job
from headbudget.pruning.workloads import LMWorkload, Workload, eval_text_name, load_workload


def parse_methods(spec: str) -> list[tuple[str, str, int | None]]:
    """``"cahp@2,cahp@6,michel"`` -> ``[(label, method, poly_degree), ...]``; every method must be registered
    (:func:`headbudget.pruning.methods.available_importances`)."""
    out = []
    for item in filter(None, (raw.strip() for raw in spec.split(","))):
        method, _, deg = item.partition("@")
        try:
            get_importance(method)
        except ValueError as e:
            raise type(e)(f"methods {spec!r}: {e}") from None
        if deg and method != "cahp":
            raise ValueError(f"methods {spec!r}: only cahp takes a polynomial degree (@d), got {item!r}")
        try:
            degree = int(deg) if deg else None
        except ValueError:
            raise ValueError(f"methods {spec!r}: bad polynomial degree in {item!r}") from None
        out.append((f"cahp-d{degree}" if degree is not None else method, method, degree))
    if not out:
        raise ValueError("methods: no method given")
    if len({label for label, _, _ in out}) != len(out):
        raise ValueError(f"methods {spec!r}: repeated entry")
    return out


def _as_method(job: PruneJob, method: str, **changes: Any) -> PruneJob:
    """``job`` for one entry: ``layer_floor`` off reaches the baselines only; cahp keeps its floor (its paper's)."""
    floor = job.layer_floor or get_importance(method).keeps_layer_floor
    return replace(job, method=method, layer_floor=floor, **changes)


def _finished(sub: PruneJob) -> dict[str, Any] | None:
    """``{"report", "details"}`` of a method already finished in ``sub.out`` with the same settings, else None."""
    out = Path(sub.out)
    try:
        report = json.loads((out / "report.json").read_text())
        details = json.loads((out / "details.json").read_text())
    except (OSError, ValueError):
        return None
    if details.get("job") != _job_fingerprint(sub) or (sub.save_model and not (out / "model").is_dir()):
        return None
    return {"report": report, "details": details}


def check_compare_job(job: PruneCompareJob) -> list[tuple[str, str, int | None]]:
    """A one-line error naming the first invalid setting of ``job`` (nothing is loaded); its parsed ``methods``."""
    if not isinstance(job, PruneCompareJob):
        raise TypeError(f"a comparison takes a PruneCompareJob (its methods, calibration_seeds and ranking_rule "
                        f"with the shared settings), not a {type(job).__name__}")
    entries = parse_methods(job.methods)
    forced = job.keep is not None or job.keep_ratio is not None
    if not forced and not get_importance(entries[0][1]).finds_count:
        raise ValueError(f"without a forced head count (keep / keep_ratio) the first method must find its own "
                         f"head count, as cahp does ({entries[0][1]} needs one)")
    seeds = job.calibration_seeds
    if (job.eval_data or seeds is not None) and job.task != "lm":
        raise ValueError(f"eval_data / calibration_seeds score and calibrate LMs: they need task lm, not {job.task}")
    check_job(_as_method(job, "cahp"))
    names = [eval_text_name(p) for p in job.eval_data]
    if len(set(names)) != len(names) or "heldout" in names:
        raise ValueError(f"eval_data {','.join(job.eval_data)!r}: two texts share a name (file stem) or one is "
                         "named 'heldout'")
    if seeds is not None and (not seeds or len(set(seeds)) != len(seeds)):
        raise ValueError(f"calibration_seeds {','.join(map(str, seeds))!r}: "
                         + ("repeated seed" if seeds else "no seed given"))
    for method in dict.fromkeys(m for _, m, _ in entries):  # e.g. attattr with task lm: before any method runs
        check = get_importance(method).check
        if check is not None:
            check(_as_method(job, method))
    return entries


@quiet_unless_progress
def run_prune_compare(job: PruneCompareJob, *, resume: bool = False,
                      on_row: Callable[[dict[str, Any]], None] | None = None,
                      on_stage: Callable[[str, str, float], None] | None = None) -> dict[str, Any]:
    """Run several methods.  Without a forced count (``job.keep`` / ``job.keep_ratio``) every ``cahp`` entry
    finds its own knee and each baseline takes the count of the nearest ``cahp`` entry before it; with one,
    every entry uses it.  Each row records where its count came from (``count_from``).

    ``resume`` reuses every method already finished in ``job.out`` with the same settings (its
    ``details.json`` records them).  ``on_row(row)`` is called after each method, when ``compare.md`` /
    ``compare.json`` are rewritten too, so a comparison cut short keeps every method it finished.
    ``on_stage(where, stage, seconds)``: as each stage finishes (``where``: the method's label,
    ``seed<s>/<label>`` with calibration seeds, ``""`` for loading; ``stage``: a name of ``report.json``'s
    ``seconds``, or ``reused`` for a method ``resume`` read back).

    ``job.calibration_seeds`` (task lm): the whole comparison once per seed in ``job.out/seed<s>``, then the
    per-seed values, their spread and the ranking (``job.ranking_rule``) per text: docs/pruning.md, "Three
    held-out texts, three calibration seeds"."""
    entries = check_compare_job(job)
    seeds, rule, job = job.calibration_seeds, job.ranking_rule, job.prune_job()
    if seeds is not None:
        return _run_compare_seeds(job, entries, list(seeds), resume, on_row, rule, on_stage)
    loaded = load_workload(job)
    if on_stage is not None:
        on_stage("", "load", loaded.load_seconds)
    rows = _compare_rows(job, entries, loaded, resume, on_row, on_stage)
    return _write_compare(job, loaded, rows)


def _run_compare_seeds(job: PruneJob, entries: list[tuple[str, str, int | None]], seeds: list[int], resume: bool,
                       on_row: Callable[[dict[str, Any]], None] | None, rule: str,
                       on_stage: Callable[[str, str, float], None] | None = None) -> dict[str, Any]:
    loaded = load_workload(replace(job, calib_seed=seeds[0]))
    assert isinstance(loaded, LMWorkload)
    if on_stage is not None:
        on_stage("", "load", loaded.load_seconds)
    out = Path(job.out)
    per_seed: dict[str, Any] = {}
    for s in seeds:
        sub = replace(job, out=str(out / f"seed{s}"), calib_seed=s, seed=job.seed + s)
        loaded.use_calibration_seed(sub, s)

        def tagged(row: dict[str, Any], s: int = s) -> None:
            row["seed"] = s
            if on_row is not None:
                on_row(row)

        def staged(where: str, stage: str, secs: float, s: int = s) -> None:
            if on_stage is not None:
                on_stage(f"seed{s}/{where}" if where else "", stage, secs)

        rows = _compare_rows(sub, entries, loaded, resume, tagged, staged)
        _write_compare(sub, loaded, rows)
        per_seed[str(s)] = {"calib_offsets": list(loaded.data.calib_offsets), "out": f"seed{s}", "rows": rows}
        if len(per_seed) < len(seeds):  # a run cut short keeps the summary of the seeds it finished
            _write_seeds_summary(job, loaded, entries, seeds[:len(per_seed)], per_seed, rule, planned=seeds)
    return _write_seeds_summary(job, loaded, entries, seeds, per_seed, rule)


def _write_seeds_summary(job: PruneJob, loaded: LMWorkload, entries: list[tuple[str, str, int | None]],
                         seeds: list[int], per_seed: dict[str, Any], rule: str,
                         planned: list[int] | None = None) -> dict[str, Any]:
    """The top ``compare.md`` / ``compare.json`` over the finished ``seeds`` (of ``planned``, when not all)."""
    from headbudget.evaluation.rankings import rank_methods, ranking_markdown, spread

    out = Path(job.out)
    labels = [lbl for lbl, _, _ in entries]
    splits = list(loaded.evals)
    names = {sp: (f"{Path(str(job.data)).stem} (held-out tail)" if sp == "heldout" else sp) for sp in splits}
    lower = loaded.metric_name == "perplexity"
    stages = ["pruned"] + (["finetuned"] if job.finetune_epochs > 0 else [])
    row = {s: {r["label"]: r for r in per_seed[str(s)]["rows"]} for s in seeds}  # row[seed][label]
    values = {st: {lbl: {names[sp]: [row[s][lbl]["metric"][sp][st] for s in seeds] for sp in splits}
                   for lbl in labels} for st in stages}
    aggregate = {st: {lbl: {t: spread(v) for t, v in d.items()} for lbl, d in values[st].items()} for st in stages}
    ranking = ({st: rank_methods(values[st], lower_is_better=lower, rule=rule) for st in stages}
               if len(labels) > 1 else {})
    heads = {lbl: [row[s][lbl]["heads_kept"] for s in seeds] for lbl in labels}
    md = [f"# Head pruning comparison ({job.task}, {loaded.heads_total} heads), calibration seeds "
          f"{', '.join(map(str, seeds))}\n",
          f"**Partial:** seeds {', '.join(map(str, seeds))} of {', '.join(map(str, planned))} finished.\n"
          if planned is not None else "",
          f"Calibration: {len(loaded.data.calib)} windows of {loaded.data.context} tokens of {job.data} per seed "
          "(offsets in compare.json); scored: " + ", ".join(names.values())
          + f" ({loaded.metric_name}, {'lower' if lower else 'higher'} is better). Heads kept per seed: "
          + "; ".join(f"{lbl} {', '.join(map(str, h))}" for lbl, h in heads.items()) + ".\n",
          "Dense: " + ", ".join(f"{names[sp]} {rpt._fmt(loaded.dense_acc[sp])}" for sp in splits) + "\n"
          if loaded.dense_acc else ""]
    for st in stages:
        # one seed has no spread to show: a "± 0" would read as "no variation"
        md.append(f"## {st.capitalize()}: " + ("mean ± std [min–max] over the seeds\n" if len(seeds) > 1
                                               else f"one seed ({seeds[0]}), no spread\n"))
        if len(labels) > 1:
            md.append(ranking_markdown(values[st], lower_is_better=lower, rule=rule, digits=4))
        md.append("Per seed:\n\n| method | text | " + " | ".join(f"seed {s}" for s in seeds) + " |\n|---|---|"
                  + "---:|" * len(seeds))
        md.append("\n".join(f"| {lbl} | {t} | " + " | ".join(rpt._fmt(v) for v in vs) + " |"
                            for lbl, d in values[st].items() for t, vs in d.items()) + "\n")
    md.append("Each seed's own table: " + ", ".join(f"[seed {s}](seed{s}/compare.md)" for s in seeds) + ".\n")
    atomic_write_text(out / "compare.md", "\n".join(md))
    summary = {"task": job.task, "model": job.model, "metric_name": loaded.metric_name,
               "heads_total": loaded.heads_total, "calibration_seeds": seeds,
               **({"calibration_seeds_planned": planned} if planned is not None else {}), "texts": names,
               "per_seed": {s: {k: v for k, v in d.items() if k != "rows"} for s, d in per_seed.items()},
               "values": values, "aggregate": aggregate, "ranking": ranking,
               "rows": [r for s in seeds for r in per_seed[str(s)]["rows"]]}
    rpt.write_json(out / "compare.json", summary)
    return summary


def _compare_rows(job: PruneJob, entries: list[tuple[str, str, int | None]], loaded: Workload, resume: bool,
                  on_row: Callable[[dict[str, Any]], None] | None,
                  on_stage: Callable[[str, str, float], None] | None = None) -> list[dict[str, Any]]:
    forced = job.keep is not None or job.keep_ratio is not None
    out = Path(job.out)
    rows: list[dict[str, Any]] = []
    forced_from = (f"keep={job.keep}" if job.keep is not None
                   else f"keep_ratio={job.keep_ratio:g}" if forced else "")
    last_cahp: tuple[int, str] | None = None  # (heads kept, label) of the nearest cahp entry so far
    for label, method, degree in entries:
        if forced:
            keep, ratio, count_from = job.keep, job.keep_ratio, forced_from
        elif get_importance(method).finds_count:  # cahp: its own knee
            keep, ratio, count_from = None, None, f"{label} knee"
        else:
            assert last_cahp is not None  # the first entry is cahp
            keep, ratio, count_from = last_cahp[0], None, f"{last_cahp[1]} knee"
        sub = _as_method(job, method, out=str(out / label), keep=keep, keep_ratio=ratio,
                         poly_degree=degree if degree is not None else job.poly_degree)
        res = _finished(sub) if resume else None

        def staged(stage: str, secs: float, label: str = label) -> None:
            if on_stage is not None:
                on_stage(label, stage, secs)

        if res is None:
            res = pipeline.run_prune(sub, loaded, on_stage=staged)  # looked up on the module: tests spy on it there
        else:
            staged("reused", float(res["report"]["seconds"].get("total", 0.0)))
            if loaded.dense_acc is None:
                loaded.dense_acc = {s: v["dense"] for s, v in res["details"][loaded.metric_name].items()}
        rep = res["report"]
        if not forced and get_importance(method).finds_count:
            last_cahp = (rep["heads_kept"], label)
        depth = rpt.depth_profile(rep["kept"], len(rep["kept"]))
        row = {"label": label, "method": label, "heads_kept": rep["heads_kept"], "count_from": count_from,
               "kept": rep["kept"], "knee_k": rep["knee_k"], "mean_depth": rep.get("mean_depth", depth[0]),
               "middle_third_share": rep.get("middle_third_share", depth[1]),
               "metric": res["details"][loaded.metric_name], "seconds": rep["seconds"], "cost": rep["cost"]}
        if rep.get("warning"):
            row["warning"] = rep["warning"]
        if loaded.metric_name == "accuracy":
            row["accuracy"] = row["metric"]
        rows.append(row)
        if on_row is not None:
            on_row(row)
        if len(rows) < len(entries):  # a comparison cut short keeps the methods it finished
            _write_compare(job, loaded, rows, planned=[lbl for lbl, _, _ in entries])
    return rows


def _write_compare(job: PruneJob, loaded: Workload, rows: list[dict[str, Any]],
                   planned: Sequence[str] | None = None) -> dict[str, Any]:
    """``compare.md``, ``compare.json`` and the plots of one comparison in ``job.out``; ``planned``: every
    method's label while only ``rows``' have finished."""
    out = Path(job.out)
    n_layers = len(rows[0]["kept"])
    table = rpt.compare_markdown(rows, list(loaded.evals))
    rpt.plot_heads_per_layer({r["label"]: r["kept"] for r in rows}, n_layers, out / "heads_per_layer.png")
    p = loaded.primary
    points = {}
    for r in rows:
        points[f"{r['label']} pruned"] = [(r["heads_kept"], r["metric"][p]["pruned"])]
        if r["metric"][p]["finetuned"] is not None:
            points[f"{r['label']} fine-tuned"] = [(r["heads_kept"], r["metric"][p]["finetuned"])]
    mname = loaded.metric_name
    rpt.plot_accuracy_vs_heads(points, out / "accuracy_vs_heads.png",
                               dense=(loaded.heads_total, loaded.dense_acc[p]) if loaded.dense_acc else None,
                               ylabel=f"{p} {mname}", title=f"{mname.capitalize()} vs heads kept")
    if planned is not None:
        table = (f"**Partial:** {len(rows)} of {len(planned)} methods finished ({', '.join(planned[len(rows):])} "
                 "not yet).\n\n" + table)
    md = (f"# Head pruning comparison ({job.task}, {loaded.heads_total} heads)\n\n{table}\n"
          "![heads per layer](heads_per_layer.png)\n\n![accuracy vs heads](accuracy_vs_heads.png)\n")
    if mname == "perplexity":
        md += "\nMetric: held-out perplexity (lower is better).\n"
    atomic_write_text(out / "compare.md", md)
    summary = {"task": job.task, "model": job.model, "metric_name": mname, "heads_total": loaded.heads_total,
               "load_seconds": loaded.load_seconds, **({"methods_planned": list(planned)} if planned else {}),
               "rows": rows}
    rpt.write_json(out / "compare.json", summary)
    return summary


__all__ = ["check_compare_job", "parse_methods", "run_prune_compare"]
