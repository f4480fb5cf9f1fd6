"""``headbudget experiment saturation|ngram``: the synthetic experiments behind theory-guided allocation.

    headbudget experiment saturation --out results/saturation            # ~5 min on 2 shared cores
    headbudget experiment saturation --quick --out /tmp/sat               # ~20 s smoke run
    headbudget experiment ngram --budget 64 --offsets 1,2,3,4 --out results/ngram
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from headbudget.run_dir import claim_output_dir
from headbudget.threads import add_threads_flag


def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag}: expected a comma list of numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{flag}: expected positive numbers, got {text!r}")
    return values


def _positive(value: int | None, flag: str) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{flag} must be positive, got {value}")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "experiment",
        help="synthetic experiments: head-dim saturation, n-gram extraction at a fixed budget",
        description="Synthetic experiments that test the allocation theory. Each writes JSON and a PNG "
        "and prints what it measured and whether it agrees with the prediction.",
    )
    esub = p.add_subparsers(dest="experiment", metavar="EXPERIMENT")

    s = esub.add_parser(
        "saturation",
        help="students of head dim 1..64 imitate a fixed single-head teacher at L in {16,64,256,1024}",
        description="Normalised error vs student head dim for each sequence length L (1 = uniform attention).",
    )
    s.add_argument("--out", default="results/saturation", help="output folder (saturation.json, .png)")
    s.add_argument("--quick", action="store_true", help="small smoke-run sizes (~20 s)")
    s.add_argument("--seq-lens", help="comma list of sequence lengths (default 16,64,256,1024)")
    s.add_argument("--dims", help="comma list of student head dims (default 1,2,4,8,16,32,64)")
    s.add_argument("--d-model", type=int, help="input width (default 64)")
    s.add_argument("--teacher-dim", type=int, help="teacher head dim (default 64)")
    s.add_argument("--logit-scale", type=float, help="teacher logit std (default 2.0)")
    s.add_argument("--steps", type=int, help="training steps per student and learning rate (default 200)")
    s.add_argument("--lrs", help="comma list of learning rates; the best per student is kept (default 0.03,0.1)")
    s.add_argument("--tokens-per-step", type=int, help="tokens per training batch (default 2048)")
    s.add_argument("--seed", type=int, default=None)
    add_threads_flag(s)  # applied by cli.main (headbudget.threads); the experiment keeps it
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--overwrite", action="store_true",
                   help="replace the results of an earlier run in --out (without it such a folder is refused)")
    s.set_defaults(func=run_saturation_cmd)

    n = esub.add_parser(
        "ngram",
        help="copy tokens at a few offsets with one attention layer; sweep n_heads x head_dim at fixed budget",
        description="Error vs number of heads at a fixed attention budget n_heads x head_dim.",
    )
    n.add_argument("--out", default="results/ngram", help="output folder (ngram.json, .png)")
    n.add_argument("--quick", action="store_true", help="small smoke-run sizes (~30-60 s)")
    n.add_argument("--budget", type=int, help="n_heads x head_dim (default 64)")
    n.add_argument("--heads", help="comma list of head counts, each dividing --budget (default: all divisors)")
    n.add_argument("--offsets", help="comma list of offsets to copy (default 1,2,3,4)")
    n.add_argument("--vocab", type=int, help="vocabulary size (default 16)")
    n.add_argument("--seq-len", type=int, help="sequence length (default 32)")
    n.add_argument("--d-model", type=int, help="embedding width (default 64)")
    n.add_argument("--steps", type=int, help="training steps per model (default 600)")
    n.add_argument("--batch", type=int, help="sequences per step (default 64)")
    n.add_argument("--lr", type=float, help="peak learning rate (default 3e-3)")
    n.add_argument("--seeds", help="comma list of seeds (default 0,1)")
    add_threads_flag(n)
    n.add_argument("--no-progress", action="store_true")
    n.add_argument("--overwrite", action="store_true",
                   help="replace the results of an earlier run in --out (without it such a folder is refused)")
    n.set_defaults(func=run_ngram_cmd)

    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run_saturation_cmd(args: argparse.Namespace) -> int:
    from headbudget.experiments._common import parse_int_list
    from headbudget.experiments.saturation import (
        SaturationConfig,
        format_saturation,
        run_saturation,
        write_saturation,
    )

    cfg = SaturationConfig.quick() if args.quick else SaturationConfig()
    over: dict = {}
    if args.seq_lens:
        over["seq_lens"] = tuple(parse_int_list(args.seq_lens, "--seq-lens"))
    if args.dims:
        over["student_dims"] = tuple(parse_int_list(args.dims, "--dims"))
    if args.lrs:
        over["lrs"] = _floats(args.lrs, "--lrs")
    for flag, key in (("d_model", "d_model"), ("teacher_dim", "teacher_dim"), ("steps", "steps"),
                      ("tokens_per_step", "tokens_per_step"), ("threads", "threads")):
        value = getattr(args, flag)
        _positive(value, "--" + flag.replace("_", "-"))
        if value is not None:
            over[key] = value
    if args.logit_scale is not None:
        if args.logit_scale <= 0:
            raise ValueError(f"--logit-scale must be positive, got {args.logit_scale}")
        over["logit_scale"] = args.logit_scale
    if args.seed is not None:
        over["seed"] = args.seed
    over.setdefault("threads", 0)  # 0: keep what cli.main's --threads policy chose
    cfg = replace(cfg, **over)
    with claim_output_dir(args.out, command="headbudget experiment saturation", overwrite=args.overwrite):
        result = run_saturation(cfg, progress=not args.no_progress)
        json_path, png_path = write_saturation(result, args.out)
    print(format_saturation(result))
    print(f"wrote {json_path} and {png_path}")
    return 0


def run_ngram_cmd(args: argparse.Namespace) -> int:
    from headbudget.experiments._common import parse_int_list
    from headbudget.experiments.ngram import NgramConfig, format_ngram, run_ngram, write_ngram

    cfg = NgramConfig.quick() if args.quick else NgramConfig()
    over: dict = {}
    if args.heads:
        over["head_counts"] = tuple(parse_int_list(args.heads, "--heads"))
    if args.offsets:
        over["offsets"] = tuple(parse_int_list(args.offsets, "--offsets"))
    if args.seeds:
        try:
            over["seeds"] = tuple(int(x) for x in args.seeds.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--seeds: expected a comma list of integers, got {args.seeds!r}") from None
    for flag in ("budget", "vocab", "seq_len", "d_model", "steps", "batch", "threads"):
        value = getattr(args, flag)
        _positive(value, "--" + flag.replace("_", "-"))
        if value is not None:
            over[flag] = value
    if args.lr is not None:
        if args.lr <= 0:
            raise ValueError(f"--lr must be positive, got {args.lr}")
        over["lr"] = args.lr
    if "budget" in over and "head_counts" not in over and args.quick:
        over["head_counts"] = None
    over.setdefault("threads", 0)  # 0: keep what cli.main's --threads policy chose
    cfg = replace(cfg, **over)
    with claim_output_dir(args.out, command="headbudget experiment ngram", overwrite=args.overwrite):
        result = run_ngram(cfg, progress=not args.no_progress)
        json_path, png_path = write_ngram(result, args.out)
    print(format_ngram(result))
    print(f"wrote {json_path} and {png_path}")
    return 0
