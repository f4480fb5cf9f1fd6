"""Budget D of a schedule next to its reference, with the parameters and forward FLOPs per token it
implies (``headbudget schedule --budget ... --strategy ...`` prints it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from headbudget.accounting import count_parameters, flops_per_token
from headbudget.schedules import HeadSchedule


@dataclass(frozen=True)
class BudgetReport:
    """Budget D of a schedule against its reference, with the parameters and FLOPs it implies."""

    name: str
    budget: int
    reference_budget: int
    fraction: float
    per_layer_width: tuple[int, ...]
    attention_params: int
    reference_attention_params: int
    total_params: int
    flops_per_token: int
    reference_flops_per_token: int

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), per_layer_width=list(self.per_layer_width))

    def format(self) -> str:
        return (f"{self.name}: D={self.budget} ({self.fraction:.3f} of {self.reference_budget}), "
                f"attention params {self.attention_params:,} (ref {self.reference_attention_params:,}), "
                f"total params {self.total_params:,}, FLOPs/token {self.flops_per_token:,} "
                f"(ref {self.reference_flops_per_token:,})")


def budget_report(schedule: HeadSchedule, reference: HeadSchedule, vocab_size: int, n_positions: int,
                  context: int | None = None) -> BudgetReport:
    """Budget, parameters and forward FLOPs/token of ``schedule`` next to ``reference``.

    >>> from headbudget.budget import reference_schedule, uniform_shrink
    >>> ref = reference_schedule("cpu-tiny")
    >>> budget_report(uniform_shrink(ref, 0.5), ref, 512, 128).fraction
    0.5
    """
    ctx = n_positions if context is None else context
    p = count_parameters(schedule, vocab_size, n_positions)
    return BudgetReport(
        name=schedule.name, budget=schedule.budget, reference_budget=reference.budget,
        fraction=schedule.budget / reference.budget, per_layer_width=tuple(s.width for s in schedule.layers),
        attention_params=p.attention,
        reference_attention_params=count_parameters(reference, vocab_size, n_positions).attention,
        total_params=p.total, flops_per_token=int(flops_per_token(schedule, vocab_size, ctx)["total"]),
        reference_flops_per_token=int(flops_per_token(reference, vocab_size, ctx)["total"]))


def budget_step(schedule: HeadSchedule, strategy: str) -> int:
    """The granularity ``strategy`` moves the budget in: the target is met within it (docs/allocation.md)."""
    if strategy == "front_loaded_heads":
        return max(s.head_dim for s in schedule.layers)
    return max(s.n_heads * schedule.head_dim_multiple for s in schedule.layers)
