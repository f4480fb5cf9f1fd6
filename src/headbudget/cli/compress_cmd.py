"""``headbudget compress``: low-rank (SVD) or K/V-grouping compression of a trained model.

    headbudget compress runs/cpu-small/model --method svd --keep 0.5 --allocation later_layers_first \\
        --data ../shared/data/text/tinyshakespeare.txt --out runs/cpu-small-svd50 --sweep 0.25,0.5,0.75
    headbudget compress gpt2-dir --method group --keep 0.5 --groups groups.json --out runs/gpt2-gqa
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from headbudget.cli.model_flags import add_device_flag, add_dtype_flag
from headbudget.data.text import read_text
from headbudget.threads import add_threads_flag


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compress",
        help="compress attention by per-head SVD or K/V head grouping, with a perplexity report",
        description="Compress a headbudget or Hugging Face GPT-2 model directory. Writes OUT/model/ "
        "(loadable with from_pretrained), OUT/report.json, and with --sweep OUT/sweep.json and OUT/sweep.png.",
    )
    p.add_argument("model", metavar="MODEL",
                   help="model or run folder, or GGUF file, of any decoder headbudget converts (GPT-2, Llama, ...)")
    p.add_argument("--method", choices=["svd", "group"], default="svd",
                   help="svd: per-head rank reduction of W_Q W_K^T and W_V W_O; group: share K/V within head groups")
    p.add_argument("--keep", type=float, default=0.5,
                   help="kept fraction of the attention rank budget (svd) or of the K/V heads (group)")
    p.add_argument("--allocation", choices=["uniform", "later_layers_first", "earlier_layers_first"],
                   default="uniform", help="how the kept budget is spread over layers")
    p.add_argument("--strength", type=float, default=0.5,
                   help="slope of the non-uniform allocations: keep factors from (1+s) to (1-s) x mean")
    p.add_argument("--groups", default=None,
                   help="JSON file with explicit head groups for --method group: a list with one entry per "
                   "layer (a list of head-index lists, or null to allocate that layer), or an object "
                   "{\"LAYER\": groups} naming some layers; e.g. CAHP clusters")
    p.add_argument("--data", default=None,
                   help="text for perplexity before/after: a file, an HF dataset NAME[:CONFIG], or synthetic[:N_WORDS] "
                   "(held-out text of the built-in grammar)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder or spec (default: the model's own, see headbudget.loading)")
    p.add_argument("--context", type=int, default=256, help="perplexity window (capped at the model's positions)")
    p.add_argument("--stride", type=int, default=None, help="perplexity stride (default context/2)")
    p.add_argument("--max-windows", type=int, default=None, help="score only the first N windows")
    p.add_argument("--max-tokens", type=int, default=None, help="use only the first N tokens of --data")
    p.add_argument("--sweep", default=None,
                   help="comma list of kept fractions: compare all three allocations at each (needs --data)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results of an earlier run in --out (without it such a folder is refused)")
    add_device_flag(p)
    add_dtype_flag(p, auto="float32; the compression itself always runs in float32, --dtype is the type "
                   "perplexity is measured in and the compressed model saved in")
    add_threads_flag(p)  # applied by cli.main (headbudget.threads)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def _fraction(value: float, flag: str) -> float:
    if not 0 < value <= 1:
        raise ValueError(f"{flag} must be in (0, 1], got {value}")
    return value


def read_groups(path: str) -> list | dict:
    """Read a --groups JSON file: ``[[[0, 1], [2, 3]], null, ...]`` (one entry per layer) or
    ``{"0": [[0, 1], [2, 3]]}`` (only the named layers)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--groups: no file {path}")
    try:
        data = json.loads(read_text(p))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    if isinstance(data, dict):  # {"layer": groups}: layers not named are allocated
        try:
            out = {int(k): v for k, v in data.items()}
        except ValueError:
            raise ValueError(f"{path}: keys must be layer indices, got {sorted(data)[:3]}") from None
        for i, g in out.items():
            if g is not None and not (isinstance(g, list) and all(isinstance(x, list) for x in g)):
                raise ValueError(f"{path}: layer {i}: expected a list of head-index lists or null, got {g!r}")
        return out
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list with one entry per layer")
    for i, g in enumerate(data):
        if g is not None and not (isinstance(g, list) and all(isinstance(x, list) for x in g)):
            raise ValueError(f"{path}: layer {i}: expected a list of head-index lists or null, got {g!r}")
    return data


def run(args: argparse.Namespace) -> int:
    from headbudget.compression.pipeline import format_report, run_compress
    from headbudget.loading import resolve_device, resolve_dtype
    from headbudget.run_dir import claim_output_dir

    resolve_dtype(args.dtype)
    resolve_device(args.device)
    _fraction(args.keep, "--keep")
    sweep = None
    if args.sweep:
        try:
            sweep = [float(x) for x in args.sweep.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--sweep: expected a comma list of fractions, got {args.sweep!r}") from None
        for k in sweep:
            _fraction(k, "--sweep")
    if args.context < 2:
        raise ValueError(f"--context must be >= 2, got {args.context}")
    groups = read_groups(args.groups) if args.groups else None
    if groups is not None and args.method != "group":
        raise ValueError("--groups only applies to --method group")
    with claim_output_dir(args.out, command="headbudget compress", overwrite=args.overwrite):
        report = run_compress(
            args.model, args.method, args.keep, args.allocation, args.out, data=args.data,
            tokenizer=args.tokenizer, sweep=sweep, groups=groups, context=args.context, stride=args.stride,
            max_windows=args.max_windows, max_tokens=args.max_tokens, strength=args.strength,
            progress=not args.no_progress, threads=args.threads, dtype=args.dtype, device=args.device,
        )
    print(format_report(report))
    print(f"wrote {Path(args.out) / 'model'}, {Path(args.out) / 'report.json'}"
          + (f", {Path(args.out) / 'sweep.png'}" if sweep else ""))
    return 0
