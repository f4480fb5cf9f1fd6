"""How fast distillation recovers a student on this CPU, and what the teacher cache buys.

Runs the trainer's own distillation loop (``headbudget distill``'s recipe of benchmarks/kv_frontier.py: batch 8 x
256 tokens, AdamW, KL at T = 2, precision auto) for ``--steps`` steps in four ways, interleaved in one process:

* ``plain KL``: the KL as headbudget computed it before (log_softmax and kl_div over whole float32 tensors), the
  teacher's full forward pass every step;
* ``chunked KL``: the exact same loss, forward and backward a few tokens at a time (``distillation_kl``);
* ``cache cold``: chunked, with an empty ``distill.teacher_cache`` (the first student of a frontier: the teacher
  runs and its last hidden states are written);
* ``cache warm``: chunked, read back from the cache (every later student: only the teacher's output layer runs).

All four compute the same loss (tests: equal metrics bit for bit with and without the cache; the chunked KL equals
the plain formula in value and gradient).  For each it reports CPU seconds per step (``time.process_time``, the
first step of each run and the last, which also validates, left out) and tokens per CPU-second, and the loop's FLOP rate (6 x the student's matmul
parameters per token plus attention, and 2 x the teacher's where it runs: the output layer alone on a cache hit)
against this CPU's measured one-thread matmul rate (fp32 and bf16, best of several).

    python benchmarks/distill_speed.py --student runs/kv_frontier/merge-kv-sensitivity-kv50/model \\
        --teacher runs/kv_frontier/dense/model --data runs/kv_frontier/text/calib.txt \\
        --out /tmp/distill_speed --results benchmarks/results/distill_speed_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from headbudget.devices import cpu_description


def matmul_rate(dtype: torch.dtype, m: int = 2048, k: int = 576, n: int = 1536, reps: int = 5) -> float:
    """Best FLOP/s of one (m x k) @ (k x n) product in ``dtype`` over ``reps`` timed rounds."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * m * k * n / (time.perf_counter() - t0))
    return best


def linear_params(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def attention_flops_per_token(model: torch.nn.Module, context: int) -> float:
    """Forward FLOPs per token of the score and value products (full T x T, as the eager kernel computes)."""
    cfg = model.config
    width = sum(h * d for h, d in zip(*_heads_and_dims(cfg)))
    return 4.0 * context * width


def _heads_and_dims(cfg) -> tuple[list[int], list[int]]:
    layers = int(cfg.num_hidden_layers)
    heads = getattr(cfg, "layer_heads", None) or [int(cfg.num_attention_heads)] * layers
    dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return list(heads), [dim] * layers


def plain_kl(student_logits, teacher_logits, targets=None, temperature=1.0, ignore_index=-100, rows=None):
    """The KL as headbudget computed it before the chunked one (the baseline of this benchmark)."""
    import torch.nn.functional as F

    log_ps = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_pt = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    per_token = F.kl_div(log_ps, log_pt, reduction="none", log_target=True).sum(-1)
    if targets is not None:
        per_token = per_token[targets != ignore_index]
    return per_token.mean() * (temperature * temperature)


def run_config(args: argparse.Namespace, name: str, out: Path, distill: dict, plain: bool = False) -> dict:
    import headbudget.train.distill as distill_module
    from headbudget.train import RunConfig, Trainer

    cfg = RunConfig.from_dict({
        "name": "distill-speed", "model": {"init": str(args.student)},
        "data": {"source": str(args.data), "tokenizer": "model", "cache_dir": str(out / "data-cache"),
                 "max_chars": args.max_chars},
        "train": {"steps": args.steps, "batch_size": args.batch_size, "context": args.context, "lr": 1e-4,
                  "warmup_steps": 1, "weight_decay": 0.0, "eval_every": 0, "log_every": 1, "ckpt_every": 0,
                  "progress": False, "threads": args.threads, "precision": args.precision},
        "distill": {"teacher": str(args.teacher), "temperature": 2.0, "alpha": 1.0, **distill}})
    marks: list[float] = []
    run_dir = out / "runs" / name.replace(" ", "-")
    shutil.rmtree(run_dir, ignore_errors=True)
    trainer = Trainer(cfg, run_dir, save_model=False, callbacks=[lambda *_: marks.append(time.process_time())])
    chunked = distill_module.distillation_kl
    distill_module.distillation_kl = plain_kl if plain else chunked
    try:
        start = time.process_time()
        trainer.run()
    finally:
        distill_module.distillation_kl = chunked
    # the first step warms caches up, the last one also runs the final validation: both left out
    steps = [b - a for a, b in zip([start, *marks], marks)][1:-1]
    per_step = sum(steps) / len(steps)
    tokens = args.batch_size * args.context
    return {"config": name, "cpu_s_per_step": per_step, "tokens_per_cpu_s": tokens / per_step, "steps_timed": len(steps),
            "cache": (trainer.summary or {}).get("distill", {}).get("cache")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--student", required=True, help="the student model folder")
    ap.add_argument("--teacher", required=True, help="the teacher model folder")
    ap.add_argument("--data", required=True, help="training text file")
    ap.add_argument("--out", required=True, help="work folder (runs, caches); emptied of old runs")
    ap.add_argument("--results", required=True, help="JSON to write")
    ap.add_argument("--steps", type=int, default=4, help="per run; the first and last are not timed (at least 3)")
    ap.add_argument("--rounds", type=int, default=2, help="full / warm repeated this many times, interleaved")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--max-chars", type=int, default=200_000)
    args = ap.parse_args(argv)
    if args.steps < 3:
        ap.error(f"--steps {args.steps}: at least 3 (the first and the last step are not timed)")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    cache = out / "teacher-cache"
    shutil.rmtree(cache, ignore_errors=True)
    rows = []
    cached = {"teacher_cache": str(cache)}
    plan = [("plain KL", {}), ("cache cold", cached)]
    for _ in range(args.rounds):
        plan += [("cache warm", cached), ("chunked KL", {}), ("plain KL", {})]
    for name, distill in plan:
        row = run_config(args, name, out, distill, plain=name == "plain KL")
        rows.append(row)
        print(f"{name:11s} {row['cpu_s_per_step']:7.2f} CPU s/step  {row['tokens_per_cpu_s']:7.1f} tokens/CPU-s",
              flush=True)
    from headbudget.loading import load_model

    student = load_model(str(args.student), "causal")
    teacher = load_model(str(args.teacher), "causal")
    s_flops = 6 * linear_params(student) + 3 * attention_flops_per_token(student, args.context)
    t_flops = 2 * linear_params(teacher) + attention_flops_per_token(teacher, args.context)
    t_head_flops = 2 * teacher.get_output_embeddings().weight.numel()
    peak = {"fp32": matmul_rate(torch.float32), "bf16": matmul_rate(torch.bfloat16)}
    summary: dict[str, dict] = {}
    for name in ("plain KL", "chunked KL", "cache cold", "cache warm"):
        got = [r for r in rows if r["config"] == name]
        rate = sum(r["tokens_per_cpu_s"] for r in got) / len(got)
        flops = s_flops + (t_head_flops if name == "cache warm" else t_flops)
        summary[name] = {"tokens_per_cpu_s": rate, "flops_per_token": flops, "flop_rate": rate * flops,
                         "fraction_of_fp32_peak": rate * flops / peak["fp32"],
                         "fraction_of_bf16_peak": rate * flops / peak["bf16"]}
    base = summary["plain KL"]["tokens_per_cpu_s"]
    for name in summary:
        summary[name]["speedup_vs_plain"] = summary[name]["tokens_per_cpu_s"] / base
    result = {"cpu": cpu_description(), "torch": torch.__version__, "threads": args.threads, "precision": args.precision,
              "batch": [args.batch_size, args.context], "matmul_peak_flops": peak,
              "runs": rows, "summary": summary,
              "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])}
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{cpu_description()}, {args.threads} thread(s), precision {args.precision}; matmul peak "
          f"{peak['fp32'] / 1e9:.0f} GFLOP/s fp32, {peak['bf16'] / 1e9:.0f} bf16")
    print(f"{'config':11s} {'tokens/CPU-s':>12s} {'x plain':>7s} {'GFLOP/s':>8s} {'% fp32 peak':>11s} {'% bf16 peak':>11s}")
    for name, v in summary.items():
        print(f"{name:11s} {v['tokens_per_cpu_s']:12.1f} {v['speedup_vs_plain']:7.2f} {v['flop_rate'] / 1e9:8.1f} "
              f"{100 * v['fraction_of_fp32_peak']:10.1f}% {100 * v['fraction_of_bf16_peak']:10.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
