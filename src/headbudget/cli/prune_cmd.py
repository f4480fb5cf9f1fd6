"""``headbudget finetune``, ``headbudget prune`` and ``headbudget prune-compare``.

    headbudget finetune MODEL --task sst5 --data-dir ../shared/data/classification/sst5 --out runs/ft
    headbudget prune runs/ft --task sst5 --data-dir ../shared/data/classification/sst5 \\
        --method cahp --poly-degree 6 --out runs/cahp
    headbudget prune-compare runs/ft --task sst5 --data-dir ../shared/data/classification/sst5 \\
        --methods cahp@2,cahp@6,michel,fisher,magnitude,random --out runs/compare

``prune`` writes ``OUT/model`` (the physically pruned model, loadable with
``headbudget.pruning.finetune.load_classifier``), ``OUT/report.json`` (fixed schema, see
:mod:`headbudget.pruning.report`), ``OUT/details.json``, ``OUT/report.md`` and plots.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

METHODS = ("cahp", "michel", "fisher", "magnitude", "random")


@dataclass
class PruneJob:
    """Everything one pruning run needs (the CLI flags, as a dataclass for Python callers).

    Example::

        run_prune(PruneJob("runs/ft", "sst5", "../shared/data/classification/sst5", "runs/cahp"))
    """

    model: str
    task: str
    data_dir: str
    out: str
    method: str = "cahp"
    keep: int | None = None
    keep_ratio: float | None = None
    poly_degree: int = 6
    pool_size: int = 32
    perplexity: float = 10.0
    mss: str = "mean"
    curve: str = "mss"
    curve_step: int = 1
    salience_fraction: float = 0.25
    importance_batches: int | None = None
    finetune_epochs: int = 3
    lr: float = 2e-5
    warmup_ratio: float = 0.1
    weight_decay: float = 0.01
    batch_size: int = 32
    seed: int = 0
    limit_train: int | None = None
    limit_eval: int | None = None
    max_length: int = 128
    device: str | None = None
    progress: bool = True
    save_model: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def _check_job(job: PruneJob) -> None:
    if job.method not in METHODS:
        raise ValueError(f"--method: unknown method {job.method!r}; choose from {', '.join(METHODS)}")
    if job.keep is not None and job.keep_ratio is not None:
        raise ValueError("give --keep or --keep-ratio, not both")
    if job.keep_ratio is not None and not 0 < job.keep_ratio < 1:
        raise ValueError(f"--keep-ratio must be in (0, 1), got {job.keep_ratio}")
    if job.keep is not None and job.keep < 1:
        raise ValueError(f"--keep must be >= 1, got {job.keep}")
    if job.method != "cahp" and job.keep is None and job.keep_ratio is None:
        raise ValueError(
            f"--method {job.method} needs --keep N or --keep-ratio r (baselines are forced to a head count; "
            "prune-compare takes it from CAHP)"
        )
    if job.curve not in ("mss", "accuracy"):
        raise ValueError(f"--curve must be 'mss' or 'accuracy', got {job.curve!r}")
    if job.mss not in ("mean", "nearest"):
        raise ValueError(f"--mss must be 'mean' or 'nearest', got {job.mss!r}")
    if job.pool_size < 2:
        raise ValueError(f"--pool-size must be >= 2, got {job.pool_size}")
    if job.finetune_epochs < 0:
        raise ValueError(f"--finetune-epochs must be >= 0, got {job.finetune_epochs}")
    for name in ("limit_train", "limit_eval", "importance_batches"):
        v = getattr(job, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")


class _Loaded:
    """Model, tokenizer and data of a job (loaded once, shared by prune-compare's methods)."""

    def __init__(self, job: PruneJob) -> None:
        import torch

        from headbudget.pruning.finetune import load_tokenizer
        from headbudget.pruning.tasks import get_task, load_task, subsample

        t0 = time.perf_counter()
        self.spec = get_task(job.task)
        self.data = load_task(job.task, job.data_dir)
        self.device = torch.device(job.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model_path = job.model
        self.tokenizer = load_tokenizer(job.model)
        self.train = subsample(self.data.train, job.limit_train, job.seed)
        self.evals = {s: subsample(self.data.splits[s], job.limit_eval, job.seed) for s in self.data.eval_splits}
        if not self.evals:
            raise ValueError(f"task {job.task}: no evaluation split found in {job.data_dir}")
        self.primary = next(iter(self.evals))
        self.state = None  # dense weights, to restore between methods
        model = self.fresh_model(job)
        self.heads_total = sum(_adapter(model).head_counts())
        self.load_seconds = time.perf_counter() - t0
        self.dense_acc: dict[str, float] | None = None

    def fresh_model(self, job: PruneJob) -> Any:
        from headbudget.pruning.finetune import load_classifier

        model = load_classifier(self.model_path, self.spec.num_labels, self.spec.label_names, seed=job.seed)
        return model.to(self.device).eval()


def _adapter(model: Any) -> Any:
    from headbudget.pruning.adapters import get_adapter

    return get_adapter(model)


def _evaluate(model: Any, loaded: _Loaded, job: PruneJob, stage: str) -> dict[str, float]:
    from headbudget.pruning.finetune import evaluate_accuracy

    return {
        s: evaluate_accuracy(model, loaded.tokenizer, ex, 64, job.max_length, job.progress, f"{stage} {s}")
        for s, ex in loaded.evals.items()
    }


def _target_heads(job: PruneJob, heads_total: int) -> int | None:
    if job.keep is not None:
        return job.keep
    if job.keep_ratio is not None:
        return max(1, int(round(job.keep_ratio * heads_total)))
    return None


def run_prune(job: PruneJob, loaded: _Loaded | None = None) -> dict[str, Any]:
    """Select, remove, fine-tune and report one method; returns ``{"report", "details"}``."""

    from headbudget.pruning import report as rpt
    from headbudget.pruning.adapters import save_pruned
    from headbudget.pruning.cahp import cahp_select, kept_by_layer
    from headbudget.pruning.finetune import evaluate_accuracy, finetune
    from headbudget.pruning.importance import ImportanceContext, gate_mask, prune_spec, select_by_method
    from headbudget.pruning.tasks import make_loader

    _check_job(job)
    t_start = time.perf_counter()
    seconds: dict[str, float] = {}
    if loaded is None:
        loaded = _Loaded(job)
        seconds["load"] = loaded.load_seconds
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    model = loaded.fresh_model(job)
    adapter = _adapter(model)
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
    sig_batches = list(make_loader(loaded.train, loaded.tokenizer, job.batch_size, False, job.seed, job.max_length))
    imp_batches = list(make_loader(loaded.train, loaded.tokenizer, job.batch_size, True, job.seed, job.max_length))
    details: dict[str, Any] = {"model": str(job.model), "task": job.task, "primary_split": loaded.primary,
                               "train_examples": len(loaded.train),
                               "eval_examples": {s: len(v) for s, v in loaded.evals.items()}}
    knee_k, mss = None, []
    plots: list[str] = []
    t = time.perf_counter()
    if job.method == "cahp":
        accuracy_fn = accuracy_ks = None
        if job.curve == "accuracy" and target is None:
            curve_examples = loaded.evals[loaded.primary]

            def accuracy_fn(kept: list[int]) -> float:
                with adapter.set_gate_values(gate_mask(kept, counts)):
                    return evaluate_accuracy(model, loaded.tokenizer, curve_examples, 64, job.max_length, False)

            accuracy_ks = list(range(2, n_total, max(1, job.curve_step)))
        sel, secs = cahp_select(
            adapter, sig_batches, imp_batches, n_classes=loaded.spec.num_labels, grid=job.pool_size,
            keep=target, poly_degree=job.poly_degree, perplexity=job.perplexity, mss_variant=job.mss,
            seed=job.seed, salience_fraction=job.salience_fraction, accuracy_fn=accuracy_fn,
            accuracy_ks=accuracy_ks, progress=job.progress,
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
    else:
        assert target is not None
        ctx = ImportanceContext(adapter, model, imp_batches[: job.importance_batches], seed=job.seed,
                                progress=job.progress)
        kept, scores = select_by_method(job.method, ctx, target)
        seconds["select"] = time.perf_counter() - t
        if scores is not None:
            details["scores"] = scores
    kept_layers = kept_by_layer(kept, heads, len(counts))

    t = time.perf_counter()
    adapter.prune_heads(prune_spec(kept, counts))
    seconds["prune"] = time.perf_counter() - t
    if adapter.head_counts() != [len(kept_layers[layer]) for layer in range(len(counts))]:
        raise RuntimeError("pruning left unexpected head counts")
    t = time.perf_counter()
    pruned = _evaluate(model, loaded, job, "pruned")
    seconds["pruned_eval"] = time.perf_counter() - t

    finetuned: dict[str, float | None] = {s: None for s in loaded.evals}
    if job.finetune_epochs > 0:
        t = time.perf_counter()
        hist = finetune(model, loaded.tokenizer, {"train": loaded.train, **loaded.evals}, epochs=job.finetune_epochs,
                        lr=job.lr, warmup_ratio=job.warmup_ratio, weight_decay=job.weight_decay,
                        batch_size=job.batch_size, seed=job.seed, max_length=job.max_length, progress=job.progress)
        seconds["finetune"] = time.perf_counter() - t
        finetuned = dict(hist["final"])
        details["finetune_history"] = hist["epochs"]
    if job.save_model:
        t = time.perf_counter()
        save_pruned(model, out / "model", loaded.tokenizer)
        seconds["save"] = time.perf_counter() - t
    seconds["total"] = time.perf_counter() - t_start + seconds.get("load", 0.0)

    accuracy = {s: {"dense": dense[s], "pruned": pruned[s], "finetuned": finetuned.get(s)} for s in loaded.evals}
    details["accuracy"] = accuracy
    details["kept_original"] = {str(k): v for k, v in adapter.original_heads().items()}
    p = loaded.primary
    report = rpt.build_report(job.method, n_total, kept_layers, knee_k, mss,
                              {"dense": dense[p], "pruned": pruned[p], "finetuned": finetuned.get(p)}, seconds)
    plots.append(str(rpt.plot_heads_per_layer({job.method: kept_layers}, len(counts), out / "heads_per_layer.png")))
    points = {f"{job.method} pruned": [(report["heads_kept"], pruned[p])]}
    if finetuned.get(p) is not None:
        points[f"{job.method} fine-tuned"] = [(report["heads_kept"], float(finetuned[p]))]  # type: ignore[arg-type]
    curve = [(c[1], c[2]) for c in details.get("accuracy_curve") or []]
    plots.append(str(rpt.plot_accuracy_vs_heads(points, out / "accuracy_vs_heads.png", dense=(n_total, dense[p]),
                                                curve=curve or None, ylabel=f"{p} accuracy")))
    rpt.write_json(out / "report.json", report)
    rpt.write_json(out / "details.json", details)
    rpt.atomic_write_text(out / "report.md", rpt.report_markdown(report, details, plots))
    return {"report": report, "details": details}


def parse_methods(spec: str) -> list[tuple[str, str, int | None]]:
    """``"cahp@2,cahp@6,michel"`` -> ``[(label, method, poly_degree), ...]``."""
    out = []
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        method, _, deg = item.partition("@")
        if method not in METHODS:
            raise ValueError(f"--methods: unknown method {method!r} in {spec!r}; choose from {', '.join(METHODS)}")
        if deg and method != "cahp":
            raise ValueError(f"--methods: only cahp takes a polynomial degree (@d), got {item!r}")
        try:
            degree = int(deg) if deg else None
        except ValueError:
            raise ValueError(f"--methods: bad polynomial degree in {item!r}") from None
        label = f"cahp-d{degree}" if degree is not None else method
        out.append((label, method, degree))
    if not out:
        raise ValueError("--methods: no method given")
    labels = [lbl for lbl, _, _ in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--methods: repeated entry in {spec!r}")
    return out


def run_compare(job: PruneJob, methods: str) -> dict[str, Any]:
    """Run several methods at one head count (CAHP's, from the first cahp entry, unless --keep)."""
    from headbudget.pruning import report as rpt

    entries = parse_methods(methods)
    if job.keep is None and job.keep_ratio is None and entries[0][1] != "cahp":
        raise ValueError("prune-compare: without --keep/--keep-ratio the first method must be cahp (it sets the head count)")
    _check_job(replace(job, method="cahp"))
    loaded = _Loaded(job)
    out = Path(job.out)
    rows: list[dict[str, Any]] = []
    target_keep, target_ratio = job.keep, job.keep_ratio
    for label, method, degree in entries:
        sub = replace(job, method=method, out=str(out / label), keep=target_keep, keep_ratio=target_ratio,
                      poly_degree=degree if degree is not None else job.poly_degree)
        res = run_prune(sub, loaded)
        rep = res["report"]
        if target_keep is None and target_ratio is None:
            target_keep = rep["heads_kept"]
        rows.append({"label": label, "method": label, "heads_kept": rep["heads_kept"], "kept": rep["kept"],
                     "knee_k": rep["knee_k"], "accuracy": res["details"]["accuracy"], "seconds": rep["seconds"]})
    splits = list(loaded.evals)
    n_layers = len(rows[0]["kept"])
    table = rpt.compare_markdown(rows, splits)
    rpt.plot_heads_per_layer({r["label"]: r["kept"] for r in rows}, n_layers, out / "heads_per_layer.png")
    p = loaded.primary
    points = {}
    for r in rows:
        points[f"{r['label']} pruned"] = [(r["heads_kept"], r["accuracy"][p]["pruned"])]
        if r["accuracy"][p]["finetuned"] is not None:
            points[f"{r['label']} fine-tuned"] = [(r["heads_kept"], r["accuracy"][p]["finetuned"])]
    rpt.plot_accuracy_vs_heads(points, out / "accuracy_vs_heads.png",
                               dense=(loaded.heads_total, loaded.dense_acc[p]) if loaded.dense_acc else None,
                               ylabel=f"{p} accuracy")
    md = (f"# Head pruning comparison ({job.task}, {loaded.heads_total} heads)\n\n{table}\n"
          "![heads per layer](heads_per_layer.png)\n\n![accuracy vs heads](accuracy_vs_heads.png)\n")
    rpt.atomic_write_text(out / "compare.md", md)
    summary = {"task": job.task, "model": job.model, "heads_total": loaded.heads_total,
               "load_seconds": loaded.load_seconds, "rows": rows}
    rpt.write_json(out / "compare.json", summary)
    return summary


# --------------------------------------------------------------------------- argparse
def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="fine-tuned classifier folder (or wheel / pruned model)")
    p.add_argument("--task", required=True, choices=("sst5", "mnli"))
    p.add_argument("--data-dir", required=True, help="folder with the task's files")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--keep", type=int, default=None, help="force the number of heads kept (skips the knee)")
    p.add_argument("--keep-ratio", type=float, default=None, help="force the fraction of heads kept")
    p.add_argument("--poly-degree", type=int, default=6, help="Kneedle polynomial degree (lower keeps more heads)")
    p.add_argument("--pool-size", type=int, default=32, help="signature grid size B (B x B per head)")
    p.add_argument("--perplexity", type=float, default=10.0, help="t-SNE perplexity (clipped below #heads)")
    p.add_argument("--mss", choices=("mean", "nearest"), default="mean",
                   help="silhouette variant: published mean-of-other-medoids, or textbook nearest")
    p.add_argument("--curve", choices=("mss", "accuracy"), default="mss",
                   help="knee of MSS vs k (default) or of measured dev accuracy vs heads kept")
    p.add_argument("--curve-step", type=int, default=1, help="k step of the accuracy curve")
    p.add_argument("--salience-fraction", type=float, default=0.25, help="share of training batches for salience")
    p.add_argument("--importance-batches", type=int, default=None,
                   help="baselines: training batches their gradient importance uses (default all)")
    p.add_argument("--finetune-epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--warmup-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit-train", type=int, default=None, help="seeded subsample of the training split")
    p.add_argument("--limit-eval", type=int, default=None, help="seeded subsample of each eval split")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _job(args: argparse.Namespace, method: str = "cahp") -> PruneJob:
    return PruneJob(
        model=args.model, task=args.task, data_dir=args.data_dir, out=args.out, method=method, keep=args.keep,
        keep_ratio=args.keep_ratio, poly_degree=args.poly_degree, pool_size=args.pool_size,
        perplexity=args.perplexity, mss=args.mss, curve=args.curve, curve_step=args.curve_step,
        salience_fraction=args.salience_fraction, importance_batches=args.importance_batches,
        finetune_epochs=args.finetune_epochs, lr=args.lr,
        warmup_ratio=args.warmup_ratio, weight_decay=args.weight_decay, batch_size=args.batch_size,
        seed=args.seed, limit_train=args.limit_train, limit_eval=args.limit_eval, max_length=args.max_length,
        device=args.device, progress=not args.no_progress,
    )


def _cmd_finetune(args: argparse.Namespace) -> int:
    from headbudget.pruning.finetune import run_finetune

    if args.epochs < 1:
        raise ValueError(f"--epochs must be >= 1, got {args.epochs}")
    summary = run_finetune(
        args.model, args.task, args.data_dir, args.out, epochs=args.epochs, lr=args.lr,
        warmup_ratio=args.warmup_ratio, weight_decay=args.weight_decay, batch_size=args.batch_size,
        seed=args.seed, max_length=args.max_length, train_limit=args.limit_train, eval_limit=args.limit_eval,
        max_steps=args.max_steps, device=args.device, progress=not args.no_progress,
    )
    accs = ", ".join(f"{s} {a:.4f}" for s, a in summary.get("final", {}).items())
    print(f"fine-tuned {args.model} on {args.task}: {accs}; saved to {args.out}")
    return 0


def _print_report(rep: dict[str, Any], out: str) -> None:
    m = rep["metric"]

    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.4f}"

    print(f"{rep['method']}: kept {rep['heads_kept']}/{rep['heads_total']} heads"
          + (f" (knee k={rep['knee_k']})" if rep["knee_k"] is not None else "")
          + f"; accuracy dense {f(m['dense'])}, pruned {f(m['pruned'])}, fine-tuned {f(m['finetuned'])}; "
          f"report in {out}/report.md")


def _cmd_prune(args: argparse.Namespace) -> int:
    res = run_prune(_job(args, args.method))
    _print_report(res["report"], args.out)
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    summary = run_compare(_job(args), args.methods)
    for r in summary["rows"]:
        print(f"{r['label']}: {r['heads_kept']} heads; " + ", ".join(
            f"{s} pruned {a['pruned']:.4f} fine-tuned {'-' if a['finetuned'] is None else format(a['finetuned'], '.4f')}"
            for s, a in r["accuracy"].items()))
    print(f"table in {args.out}/compare.md")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("finetune", help="fine-tune a sequence classifier (SST-5, MNLI)",
                              description="Fine-tune a classifier: AdamW, linear warmup, dynamic padding.")
    p.add_argument("model", metavar="MODEL", help="model folder, unpacked wheel, .whl or pruned model")
    p.add_argument("--task", required=True, choices=("sst5", "mnli"))
    p.add_argument("--data-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--warmup-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit-train", type=int, default=None)
    p.add_argument("--limit-eval", type=int, default=None)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_finetune)

    p = subparsers.add_parser("prune", help="prune attention heads (CAHP or a baseline), fine-tune, report",
                              description="Prune heads with CAHP or a baseline; writes the model and report.json.")
    _add_common(p)
    p.add_argument("--method", choices=METHODS, default="cahp")
    p.set_defaults(func=_cmd_prune)

    p = subparsers.add_parser("prune-compare", help="several pruning methods at one head count",
                              description="Run several methods at CAHP's head count (or --keep) and tabulate.")
    _add_common(p)
    p.add_argument("--methods", default="cahp,michel,fisher,magnitude,random",
                   help="comma list; cahp@D sets CAHP's polynomial degree (e.g. cahp@2,cahp@6,michel)")
    p.set_defaults(func=_cmd_compare)
