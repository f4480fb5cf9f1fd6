"""``headbudget finetune``, ``headbudget prune`` and ``headbudget prune-compare``.

    headbudget finetune MODEL --task sst5 --data-dir ../shared/data/classification/sst5 --out runs/ft
    headbudget prune runs/ft --task sst5 --data-dir ../shared/data/classification/sst5 \\
        --method cahp --poly-degree 6 --out runs/cahp
    headbudget prune-compare runs/ft --task sst5 --data-dir ../shared/data/classification/sst5 \\
        --methods cahp@2,cahp@6,michel,fisher,magnitude,random --out runs/compare

    # causal LMs, label-free (metric: held-out perplexity, lower is better)
    headbudget prune runs/prism --task lm --data ../shared/data/text/tinyshakespeare.txt \
        --method cahp --keep 12 --out runs/cahp-lm

Flags only: the pipelines are :mod:`headbudget.pruning.pipeline` (prune, prune-compare) and
:func:`headbudget.pruning.finetune.run_finetune`.  ``prune`` writes ``OUT/model`` (opens with
:func:`headbudget.loading.load_model`; a pruned decoder is a plain headbudget checkpoint),
``OUT/report.json``, ``OUT/details.json``, ``OUT/report.md`` and plots.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

from headbudget.cli.model_flags import add_device_flag, add_dtype_flag
from headbudget.pruning.compare import run_compare
from headbudget.pruning.pipeline import METHODS, PruneJob, run_prune
from headbudget.run_dir import claim_output_dir


# --------------------------------------------------------------------------- argparse
def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help="fine-tuned classifier folder (or wheel / pruned model); with --task lm a causal LM "
                        "folder, a `headbudget train` run folder or a GGUF file")
    p.add_argument("--task", required=True, choices=("sst5", "mnli", "lm"),
                   help="classification task, or lm: label-free pruning of a causal LM (metric: perplexity)")
    p.add_argument("--data-dir", default=None, help="sst5/mnli: folder with the task's files")
    p.add_argument("--data", default=None, help="lm: text file (calibration windows + held-out tail)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer instead of the model's own (a folder, byte, gpt2[:DIR], hf:NAME)")
    p.add_argument("--context", type=int, default=128, help="lm: window length in tokens")
    p.add_argument("--calib-windows", type=int, default=32, help="lm: calibration windows (signatures, salience)")
    p.add_argument("--heldout-fraction", type=float, default=0.1,
                   help="lm: share of the text's tokens (its end) held out for perplexity")
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
    p.add_argument("--salience-fraction", type=float, default=0.25,
                   help="share of the training set for salience (first int(f*n) examples, file order)")
    p.add_argument("--salience-order", choices=("file", "shuffled"), default="file",
                   help="salience data: the first examples in file order (published code) or the first "
                        "batches of the seeded shuffle")
    p.add_argument("--legacy-signatures", action="store_true",
                   help="population variance, var + 1e-10 (no 1e-6 floor) and float64 t-SNE instead of the "
                        "published code's sample variance, max(var, 1e-6) and float32")
    p.add_argument("--representative", choices=("salience", "fisher"), default=None,
                   help="cahp: the score that picks each cluster's head (default: salience for sst5/mnli, "
                        "fisher for lm)")
    p.add_argument("--allocation", choices=("cluster", "importance"), default=None,
                   help="cahp: one head per cluster (published; default for sst5/mnli) or the head count "
                        "spread over --clusters clusters by summed importance (default for lm)")
    p.add_argument("--clusters", type=int, default=None,
                   help="cahp --allocation importance: number of clusters (default 30)")
    p.add_argument("--importance-batches", type=int, default=None,
                   help="baselines: training batches their gradient importance uses (default all)")
    p.add_argument("--gate-lr", type=float, default=0.5,
                   help="pipelined-dsp / joint-dsp / pass: learning rate of the head logits (published: 0.5)")
    p.add_argument("--gate-epochs", type=int, default=1,
                   help="pipelined-dsp / joint-dsp / pass: passes over the training batches for gate training")
    p.add_argument("--gate-cooldown", type=int, default=None,
                   help="pipelined-dsp / joint-dsp: steps to anneal the temperature 1000 -> 1e-8 (default: the "
                        "published SST-5 setting, 90 pipelined / 270 joint)")
    p.add_argument("--attattr-examples", type=int, default=200,
                   help="attattr: first N examples of the primary evaluation split (published: 200)")
    p.add_argument("--attattr-steps", type=int, default=20,
                   help="attattr: integrated-gradients steps (published: 20)")
    p.add_argument("--granularity", choices=("head", "group", "balanced"), default="head",
                   help="grouped-query models: any query heads (head), whole kv groups so the KV cache shrinks "
                        "(group), or the same number of query heads per kv head in a layer (balanced)")
    p.add_argument("--finetune-epochs", type=int, default=None,
                   help="recovery fine-tuning epochs (default 3; 0 for --task lm, where an epoch is one pass "
                        "over the calibration windows)")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--warmup-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--knee-warn-ratio", type=float, default=2.0,
                   help="--task lm, knee-chosen count: warn when pruned perplexity exceeds this x dense (0: off)")
    p.add_argument("--limit-train", type=int, default=None, help="seeded subsample of the training split")
    p.add_argument("--limit-eval", type=int, default=None,
                   help="seeded subsample of each eval split (lm: at most N held-out windows)")
    add_device_flag(p)
    add_dtype_flag(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results of an earlier run in --out (without it such a folder is refused)")


def _job(args: argparse.Namespace, method: str = "cahp") -> PruneJob:
    return PruneJob(
        model=args.model, task=args.task, data_dir=args.data_dir, out=args.out, method=method, keep=args.keep,
        keep_ratio=args.keep_ratio, poly_degree=args.poly_degree, pool_size=args.pool_size,
        perplexity=args.perplexity, mss=args.mss, curve=args.curve, curve_step=args.curve_step,
        salience_fraction=args.salience_fraction, importance_batches=args.importance_batches,
        finetune_epochs=(args.finetune_epochs if args.finetune_epochs is not None
                         else (0 if args.task == "lm" else 3)), lr=args.lr,
        warmup_ratio=args.warmup_ratio, weight_decay=args.weight_decay, batch_size=args.batch_size,
        seed=args.seed, limit_train=args.limit_train, limit_eval=args.limit_eval, max_length=args.max_length,
        device=args.device, dtype=args.dtype, progress=not args.no_progress, data=args.data, tokenizer=args.tokenizer,
        context=args.context, calib_windows=args.calib_windows, heldout_fraction=args.heldout_fraction,
        salience_order=args.salience_order,
        knee_warn_ratio=args.knee_warn_ratio, representative=args.representative, allocation=args.allocation,
        n_clusters=args.clusters, gate_lr=args.gate_lr, gate_epochs=args.gate_epochs,
        gate_cooldown=args.gate_cooldown, attattr_examples=args.attattr_examples, attattr_steps=args.attattr_steps,
        granularity=args.granularity,
        **(dict(ddof=0, var_floor=None, var_eps=1e-10, tsne_dtype="float64") if args.legacy_signatures else {}),
    )


def _cmd_finetune(args: argparse.Namespace) -> int:
    from headbudget.pruning.finetune import run_finetune

    if args.epochs < 1:
        raise ValueError(f"--epochs must be >= 1, got {args.epochs}")
    with claim_output_dir(args.out, command="headbudget finetune", overwrite=args.overwrite):
        summary = run_finetune(
            args.model, args.task, args.data_dir, args.out, epochs=args.epochs, lr=args.lr,
            warmup_ratio=args.warmup_ratio, weight_decay=args.weight_decay, batch_size=args.batch_size,
            seed=args.seed, max_length=args.max_length, train_limit=args.limit_train, eval_limit=args.limit_eval,
            max_steps=args.max_steps, device=args.device, progress=not args.no_progress,
        )
    accs = ", ".join(f"{s} {a:.4f}" for s, a in summary.get("final", {}).items())
    print(f"fine-tuned {args.model} on {args.task}: {accs}; saved to {args.out}")
    return 0


def _print_report(rep: dict[str, Any], out: str, metric_name: str = "accuracy") -> None:
    m = rep["metric"]

    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.4f}"

    print(f"{rep['method']}: kept {rep['heads_kept']}/{rep['heads_total']} heads"
          + (f" (knee k={rep['knee_k']})" if rep["knee_k"] is not None else "")
          + f"; {metric_name} dense {f(m['dense'])}, pruned {f(m['pruned'])}, fine-tuned {f(m['finetuned'])}; "
          f"report in {out}/report.md")
    cost = rep.get("cost") or {}
    sizes = [f"{label} {cost[key]['before']:,} -> {cost[key]['after']:,}"
             for key, label in (("params", "params"), ("flops_per_token", "FLOPs/token"),
                                ("kv_cache_bytes_per_token", "KV-cache bytes/token")) if key in cost]
    if sizes:
        print("  " + "; ".join(sizes))


def _cmd_prune(args: argparse.Namespace) -> int:
    job = _job(args, args.method)
    with claim_output_dir(args.out, command="headbudget prune", overwrite=args.overwrite):
        res = run_prune(job)
    if res["report"].get("warning"):
        print(f"warning: {res['report']['warning']}", file=sys.stderr)
    _print_report(res["report"], args.out, res["details"].get("metric_name", "accuracy"))
    return 0


def _comma_list(flag: str, raw: str | None, cast: Any = str) -> list[Any] | None:
    if raw is None:
        return None
    items = [x.strip() for x in raw.split(",") if x.strip()]
    if not items:
        raise ValueError(f"{flag} {raw!r}: empty list")
    try:
        return [cast(x) for x in items]
    except ValueError:
        raise ValueError(f"{flag} {raw!r}: not a comma list of integers") from None


def _cmd_compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from headbudget.pruning.workloads import eval_text_name

    eval_data = _comma_list("--eval-data", args.eval_data) or []
    seeds = _comma_list("--calibration-seeds", args.calibration_seeds, int)
    if (eval_data or seeds is not None) and args.task != "lm":
        raise ValueError(f"--eval-data / --calibration-seeds score and calibrate LMs: they need --task lm, "
                         f"not {args.task}")
    for path in eval_data:
        if not Path(path).is_file():
            raise FileNotFoundError(f"--eval-data: no file {path}")
    names = [eval_text_name(p) for p in eval_data]
    if len(set(names)) != len(names) or "heldout" in names:
        raise ValueError(f"--eval-data {args.eval_data!r}: two texts share a name (file stem) or one is named "
                         "'heldout'")
    if seeds is not None and len(set(seeds)) != len(seeds):
        raise ValueError(f"--calibration-seeds {args.calibration_seeds!r}: repeated seed")
    job = replace(_job(args), eval_data=tuple(eval_data))
    with claim_output_dir(args.out, command="headbudget prune-compare", resume=args.resume,
                          overwrite=args.overwrite):
        summary = run_compare(job, args.methods, resume=args.resume, calibration_seeds=seeds,
                              ranking_rule=args.ranking_rule)
    if seeds is not None:
        for stage, rank in summary["ranking"].items():
            lines = [f"{lbl}: " + ", ".join(f"{t} {a['mean']:.4f} ± {a['std']:.4f}" for t, a in d.items())
                     for lbl, d in summary["aggregate"][stage].items()]
            print(f"{stage} ({len(seeds)} calibration seeds, mean ± std):\n  " + "\n  ".join(lines))
            print(f"ranking ({stage}, rule {rank['rule']}): {rank['label']}")
        print(f"table in {args.out}/compare.md")
        return 0
    for r in summary["rows"]:
        if r.get("warning"):
            print(f"warning: {r['label']}: {r['warning']}", file=sys.stderr)
        print(f"{r['label']}: {r['heads_kept']} heads; " + ", ".join(
            f"{s} pruned {a['pruned']:.4f} fine-tuned {'-' if a['finetuned'] is None else format(a['finetuned'], '.4f')}"
            for s, a in r["metric"].items()))
        kv = (r.get("cost") or {}).get("kv_cache_bytes_per_token")
        if kv:
            c = r["cost"]
            print(f"  params {c['params']['before']:,} -> {c['params']['after']:,}; FLOPs/token "
                  f"{c['flops_per_token']['before']:,} -> {c['flops_per_token']['after']:,}; KV-cache bytes/token "
                  f"{kv['before']:,} -> {kv['after']:,}")
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
    add_device_flag(p)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results of an earlier run in --out (without it such a folder is refused)")
    p.set_defaults(func=_cmd_finetune)

    p = subparsers.add_parser("prune", help="prune attention heads (CAHP or a baseline), fine-tune, report",
                              description="Prune heads with CAHP or a baseline; writes the model and report.json.")
    _add_common(p)
    p.add_argument("--method", choices=METHODS, default="cahp")
    p.set_defaults(func=_cmd_prune)

    p = subparsers.add_parser("prune-compare", help="several pruning methods, one table",
                              description="Run several methods and tabulate: each cahp@d finds its own knee, each "
                                          "baseline takes the count of the nearest cahp entry before it (or --keep).")
    _add_common(p)
    p.add_argument("--methods", default="cahp,michel,fisher,magnitude,random",
                   help="comma list; cahp@D sets CAHP's polynomial degree (e.g. cahp@2,cahp@6,michel)")
    p.add_argument("--resume", action="store_true",
                   help="reuse every method already finished in --out with the same settings; run the rest")
    p.add_argument("--eval-data", default=None,
                   help="lm: comma list of more held-out text files, each scored by perplexity (at most "
                        "--limit-eval windows) and named by its file stem in the table")
    p.add_argument("--calibration-seeds", default=None,
                   help="lm: comma list of seeds, e.g. 0,1,2: the comparison once per seed (calibration windows "
                        "drawn with it, in OUT/seed<s>), then mean, std and min-max per method and text and a "
                        "ranking that names a method only if it is best on every text")
    p.add_argument("--ranking-rule", choices=("mean", "range"), default="mean",
                   help="with --calibration-seeds: best = better mean on every text (mean), or worst seed better "
                        "than every other method's best seed on every text (range)")
    p.set_defaults(func=_cmd_compare)
