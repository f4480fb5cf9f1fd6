"""Evaluation: zero-shot multiple choice (lm-evaluation-harness's numbers) and perplexity.

    from headbudget.evaluation import evaluate_tasks, perplexity, load_model_and_tokenizer
    model, tok = load_model_and_tokenizer("runs/prism", tokenizer="../shared/data/tokenizers/gpt2")
    report = evaluate_tasks(model, tok, ["piqa", "arc_easy"], data_dir="../shared/data/zeroshot",
                            limit=200)
    ppl = perplexity(model, tok, open("../shared/data/text/wikitext2_valid.tokens").read(),
                     context=1024, stride=512)

Heavy modules (transformers, datasets) are imported lazily.  Importing this package registers
headbudget's scorer with lm-evaluation-harness (when it is installed) as the model ``headbudget``:

    import headbudget.evaluation, lm_eval          # `import headbudget` does it too
    lm_eval.simple_evaluate(model="headbudget", model_args="pretrained=runs/prism/model",
                            tasks=["arc_easy"])
"""

from __future__ import annotations

from typing import Any

__all__ = ["evaluate_tasks", "evaluate_suite", "evaluate_harness", "register_lm_eval_model", "perplexity", "load_model_and_tokenizer", "TASKS", "get_task",
           "load_examples", "Scorer", "DataError"]

_LAZY = {
    "evaluate_tasks": "headbudget.evaluation.zeroshot",
    "Scorer": "headbudget.evaluation.scorer",
    "evaluate_suite": "headbudget.evaluation.suite",
    "evaluate_harness": "headbudget.evaluation.harness",
    "perplexity": "headbudget.evaluation.perplexity",
    "load_model_and_tokenizer": "headbudget.loading",
    "TASKS": "headbudget.evaluation.tasks",
    "get_task": "headbudget.evaluation.tasks",
    "load_examples": "headbudget.evaluation.tasks",
    "DataError": "headbudget.evaluation.tasks",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'headbudget.evaluation' has no attribute {name!r}")


def register_lm_eval_model() -> bool:
    """Register :class:`headbudget.evaluation.harness.HeadBudgetLM` with lm-eval as ``headbudget``,
    as a ``"module:Class"`` placeholder (nothing heavy is imported until lm-eval asks for it).
    False when lm-eval is not installed."""
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
