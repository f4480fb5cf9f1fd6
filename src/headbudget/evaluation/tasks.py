"""Zero-shot multiple-choice tasks, declared as data: headbudget's task files are lm-eval YAML
(``lm_eval_tasks/<task>.yaml``, prompts in ``prompts.py`` there), read by lm-eval when it is installed and
by :func:`read_task_file` when it is not, so both paths build the same examples, as lm-evaluation-harness's
task of the same name (continuation ``target_delimiter + choice``; with ``partial=True``, winogrande's
partial scoring, the choices are contexts sharing one continuation).  A malformed row is a
:class:`DataError` naming the file, the line and the field.

    >>> ex = get_task("piqa").example({"goal": "Open a jar", "sol1": "twist", "sol2": "bite", "label": 1})
    >>> ex.contexts[0], ex.continuations, ex.target
    ('Question: Open a jar\\nAnswer:', [' twist', ' bite'], 1)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from headbudget import io
from headbudget.evaluation.lm_eval_tasks import prompts
from headbudget.evaluation.lm_eval_tasks.prompts import FieldError
from headbudget.evaluation.task_code import BUILTIN_TASKS_DIR


class DataError(ValueError):
    """A malformed task row; the message names the file, the line and the field."""


@dataclass(frozen=True)
class MCExample:
    """One multiple-choice item: choice ``i`` is scored as log P(``continuations[i]`` | ``contexts[i]``),
    ``norm_lengths[i]`` is the character length ``acc_norm`` divides by."""

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
    target_field: str = "label"  # the row field a bad label is named by

    def example(self, row: dict[str, Any]) -> MCExample:
        """Build the scored example of one row (raises :class:`FieldError` on a bad row)."""
        if not isinstance(row, dict):
            raise FieldError("<row>", f"expected a JSON object, got {type(row).__name__}")
        choices = self.doc_to_choice(row)
        target = self.doc_to_target(row)
        if not 0 <= target < len(choices):
            raise FieldError(self.target_field, f"label {target} out of range for {len(choices)} choices")
        lengths = [float(len(c)) for c in choices]
        if self.partial:
            return MCExample(list(choices), [self.target_delimiter + self.doc_to_text(row)] * len(choices),
                             target, lengths)
        return MCExample([self.doc_to_text(row)] * len(choices), [self.target_delimiter + c for c in choices],
                         target, lengths)


class _TaskFileLoader(yaml.SafeLoader):
    """Reads a built-in task file, keeping ``!function prompts.x`` as the name ``x``."""


_TaskFileLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node).partition(".")[2])


def read_task_file(path: str | Path) -> TaskSpec:
    """The :class:`TaskSpec` of one of headbudget's task files (lm-eval YAML), its prompts from ``prompts.py``."""
    cfg = yaml.load(io.read_text(path), Loader=_TaskFileLoader)  # noqa: S506 (a SafeLoader with one tag more)
    meta = cfg["metadata"]
    text, choices, target = (getattr(prompts, cfg[k]) for k in ("doc_to_text", "doc_to_choice", "doc_to_target"))
    if meta.get("partial_scoring"):  # lm-eval's terms: text is the right context's index, target the continuation
        text, target = target, text
    return TaskSpec(name=cfg["task"], local_file=meta["local_file"], hf_path=cfg["dataset_path"],
                    hf_name=cfg.get("dataset_name"), hf_split=cfg.get("test_split") or cfg["validation_split"],
                    doc_to_text=text, doc_to_choice=choices, doc_to_target=target,
                    partial=bool(meta.get("partial_scoring")), metrics=tuple(m["metric"] for m in cfg["metric_list"]),
                    target_delimiter=cfg.get("target_delimiter", " "), target_field=meta.get("label_field", "label"))


#: headbudget's built-in zero-shot tasks, read from its task files
TASKS: dict[str, TaskSpec] = {spec.name: spec for spec in map(read_task_file, sorted(BUILTIN_TASKS_DIR.glob("*.yaml")))}


def get_task(name: str) -> TaskSpec:
    """The built-in task ``name``; a ``ValueError`` listing the known tasks otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None


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
    """The first ``limit`` examples of ``task`` (all when ``None``), from ``data_dir / spec.local_file``
    (JSONL, Hugging Face schema) or else the hub (``datasets.load_dataset(hf_path, hf_name, split=...)``).

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
