"""Evidence: CAHP's signature pass, per-batch (``legacy=True``) vs regrouped by length, interleaved.

    python benchmarks/signature_speed.py --n 1000 --repeats 2 --threads 1 --bf16 --select

Both paths run in one process on the same batches (the pipeline's: SST-5 train in file order,
batch 32, max length 64, dynamic padding), alternating which goes first in each repeat, so the
background load of a shared CPU hits both alike.  The table gives each path's median seconds and
per-example time; the median over repeats of each repeat's new/old ratio is applied to the full
recipe's measured 126.5 s (published code: 166 s) to estimate the new ratio to the published time --
an estimate, stated as such (``--n 8544`` is the full recipe's data itself).
``--select`` also runs CAHP's selection (t-SNE, k-medoids sweep, knee; salience computed once on
the first 25% of the subset and shared) on every path's JM features and reports the kept heads.
Without a fine-tuned checkpoint the classifier head is freshly initialised (seed 0): attention maps
do not depend on it, the salience does, identically for all paths.  ``--bf16`` also times the
regrouped path under bfloat16 autocast, which headbudget does not offer: it moves the JM features by
~0.04 and the knee with them (CAHP's knee here moves under 1e-7 relative changes of the features).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
FULL_RECIPE_LEGACY_S = 126.5  # benchmarks/RESULTS.md, CAHP full recipe, one thread
PUBLISHED_S = 166.0


def run_signatures(adapter, batches, n_classes: int, *, legacy: bool, bf16: bool):
    from headbudget.pruning.signatures import collect_signatures

    device = next(adapter.model.parameters()).device

    def attention(b):  # cahp.model_signatures' call: the batch minus labels
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return adapter.attention_probs(**{k: v.to(device) for k, v in b.items() if k != "labels"})

    t0 = time.perf_counter()
    sig = collect_signatures(attention, batches, adapter.head_counts(), n_classes, grid=32, progress=False,
                             total=len(batches), legacy=legacy)
    return sig, time.perf_counter() - t0


def compare(ref, sig) -> dict:
    """Largest differences of the per-class means, variances and JM features against the reference."""
    f_ref, f_new = ref.features(), sig.features()
    return {
        "mean_max_abs": float((sig.mean - ref.mean).abs().max()),
        "var_max_abs": float((sig.var - ref.var).abs().max()),
        "var_max_rel_above_floor": float(((sig.var - ref.var).abs() / ref.var.clamp(min=1e-6)).max()),
        "jm_max_abs": float(abs(f_new - f_ref).max()),
        "counts_equal": bool(torch.equal(sig.count, ref.count)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="all-MiniLM-L6-v2 folder (or a fine-tuned copy)")
    p.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "classification" / "sst5"))
    p.add_argument("--n", type=int, default=1000, help="first N training sentences")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bf16", action="store_true",
                   help="also time the regrouped path under bfloat16 autocast (not offered by headbudget: it moves the knee)")
    p.add_argument("--select", action="store_true", help="compare CAHP's kept heads and knee across paths")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "signature_speed.json"))
    args = p.parse_args(argv)

    from headbudget.data.classification import load_task, make_loader
    from headbudget.io import atomic_write_json
    from headbudget.loading import load_model_and_tokenizer
    from headbudget.models.surgery import get_adapter

    if not Path(args.model).exists():
        print(f"error: --model {args.model}: no such folder", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(args.model, "classifier", num_labels=5)
    model.eval()
    adapter = get_adapter(model)
    train = load_task("sst5", args.data_dir, splits=["train"]).train[: args.n]
    batches = list(make_loader(train, tok, args.batch_size, False, 0, args.max_length))
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    padded = sum(int(b["attention_mask"].numel()) for b in batches)

    paths = {"legacy": dict(legacy=True, bf16=False), "by-length": dict(legacy=False, bf16=False)}
    if args.bf16:
        paths["by-length bf16"] = dict(legacy=False, bf16=True)
    secs: dict[str, list[float]] = {k: [] for k in paths}
    sigs = {}
    names = list(paths)
    for r in range(args.repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            sigs[name], s = run_signatures(adapter, batches, 5, **paths[name])
            secs[name].append(s)
            print(f"repeat {r}: {name:15s} {s:7.2f} s", flush=True)

    rows = []
    for name in names:
        med = statistics.median(secs[name])
        # paired: each repeat's time over the legacy time of the same repeat (back to back, so a burst of
        # background load hits both), then the median over repeats
        ratio = statistics.median(s / ref for s, ref in zip(secs[name], secs["legacy"]))
        est = FULL_RECIPE_LEGACY_S * ratio
        rows.append({"path": name, "seconds": secs[name], "median_s": med, "ms_per_example": 1000 * med / len(train),
                     "ratio_to_legacy": ratio, "est_full_recipe_s": est, "est_ratio_to_published": est / PUBLISHED_S,
                     "vs_legacy": compare(sigs["legacy"], sigs[name])})

    if args.select:
        from headbudget.pruning.cahp import select_heads
        from headbudget.pruning.importance import default_loss, salience

        sal = salience(adapter, model, batches, default_loss, fraction=0.25, progress=False)
        for row in rows:
            sig = sigs[row["path"]]
            sel = select_heads(sig.features(), sig.heads, sal, poly_degree=6, seed=42)
            row["knee_k"] = int(sel.knee_k)
            row["kept"] = [list(sig.heads[i]) for i in sel.kept]
        for row in rows:
            row["same_kept_as_legacy"] = row["kept"] == rows[0]["kept"] and row["knee_k"] == rows[0]["knee_k"]

    print(f"\n{len(train)} SST-5 train sentences, {len(batches)} batches of {args.batch_size}, max length "
          f"{args.max_length}, {args.threads} thread(s); real tokens {real} of {padded} padded")
    print("| path | median s | ms/example | x legacy | est. full recipe s | x published (166 s) | max |JM diff| |"
          + (" knee | same heads |" if args.select else ""))
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|---|" if args.select else ""))
    for row in rows:
        line = (f"| {row['path']} | {row['median_s']:.2f} | {row['ms_per_example']:.2f} | {row['ratio_to_legacy']:.3f} | "
                f"{row['est_full_recipe_s']:.1f} | {row['est_ratio_to_published']:.3f} | {row['vs_legacy']['jm_max_abs']:.2e} |")
        if args.select:
            line += f" {row['knee_k']} | {row['same_kept_as_legacy']} |"
        print(line)
    out = {"command": "python benchmarks/signature_speed.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "model": args.model, "n_examples": len(train), "batches": len(batches), "batch_size": args.batch_size,
           "max_length": args.max_length, "threads": args.threads, "real_tokens": real, "padded_tokens": padded,
           "full_recipe_legacy_s": FULL_RECIPE_LEGACY_S, "published_s": PUBLISHED_S,
           "estimate": "est_full_recipe_s = 126.5 s x median over repeats of (new s / legacy s of the same repeat)", "rows": rows}
    atomic_write_json(args.out, out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
