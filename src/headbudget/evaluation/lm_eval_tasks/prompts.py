"""The prompts of headbudget's built-in tasks, for lm-eval's YAML files in this folder.

Each function is the :class:`headbudget.evaluation.tasks.TaskSpec`'s own (one definition), so a task
read through lm-eval builds the same ``(context, continuation)`` pairs as the built-in path that runs
without lm-eval, and both are scored by the same scorer and tokenizer path::

    # piqa.yaml
    doc_to_text: !function prompts.piqa_text

    >>> piqa_text({"goal": "Open a jar", "sol1": "twist", "sol2": "bite", "label": 1})
    'Question: Open a jar\\nAnswer:'
"""

from __future__ import annotations

from headbudget.evaluation.tasks import get_task


def _prompts(name: str) -> tuple:
    spec = get_task(name)
    return spec.doc_to_text, spec.doc_to_choice, spec.doc_to_target


piqa_text, piqa_choices, piqa_target = _prompts("piqa")
hellaswag_text, hellaswag_choices, hellaswag_target = _prompts("hellaswag")
arc_easy_text, arc_easy_choices, arc_easy_target = _prompts("arc_easy")
arc_challenge_text, arc_challenge_choices, arc_challenge_target = _prompts("arc_challenge")
openbookqa_text, openbookqa_choices, openbookqa_target = _prompts("openbookqa")
copa_text, copa_choices, copa_target = _prompts("copa")
# winogrande is scored by partial evaluation: in lm-eval's terms doc_to_text is the index of the right
# context, doc_to_choice the contexts (the sentence up to the blank, each option filled in) and
# doc_to_target the continuation all of them share -- the TaskSpec's text/choices/target in that order.
winogrande_continuation, winogrande_contexts, winogrande_answer = _prompts("winogrande")
