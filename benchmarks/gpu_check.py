"""One prepared GPU check (fits in 8 minutes on one H200): throughput, MFU and memory of gpt2-124m uniform
vs prism, then short uniform / prism / uniform@128 training runs with validation loss.

    python benchmarks/gpu_check.py                         # one GPU; writes benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --smoke                 # seconds on CPU at tiny size (what the tests run)
    python benchmarks/gpu_check.py --budget-s 300 --batch-size 8 --peak-tflops 989

Part 1, throughput: gpt2-124m (12 x 768, vocab 50304), context 1024, bf16 autocast, ``torch.compile``,
fused AdamW; each schedule is built, compiled and warmed up alone, then timed for ``--steps`` training
steps (forward + backward + optimizer step on random tokens; median step time).  The step is the
trainer's own (``Trainer.compute_loss`` on ``build_model``), so the training runs of part 2 reuse the
compiled kernels from inductor's cache.  MFU = 3 x forward FLOPs per token (``headbudget.accounting``:
every linear layer and the output head, attention at the full context, no causal discount) x tokens/s /
the device's dense bf16 peak (989 TFLOP/s for H100/H200 SXM; ``--peak-tflops`` for others).

Part 2, training: ``headbudget.train.compare.run_compare`` of uniform, prism and the wide-head control
uniform@128 (at CPU scale the all-wide control matches or beats prism, so it must be in the comparison)
on the largest text corpus under ``--data-dir`` (GPT-2 BPE from its ``tokenizers/gpt2``), one seed,
identical batches; the number of steps is sized from part 1's tokens/s to the time left.

Goals on the GPU: prism / uniform tokens/s >= 0.98 and MFU >= 45%.  Prints a table and writes JSON
(``meta``, ``throughput``, ``prism_over_uniform``, ``training``, ``goals``, ``wall_s``).
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from headbudget.accounting import flops_per_token
from headbudget.io import atomic_write_json
from headbudget.threads import configure_threads
from headbudget.train import Trainer, build_model
from headbudget.train.compare import run_compare
from headbudget.train.config import (
    CompareConfig,
    RunConfig,
    apply_overrides,
    load_config,
    resolve_config_path,
)
from headbudget.train.loop import TrainLoop, param_groups
from headbudget.train.memory import PeakMemory
from headbudget.train.setup import build_schedule

ROOT = Path(__file__).resolve().parents[1]
#: dense bf16 tensor-core peaks (FLOP/s) by a substring of torch.cuda.get_device_name()
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}
SCHEDULES = ("uniform", "prism", "uniform@128")
SMOKE_SCHEDULES = ("uniform", "prism", "uniform@32")  # the smoke model is 64 wide: its widest prism head

#: --smoke: the same code path at a size that runs in seconds on a CPU
SMOKE_MODEL = ["model.n_layers=3", "model.d_model=64", "model.n_heads=2", "model.prism_max_head_dim=32",
               "model.prism_min_head_dim=8", "model.vocab_size=320", "model.n_positions=64"]


def base_config(args: argparse.Namespace) -> RunConfig:
    cfg = load_config(resolve_config_path("gpt2-124m"))
    over = [f"train.context={args.context}", "train.grad_accum=1", "train.ckpt_every=0", "train.progress=false",
            f"train.compile={str(args.compile).lower()}", f"train.precision={args.precision}",
            f"train.device={args.device}"]
    if args.smoke:
        over += SMOKE_MODEL
    return apply_overrides(cfg, over)


def peak_flops(args: argparse.Namespace, device: torch.device) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def throughput(cfg: RunConfig, schedule: str, args: argparse.Namespace, device: torch.device,
               peak: float | None) -> dict[str, Any]:
    """Median training-step time of one schedule, built and measured alone (its own peak memory)."""
    cfg = cfg.replace(model={"schedule": schedule})
    vocab, ctx, bs = cfg.model.vocab_size, cfg.train.context, args.batch_size
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with PeakMemory(device) as mem:
        model = build_model(cfg, vocab).to(device).train()
        n_params = sum(p.numel() for p in model.parameters())
        decay = {n for n, p in model.named_parameters() if p.dim() >= 2}
        opt = torch.optim.AdamW(param_groups(model, 0.1, decay), lr=1e-4, fused=device.type == "cuda")
        fwd = torch.compile(model) if args.compile else model
        use_bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")
        x = torch.randint(0, vocab, (bs, ctx + 1), device=device)
        # the training loop's own step (TrainLoop), on one batch over and over
        loop = TrainLoop(model, opt, lambda b: Trainer.compute_loss(fwd, b[:, :-1], b[:, 1:]),
                         autocast=torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16))
        batches = itertools.repeat(x)

        def step() -> float:
            _sync(device)
            t0 = time.perf_counter()
            loop.step(batches, 0, need_norm=False)
            _sync(device)
            return time.perf_counter() - t0

        t0 = time.perf_counter()
        for _ in range(args.warmup):  # compiles on the first call
            step()
        warmup_s = time.perf_counter() - t0
        times = [step() for _ in range(args.steps)]
    med = statistics.median(times)
    tps = bs * ctx / med
    fwd_flops = int(flops_per_token(build_schedule(cfg), vocab, ctx)["total"])
    return {"schedule": schedule, "params": n_params, "batch_size": bs, "context": ctx,
            "precision": "bf16" if use_bf16 else "fp32", "compile": args.compile, "warmup_s": warmup_s,
            "step_s_median": med, "tokens_per_s": tps, "fwd_flops_per_token": fwd_flops,
            "mfu": (3 * fwd_flops * tps / peak) if peak else None, "peak_memory_mb": mem.peak_mb}


def largest_corpus(data_dir: Path) -> Path | None:
    files = [p for p in (data_dir / "text").glob("*") if p.is_file()] if (data_dir / "text").is_dir() else []
    return max(files, key=lambda p: p.stat().st_size) if files else None


def training(cfg: RunConfig, args: argparse.Namespace, seconds: float, tokens_per_s: float,
             out: Path) -> dict[str, Any]:
    """uniform / prism / uniform@128 on the largest local corpus, steps sized to ``seconds``."""
    corpus = None if args.smoke else largest_corpus(Path(args.data_dir))
    gpt2_dir = Path(args.data_dir) / "tokenizers" / "gpt2"
    if corpus is not None:
        source = str(corpus)
        tokenizer = f"gpt2:{gpt2_dir}" if (gpt2_dir / "encoder.json").is_file() else "bpe:8192"
        split_blank = True  # documents separated by blank lines (movie_reviews); one file otherwise
    else:
        source, tokenizer, split_blank = "synthetic:20000", "byte", False
    schedules = SMOKE_SCHEDULES if args.smoke else SCHEDULES
    tokens_per_step = args.train_batch_size * cfg.train.context
    per_run = seconds / len(schedules)
    # a run also compiles (cached from part 1 for uniform/prism) and evaluates: keep 1/3 of it for that
    steps = max(args.min_train_steps, int(per_run * 2 / 3 * tokens_per_s / tokens_per_step))
    steps = min(steps, args.max_train_steps)
    run_cfg = apply_overrides(cfg, [
        f"data.source={source}", f"data.tokenizer={tokenizer}", "data.max_chars=null", "data.val_fraction=0.05",
        f"data.split_blank_lines={str(split_blank).lower()}", f"data.cache_dir={out / 'data-cache'}",
        f"train.steps={steps}", f"train.batch_size={args.train_batch_size}",
        f"train.warmup_steps={max(1, steps // 10)}", f"train.eval_every={steps}", "train.eval_batches=8",
        f"train.eval_batch_size={args.train_batch_size}", f"train.log_every={max(1, steps // 10)}",
        f"train.lr={args.lr}",
    ])
    t0 = time.perf_counter()
    settings = CompareConfig.from_run(run_cfg, schedules=";".join(schedules), seeds=1, save_models=False)
    summary = run_compare(settings, out / "compare", plot=False)
    runs = [{k: r[k] for k in ("schedule", "params", "heads", "final_val_loss", "final_train_loss",
                               "tokens_per_s", "peak_memory_mb", "wall_s")} for r in summary["runs"]]
    return {"corpus": source, "tokenizer": tokenizer, "steps": steps, "batch_size": args.train_batch_size,
            "tokens": steps * tokens_per_step, "runs": runs, "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, seconds (checks the script runs)")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu")
    ap.add_argument("--budget-s", type=float, default=None, help="total wall-clock budget in seconds (480; smoke 20)")
    ap.add_argument("--batch-size", type=int, default=None, help="throughput batch in sequences (16; smoke 2)")
    ap.add_argument("--context", type=int, default=None, help="context length (1024; smoke 64)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per schedule (20; smoke 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first, compile included (3; smoke 1)")
    ap.add_argument("--precision", default="bf16", help="bf16 (autocast) or fp32")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile (default on; off with --smoke, where compiling would dominate)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: known GPUs)")
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--train-batch-size", type=int, default=None, help="training runs' batch (32; smoke 2)")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--min-train-steps", type=int, default=None, help="(20; smoke 3)")
    ap.add_argument("--max-train-steps", type=int, default=None, help="(2000; smoke 6)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_check.json"))
    args = ap.parse_args(argv)
    small = args.smoke
    defaults = {"batch_size": (16, 2), "context": (1024, 64), "steps": (20, 2), "warmup": (3, 1),
                "train_batch_size": (32, 2), "min_train_steps": (20, 3), "compile": (True, False),
                "budget_s": (480.0, 20.0), "max_train_steps": (2000, 6)}
    for k, (gpu, smoke) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, smoke if small else gpu)
    if small and args.device == "auto":
        args.device = "cpu"
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    args.device = device.type
    if device.type == "cpu":  # idle cores only: oversubscribed threads distort CPU timings badly
        configure_threads(None)
    if device.type != "cuda" and not small:
        print("gpu_check: no CUDA device; the figures below are CPU figures (use --smoke for a quick check)",
              file=sys.stderr)
    t_start = time.perf_counter()
    cfg = base_config(args)
    peak = peak_flops(args, device)
    rows = [throughput(cfg, s, args, device, peak) for s in ("uniform", "prism")]
    ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    print(f"{'schedule':<10} {'params':>12} {'step s':>8} {'tokens/s':>12} {'MFU':>7} {'peak MB':>10} {'warmup s':>9}")
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(f"{r['schedule']:<10} {r['params']:>12,} {r['step_s_median']:>8.4f} {r['tokens_per_s']:>12,.0f} "
              f"{mfu:>7} {r['peak_memory_mb']:>10,.0f} {r['warmup_s']:>9.1f}")
    print(f"prism / uniform tokens/s: {ratio:.3f}")

    left = args.budget_s - (time.perf_counter() - t_start) - (5 if small else 30)  # margin for eval + writing
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        train = training(cfg, args, max(left, 1.0), rows[0]["tokens_per_s"], Path(tmp))
    print(f"\ntraining on {train['corpus']} ({train['tokenizer']}), {train['steps']} steps x "
          f"{train['batch_size']} x {cfg.train.context} tokens, one seed, identical batches")
    print(f"{'schedule':<12} {'heads':<28} {'val loss':>9} {'tokens/s':>12} {'wall s':>8}")
    for r in train["runs"]:
        print(f"{r['schedule']:<12} {','.join(map(str, r['heads'])):<28} {r['final_val_loss']:>9.4f} "
              f"{r['tokens_per_s']:>12,.0f} {r['wall_s']:>8.1f}")

    mfus = [r["mfu"] for r in rows if r["mfu"] is not None]
    result = {
        "meta": {"device": device.type, "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
                 else platform.processor() or platform.machine(), "torch": torch.__version__, "smoke": small,
                 "budget_s": args.budget_s, "peak_flops": peak, "command": " ".join(sys.argv)},
        "throughput": rows,
        "prism_over_uniform": ratio,
        "training": train,
        "goals": {"prism_over_uniform_ge_0.98": ratio >= 0.98,
                  "mfu_ge_0.45": (min(mfus) >= 0.45) if mfus else None},
        "wall_s": time.perf_counter() - t_start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, result)
    print(f"\n{out}  ({result['wall_s']:.0f}s of {args.budget_s:.0f}s)")
    return result


if __name__ == "__main__":
    main()
