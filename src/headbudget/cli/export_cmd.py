"""``headbudget export``: write a model as a GGUF file for llama.cpp.

    headbudget export runs/smol-pruned/model --format gguf --out smol-pruned.gguf --outtype f16
    headbudget export ../cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --format gguf --out smol-f32.gguf
"""

from __future__ import annotations

import argparse
import sys

from headbudget.cli.dataclass_flags import add_settings, printed
from headbudget.export import ExportJob
from headbudget.progress import library_bars


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a model as an f32/f16 GGUF file llama.cpp runs (llama for uniform layouts, deci for pruned)",
        description="Write a headbudget model (uniform or pruned), a Hugging Face Llama/Mistral/Qwen2 folder or a "
        "GGUF file as an f32/f16 GGUF: llama.cpp's llama architecture when every layer is alike, its deci "
        "architecture (per-layer head counts and MLP widths, one head size) otherwise. Unequal query groups are "
        "written with duplicated key/value heads (the cost is printed); per-layer head widths are refused.")
    add_settings(p, ExportJob, "the export's settings", positional=("model",))
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return 0 if printed(args) else _export(args)


@library_bars(False)  # the result and any warning are the output
def _export(args: argparse.Namespace) -> int:
    from headbudget.export import export_model, kv_cache_line

    result = export_model(args.settings, overwrite=args.overwrite)
    for warning in (result["warning"], result["kv_warning"]):
        if warning:
            print(f"headbudget export: warning: {warning}", file=sys.stderr)
    heads = result["n_heads"]
    shown = heads[0] if len(set(heads)) == 1 else ",".join(map(str, heads))
    print(f"wrote {result['out']} ({result['arch']}, {len(heads)} layers, heads {shown}, head size "
          f"{result['head_dim']}, {result['outtype']}, {result['bytes']} bytes; tokenizer {result['tokenizer']})")
    print(kv_cache_line(result["kv_cache_bytes_per_token"]))
    return 0
