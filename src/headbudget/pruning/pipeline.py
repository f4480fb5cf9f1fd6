"""The pruning pipeline of one method (:func:`run_prune`); several at one head count are
:func:`headbudget.pruning.compare.run_prune_compare`.

A classifier (``sst5``, ``mnli``) keeps its Hugging Face class plus ``kept_heads.json``; ``task="lm"``
prunes a causal LM label-free as a headbudget model (:mod:`headbudget.pruning.lm`).  Each run writes
``OUT/model`` (tokenizer at its root), ``OUT/report.json`` (:mod:`headbudget.pruning.report`),
``OUT/details.json``, ``OUT/report.md`` and plots; see docs/pruning.md, "Commands".

    >>> from headbudget.pruning.job import PruneJob
    >>> from headbudget.pruning.pipeline import run_prune
    >>> run_prune(PruneJob("runs/ft", "sst5", "../shared/data/classification/sst5", "runs/cahp"))
    ...                                                                              # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headbudget.io import atomic_write_text
from headbudget.progress import quiet_unless_progress
from headbudget.pruning import report as rpt
from headbudget.pruning.job import PruneJob, require_positive
from headbudget.pruning.methods import MethodRun, Selection, get_importance, method_job_fields
from headbudget.pruning.workloads import Workload, load_workload, model_adapter

if TYPE_CHECKING:
    from headbudget.models.surgery import HeadAdapter


def check_job(job: PruneJob) -> None:
    """A one-line ``ValueError`` naming the first invalid setting of ``job``."""
    from headbudget.devices import resolve_device, resolve_dtype

    resolve_dtype(job.dtype, flag="dtype")
    resolve_device(job.device, flag="device")
    for f in dataclasses.fields(job):  # every setting with choices, as its flag declares them
        choices, value = f.metadata.get("choices"), getattr(job, f.name)
        if choices and value is not None and value not in choices:
            raise ValueError(f"{f.name} must be one of {', '.join(map(str, choices))}, got {value!r}")
    if job.task == "lm":
        if not job.data:
            raise ValueError("task lm needs a text file (data): calibration windows and held-out perplexity")
        if job.curve == "accuracy":
            raise ValueError("the accuracy curve is for classification tasks; with task lm use the mss curve "
                             "or a forced head count")
        if job.context < 2:
            raise ValueError(f"context must be >= 2 tokens, got {job.context}")
        require_positive(job, "calib_windows")
        if not 0 < job.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {job.heldout_fraction}")
        for path in job.eval_data:
            if not Path(path).is_file():
                raise FileNotFoundError(f"eval_data: no file {path}")
    elif job.eval_data:
        raise ValueError("eval_data (held-out texts scored by perplexity) is for task lm")
    elif not job.data_dir:
        raise ValueError(f"task {job.task} needs its data folder (data_dir)")
    method = get_importance(job.method)  # a one-line error naming the registered methods
    if job.keep is not None and job.keep_ratio is not None:
        raise ValueError("give a head count (keep) or a ratio (keep_ratio), not both")
    if job.keep_ratio is not None and not 0 < job.keep_ratio < 1:
        raise ValueError(f"keep_ratio must be in (0, 1), got {job.keep_ratio}")
    if job.keep is not None and job.keep < 1:
        raise ValueError(f"keep must be >= 1 head, got {job.keep}")
    if not method.finds_count and job.keep is None and job.keep_ratio is None:
        raise ValueError(f"method {job.method} needs a head count (keep or keep_ratio): baselines are "
                         "forced to a head count; prune-compare takes it from CAHP")
    if method.check is not None:
        method.check(job)
    if job.pool_size < 2:
        raise ValueError(f"pool_size must be >= 2, got {job.pool_size}")
    if job.finetune_epochs < 0:
        raise ValueError(f"finetune_epochs must be >= 0, got {job.finetune_epochs}")
    require_positive(job, "limit_train", "limit_eval", "importance_batches")


def _checked_target(job: PruneJob, counts: list[int]) -> int | None:
    """The number of heads the job keeps (None: the method decides), refused in one line when out of range."""
    n_total = sum(counts)
    target = job.keep
    if target is None and job.keep_ratio is not None:
        target = max(1, int(round(job.keep_ratio * n_total)))
    # without the floor a baseline may keep fewer heads than there are layers (some layers lose every head)
    low = len(counts) if job.layer_floor or get_importance(job.method).keeps_layer_floor else 1
    if target is not None and not low <= target < n_total:
        raise ValueError(f"cannot keep {target} heads: this model has {n_total} heads in {len(counts)} "
                         f"layers (keep between {low} and {n_total - 1})")
    return target


@quiet_unless_progress
def run_prune(job: PruneJob, loaded: Workload | None = None,
              on_stage: Callable[[str, float], None] | None = None) -> dict[str, Any]:
    """Select (the job's registered method, :mod:`headbudget.pruning.methods`), remove, fine-tune and report
    one method; returns ``{"report", "details"}``.

    ``on_stage(stage, seconds)`` is called as each stage finishes, with the names of ``report.json``'s
    ``seconds`` (``dense_eval``, the method's own stages such as ``signatures`` / ``salience`` / ``cluster``,
    ``select``, ``prune``, ``pruned_eval``, ``finetune``, ``save``, ``total``): a long run says where it is."""
    from headbudget.pruning.cahp import kept_by_layer

    check_job(job)
    t_start = time.perf_counter()
    seconds: dict[str, float] = {}
    told: set[str] = set()

    def tell() -> None:  # the stages finished since the last call, in the order they ran
        for name, secs in list(seconds.items()):
            if name not in told:
                told.add(name)
                if on_stage is not None:
                    on_stage(name, secs)

    if loaded is None:
        loaded = load_workload(job)
        seconds["load"] = loaded.load_seconds
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    model = loaded.fresh_model(job)
    cost_before = _cost(model)
    adapter = model_adapter(model)
    counts = adapter.head_counts()

    t = time.perf_counter()
    if loaded.dense_acc is None:
        loaded.dense_acc = loaded.evaluate(model, job, "dense")
        seconds["dense_eval"] = time.perf_counter() - t
    tell()
    dense = dict(loaded.dense_acc)

    target = _checked_target(job, counts)
    run = MethodRun(job, loaded, adapter, model, target, out, signature_batches=loaded.batches(job, False),
                    importance_batches=loaded.batches(job, True))
    details: dict[str, Any] = loaded.describe(job)
    sel = _select(run, seconds)
    tell()
    details.update(sel.details)
    kept = sel.kept if job.granularity == "head" else _with_granularity(run, sel.kept, details)
    kept_layers = kept_by_layer(kept, run.heads, len(counts))

    _remove_heads(adapter, kept, kept_layers, seconds)
    cost = {"before": cost_before, "after": _cost(model)}
    t = time.perf_counter()
    pruned = loaded.evaluate(model, job, "pruned")
    seconds["pruned_eval"] = time.perf_counter() - t
    tell()
    finetuned = _recover_and_save(model, loaded, job, details, seconds)
    seconds["total"] = time.perf_counter() - t_start + seconds.get("load", 0.0)
    tell()

    stages = {s: {"dense": dense[s], "pruned": pruned[s], "finetuned": finetuned.get(s)} for s in loaded.evals}
    details.update({"metric_name": loaded.metric_name, loaded.metric_name: stages, **loaded.details(),
                    "kept_original": {str(k): v for k, v in adapter.original_heads().items()},
                    "job": _job_fingerprint(job)})
    report = _method_report(run, sel, kept_layers, dict(stages[loaded.primary]), seconds, cost, details)
    plots = sel.plots + _plot_result(run, report, kept_layers, stages[loaded.primary], details)
    rpt.write_json(out / "report.json", report)
    rpt.write_json(out / "details.json", details)
    atomic_write_text(out / "report.md", rpt.report_markdown(report, details, plots))
    return {"report": report, "details": details}


def _cost(model: Any) -> dict[str, Any]:
    """``report.json``'s ``cost`` of ``model``: parameters, forward FLOPs and KV-cache bytes per token (as
    headbudget and as llama.cpp's GGUF export store the cache)."""
    from headbudget.evaluation.cost import model_cost, model_kv_cache_bytes
    from headbudget.models.export_gguf import gguf_kv_cache_bytes

    return dict(model_cost(model), kv_cache_bytes_per_token=model_kv_cache_bytes(model),
                gguf_kv_cache_bytes_per_token=gguf_kv_cache_bytes(model))


def _select(run: MethodRun, seconds: dict[str, float]) -> Selection:
    """The job's method chooses the heads; ``seconds["select"]``: its stage timings summed, else its wall time."""
    t = time.perf_counter()
    sel = get_importance(run.job.method).select(run)
    seconds.update(sel.seconds)
    seconds["select"] = sum(sel.seconds.values()) if sel.seconds else time.perf_counter() - t
    return sel


def _with_granularity(run: MethodRun, kept: list[int], details: dict[str, Any]) -> list[int]:
    """``kept`` turned into whole kv groups / balanced layers (:mod:`headbudget.pruning.granularity`)."""
    import numpy as np

    from headbudget.pruning.granularity import apply_granularity, kv_groups_of
    from headbudget.pruning.importance import flatten, unflatten

    counts, n_total = run.head_counts, len(run.heads)
    # per-head scores of the method; methods without one final score (cahp, michel) rank their own
    # selection first: 1 for a kept head, 0 for the rest
    flat = None if details.get("scores") is None else flatten(details["scores"])
    if flat is None or len(flat) != n_total:
        flat = np.isin(np.arange(n_total), kept).astype(np.float64)
    details["granularity"] = run.job.granularity
    floor = run.job.layer_floor or get_importance(run.job.method).keeps_layer_floor
    return apply_granularity(run.job.granularity, unflatten(np.asarray(flat, dtype=np.float64), counts),
                             kv_groups_of(run.adapter), run.target or len(kept), layer_floor=floor)


def _remove_heads(adapter: HeadAdapter, kept: list[int], kept_layers: dict[int, list[int]], seconds: dict[str, float]) -> None:
    """Remove every head not in ``kept`` from the model and check what is left."""
    from headbudget.pruning.importance import prune_spec

    counts = adapter.head_counts()
    t = time.perf_counter()
    adapter.prune_heads(prune_spec(kept, counts))
    seconds["prune"] = time.perf_counter() - t
    if adapter.head_counts() != [len(kept_layers[layer]) for layer in range(len(counts))]:
        raise RuntimeError("pruning left unexpected head counts")


def _recover_and_save(model: Any, loaded: Workload, job: PruneJob, details: dict[str, Any],
                      seconds: dict[str, float]) -> dict[str, float | None]:
    """Recovery fine-tuning (``finetune_epochs`` > 0) and ``OUT/model``; the fine-tuned metric per split."""
    finetuned: dict[str, float | None] = {s: None for s in loaded.evals}
    if job.finetune_epochs > 0:
        t = time.perf_counter()
        final, details["finetune_history"] = loaded.finetune(model, job)
        seconds["finetune"] = time.perf_counter() - t
        finetuned = dict(final)
    if job.save_model:
        t = time.perf_counter()
        loaded.save(model, Path(job.out) / "model")
        seconds["save"] = time.perf_counter() - t
    return finetuned


def _method_report(run: MethodRun, sel: Selection, kept_layers: dict[int, list[int]], primary: dict[str, Any],
                   seconds: dict[str, float], cost: dict[str, Any], details: dict[str, Any]) -> dict[str, Any]:
    """``report.json`` (:func:`headbudget.pruning.report.build_report`) with a warning when the result is suspect:
    an LM knee that blows up perplexity, or DSP gates that never cooled down."""
    job, loaded = run.job, run.workload
    n_total = len(run.heads)
    report = rpt.build_report(job.method, n_total, kept_layers, sel.knee_k, sel.mss, primary, seconds, cost,
                              n_layers=len(kept_layers), k_source=rpt.k_source_of(details.get("knee_source")))
    dense, pruned = primary["dense"], primary["pruned"]
    if (loaded.metric_name == "perplexity" and job.method == "cahp" and run.target is None and job.knee_warn_ratio > 0
            and float(pruned) > job.knee_warn_ratio * float(dense)):
        report["warning"] = (
            f"the knee keeps {report['heads_kept']}/{n_total} heads and held-out perplexity goes from "
            f"{dense:.4g} to {pruned:.4g} ({pruned / dense:.1f}x dense, more than "
            f"{job.knee_warn_ratio:g}x): force a head count with keep / keep_ratio")
    gate_info = details.get("gate_training") or {}
    if gate_info.get("cooled_down") is False:  # DSP on a short run: the relaxation never sharpened
        report["warning"] = (
            f"{job.method}: the temperature never reached {gate_info['t_end']:g}: {gate_info['steps']} gate-training "
            f"steps < cooldown {gate_info['cooldown']} (last temperature {gate_info['final_temperature']:.3g}); "
            "raise gate_epochs (--gate-epochs) or lower gate_cooldown (--gate-cooldown)")
    return report


def _plot_result(run: MethodRun, report: dict[str, Any], kept_layers: dict[int, list[int]],
                 primary: dict[str, Any], details: dict[str, Any]) -> list[str]:
    """Heads kept per layer, and the metric vs heads kept (with CAHP's accuracy curve when it measured one)."""
    job, loaded, out = run.job, run.workload, run.out
    method, mname, p = job.method, loaded.metric_name, loaded.primary
    plots = [str(rpt.plot_heads_per_layer({method: kept_layers}, len(kept_layers), out / "heads_per_layer.png"))]
    points = {f"{method} pruned": [(report["heads_kept"], primary["pruned"])]}
    if primary["finetuned"] is not None:
        points[f"{method} fine-tuned"] = [(report["heads_kept"], float(primary["finetuned"]))]
    curve = [(c[1], c[2]) for c in details.get("accuracy_curve") or []]
    plots.append(str(rpt.plot_accuracy_vs_heads(points, out / "accuracy_vs_heads.png",
                                                dense=(len(run.heads), primary["dense"]), curve=curve or None,
                                                ylabel=f"{p} {mname}", title=f"{mname.capitalize()} vs heads kept")))
    return plots


def _job_fingerprint(job: PruneJob) -> dict[str, Any]:
    """The settings that decide a method's result (``resume`` reuses a finished method only when they match)."""
    d = {k: v for k, v in vars(job).items() if k not in ("out", "progress", "device", "extra")}
    # settings added later are left out while unset or at their default: older runs stay resumable
    for k, unset in (("representative", (None,)), ("allocation", (None,)), ("n_clusters", (None,)),
                     ("granularity", ("head",)), ("calib_seed", (None,)), ("eval_data", (None, ()))):
        if k in d and d[k] in unset:
            del d[k]
    if d.get("layer_floor") is True:  # True itself: 1 or another truthy value stays recorded
        del d["layer_floor"]
    by_method = method_job_fields()  # other methods' own settings are no part of this one's result
    for k in {k for fields in by_method.values() for k in fields} - set(by_method.get(job.method, ())):
        d.pop(k, None)
    return json.loads(json.dumps(d, default=str))


__all__ = ["check_job", "run_prune"]
