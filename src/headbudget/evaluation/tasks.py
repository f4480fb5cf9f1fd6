"""Zero-shot multiple-choice tasks, declared as data.

Each :class:`TaskSpec` says where the rows come from (a local JSONL file name, or a Hugging Face
dataset path/config/split) and how a row becomes a multiple-choice example, exactly as
lm-evaluation-harness's default task of the same name builds it:

* ``doc_to_text(row) -> str``: the context (prompt);
* ``doc_to_choice(row) -> list[str]``: the choices;
* ``doc_to_target(row) -> int``: the index of the right choice;
* ``partial=True`` (winogrande's *partial scoring*): the choices are *contexts* and every choice
  is scored on the same continuation ``doc_to_text(row)``.

The continuation scored is ``target_delimiter + choice`` (a single space by default) and ``acc_norm``
divides by ``len(choice)`` in characters (without the delimiter), as the harness does.

Adding a task is a few lines::

    >>> from headbudget.evaluation.tasks import TASKS, TaskSpec, register_task, get_task
    >>> get_task("arc_easy").local_file
    'arc_easy_test.jsonl'
    >>> ex = get_task("piqa").example({"goal": "Open a jar", "sol1": "twist", "sol2": "bite",
    ...                                 "label": 1})
    >>> ex.contexts[0], ex.continuations, ex.target
    ('Question: Open a jar\\nAnswer:', [' twist', ' bite'], 1)

Malformed rows raise :class:`DataError` naming the file, the line and the field.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from headbudget import io


class DataError(ValueError):
    """A malformed task row; the message names the file, the line and the field."""


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


@dataclass(frozen=True)
class MCExample:
    """One multiple-choice item, ready to score.

    Choice ``i`` is scored as log P(``continuations[i]`` | ``contexts[i]``); ``norm_lengths[i]`` is
    the character length ``acc_norm`` divides by.
    """

    contexts: list[str]
    continuations: list[str]
    target: int
    norm_lengths: list[float]
    where: str = ""  # "file:line" of the row, for error messages


@dataclass(frozen=True)
class TaskSpec:
    """A zero-shot multiple-choice task, as lm-evaluation-harness defines it."""

    name: str
    local_file: str
    hf_path: str
    hf_name: str | None
    hf_split: str
    doc_to_text: Callable[[dict[str, Any]], str]
    doc_to_choice: Callable[[dict[str, Any]], list[str]]
    doc_to_target: Callable[[dict[str, Any]], int]
    partial: bool = False
    metrics: tuple[str, ...] = ("acc", "acc_norm")
    target_delimiter: str = " "
    notes: str = field(default="", compare=False)

    def example(self, row: dict[str, Any]) -> MCExample:
        """Build the scored example of one row (raises :class:`FieldError` on a bad row)."""
        if not isinstance(row, dict):
            raise FieldError("<row>", f"expected a JSON object, got {type(row).__name__}")
        choices = self.doc_to_choice(row)
        target = self.doc_to_target(row)
        if not 0 <= target < len(choices):
            raise FieldError(self.target_field, f"label {target} out of range for "
                             f"{len(choices)} choices")
        if self.partial:
            cont = self.target_delimiter + self.doc_to_text(row)
            return MCExample(list(choices), [cont] * len(choices), target,
                             [float(len(c)) for c in choices])
        text = self.doc_to_text(row)
        return MCExample([text] * len(choices), [self.target_delimiter + c for c in choices],
                         target, [float(len(c)) for c in choices])

    @property
    def target_field(self) -> str:
        return _TARGET_FIELD.get(self.name, "label")


_TARGET_FIELD: dict[str, str] = {}
TASKS: dict[str, TaskSpec] = {}


def register_task(spec: TaskSpec, target_field: str = "label") -> TaskSpec:
    """Add ``spec`` to :data:`TASKS` (``target_field`` names the label field in error messages)."""
    TASKS[spec.name] = spec
    _TARGET_FIELD[spec.name] = target_field
    return spec


def get_task(name: str) -> TaskSpec:
    """The registered task ``name``; a ``ValueError`` listing the known tasks otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None


register_task(TaskSpec(
    name="piqa", local_file="piqa_validation.jsonl",
    hf_path="baber/piqa", hf_name=None, hf_split="validation",
    doc_to_text=lambda r: f"Question: {_get(r, 'goal')}\nAnswer:",
    doc_to_choice=lambda r: [_get(r, "sol1"), _get(r, "sol2")],
    doc_to_target=lambda r: _int_label(r, "label"),
))
register_task(TaskSpec(
    name="hellaswag", local_file="hellaswag_validation.jsonl",
    hf_path="Rowan/hellaswag", hf_name=None, hf_split="validation",
    doc_to_text=_hellaswag_text,
    doc_to_choice=lambda r: [_hellaswag_preprocess(e)
                             for e in _str_list(r, "endings", _get(r, "endings", list))],
    doc_to_target=lambda r: _int_label(r, "label"),
))
for _name, _config in (("arc_easy", "ARC-Easy"), ("arc_challenge", "ARC-Challenge")):
    register_task(TaskSpec(
        name=_name, local_file=f"{_name}_test.jsonl",
        hf_path="allenai/ai2_arc", hf_name=_config, hf_split="test",
        doc_to_text=lambda r: f"Question: {_get(r, 'question')}\nAnswer:",
        doc_to_choice=_arc_choices,
        doc_to_target=_arc_target,
    ), target_field="answerKey")
register_task(TaskSpec(
    name="openbookqa", local_file="openbookqa_test.jsonl",
    hf_path="allenai/openbookqa", hf_name="main", hf_split="test",
    doc_to_text=lambda r: _get(r, "question_stem"),
    doc_to_choice=_arc_choices,
    doc_to_target=_arc_target,
), target_field="answerKey")
register_task(TaskSpec(
    name="winogrande", local_file="winogrande_validation.jsonl",
    hf_path="allenai/winogrande", hf_name="winogrande_xl", hf_split="validation",
    # partial scoring: choices are the sentence up to the blank with each option filled in,
    # the shared continuation is the rest of the sentence.
    doc_to_text=lambda r: _get(r, "sentence")[_winogrande_split(r) + 1:].strip(),
    doc_to_choice=lambda r: [_get(r, "sentence")[:_winogrande_split(r)] + _get(r, o)
                             for o in ("option1", "option2")],
    doc_to_target=lambda r: _int_label(r, "answer", base=1),
    partial=True, metrics=("acc",),
), target_field="answer")
register_task(TaskSpec(
    name="copa", local_file="copa_validation.jsonl",
    hf_path="aps/super_glue", hf_name="copa", hf_split="validation",
    doc_to_text=_copa_text,
    # the harness's copa choices start with a space and are joined with the default " " delimiter
    doc_to_choice=lambda r: [" " + _copa_choice(_get(r, c)) for c in ("choice1", "choice2")],
    doc_to_target=lambda r: _int_label(r, "label"),
    metrics=("acc",),
))


# --------------------------------------------------------------------------------------------
# Loading


#: ``(line_number, row)`` of a task's JSONL file (:func:`headbudget.io.iter_jsonl`); a bad line is a DataError
iter_jsonl = functools.partial(io.iter_jsonl, error=DataError)


def _examples(spec: TaskSpec, rows: Iterator[tuple[int, Any]], source: str,
              limit: int | None) -> list[MCExample]:
    out: list[MCExample] = []
    for lineno, row in rows:
        if limit is not None and len(out) >= limit:
            break
        try:
            ex = spec.example(row)
        except FieldError as exc:
            raise DataError(f"{source}:{lineno}: field {exc.field!r}: {exc}") from None
        out.append(replace(ex, where=f"{source}:{lineno}"))
    if not out:
        raise DataError(f"{source}: no rows for task {spec.name!r}")
    return out


def load_examples(task: str | TaskSpec, data_dir: str | Path | None = None,
                  limit: int | None = None) -> list[MCExample]:
    """The first ``limit`` examples of ``task`` (all when ``None``).

    With ``data_dir``, rows come from ``data_dir / spec.local_file`` (JSONL, Hugging Face schema);
    otherwise from the hub through ``datasets.load_dataset(hf_path, hf_name, split=hf_split)``.

        >>> exs = load_examples("piqa", "../shared/data/zeroshot", limit=10)  # doctest: +SKIP
    """
    spec = get_task(task) if isinstance(task, str) else task
    if data_dir is not None:
        path = Path(data_dir) / spec.local_file
        if not path.is_file():
            raise FileNotFoundError(f"task {spec.name!r}: no file {path} "
                                    f"(expected {spec.local_file} in --data-dir)")
        return _examples(spec, iter_jsonl(path), str(path), limit)
    import datasets  # heavy: only when the hub is used

    split = spec.hf_split if limit is None else f"{spec.hf_split}[:{limit}]"
    ds = datasets.load_dataset(spec.hf_path, spec.hf_name, split=split)
    source = f"hf:{spec.hf_path}" + (f"/{spec.hf_name}" if spec.hf_name else "") + f"[{spec.hf_split}]"
    return _examples(spec, ((i + 1, dict(r)) for i, r in enumerate(ds)), source, limit)
