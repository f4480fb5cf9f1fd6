"""Evaluation: zero-shot multiple choice (lm-evaluation-harness's numbers) and perplexity.

    from headbudget.evaluation import evaluate_tasks, perplexity, load_model_and_tokenizer
    model, tok = load_model_and_tokenizer("runs/prism", tokenizer="../shared/data/tokenizers/gpt2")
    report = evaluate_tasks(model, tok, ["piqa", "arc_easy"], data_dir="../shared/data/zeroshot",
                            limit=200)
    ppl = perplexity(model, tok, open("../shared/data/text/wikitext2_valid.tokens").read(),
                     context=1024, stride=512)

Heavy modules (transformers, datasets) are imported lazily.
"""

from __future__ import annotations

from typing import Any

__all__ = ["evaluate_tasks", "perplexity", "load_model_and_tokenizer", "TASKS", "get_task",
           "load_examples", "Scorer", "DataError"]

_LAZY = {
    "evaluate_tasks": "headbudget.evaluation.zeroshot",
    "Scorer": "headbudget.evaluation.zeroshot",
    "perplexity": "headbudget.evaluation.perplexity",
    "load_model_and_tokenizer": "headbudget.evaluation.loading",
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
