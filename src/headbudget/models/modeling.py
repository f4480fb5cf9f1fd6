"""The headbudget decoder as the package uses it: the standalone model bound to the package config.

The model itself is ``modeling_headbudget.py`` (copied next to every checkpoint); these subclasses only bind
:class:`headbudget.models.HeadBudgetConfig` (presets, ``head_schedule``) for ``AutoModelForCausalLM``.

    >>> model = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", "prism", vocab_size=300))
    >>> model.prune_heads({3: [0]}); model.config.head_schedule.heads
    (1, 2, 4, 3)
"""

from __future__ import annotations

from headbudget.models import modeling_headbudget as standalone
from headbudget.models.config import HeadBudgetConfig


class HeadBudgetModel(standalone.HeadBudgetModel):
    config_class = HeadBudgetConfig


class HeadBudgetForCausalLM(standalone.HeadBudgetForCausalLM):
    config_class = HeadBudgetConfig
