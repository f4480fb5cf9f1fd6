"""Sentence(-pair) classification tasks for fine-tuning and head pruning: SST-5 and MNLI.

Each task reads its original distribution format (SST-5 PTB trees, GLUE MNLI TSV) or the Hugging Face
datasets schema as JSONL from a local directory (nothing is downloaded); the files and fields are listed
in docs/pruning-models.md.  Malformed input raises :class:`TaskDataError` (a ``ValueError``) naming the
file and line; a file that is not UTF-8 a :class:`headbudget.io.NotUTF8Error` naming the file, byte offset
and line.

    >>> from headbudget.data.classification import load_task, make_loader
    >>> data = load_task("sst5", "../shared/data/classification/sst5")           # doctest: +SKIP
    >>> data.num_labels, len(data.splits["dev"]), data.splits["dev"][0].label    # doctest: +SKIP
    (5, 1101, 3)
    >>> loader = make_loader(data.splits["train"], tokenizer, batch_size=32, shuffle=True, seed=0)  # doctest: +SKIP
"""

from __future__ import annotations

import csv
import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from headbudget.io import iter_jsonl, iter_text_lines


class TaskDataError(ValueError):
    """A malformed data file; the message names the file and line."""


@dataclass(frozen=True)
class Example:
    """One classification example (``text_pair`` is the hypothesis for NLI, else ``None``)."""

    text: str
    label: int
    text_pair: str | None = None


@dataclass
class TaskData:
    """A loaded task: its splits (name -> examples) and label set."""

    name: str
    num_labels: int
    label_names: tuple[str, ...]
    splits: dict[str, list[Example]]
    eval_splits: tuple[str, ...] = ()
    source: str = ""

    @property
    def train(self) -> list[Example]:
        return self.splits["train"]


@dataclass(frozen=True)
class ClassificationTask:
    """Registry entry: label set, split names and the loader ``loader(data_dir, splits) -> (splits, source)``."""

    name: str
    num_labels: int
    label_names: tuple[str, ...]
    splits: tuple[str, ...]
    eval_splits: tuple[str, ...]
    loader: Callable[[Path, Sequence[str]], tuple[dict[str, list[Example]], str]] = field(repr=False)
    sentence_pair: bool = False


# --------------------------------------------------------------------------- PTB trees (SST)
_PTB_UNESCAPE = {"-LRB-": "(", "-RRB-": ")", "-LSB-": "[", "-RSB-": "]", "-LCB-": "{", "-RCB-": "}"}
_PTB_TOKEN = re.compile(r"\(|\)|[^\s()]+")


def _unescape(word: str) -> str:
    return _PTB_UNESCAPE.get(word, word).replace("\\/", "/").replace("\\*", "*")


def parse_ptb_tree(line: str, where: str = "<tree>", num_labels: int = 5, unescape: bool = True) -> Example:
    """Parse one PTB tree ``(3 (2 It) (4 ...))``: the root label and the leaves joined by spaces; ``where``
    (``file:line``) prefixes any error."""
    tokens = _PTB_TOKEN.findall(line)
    if not tokens:
        raise TaskDataError(f"{where}: empty line (expected a PTB tree)")
    leaves: list[str] = []
    stack: list[list[int]] = []  # [label, n_children, has_leaf] of the open nodes
    root, n, pos = -1, len(tokens), 0
    while pos < n:
        tok = tokens[pos]
        if tok == "(":
            if root >= 0:
                raise TaskDataError(f"{where}: malformed PTB tree: trailing text after the root: "
                                    f"{' '.join(tokens[pos:])!r}")
            if stack and stack[-1][2]:
                raise TaskDataError(f"{where}: malformed PTB tree: a node mixes words and subtrees")
            if pos + 1 >= n or tokens[pos + 1] in ("(", ")"):
                raise TaskDataError(f"{where}: malformed PTB tree: node without a label")
            lab = tokens[pos + 1]
            if not lab.isdigit():
                raise TaskDataError(f"{where}: malformed PTB tree: label {lab!r} is not an integer")
            label = int(lab)
            if not 0 <= label < num_labels:
                raise TaskDataError(f"{where}: malformed PTB tree: label {label} outside 0..{num_labels - 1}")
            if stack:
                stack[-1][1] += 1
            stack.append([label, 0, 0])
            pos += 2
        elif tok == ")":
            if not stack:
                raise TaskDataError(f"{where}: malformed PTB tree: unbalanced parentheses (unexpected ')')")
            label, kids, has_leaf = stack.pop()
            if not kids and not has_leaf:
                raise TaskDataError(f"{where}: malformed PTB tree: node with label {label} has no children")
            if not stack:
                root = label
            pos += 1
        else:
            if not stack:
                raise TaskDataError(f"{where}: malformed PTB tree: expected '(' but got {tok!r}")
            if stack[-1][1]:
                raise TaskDataError(f"{where}: malformed PTB tree: a node mixes words and subtrees")
            # a leaf: usually one word, occasionally several ("8 1\\/2" in SST train)
            stack[-1][2] = 1
            leaves.append(_unescape(tok) if unescape else tok)
            pos += 1
    if stack:
        raise TaskDataError(f"{where}: malformed PTB tree: unbalanced parentheses (missing ')')")
    return Example(text=" ".join(leaves), label=root)


_LONE_CR = re.compile(r"(?<=\r)(?!\n)")


def _universal_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line_number, line)`` split at ``\\n``, ``\\r\\n`` and a lone ``\\r``, as a file opened in text mode
    splits them (how these readers read before :func:`~headbudget.io.iter_text_lines`, which splits at
    ``\\n`` only: a file with old Mac line ends was one line, and ``csv`` refuses a ``\\r`` inside one)."""
    lineno = 0
    for _, line in iter_text_lines(path):  # not UTF-8: names the file, offset and line
        for part in _LONE_CR.split(line) if "\r" in line else (line,):
            if part:
                lineno += 1
                yield lineno, part


def read_ptb_file(path: Path, num_labels: int = 5) -> list[Example]:
    """All trees of a PTB file (blank lines skipped); errors name ``file:line``."""
    return [parse_ptb_tree(line, f"{path}:{lineno}", num_labels)
            for lineno, line in _universal_lines(path) if line.strip()]


def _read_jsonl(path: Path, fields: Sequence[str], num_labels: int,
                skip_negative: bool = False) -> list[dict]:
    rows = []
    for lineno, row in iter_jsonl(path, error=TaskDataError):
        where = f"{path}:{lineno}"
        for f in (*fields, "label"):
            if f not in row:
                raise TaskDataError(f"{where}: missing field {f!r}")
        for f in fields:
            if not isinstance(row[f], str):
                raise TaskDataError(f"{where}: field {f!r} must be a string")
        label = row["label"]
        if isinstance(label, bool) or not isinstance(label, int):
            raise TaskDataError(f"{where}: field 'label' must be an integer, got {label!r}")
        if label < 0 and skip_negative:
            continue
        if not 0 <= label < num_labels:
            raise TaskDataError(f"{where}: field 'label' = {label} outside 0..{num_labels - 1}")
        rows.append(row)
    return rows


def _resolve_dir(data_dir: Path, task: str) -> Path:
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"{data_dir}: data directory not found for task {task!r}")
    return data_dir / task if (data_dir / task).is_dir() else data_dir


_MNLI_LABELS = ("entailment", "neutral", "contradiction")


def read_glue_mnli_tsv(path: Path) -> list[Example]:
    """A GLUE MNLI TSV (header with ``sentence1``, ``sentence2``, ``gold_label``); ``-`` gold labels skipped."""
    out = []
    lines = (line for _, line in _universal_lines(path))
    reader = csv.reader(lines, delimiter="\t", quoting=csv.QUOTE_NONE)
    try:
        header = next(reader)
    except StopIteration:
        raise TaskDataError(f"{path}:1: empty file (expected a TSV header)") from None
    missing = [c for c in ("sentence1", "sentence2", "gold_label") if c not in header]
    if missing:
        raise TaskDataError(f"{path}:1: header lacks column(s) {', '.join(missing)}")
    i1, i2, il = header.index("sentence1"), header.index("sentence2"), header.index("gold_label")
    for lineno, row in enumerate(reader, 2):
        if not row or (len(row) == 1 and not row[0].strip()):
            continue
        if len(row) != len(header):
            raise TaskDataError(f"{path}:{lineno}: expected {len(header)} tab-separated columns, "
                                f"got {len(row)}")
        gold = row[il].strip()
        if gold == "-":
            continue
        if gold not in _MNLI_LABELS:
            raise TaskDataError(f"{path}:{lineno}: gold_label {gold!r} is not one of "
                                f"{', '.join(_MNLI_LABELS)}")
        out.append(Example(row[i1], _MNLI_LABELS.index(gold), row[i2]))
    return out


def _sst5_jsonl(path: Path) -> list[Example]:
    return [Example(r["text"], r["label"]) for r in _read_jsonl(path, ["text"], 5)]


def _mnli_jsonl(path: Path) -> list[Example]:
    rows = _read_jsonl(path, ["premise", "hypothesis"], 3, skip_negative=True)
    return [Example(r["premise"], r["label"], r["hypothesis"]) for r in rows]


#: task -> (original file suffix, reader, format name), (JSONL reader, format name), HF names of its splits
_FORMATS: dict[str, tuple[Any, ...]] = {
    "sst5": ((".txt", read_ptb_file, "ptb"), (_sst5_jsonl, "setfit-jsonl"), {"dev": "validation"}),
    "mnli": ((".tsv", read_glue_mnli_tsv, "glue-tsv"), (_mnli_jsonl, "hf-glue-jsonl"),
             {"dev_matched": "validation_matched", "dev_mismatched": "validation_mismatched"}),
}


def _load_splits(task: str, data_dir: Path, splits: Sequence[str]) -> tuple[dict[str, list[Example]], str]:
    """Each split from its original file, else from its HF JSONL (``<HF split name>.jsonl`` or
    ``<split>.jsonl``); and the formats read, e.g. ``"glue-tsv+hf-glue-jsonl"``."""
    d = _resolve_dir(data_dir, task)
    (suffix, read_native, native_kind), (read_jsonl, jsonl_kind), hf_names = _FORMATS[task]
    out: dict[str, list[Example]] = {}
    sources = set()
    for split in splits:
        native, jl = d / f"{split}{suffix}", [d / f"{hf_names.get(split, split)}.jsonl", d / f"{split}.jsonl"]
        found = next((p for p in jl if p.exists()), None)
        if native.exists():
            out[split], kind = read_native(native), native_kind
        elif found is not None:
            out[split], kind = read_jsonl(found), jsonl_kind
        else:
            raise FileNotFoundError(f"{d}: no {split} split for {task} "
                                    f"(looked for {native.name} or {jl[0].name})")
        sources.add(kind)
    return out, "+".join(sorted(sources))


TASKS: dict[str, ClassificationTask] = {
    "sst5": ClassificationTask(
        name="sst5", num_labels=5,
        label_names=("very negative", "negative", "neutral", "positive", "very positive"),
        splits=("train", "dev", "test"), eval_splits=("dev", "test"), loader=partial(_load_splits, "sst5")),
    "mnli": ClassificationTask(
        name="mnli", num_labels=3, label_names=_MNLI_LABELS, sentence_pair=True,
        splits=("train", "dev_matched", "dev_mismatched"),
        eval_splits=("dev_matched", "dev_mismatched"), loader=partial(_load_splits, "mnli")),
}


def get_task(name: str) -> ClassificationTask:
    """The registry entry for ``name`` (``ValueError`` listing the known tasks otherwise)."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None


def load_task(name: str, data_dir: str | Path, splits: Sequence[str] | None = None) -> TaskData:
    """Load ``splits`` (default: all of the task's splits) from ``data_dir`` (or ``data_dir/<name>``)."""
    spec = get_task(name)
    wanted = tuple(splits) if splits is not None else spec.splits
    bad = [s for s in wanted if s not in spec.splits]
    if bad:
        raise ValueError(f"task {name}: unknown split(s) {', '.join(bad)}; "
                         f"splits are {', '.join(spec.splits)}")
    data, source = spec.loader(Path(data_dir), wanted)
    for split, rows in data.items():
        if not rows:
            raise TaskDataError(f"task {name}: split {split!r} in {data_dir} has no examples")
    return TaskData(name=spec.name, num_labels=spec.num_labels, label_names=spec.label_names, splits=data,
                    eval_splits=tuple(s for s in spec.eval_splits if s in data), source=source)


# --------------------------------------------------------------------------- batching
class ClassificationCollator:
    """Tokenizes a list of :class:`Example` with dynamic padding (to the longest in the batch): ``input_ids``,
    ``attention_mask`` (+ ``token_type_ids`` when the tokenizer makes them) and ``labels``; sequences are
    truncated to ``max_length`` tokens."""

    def __init__(self, tokenizer: Any, max_length: int = 128) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length

    def __call__(self, batch: Sequence[Example]) -> dict[str, torch.Tensor]:
        texts = [[ex.text for ex in batch]]
        if any(ex.text_pair is not None for ex in batch):
            texts.append([ex.text_pair or "" for ex in batch])
        enc = self.tokenizer(*texts, padding=True, truncation=True, max_length=self.max_length,
                             return_tensors="pt")
        out = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        out["labels"] = torch.tensor([ex.label for ex in batch], dtype=torch.long)
        return out


def make_loader(examples: Sequence[Example], tokenizer: Any, batch_size: int = 32, shuffle: bool = False,
                seed: int = 0, max_length: int = 128) -> torch.utils.data.DataLoader:
    """A ``DataLoader`` over ``examples`` with :class:`ClassificationCollator` (seeded shuffling)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(list(examples), batch_size=batch_size, shuffle=shuffle,
                                       generator=gen if shuffle else None,
                                       collate_fn=ClassificationCollator(tokenizer, max_length))


def subsample(examples: Sequence[Example], n: int | None, seed: int = 0) -> list[Example]:
    """A seeded random subset of ``n`` examples (all of them when ``n`` is None or larger)."""
    if n is None or n >= len(examples):
        return list(examples)
    return [examples[i] for i in sorted(random.Random(seed).sample(range(len(examples)), n))]


def iter_batches(examples: Sequence[Example], batch_size: int) -> Iterator[list[Example]]:
    """Consecutive batches of examples (no shuffling)."""
    for i in range(0, len(examples), batch_size):
        yield list(examples[i : i + batch_size])


__all__ = ["TASKS", "ClassificationCollator", "Example", "TaskData", "TaskDataError", "ClassificationTask",
           "get_task", "iter_batches", "load_task", "make_loader", "parse_ptb_tree", "read_glue_mnli_tsv",
           "read_ptb_file", "subsample"]
