"""Evaluation: zero-shot multiple choice (lm-evaluation-harness's numbers) and perplexity.

Heavy modules (transformers, datasets) are imported lazily.  Importing this package registers
headbudget's scorer with lm-evaluation-harness (when it is installed) as the model ``headbudget``.

    report = evaluate_tasks(model, tok, ["piqa", "arc_easy"], data_dir="../shared/data/zeroshot", limit=200)
    lm_eval.simple_evaluate(model="headbudget", model_args="pretrained=runs/prism/model", tasks=["arc_easy"])
"""

from __future__ import annotations

from typing import Any

__all__ = ["evaluate_tasks", "evaluate_suite", "evaluate_harness", "register_lm_eval_model", "perplexity",
           "load_model_and_tokenizer", "TASKS", "get_task", "load_examples", "Scorer", "DataError"]

_LAZY = {  # name -> the module (under headbudget.) that defines it
    "evaluate_tasks": "evaluation.zeroshot", "Scorer": "evaluation.scorer",
    "evaluate_suite": "evaluation.suite", "evaluate_harness": "evaluation.harness",
    "perplexity": "evaluation.perplexity", "load_model_and_tokenizer": "loading",
    **dict.fromkeys(("TASKS", "get_task", "load_examples", "DataError"), "evaluation.tasks")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"headbudget.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'headbudget.evaluation' has no attribute {name!r}")


def register_lm_eval_model() -> bool:
    """Register :class:`headbudget.evaluation.harness.HeadBudgetLM` with lm-eval as ``headbudget``, as a
    ``"module:Class"`` placeholder (nothing heavy imported until used); False without lm-eval."""
    from importlib.util import find_spec

    try:
        if find_spec("lm_eval") is None:
            return False
        # lm-eval's own names first: its get_model() only fills an *empty* registry with them
        import lm_eval.models  # noqa: F401
        from lm_eval.api.registry import model_registry
    except (ImportError, ValueError):  # a broken or blocked lm-eval must not break `import headbudget`
        return False

    if "headbudget" not in model_registry:
        model_registry.register("headbudget", target="headbudget.evaluation.harness:HeadBudgetLM")
    return True


register_lm_eval_model()
