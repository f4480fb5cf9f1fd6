"""``headbudget experiment saturation|ngram``: the synthetic experiments behind theory-guided allocation.

    headbudget experiment saturation --out results/saturation            # ~5 min on 2 shared cores
    headbudget experiment saturation --quick --out /tmp/sat               # ~20 s smoke run
    headbudget experiment ngram --budget 64 --offsets 1,2,3,4 --out results/ngram
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from headbudget.cli.dataclass_flags import (
    add_config_flags,
    add_dataclass_flags,
    add_overwrite_flag,
    build,
    deep_merge,
    flag_name,
    print_config,
    settings_mapping,
)
from headbudget.run_dir import claim_output_dir
from headbudget.threads import add_threads_flag


def _check_positive(cfg: Any, cls: type) -> None:
    """Every size, count and rate of an experiment config is positive (seeds excepted): one line naming the flag."""
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True) or f.name in ("seed", "seeds"):
            continue
        value = getattr(cfg, f.name)
        if isinstance(value, tuple):
            if not value or any(v <= 0 for v in value):
                kind = "integers" if all(isinstance(v, int) for v in value) else "numbers"
                raise ValueError(f"{flag_name(f)}: expected positive {kind}, got {','.join(map(str, value))!r}")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
            raise ValueError(f"{flag_name(f)} must be positive, got {value}")


def _add_experiment(esub: Any, name: str, cls: type, help: str, description: str, quick: str) -> None:
    p = esub.add_parser(name, help=help, description=description + " Defaults shown are the full run's; --quick "
                        "starts from smaller ones, and flags given override either.")
    p.add_argument("--quick", action="store_true", help=quick)
    add_dataclass_flags(p, cls)
    add_config_flags(p, cls, f"the {name} experiment's settings")
    add_threads_flag(p)  # applied by cli.main (headbudget.threads); the experiment keeps it
    add_overwrite_flag(p)

    def validate(args: argparse.Namespace) -> None:  # the config before any work: a bad value costs nothing
        defaults = dataclasses.asdict(cls.quick() if args.quick else cls())
        given = settings_mapping(cls, args)  # --config, --set and the flags given
        if name == "ngram" and args.quick and "budget" in given and "head_counts" not in given:
            defaults["head_counts"] = None  # the quick head counts divide only the default budget
        cfg = build(cls, deep_merge(defaults, given), args)
        _check_positive(cfg, cls)
        if args.threads is not None and args.threads <= 0:
            raise ValueError(f"--threads must be positive, got {args.threads}")
        args.cfg = dataclasses.replace(cfg, threads=args.threads or 0)  # 0: keep what cli.main's policy chose

    p.set_defaults(func=run_experiment, validate=validate)


def register(sub: argparse._SubParsersAction) -> None:
    from headbudget.experiments.ngram import NgramConfig
    from headbudget.experiments.saturation import SaturationConfig

    p = sub.add_parser(
        "experiment", help="synthetic experiments: head-dim saturation, n-gram extraction at a fixed budget",
        description="Synthetic experiments that test the allocation theory. Each writes JSON and a PNG "
        "and prints what it measured and whether it agrees with the prediction.")
    esub = p.add_subparsers(dest="experiment", metavar="EXPERIMENT")
    _add_experiment(esub, "saturation", SaturationConfig,
                    help="students of head dim 1..64 imitate a fixed single-head teacher at L in {16,64,256,1024}",
                    description="Normalised error vs student head dim for each sequence length L (1 = uniform "
                                "attention).", quick="small smoke-run sizes (~20 s)")
    _add_experiment(esub, "ngram", NgramConfig,
                    help="copy tokens at a few offsets with one attention layer; sweep n_heads x head_dim at fixed "
                         "budget", description="Error vs number of heads at a fixed attention budget n_heads x "
                                               "head_dim.", quick="small smoke-run sizes (~30-60 s)")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run_experiment(args: argparse.Namespace) -> int:
    """``headbudget experiment NAME``: its ``run_NAME``, ``write_NAME`` and ``format_NAME`` on the config."""
    import importlib

    if args.print_config:
        return print_config(args.cfg)
    name = args.experiment
    module = importlib.import_module(f"headbudget.experiments.{name}")
    out = args.cfg.out  # --out, or the out: of --config
    with claim_output_dir(out, command=f"headbudget experiment {name}", overwrite=args.overwrite,
                          inputs={"--config": getattr(args, "config", None)}) as write_to:
        result = getattr(module, f"run_{name}")(args.cfg)
        json_path, png_path = getattr(module, f"write_{name}")(result, write_to)
    print(getattr(module, f"format_{name}")(result))
    print(f"wrote {Path(out) / Path(json_path).name} and {Path(out) / Path(png_path).name}")
    return 0
