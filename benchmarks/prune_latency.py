"""Dense vs pruned forward latency of a classifier (the speedup of head removal).

    python benchmarks/prune_latency.py --dense runs/ft --pruned runs/cahp/model \\
        --batch-size 32 --seq-len 64 --repeats 20 --out runs/cahp/latency.json

Both models get the same random token batch (fixed seed); the median wall time of ``--repeats``
forward passes (after ``--warmup``) is reported, plus parameter counts and attention heads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch


def _load(path: str, num_labels: int) -> Any:
    from headbudget.loading import load_model

    return load_model(path, "classifier", num_labels=num_labels)


@torch.no_grad()
def time_forward(model: Any, batch: dict[str, torch.Tensor], repeats: int = 20, warmup: int = 3) -> list[float]:
    """Seconds of each of ``repeats`` forward passes (after ``warmup`` untimed ones)."""
    for _ in range(warmup):
        model(**batch)
    times = []
    for _ in range(repeats):
        if batch["input_ids"].is_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        model(**batch)
        if batch["input_ids"].is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def measure(dense_path: str, pruned_path: str, num_labels: int = 5, batch_size: int = 32, seq_len: int = 64,
            repeats: int = 20, warmup: int = 3, seed: int = 0, device: str = "cpu") -> dict[str, Any]:
    """Median forward latency of both models and the speedup dense / pruned.

    The two models' passes are *interleaved* (dense, pruned, dense, ...) so that load from other
    processes on a shared machine hits both alike.
    """
    from headbudget.models.surgery import get_adapter

    models = {"dense": _load(dense_path, num_labels).to(device), "pruned": _load(pruned_path, num_labels).to(device)}
    vocab = int(models["dense"].config.vocab_size)
    ids = torch.randint(5, vocab, (batch_size, seq_len), generator=torch.Generator().manual_seed(seed)).to(device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    for m in models.values():
        time_forward(m, batch, repeats=0, warmup=warmup)
    times: dict[str, list[float]] = {"dense": [], "pruned": []}
    for _ in range(repeats):
        for name, m in models.items():
            times[name] += time_forward(m, batch, repeats=1, warmup=0)
    out: dict[str, Any] = {"batch_size": batch_size, "seq_len": seq_len, "repeats": repeats, "device": device,
                           "threads": torch.get_num_threads()}
    for name, path in (("dense", dense_path), ("pruned", pruned_path)):
        out[name] = {
            "path": path,
            "median_ms": 1000 * statistics.median(times[name]),
            "min_ms": 1000 * min(times[name]),
            "params": sum(p.numel() for p in models[name].parameters()),
            "heads": sum(get_adapter(models[name]).head_counts()),
        }
    out["speedup"] = out["dense"]["median_ms"] / out["pruned"]["median_ms"]
    out["speedup_min"] = out["dense"]["min_ms"] / out["pruned"]["min_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dense", required=True)
    p.add_argument("--pruned", required=True)
    p.add_argument("--num-labels", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    res = measure(args.dense, args.pruned, args.num_labels, args.batch_size, args.seq_len, args.repeats,
                  args.warmup, device=args.device)
    print(f"dense {res['dense']['heads']} heads {res['dense']['median_ms']:.1f} ms; "
          f"pruned {res['pruned']['heads']} heads {res['pruned']['median_ms']:.1f} ms; "
          f"speedup x{res['speedup']:.3f} (best-of x{res['speedup_min']:.3f}; batch {args.batch_size} x {args.seq_len}, {args.device})")
    if args.out:
        from headbudget.pruning.report import write_json

        write_json(Path(args.out), res)
    else:
        print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
