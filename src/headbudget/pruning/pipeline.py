"""The pruning pipeline of one method (:func:`run_prune`); several at one head count are
:func:`headbudget.pruning.compare.run_compare`.

    >>> from headbudget.pruning.pipeline import PruneJob, run_prune
    >>> run_prune(PruneJob("runs/ft", "sst5", "../shared/data/classification/sst5", "runs/cahp"))
    ...                                                                              # doctest: +SKIP
    >>> run_prune(PruneJob("runs/prism", "lm", None, "runs/cahp-lm", data="../shared/data/text/tinyshakespeare.txt",
    ...                    keep=12))                                                 # doctest: +SKIP

Classification tasks (``sst5``, ``mnli``) prune a classifier (BERT family or a fine-tuned
``*ForSequenceClassification``); it keeps its Hugging Face class and is saved with
:func:`headbudget.pruning.adapters.save_pruned` (``kept_heads.json`` records the kept heads, and
:func:`headbudget.loading.load_model` reads it back).  ``task="lm"`` prunes a causal LM label-free
(:mod:`headbudget.pruning.lm`): the decoder is converted to a headbudget model
(``load_model(..., as_headbudget=True)``), pruned by ``model.prune_heads`` and saved with
``save_pretrained``, so the result is a plain headbudget checkpoint whose schedule is what was kept.
Every output model folder holds its tokenizer at the root.

Each run writes ``OUT/model``, ``OUT/report.json`` (fixed schema, :mod:`headbudget.pruning.report`, with
parameters and forward FLOPs per token before and after), ``OUT/details.json``, ``OUT/report.md`` and plots.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from headbudget.pruning.job import PruneJob
from headbudget.pruning.workloads import (
    ClassificationWorkload,
    LMWorkload,
    Workload,
    load_workload,
    model_adapter,
)

METHODS = ("cahp", "michel", "fisher", "magnitude", "random", "pipelined-dsp", "joint-dsp", "pass", "attattr")
# Settings only these methods read; a job's fingerprint carries them only for these methods, so earlier runs of
# the other methods stay resumable.
_METHOD_FIELDS = {"pipelined-dsp": ("gate_lr", "gate_epochs", "gate_cooldown"),
                  "joint-dsp": ("gate_lr", "gate_epochs", "gate_cooldown"),
                  "pass": ("gate_lr", "gate_epochs"),
                  "attattr": ("attattr_examples", "attattr_steps")}


def check_job(job: PruneJob) -> None:
    """A one-line ``ValueError`` naming the first invalid setting of ``job``."""
    from headbudget.loading import resolve_device, resolve_dtype

    resolve_dtype(job.dtype, flag="dtype")
    resolve_device(job.device, flag="device")
    if job.task == "lm":
        if not job.data:
            raise ValueError("task lm needs a text file (data): calibration windows and held-out perplexity")
        if job.curve == "accuracy":
            raise ValueError("the accuracy curve is for classification tasks; with task lm use the mss curve "
                             "or a forced head count")
        if job.context < 2:
            raise ValueError(f"context must be >= 2 tokens, got {job.context}")
        if job.calib_windows < 1:
            raise ValueError(f"calib_windows must be >= 1, got {job.calib_windows}")
        if not 0 < job.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {job.heldout_fraction}")
        for path in job.eval_data:
            if not Path(path).is_file():
                raise FileNotFoundError(f"eval_data: no file {path}")
    elif job.eval_data:
        raise ValueError("eval_data (held-out texts scored by perplexity) is for task lm")
    elif not job.data_dir:
        raise ValueError(f"task {job.task} needs its data folder (data_dir)")
    if job.salience_order not in ("file", "shuffled"):
        raise ValueError(f"salience_order must be 'file' or 'shuffled', got {job.salience_order!r}")
    if job.method not in METHODS:
        raise ValueError(f"unknown pruning method {job.method!r}; choose from {', '.join(METHODS)}")
    if job.keep is not None and job.keep_ratio is not None:
        raise ValueError("give a head count (keep) or a ratio (keep_ratio), not both")
    if job.keep_ratio is not None and not 0 < job.keep_ratio < 1:
        raise ValueError(f"keep_ratio must be in (0, 1), got {job.keep_ratio}")
    if job.keep is not None and job.keep < 1:
        raise ValueError(f"keep must be >= 1 head, got {job.keep}")
    if job.method != "cahp" and job.keep is None and job.keep_ratio is None:
        raise ValueError(
            f"method {job.method} needs a head count (keep or keep_ratio): baselines are forced to a head "
            "count; prune-compare takes it from CAHP"
        )
    if job.method == "attattr" and job.task == "lm":
        raise ValueError("method attattr attributes a class probability: it needs a classification task "
                         "(sst5, mnli), not lm")
    if job.gate_lr <= 0:
        raise ValueError(f"gate_lr must be > 0, got {job.gate_lr}")
    if job.gate_epochs < 1:
        raise ValueError(f"gate_epochs must be >= 1, got {job.gate_epochs}")
    if job.gate_cooldown is not None and job.gate_cooldown < 1:
        raise ValueError(f"gate_cooldown must be >= 1 step, got {job.gate_cooldown}")
    if job.attattr_examples < 1:
        raise ValueError(f"attattr_examples must be >= 1, got {job.attattr_examples}")
    if job.granularity not in ("head", "group", "balanced"):
        raise ValueError(f"granularity must be head, group or balanced, got {job.granularity!r}")
    if job.attattr_steps < 1:
        raise ValueError(f"attattr_steps must be >= 1, got {job.attattr_steps}")
    if job.curve not in ("mss", "accuracy"):
        raise ValueError(f"curve must be 'mss' or 'accuracy', got {job.curve!r}")
    if job.mss not in ("mean", "nearest"):
        raise ValueError(f"mss must be 'mean' or 'nearest', got {job.mss!r}")
    if job.pool_size < 2:
        raise ValueError(f"pool_size must be >= 2, got {job.pool_size}")
    if job.finetune_epochs < 0:
        raise ValueError(f"finetune_epochs must be >= 0, got {job.finetune_epochs}")
    for name in ("limit_train", "limit_eval", "importance_batches"):
        v = getattr(job, name)
        if v is not None and v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")


def _evaluate(model: Any, loaded: Workload, job: PruneJob, stage: str) -> dict[str, float]:
    return loaded.evaluate(model, job, stage)


def _target_heads(job: PruneJob, heads_total: int) -> int | None:
    if job.keep is not None:
        return job.keep
    if job.keep_ratio is not None:
        return max(1, int(round(job.keep_ratio * heads_total)))
    return None


def run_prune(job: PruneJob, loaded: Workload | None = None) -> dict[str, Any]:
    """Select, remove, fine-tune and report one method; returns ``{"report", "details"}``."""
    from headbudget.evaluation.cost import model_cost, model_kv_cache_bytes

    def cost_of(model) -> dict[str, Any]:
        return dict(model_cost(model), kv_cache_bytes_per_token=model_kv_cache_bytes(model))
    from headbudget.pruning import report as rpt
    from headbudget.pruning.cahp import cahp_select, kept_by_layer
    from headbudget.pruning.finetune import evaluate_accuracy
    from headbudget.pruning.importance import (
        ImportanceContext,
        flatten,
        gate_mask,
        prune_spec,
        select_by_method,
        select_top,
    )

    check_job(job)
    t_start = time.perf_counter()
    seconds: dict[str, float] = {}
    if loaded is None:
        loaded = load_workload(job)
        seconds["load"] = loaded.load_seconds
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    model = loaded.fresh_model(job)
    cost_before = cost_of(model)
    adapter = model_adapter(model)
    counts = adapter.head_counts()
    heads = [(layer, h) for layer, n in enumerate(counts) for h in range(n)]
    n_total = len(heads)

    t = time.perf_counter()
    if loaded.dense_acc is None:
        loaded.dense_acc = _evaluate(model, loaded, job, "dense")
        seconds["dense_eval"] = time.perf_counter() - t
    dense = dict(loaded.dense_acc)

    target = _target_heads(job, n_total)
    if target is not None and not len(counts) <= target < n_total:
        raise ValueError(
            f"cannot keep {target} heads: this model has {n_total} heads in {len(counts)} layers "
            f"(keep between {len(counts)} and {n_total - 1})"
        )
    sig_batches = loaded.batches(job, False)
    imp_batches = loaded.batches(job, True)
    details: dict[str, Any] = loaded.describe(job)
    mname = loaded.metric_name
    knee_k, mss = None, []
    plots: list[str] = []
    t = time.perf_counter()
    if job.method == "cahp":
        accuracy_fn = accuracy_ks = None
        if job.curve == "accuracy" and target is None and isinstance(loaded, ClassificationWorkload):
            curve_examples = loaded.evals[loaded.primary]

            def accuracy_fn(kept: list[int]) -> float:
                with adapter.set_gate_values(gate_mask(kept, counts)):
                    return evaluate_accuracy(model, loaded.tokenizer, curve_examples, 64, job.max_length, False)

            accuracy_ks = list(range(2, n_total, max(1, job.curve_step)))
        if job.salience_order == "file":
            sal_batches, sal_fraction = loaded.salience_batches(job), 1.0
        else:
            sal_batches, sal_fraction = imp_batches, job.salience_fraction
        sel, secs = cahp_select(
            adapter, sig_batches, sal_batches, n_classes=loaded.n_classes, grid=job.pool_size,
            keep=target, poly_degree=job.poly_degree, perplexity=job.perplexity, mss_variant=job.mss,
            seed=job.seed, salience_fraction=sal_fraction, accuracy_fn=accuracy_fn,
            accuracy_ks=accuracy_ks, progress=job.progress, ddof=job.ddof, var_floor=job.var_floor,
            var_eps=job.var_eps, tsne_dtype=job.tsne_dtype, representative=job.representative,
            allocation=job.allocation, n_clusters=job.n_clusters,
        )
        seconds.update(secs)
        seconds["select"] = sum(secs.values())
        kept = sel.kept
        knee_k, mss = sel.knee_k, sel.mss
        details.update(knee_source=sel.knee_source, rescued=[list(heads[i]) for i in sel.rescued],
                       salience=sel.salience, clusters=sel.labels, medoids=sel.medoids,
                       embedding=sel.embedding, accuracy_curve=sel.accuracy_curve, poly_degree=job.poly_degree,
                       mss_variant=job.mss, pool_size=job.pool_size, perplexity=job.perplexity)
        plots.append(str(rpt.plot_mss(mss, knee_k, out / "mss.png", f"MSS ({job.mss}), knee k = {knee_k}")))
        plots.append(str(rpt.plot_embedding(sel.embedding, sel.labels, heads, kept, out / "embedding.png")))
    elif job.method in ("pipelined-dsp", "joint-dsp", "pass"):
        from headbudget.pruning.gated import GateSettings, train_gates

        assert target is not None
        settings = GateSettings(lr=job.gate_lr, epochs=job.gate_epochs, cooldown=job.gate_cooldown,
                                weight_lr=job.lr, seed=job.seed)
        gated = train_gates(job.method, adapter, model, imp_batches[: job.importance_batches], target, settings,
                            progress=job.progress)
        seconds["select"] = time.perf_counter() - t
        kept = gated.kept
        details.update(scores=gated.logits, gate_training=gated.info, gate_history=gated.history)
    elif job.method == "attattr":
        from headbudget.pruning.attattr import attattr_scores

        assert target is not None and isinstance(loaded, ClassificationWorkload)
        examples = loaded.evals[loaded.primary][: job.attattr_examples]
        attr = attattr_scores(adapter, model, loaded.tokenizer, examples, steps=job.attattr_steps,
                              max_length=job.max_length, progress=job.progress)
        seconds["select"] = time.perf_counter() - t
        kept = select_top(attr, target)
        details.update(scores=flatten(attr), attattr={"split": loaded.primary, "examples": len(examples),
                                                      "steps": job.attattr_steps})
    else:
        assert target is not None
        ctx = ImportanceContext(adapter, model, imp_batches[: job.importance_batches], seed=job.seed,
                                progress=job.progress)
        kept, scores = select_by_method(job.method, ctx, target)
        seconds["select"] = time.perf_counter() - t
        if scores is not None:
            details["scores"] = scores
    if job.granularity != "head":
        import numpy as np

        from headbudget.pruning.granularity import apply_granularity, kv_groups_of
        from headbudget.pruning.importance import unflatten

        # per-head scores of the method; methods without one final score (cahp, michel) rank their own
        # selection first: 1 for a kept head, 0 for the rest
        flat = None if details.get("scores") is None else flatten(details["scores"])
        if flat is None or len(flat) != n_total:
            kept_set = set(kept)
            flat = [1.0 if i in kept_set else 0.0 for i in range(n_total)]
        kept = apply_granularity(job.granularity, unflatten(np.asarray(flat, dtype=np.float64), counts),
                                 kv_groups_of(adapter), target or len(kept))
        details["granularity"] = job.granularity
    kept_layers = kept_by_layer(kept, heads, len(counts))

    t = time.perf_counter()
    adapter.prune_heads(prune_spec(kept, counts))
    seconds["prune"] = time.perf_counter() - t
    if adapter.head_counts() != [len(kept_layers[layer]) for layer in range(len(counts))]:
        raise RuntimeError("pruning left unexpected head counts")
    cost = {"before": cost_before, "after": cost_of(model)}
    t = time.perf_counter()
    pruned = _evaluate(model, loaded, job, "pruned")
    seconds["pruned_eval"] = time.perf_counter() - t

    finetuned: dict[str, float | None] = {s: None for s in loaded.evals}
    if job.finetune_epochs > 0:
        t = time.perf_counter()
        final, history = loaded.finetune(model, job)
        seconds["finetune"] = time.perf_counter() - t
        finetuned = dict(final)
        details["finetune_history"] = history
    if job.save_model:
        t = time.perf_counter()
        loaded.save(model, out / "model")
        seconds["save"] = time.perf_counter() - t
    seconds["total"] = time.perf_counter() - t_start + seconds.get("load", 0.0)

    accuracy = {s: {"dense": dense[s], "pruned": pruned[s], "finetuned": finetuned.get(s)} for s in loaded.evals}
    details["metric_name"] = mname
    details[mname] = accuracy
    if isinstance(loaded, LMWorkload):
        details["perplexity_runs"] = {k: v for k, v in loaded.last_eval.items()}
    details["kept_original"] = {str(k): v for k, v in adapter.original_heads().items()}
    details["job"] = _job_fingerprint(job)
    p = loaded.primary
    report = rpt.build_report(job.method, n_total, kept_layers, knee_k, mss,
                              {"dense": dense[p], "pruned": pruned[p], "finetuned": finetuned.get(p)}, seconds,
                              cost, n_layers=len(counts))
    if (isinstance(loaded, LMWorkload) and job.method == "cahp" and target is None and job.knee_warn_ratio > 0
            and float(pruned[p]) > job.knee_warn_ratio * float(dense[p])):
        report["warning"] = (
            f"the knee keeps {report['heads_kept']}/{n_total} heads and held-out perplexity goes from "
            f"{dense[p]:.4g} to {pruned[p]:.4g} ({pruned[p] / dense[p]:.1f}x dense, more than "
            f"{job.knee_warn_ratio:g}x): force a head count with keep / keep_ratio")
    gate_info = details.get("gate_training") or {}
    if gate_info.get("cooled_down") is False:  # DSP on a short run: the relaxation never sharpened
        report["warning"] = (
            f"{job.method}: the temperature never reached {gate_info['t_end']:g}: {gate_info['steps']} gate-training "
            f"steps < cooldown {gate_info['cooldown']} (last temperature {gate_info['final_temperature']:.3g}); "
            "raise gate_epochs (--gate-epochs) or lower gate_cooldown (--gate-cooldown)")
    plots.append(str(rpt.plot_heads_per_layer({job.method: kept_layers}, len(counts), out / "heads_per_layer.png")))
    points = {f"{job.method} pruned": [(report["heads_kept"], pruned[p])]}
    if finetuned.get(p) is not None:
        points[f"{job.method} fine-tuned"] = [(report["heads_kept"], float(finetuned[p]))]  # type: ignore[arg-type]
    curve = [(c[1], c[2]) for c in details.get("accuracy_curve") or []]
    plots.append(str(rpt.plot_accuracy_vs_heads(points, out / "accuracy_vs_heads.png", dense=(n_total, dense[p]),
                                                curve=curve or None, ylabel=f"{p} {mname}",
                                                title=f"{mname.capitalize()} vs heads kept")))
    rpt.write_json(out / "report.json", report)
    rpt.write_json(out / "details.json", details)
    rpt.atomic_write_text(out / "report.md", rpt.report_markdown(report, details, plots))
    return {"report": report, "details": details}


def _job_fingerprint(job: PruneJob) -> dict[str, Any]:
    """The settings that decide a method's result (``resume`` reuses a finished method only when they match)."""
    d = {k: v for k, v in vars(job).items() if k not in ("out", "progress", "device", "extra")}
    for k in ("representative", "allocation", "n_clusters"):  # added later: unset keeps older runs resumable
        if d[k] is None:
            del d[k]
    if d.get("granularity") == "head":  # added later: the default keeps older runs resumable
        del d["granularity"]
    for k in ("calib_seed", "eval_data"):  # added later: unset keeps older runs resumable
        if d.get(k) in (None, ()):
            d.pop(k, None)
    mine = _METHOD_FIELDS.get(job.method, ())
    for fields in _METHOD_FIELDS.values():
        for k in fields:
            if k not in mine:
                d.pop(k, None)
    return json.loads(json.dumps(d, default=str))


def __getattr__(name: str) -> Any:
    # run_compare / parse_methods moved to headbudget.pruning.compare (which imports this module): the old
    # import path keeps working, with a warning, until callers have moved
    if name in ("parse_methods", "run_compare"):
        import warnings

        from headbudget.pruning import compare

        warnings.warn(f"headbudget.pruning.pipeline.{name} moved to headbudget.pruning.compare.{name}",
                      DeprecationWarning, stacklevel=2)
        return getattr(compare, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["METHODS", "PruneJob", "check_job", "run_prune"]
