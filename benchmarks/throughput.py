"""Training-step throughput: uniform vs prism, and headbudget vs Hugging Face GPT-2 (sdpa).

A training step is forward + backward + AdamW step on random tokens. Models are timed interleaved
(A, B, C, A, B, C, ...) and the median step time is used, so ratios come from the same run and the same
machine state. Prints a table and writes JSON.

    python benchmarks/throughput.py                       # cpu-small + one gpt2-124m config on CPU
    python benchmarks/throughput.py --device cuda --dtype bf16 --configs gpt2-124m:8:1024
    python benchmarks/throughput.py --kinds uniform,nanogpt --nanogpt /path/to/nanoGPT/model.py

``nanogpt`` is Karpathy's nanoGPT ``model.py`` at the same shape (bias, tied head, vocab of the preset);
give the path to a checkout's file (it is not shipped with headbudget).  nanoGPT's MLP uses the exact (erf)
GELU, GPT-2 and headbudget the tanh one, which costs more on CPU (2.6x forward, 1.8x backward at one thread);
``nanogpt-tanh`` is nanoGPT with GPT-2's tanh GELU, i.e. the same math as ours, as a control, and
``uniform-gelu`` is ours with nanoGPT's exact GELU (``hidden_act="gelu"``, ``train --model.hidden_act gelu``):
the like-for-like pairs are uniform / nanogpt-tanh and uniform-gelu / nanogpt.

``--loop`` times whole training steps as the trainers run them, in blocks of ``--log-every`` steps that end
with the one read of the loss (so a host sync per step shows): headbudget and HF models step through
:class:`headbudget.train.loop.TrainLoop` (AdamW with decay groups, betas 0.9/0.95, clipping to 1.0; the
optimizer ``build_adamw`` picks, i.e. torch's fused kernel on CPU and CUDA, or ``--adamw loop`` for the
for-loop one), nanoGPT as its ``train.py`` does (``configure_optimizers``, which asks for the fused kernel on
CUDA only, ``clip_grad_norm_``, ``loss.item()`` at log steps).
A block is one timed unit (``--steps``/``--warmup`` count blocks); ``median_step_s`` is its median / log_every,
``median_cpu_step_s`` the same in CPU seconds of this process: with ``--threads 1`` on a shared machine the
measure to trust, as it does not count the time other processes held the core (see :func:`ratios`).

    python benchmarks/throughput.py --loop --kinds uniform,nanogpt --nanogpt model.py --log-every 10
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
from headbudget.schedules import get_preset

NANOGPT_PATH: str | None = None


class NanoGPTWrapper(torch.nn.Module):
    """nanoGPT's GPT behind the ``model(x, labels=x).loss`` call the step uses (targets = next tokens)."""

    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, idx, labels):
        targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-1)  # nanoGPT ignores -1
        _, loss = self.gpt(idx, targets)
        return type("Out", (), {"loss": loss})()


def build(kind: str, preset: str, device: str) -> torch.nn.Module:
    p = get_preset(preset)
    if kind in ("nanogpt", "nanogpt-tanh"):
        import importlib.util

        if not NANOGPT_PATH:
            raise SystemExit("--kinds nanogpt needs --nanogpt PATH/TO/model.py")
        spec = importlib.util.spec_from_file_location("nanogpt_model", NANOGPT_PATH)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        cfg = mod.GPTConfig(block_size=p.n_positions, vocab_size=p.vocab_size, n_layer=p.n_layers,
                            n_head=p.n_heads, n_embd=p.d_model, dropout=0.0, bias=True)
        gpt = mod.GPT(cfg)
        if kind == "nanogpt-tanh":  # GPT-2's activation, as headbudget and HF GPT-2 use
            for block in gpt.transformer.h:
                block.mlp.gelu = torch.nn.GELU(approximate="tanh")
        return NanoGPTWrapper(gpt).to(device).train()
    if kind == "hf-gpt2":
        cfg = GPT2Config(n_layer=p.n_layers, n_embd=p.d_model, n_head=p.n_heads, vocab_size=p.vocab_size,
                         n_positions=p.n_positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cfg._attn_implementation = "sdpa"
        model = GPT2LMHeadModel(cfg)
    elif kind == "uniform-gelu":  # ours with nanoGPT's exact GELU
        model = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset(preset, "uniform", hidden_act="gelu"))
    else:
        model = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset(preset, kind))
    return model.to(device).train()


def step_fn(model, batch, opt, device, dtype):
    """One optimizer step of the training loop (TrainLoop.step) on ``batch``, its loss read and checked."""
    import itertools

    from headbudget.train.loop import TrainLoop

    loop = TrainLoop(model, opt, lambda b: model(b, labels=b).loss,
                     autocast=torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32))
    batches = itertools.repeat(batch)

    def step():
        loop.step(batches, 0, need_norm=False)
        loop.check()  # reads the loss, as the device sync below would wait for it anyway
        if device == "cuda":
            torch.cuda.synchronize()
    return step


def loop_block_fn(kind, model, batch, device, dtype, log_every, adamw="auto"):
    """``log_every`` training steps ending with the read of the loss (the trainers' log step)."""
    import itertools

    from headbudget.train.loop import TrainLoop, build_adamw

    autocast = torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32)
    if kind.startswith("nanogpt"):  # nanoGPT's train.py, minus its data loading, lr schedule and accumulation
        opt = model.gpt.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device)

        def block():
            for _ in range(log_every):
                with autocast:
                    loss = model(batch, labels=batch).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            loss.item()
        return block
    opt = build_adamw(model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95),
                      fused={"auto": None, "fused": True, "loop": False}[adamw])
    loop = TrainLoop(model, opt, lambda b: model(b, labels=b).loss, grad_clip=1.0, autocast=autocast)
    batches = itertools.repeat(batch)

    def block():
        for i in range(log_every):
            loop.step(batches, i, need_norm=i == log_every - 1)
        loop.check()
    return block


def ratios(times: dict[str, list[float]], cpu: dict[str, list[float]]) -> dict[str, float]:
    """Throughput ratios against ``uniform`` (and ``uniform-gelu`` where timed): of the median step times
    (wall), the median of the rounds' own ratios (each round times every model back to back, so drift cancels:
    ``paired``), and those two of the CPU seconds (``cpu``, ``cpu paired``; with one thread this counts the work
    done, not the time others took the core away)."""
    out = {}
    for base in ("uniform", "uniform-gelu"):
        if base not in times:
            continue
        for other in times:
            if other in ("uniform", "uniform-gelu"):
                continue
            if base == "uniform":
                out[f"{other}/uniform"] = statistics.median(times["uniform"]) / statistics.median(times[other])
            for tag, t in (("", times), (" cpu", cpu)):
                out[f"{base}/{other}{tag}"] = statistics.median(t[other]) / statistics.median(t[base])
                out[f"{base}/{other}{tag} paired"] = statistics.median(o / u for o, u in zip(t[other], t[base]))
    return out


def run_config(preset: str, batch: int, context: int, kinds: list[str], steps: int, warmup: int,
               device: str, dtype: torch.dtype, log_every: int = 0, adamw: str = "auto") -> dict:
    """``log_every`` > 0: time blocks of that many steps through the training loops (``--loop``)."""
    p = get_preset(preset)
    torch.manual_seed(0)
    data = torch.randint(0, p.vocab_size, (batch, context), device=device)
    models = {k: build(k, preset, device) for k in kinds}
    steps_fns = {}
    for k, m in models.items():
        if log_every:
            steps_fns[k] = loop_block_fn(k, m, data, device, dtype, log_every, adamw)
            continue
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=device == "cuda")
        steps_fns[k] = step_fn(m, data, opt, device, dtype)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}  # CPU seconds of this process: blind to preemption
    for i in range(warmup + steps):
        for k in kinds:  # interleaved so drifts in machine load hit every model alike
            t, c = time.perf_counter(), time.process_time()
            steps_fns[k]()
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times[k].append((time.perf_counter() - t) / max(log_every, 1))
                cpu[k].append((time.process_time() - c) / max(log_every, 1))
    tokens = batch * context
    res = {k: {"median_step_s": statistics.median(v), "tokens_per_s": tokens / statistics.median(v),
               "median_cpu_step_s": statistics.median(cpu[k]),
               "params": sum(p.numel() for p in models[k].parameters()), "step_s": [round(t, 4) for t in v],
               "cpu_step_s": [round(t, 4) for t in cpu[k]]}
           for k, v in times.items()}
    out = {"preset": preset, "batch": batch, "context": context, "results": res,
           **({"loop": True, "log_every": log_every} if log_every else {})}
    if "uniform" in res or "uniform-gelu" in res:
        out["ratios"] = ratios(times, cpu)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="cpu-small:8:256,gpt2-124m:1:128,gpt2-124m:4:128",
                    help="comma list of PRESET:BATCH:CONTEXT")
    ap.add_argument("--kinds", default="uniform,prism,hf-gpt2")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--nanogpt", help="path to nanoGPT's model.py (for --kinds ...,nanogpt)")
    ap.add_argument("--loop", action="store_true", help="time training steps through the training loops "
                    "(headbudget.train.loop for headbudget/HF, nanoGPT's train.py steps) in blocks of --log-every")
    ap.add_argument("--log-every", type=int, default=10, help="--loop: steps per block (one loss read each)")
    ap.add_argument("--adamw", default="auto", choices=["auto", "fused", "loop"],
                    help="--loop: headbudget's/HF's AdamW: build_adamw's choice (fused where torch has the kernel), "
                    "fused, or the for-loop one")
    ap.add_argument("--out", default="benchmarks/results/throughput.json")
    args = ap.parse_args()
    global NANOGPT_PATH
    NANOGPT_PATH = args.nanogpt
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    kinds = args.kinds.split(",")
    rows = []
    for spec in args.configs.split(","):
        preset, batch, context = spec.split(":")
        rows.append(run_config(preset, int(batch), int(context), kinds, args.steps, args.warmup, args.device, dtype,
                               args.log_every if args.loop else 0, args.adamw))
    print(f"{'config':<24}{'model':<14}{'params':>13}{'step s':>10}{'cpu s':>10}{'tokens/s':>12}")
    for r in rows:
        name = f"{r['preset']} b{r['batch']} T{r['context']}"
        for k, v in r["results"].items():
            print(f"{name:<24}{k:<14}{v['params']:>13,}{v['median_step_s']:>10.3f}"
                  f"{v['median_cpu_step_s']:>10.3f}{v['tokens_per_s']:>12,.0f}")
        for k, v in r.get("ratios", {}).items():
            print(f"{'':<24}ratio {k}: {v:.3f}")
    meta = {"device": args.device, "dtype": args.dtype, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.machine(), "cpu_count": os.cpu_count(), "steps": args.steps, "warmup": args.warmup,
            "loop": args.loop, "log_every": args.log_every if args.loop else None,
            "adamw": args.adamw if args.loop else None}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"meta": meta, "configs": rows}, indent=2))
    os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
