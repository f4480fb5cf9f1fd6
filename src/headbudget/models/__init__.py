"""headbudget models: the config, the decoder, and GPT-2 weight compatibility."""

from headbudget.models.config import HeadBudgetConfig
from headbudget.models.modeling import HeadBudgetForCausalLM, HeadBudgetModel

__all__ = ["HeadBudgetConfig", "HeadBudgetForCausalLM", "HeadBudgetModel", "register_auto_classes"]


def register_auto_classes() -> None:
    """Register with ``AutoConfig``/``AutoModelForCausalLM`` (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        AutoConfig.register(HeadBudgetConfig.model_type, HeadBudgetConfig)
    except ValueError:  # already registered
        pass
    try:
        AutoModelForCausalLM.register(HeadBudgetConfig, HeadBudgetForCausalLM)
    except ValueError:
        pass
