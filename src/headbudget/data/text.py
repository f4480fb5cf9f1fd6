"""The one text reader and the one JSONL reader of headbudget.

Every text file (corpus, config, task rows) is read as strict UTF-8: a file in another encoding is one
:class:`NotUTF8Error` line naming the file, the byte, its offset and its line (Python's own message
names neither the file nor the line), and a malformed JSON line names the file, the line and the column.

    >>> from headbudget.data.text import iter_jsonl, read_text
    >>> read_text("../shared/data/text/tinyshakespeare.txt")[:14]
    'First Citizen:'
    >>> next(iter_jsonl("tests/fixtures/data/tiny.jsonl"))       # (line number, row)
    (1, {'id': 0, 'body': 'document 0: The quick brown fox jumps over the lazy dog.'})
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class NotUTF8Error(ValueError):
    """A text file that is not UTF-8: names the file, the byte, its offset and line."""


def _not_utf8(path: str | os.PathLike, raw: bytes, exc: UnicodeDecodeError, base: int = 0,
              line: int | None = None) -> NotUTF8Error:
    offset = base + exc.start
    line = line if line is not None else raw.count(b"\n", 0, exc.start) + 1
    return NotUTF8Error(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {offset}, line {line})")


def read_text(source: str | os.PathLike, *, hf_config: str | None = None, split: str = "test",
              column: str = "text", flag: str = "--data") -> str:
    """The text of a UTF-8 file, or of a Hugging Face dataset ``name[:config]`` (its ``column`` joined with
    blank lines, as the HF perplexity guide's ``"\\n\\n".join(ds["text"])``).

    A source that looks like a path (has a suffix, starts with ``.``, ``/`` or ``~``, or is a folder) and
    is not a file is a ``FileNotFoundError`` naming ``flag`` and the path; it is never looked up as a
    dataset.  Another encoding than UTF-8 is a :class:`NotUTF8Error`.

    >>> read_text("corpus.txt")     # a latin-1 file: "corpus.txt: not UTF-8 text (byte 0xe9 at offset 41, line 2)"
    >>> read_text("wikitext:wikitext-2-raw-v1")[:4]                  # doctest: +SKIP
    ' = V'
    """
    p = Path(source)
    if p.is_file():
        raw = p.read_bytes()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _not_utf8(source, raw, exc) from None
    if p.suffix or str(source).startswith((".", "/", "~")) or p.is_dir():
        raise FileNotFoundError(f"{flag}: no file {source}")
    name, _, config = str(source).partition(":")
    import datasets

    try:
        ds = datasets.load_dataset(name, config or hf_config, split=split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds
        raise ValueError(f"{flag} {source!r}: not a file and not loadable as a dataset "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    if column not in ds.column_names:
        raise ValueError(f"{flag} {source!r}: no column {column!r} (columns: {ds.column_names})")
    return "\n\n".join(ds[column])


def iter_text_lines(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """``(line_number, line)`` (newline kept) of a UTF-8 file read line by line, so a large file is never
    held whole; bytes that are not UTF-8 are one :class:`NotUTF8Error` naming the file, offset and line."""
    offset = 0
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _not_utf8(path, raw, exc, base=offset, line=lineno) from None
            offset += len(raw)


def iter_jsonl(path: str | os.PathLike, *, error: type[ValueError] = ValueError
               ) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line_number, row)`` for each non-blank line of a JSONL file whose every line is a JSON object.

    A line that is not JSON, or not an object, raises ``error`` (the caller's ``ValueError`` subclass)
    naming ``path:line``; bytes that are not UTF-8 raise :class:`NotUTF8Error`.

    >>> list(iter_jsonl("rows.jsonl"))     # '{"a": 1}\\n\\n[2]\\n'
    Traceback (most recent call last):
    ValueError: rows.jsonl:3: expected a JSON object, got list
    """
    for lineno, line in iter_text_lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise error(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        yield lineno, row


__all__ = ["NotUTF8Error", "iter_jsonl", "iter_text_lines", "read_text"]
