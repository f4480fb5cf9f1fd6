"""Evidence for low-rank head compression (docs/allocation.md): SVD (and K/V grouping) compression sweep with
the three allocations.

    python benchmarks/theory_compress.py                 # trains runs/theory_cpu_small if missing
    python benchmarks/theory_compress.py --method group
    python benchmarks/theory_compress.py --model cpu-tiny-byte   # runs/theory_cpu_tiny_byte (600 steps)

The model is the training pipeline's ``configs/cpu-small.yaml`` (6 layers x 256, uniform 4 x 64 heads,
BPE-2048) trained on tinyshakespeare.  On the shared 2-core box the full 400-step config takes ~100 min,
so this script trains it for ``--steps`` (default 150) at batch 8 (everything else as in the config).
That model is barely past unigram statistics (val loss 5.56), so its attention hardly matters; the
``cpu-tiny-byte`` model (cpu-tiny preset, byte tokenizer, context 128, 600 steps, same data) is the
one whose attention carries real signal.
Perplexity is measured on the validation split the trainer holds out (the last 5% of the text,
``headbudget.data.prepare.split_documents``), sliding window 256 / stride 128.
Writes ``benchmarks/results/theory/compress_<method>_<model>/`` (report.json, sweep.json, sweep.png, model/).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "text" / "tinyshakespeare.txt"
OUT = ROOT / "benchmarks" / "results" / "theory"


#: the models: cpu-small as the issue asks (under-trained on this box), and a byte-level cpu-tiny
#: trained long enough that its attention matters
MODELS = {
    "cpu-small": (150, ["name=theory-cpu-small-shakespeare", "train.batch_size=8", "train.eval_every=50"]),
    "cpu-tiny-byte": (600, ["name=theory-cpu-tiny-byte", "model.preset=cpu-tiny", "data.tokenizer=byte",
                            "train.context=128", "train.batch_size=16", "train.eval_every=100", "train.lr=3e-3"]),
}


def train_model(run_dir: Path, steps: int, kind: str = "cpu-small") -> Path:
    import torch

    from headbudget.train import load_config, train

    torch.set_num_threads(1)  # a script, not the library: one thread is fastest on the shared box
    cfg = load_config(str(ROOT / "configs" / "cpu-small.yaml"), [
        f"data.source={DATA}", f"train.steps={steps}", f"train.warmup_steps={max(1, steps // 20)}",
        "train.ckpt_every=100000", *MODELS[kind][1],
    ])
    t = time.perf_counter()
    res = train(cfg, str(run_dir))
    print(f"trained {steps} steps in {time.perf_counter() - t:.0f} s, final val loss {res.final_val_loss:.4f}")
    return run_dir / "model"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", choices=sorted(MODELS), default="cpu-small")
    ap.add_argument("--run", default=None, help="run dir (default runs/theory_<model>)")
    ap.add_argument("--steps", type=int, default=None, help="training steps if the model must be trained")
    ap.add_argument("--method", choices=["svd", "group"], default="svd")
    ap.add_argument("--sweep", default="0.25,0.5,0.75")
    ap.add_argument("--max-windows", type=int, default=None)
    args = ap.parse_args()
    if not DATA.is_file():
        raise SystemExit(f"missing {DATA}")
    run = Path(args.run or ROOT / "runs" / f"theory_{args.model.replace('-', '_')}")
    model_dir = run / "model"
    if not (model_dir / "config.json").is_file():
        model_dir = train_model(run, args.steps or MODELS[args.model][0], args.model)

    from headbudget.compression.job import CompressJob
    from headbudget.compression.pipeline import format_report, run_compress
    from headbudget.data.prepare import split_documents
    from headbudget.io import atomic_write_text

    _, val = split_documents([DATA.read_text(encoding="utf-8")], 0.05)
    val_file = ROOT / "runs" / "theory_tinyshakespeare_val.txt"  # runs/ is git-ignored: no data copies
    atomic_write_text(val_file, val[0])
    sweep = [float(x) for x in args.sweep.split(",")]
    t = time.perf_counter()
    context = 256 if args.model == "cpu-small" else 128
    out = OUT / f"compress_{args.method}_{args.model}"
    report = run_compress(CompressJob(str(model_dir), str(out), method=args.method, keep_ratio=0.5,
                                      allocation="later_layers_first", data=str(val_file), sweep=tuple(sweep),
                                      context=context, stride=context // 2, max_windows=args.max_windows), threads=1)
    print(format_report(report))
    print(f"sweep took {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
