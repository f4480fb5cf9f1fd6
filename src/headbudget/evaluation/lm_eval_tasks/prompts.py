"""The prompts of headbudget's built-in tasks, named by the task files in this folder (``!function prompts.x``).

lm-eval imports this file by its path when it reads a task file; headbudget's own path without lm-eval
(:mod:`headbudget.evaluation.tasks`) imports it as ``headbudget.evaluation.lm_eval_tasks.prompts``.  So it imports
nothing of headbudget: both build the same ``(context, continuation)`` pairs, as lm-evaluation-harness's default
task of the same name builds them.  A malformed row raises :class:`FieldError` naming the field.

    >>> piqa_text({"goal": "Open a jar", "sol1": "twist", "sol2": "bite", "label": 1})
    'Question: Open a jar\\nAnswer:'
"""

from __future__ import annotations

import re
from typing import Any


class FieldError(ValueError):
    """Raised by the ``doc_to_*`` helpers: ``field`` is the offending row field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# --------------------------------------------------------------------------------------------
# Field access helpers (they raise FieldError so that the loader can name file:line:field)


def _get(row: dict[str, Any], name: str, kind: type | tuple[type, ...] = str) -> Any:
    if name not in row:
        raise FieldError(name, "missing field")
    value = row[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        want = "/".join(k.__name__ for k in kinds)
        raise FieldError(name, f"expected {want}, got {type(value).__name__} {value!r:.60}")
    return value


def _str_list(row: dict[str, Any], name: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise FieldError(name, f"expected a non-empty list of strings, got {value!r:.80}")
    return value


def _int_label(row: dict[str, Any], name: str, base: int = 0) -> int:
    """A label stored as an int or a numeric string (``"0"``, ``"2"``), minus ``base``."""
    value = _get(row, name, (int, str))
    try:
        return int(value) - base
    except ValueError:
        raise FieldError(name, f"expected an integer label, got {value!r:.40}") from None


# --------------------------------------------------------------------------------------------
# Per-task row -> (text, choices, target) functions (the harness's prompts)


def _hellaswag_preprocess(text: str) -> str:
    """lm-evaluation-harness's hellaswag clean-up (WikiHow bracket artefacts)."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag_text(row: dict[str, Any]) -> str:
    label = _get(row, "activity_label")
    # None counts as absent: lm-eval's JSON reader (Arrow) fills a field other rows have with None
    if row.get("ctx_a") is not None and row.get("ctx_b") is not None:
        ctx_b = _get(row, "ctx_b")
        ctx = _get(row, "ctx_a") + " " + ctx_b.capitalize()
        return _hellaswag_preprocess(label + ": " + ctx)
    # Copies that only keep `ctx` (already cleaned, as in ../shared/data/zeroshot): use as it stands.
    return label + ": " + _get(row, "ctx")


def _arc_target(row: dict[str, Any], key: str = "answerKey") -> int:
    choices = _get(row, "choices", dict)
    labels = _str_list(row, "choices.label", choices.get("label"))
    answer = _get(row, key, str).strip()
    if answer not in labels:
        raise FieldError(key, f"answer {answer!r} is not one of the choice labels {labels}")
    return labels.index(answer)


def _arc_choices(row: dict[str, Any]) -> list[str]:
    return _str_list(row, "choices.text", _get(row, "choices", dict).get("text"))


def _winogrande_split(row: dict[str, Any]) -> int:
    sentence = _get(row, "sentence")
    if "_" not in sentence:
        raise FieldError("sentence", "no blank '_' in the sentence")
    return sentence.index("_")


def _copa_choice(text: str) -> str:
    return text[0].lower() + text[1:] if text else text


def _copa_text(row: dict[str, Any]) -> str:
    connector = {"cause": "because", "effect": "therefore"}
    question = _get(row, "question")
    if question not in connector:
        raise FieldError("question", f"expected 'cause' or 'effect', got {question!r}")
    return _get(row, "premise").strip()[:-1] + f" {connector[question]}"


# --------------------------------------------------------------------------------------------
# Each task's (text, choices, target), as its task file names them


def piqa_text(r: dict[str, Any]) -> str:
    return f"Question: {_get(r, 'goal')}\nAnswer:"


def piqa_choices(r: dict[str, Any]) -> list[str]:
    return [_get(r, "sol1"), _get(r, "sol2")]


def label_target(r: dict[str, Any]) -> int:
    return _int_label(r, "label")


hellaswag_text = _hellaswag_text


def hellaswag_choices(r: dict[str, Any]) -> list[str]:
    return [_hellaswag_preprocess(e) for e in _str_list(r, "endings", _get(r, "endings", list))]


def question_answer_text(r: dict[str, Any]) -> str:
    return f"Question: {_get(r, 'question')}\nAnswer:"


arc_choices, arc_target = _arc_choices, _arc_target


def openbookqa_text(r: dict[str, Any]) -> str:
    return _get(r, "question_stem")


# winogrande is scored by partial evaluation: the choices are contexts (the sentence up to the blank, each option
# filled in) and all of them share one continuation (the rest of the sentence).  In lm-eval's terms doc_to_text is
# the index of the right context, doc_to_choice the contexts and doc_to_target the shared continuation.
def winogrande_continuation(r: dict[str, Any]) -> str:
    return _get(r, "sentence")[_winogrande_split(r) + 1:].strip()


def winogrande_contexts(r: dict[str, Any]) -> list[str]:
    return [_get(r, "sentence")[:_winogrande_split(r)] + _get(r, o) for o in ("option1", "option2")]


def winogrande_answer(r: dict[str, Any]) -> int:
    return _int_label(r, "answer", base=1)


copa_text = _copa_text


def copa_choices(r: dict[str, Any]) -> list[str]:
    # the harness's copa choices start with a space and are joined with the default " " delimiter
    return [" " + _copa_choice(_get(r, c)) for c in ("choice1", "choice2")]
