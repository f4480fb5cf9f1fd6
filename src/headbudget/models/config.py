"""``HeadBudgetConfig``: a Hugging Face config that fully describes a headbudget decoder.

The standalone base (``configuration_headbudget.py``) stores the schedule as a dict; this subclass adds
presets and the validated :class:`~headbudget.schedules.HeadSchedule` view (``config.head_schedule``).

    >>> cfg = HeadBudgetConfig.from_preset("cpu-tiny", schedule="prism", vocab_size=300)
    >>> cfg.head_schedule.heads
    (1, 2, 4, 4)
"""

from __future__ import annotations

from typing import Any

from headbudget.models import configuration_headbudget as standalone
from headbudget.schedule_spec import schedule_from_spec
from headbudget.schedules import HeadSchedule, get_preset


class HeadBudgetConfig(standalone.HeadBudgetConfig):
    # transformers 5 turns config subclasses without their own __init__ into dataclasses: keep the base's.
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    @property
    def head_schedule(self) -> HeadSchedule:
        return HeadSchedule.from_dict(self.schedule)

    @classmethod
    def from_preset(cls, preset: str, schedule: str | HeadSchedule = "uniform",
                    schedule_options: dict | None = None, **kwargs: Any) -> HeadBudgetConfig:
        """Config for a named preset (``gpt2-124m``, ``cpu-small``, ...) and schedule kind or object."""
        p = get_preset(preset)
        if not isinstance(schedule, HeadSchedule):
            schedule = schedule_from_spec(schedule, p, **(schedule_options or {}))
        kwargs.setdefault("vocab_size", p.vocab_size)
        kwargs.setdefault("n_positions", p.n_positions)
        return cls(schedule=schedule, **kwargs)
