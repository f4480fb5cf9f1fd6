"""headbudget models: one decoder family for every scheduled, pruned or compressed model.

``modeling_headbudget.py``/``configuration_headbudget.py`` are the model (torch + transformers only,
copied next to every checkpoint); ``convert`` maps GPT-2/Llama/Mistral/Qwen2 in and out.  Importing
this module registers the ``headbudget`` model type with ``AutoConfig``/``AutoModelForCausalLM``.
"""

from headbudget.models.config import HeadBudgetConfig
from headbudget.models.convert import ConversionError, to_headbudget, to_hf
from headbudget.models.modeling import HeadBudgetForCausalLM, HeadBudgetModel

__all__ = ["ConversionError", "HeadBudgetConfig", "HeadBudgetForCausalLM", "HeadBudgetModel",
           "register_auto_classes", "to_headbudget", "to_hf"]


def register_auto_classes() -> None:
    """Register with ``AutoConfig``/``AutoModelForCausalLM`` (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(HeadBudgetConfig.model_type, HeadBudgetConfig, exist_ok=True)
    AutoModelForCausalLM.register(HeadBudgetConfig, HeadBudgetForCausalLM, exist_ok=True)


register_auto_classes()
