"""``headbudget schedule``: print a preset's per-layer head schedule with parameters and FLOPs."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from headbudget.accounting import attention_parameters, count_parameters, flops_per_token
from headbudget.cli.dataclass_flags import add_settings, printed
from headbudget.schedule_spec import schedule_from_spec
from headbudget.schedules import HeadSchedule, get_preset
from headbudget.typed_config import option


@dataclass
class ScheduleSettings:
    """``headbudget schedule`` (each flag declared once, on its field)."""

    preset: str = option("gpt2-124m", help="gpt2-124m | gpt2-354m | gpt-757m | cpu-tiny | cpu-small")
    kind: str = option("prism", help="uniform | prism | reverse | linear | uniform@HEAD_DIM | comma list of head "
                                     "counts (budgeted kinds too, see --budget)")
    max_head_dim: int | None = option(None, help="widest head (prism/reverse/linear)")
    min_head_dim: int | None = option(None, help="narrowest head (prism/reverse/linear)")
    context: int | None = option(None, help="context length for FLOPs (default: preset's)")
    budget: float | None = option(None, help="fraction of the uniform attention budget D (with --strategy)")
    strategy: str | None = option(None, help="budget strategy: uniform_shrink | late_dim_decay | front_loaded_heads "
                                             "| a comma list")
    json: bool = option(False, help="print JSON instead of a table")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schedule", help="show a head schedule with parameter and FLOP accounting",
                       description="Print a preset's per-layer schedule (heads, head_dim, kv heads, "
                                   "attention params, forward FLOPs per token) and totals.")
    add_settings(p, ScheduleSettings, "the schedule's settings")
    p.set_defaults(func=run)


def build_schedule(args: argparse.Namespace) -> HeadSchedule:
    preset = get_preset(args.preset)
    if args.budget is not None or args.strategy is not None:
        from headbudget import budget  # budgeted strategies (theory-guided allocation)

        if args.budget is None or args.strategy is None:
            raise ValueError("--budget and --strategy go together, e.g. --budget 0.75 --strategy late_dim_decay")
        return budget.budgeted_schedule(preset, args.budget, args.strategy)
    opts = {"max_head_dim": args.max_head_dim, "min_head_dim": args.min_head_dim}
    return schedule_from_spec(args.kind, preset, **{k: v for k, v in opts.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    if printed(args):
        return 0
    preset = get_preset(args.preset)
    sched = build_schedule(args)
    context = args.context or preset.n_positions
    if context <= 0:
        raise ValueError(f"--context must be positive, got {context}")
    params = count_parameters(sched, preset.vocab_size, preset.n_positions)
    flops = flops_per_token(sched, preset.vocab_size, context)
    if args.json:
        print(json.dumps({
            "preset": preset.name, "kind": sched.name, "d_model": sched.d_model, "context": context,
            "budget": sched.budget, "layers": [spec.to_dict() for spec in sched],
            "params": {"total": params.total, "non_embedding": params.non_embedding, "attention": params.attention},
            "flops_per_token": flops["total"],
        }, indent=2))
        return 0
    print(f"{preset.name} ({sched.n_layers} layers, d_model {sched.d_model}), schedule {sched.name}, "
          f"context {context}")
    header = f"{'layer':>5} {'n_heads':>7} {'head_dim':>8} {'n_kv_heads':>10} {'attn params':>12} {'fwd FLOPs/tok':>14}"
    print(header)
    print("-" * len(header))
    for i, (spec, f) in enumerate(zip(sched, flops["per_layer"])):
        print(f"{i:>5} {spec.n_heads:>7} {spec.head_dim:>8} {spec.n_kv_heads:>10} "
              f"{attention_parameters(spec, sched.d_model):>12,} {f:>14,}")
    print("-" * len(header))
    print(f"heads per layer: {','.join(map(str, sched.heads))}   attention budget D = {sched.budget:,}")
    print(f"parameters: total {params.total:,}  non-embedding {params.non_embedding:,}  "
          f"attention {params.attention:,}  mlp {params.mlp:,}")
    print(f"forward FLOPs per token: {flops['total']:,}")
    return 0
