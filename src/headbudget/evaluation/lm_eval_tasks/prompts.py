"""The prompts of headbudget's built-in tasks, named by the task files in this folder (``!function prompts.x``).

lm-eval imports this file by its path, headbudget without lm-eval (:mod:`headbudget.evaluation.tasks`) as a
module, so it imports nothing of headbudget.  A malformed row raises :class:`FieldError` naming the field.

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


# Field access helpers (they raise FieldError so that the loader can name file:line:field)


def _get(row: dict[str, Any], name: str, kind: type | tuple[type, ...] = str) -> Any:
    if name not in row:
        raise FieldError(name, "missing field")
    value = row[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        want = "/".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
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


# Each task's (text, choices, target), as its task file names them (the harness's prompts)


def _hellaswag_preprocess(text: str) -> str:
    """lm-evaluation-harness's hellaswag clean-up (WikiHow bracket artefacts)."""
    text = re.sub(r"\[.*?\]", "", text.strip().replace(" [title]", ". "))
    return text.replace("  ", " ")


def hellaswag_text(row: dict[str, Any]) -> str:
    label = _get(row, "activity_label")
    # None counts as absent: lm-eval's JSON reader (Arrow) fills a field other rows have with None
    if row.get("ctx_a") is not None and row.get("ctx_b") is not None:
        ctx_b = _get(row, "ctx_b").capitalize()
        return _hellaswag_preprocess(label + ": " + _get(row, "ctx_a") + " " + ctx_b)
    # Copies that only keep `ctx` (already cleaned, as in ../shared/data/zeroshot): use as it stands.
    return label + ": " + _get(row, "ctx")


def arc_target(row: dict[str, Any], key: str = "answerKey") -> int:
    labels = _str_list(row, "choices.label", _get(row, "choices", dict).get("label"))
    answer = _get(row, key, str).strip()
    if answer not in labels:
        raise FieldError(key, f"answer {answer!r} is not one of the choice labels {labels}")
    return labels.index(answer)


def arc_choices(row: dict[str, Any]) -> list[str]:
    return _str_list(row, "choices.text", _get(row, "choices", dict).get("text"))


def _winogrande_split(row: dict[str, Any]) -> int:
    sentence = _get(row, "sentence")
    if "_" not in sentence:
        raise FieldError("sentence", "no blank '_' in the sentence")
    return sentence.index("_")


def copa_text(row: dict[str, Any]) -> str:
    connector = {"cause": "because", "effect": "therefore"}
    question = _get(row, "question")
    if question not in connector:
        raise FieldError("question", f"expected 'cause' or 'effect', got {question!r}")
    return _get(row, "premise").strip()[:-1] + f" {connector[question]}"


def piqa_text(r: dict[str, Any]) -> str:
    return f"Question: {_get(r, 'goal')}\nAnswer:"


def piqa_choices(r: dict[str, Any]) -> list[str]:
    return [_get(r, "sol1"), _get(r, "sol2")]


def label_target(r: dict[str, Any]) -> int:
    return _int_label(r, "label")


def hellaswag_choices(r: dict[str, Any]) -> list[str]:
    return [_hellaswag_preprocess(e) for e in _str_list(r, "endings", _get(r, "endings", list))]


def question_answer_text(r: dict[str, Any]) -> str:
    return f"Question: {_get(r, 'question')}\nAnswer:"


def openbookqa_text(r: dict[str, Any]) -> str:
    return _get(r, "question_stem")


# winogrande's partial scoring: the choices are contexts (the sentence up to the blank, each option filled in)
# sharing one continuation: lm-eval's doc_to_text is the right context's index, doc_to_target the rest.
def winogrande_continuation(r: dict[str, Any]) -> str:
    return _get(r, "sentence")[_winogrande_split(r) + 1:].strip()


def winogrande_contexts(r: dict[str, Any]) -> list[str]:
    return [_get(r, "sentence")[:_winogrande_split(r)] + _get(r, o) for o in ("option1", "option2")]


def winogrande_answer(r: dict[str, Any]) -> int:
    return _int_label(r, "answer", base=1)


def copa_choices(r: dict[str, Any]) -> list[str]:
    # the harness's copa choices start with a space and are joined with the default " " delimiter
    return [" " + t[:1].lower() + t[1:] for t in (_get(r, "choice1"), _get(r, "choice2"))]
