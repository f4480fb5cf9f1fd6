"""Text sources by spec string: a path or glob of text files (a document each, unless ``split_blank_lines``),
``jsonl:PATH[:FIELD]`` (FIELD defaults to ``text``), ``hf:NAME[:CONFIG]`` (streamed) and the built-in
``synthetic[:N_WORDS]``; docs/training.md tables them.

    >>> from headbudget.data.sources import read_source
    >>> src = read_source("synthetic:300", seed=1)
    >>> src.kind, len(src.documents) > 1
    ('synthetic', True)
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from headbudget.data import synthetic
from headbudget.io import iter_jsonl, read_text

DEFAULT_SYNTHETIC_WORDS = 1_000_000


class SourceError(ValueError):
    """A data source that cannot be read (message names the file/line/field)."""


@dataclass
class TextSource:
    """Documents read from a source plus a hash identifying their content."""

    spec: str
    kind: str
    documents: list[str]
    content_hash: str
    files: list[str] = field(default_factory=list)

    @property
    def n_chars(self) -> int:
        return sum(len(d) for d in self.documents)


def _resolve_files(pattern: str) -> list[str]:
    p = os.path.expanduser(pattern)
    files = sorted(glob.glob(p)) if any(c in p for c in "*?[") else [p]
    files = [f for f in files if os.path.isfile(f)]
    if not files:
        raise SourceError(f"data source {pattern!r}: no such file")
    return files


def jsonl_parts(rest: str) -> tuple[str, str]:
    """``PATH[:FIELD]`` -> (path, field); field defaults to ``text``."""
    if ":" in rest:
        path, fieldname = rest.rsplit(":", 1)
        if fieldname and "/" not in fieldname:
            return path, fieldname
    return rest, "text"


def source_key(spec: str, seed: int = 0, max_chars: int | None = None) -> str:
    """A cheap identity of the source content (file sizes+mtimes are not trusted: files are hashed)."""
    h = hashlib.sha256()
    h.update(f"{spec}|{max_chars}".encode())
    kind, _, rest = spec.partition(":")
    if kind == "synthetic":
        h.update(f"|grammar{synthetic.GRAMMAR_VERSION}|seed{seed}".encode())
    elif kind != "hf":  # hf: remote, identified by name/config/max_chars
        for f in _resolve_files(jsonl_parts(rest)[0] if kind == "jsonl" else spec):
            h.update(f.encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def _truncate(docs: list[str], max_chars: int | None) -> list[str]:
    if max_chars is None:
        return docs
    out, total = [], 0
    for d in docs:
        if total >= max_chars:
            break
        out.append(d[: max_chars - total])
        total += len(out[-1])
    return out


def read_source(spec: str, *, seed: int = 0, max_chars: int | None = None,
                split_blank_lines: bool = False) -> TextSource:
    """Read all documents of a source (see the module docstring for the spec forms)."""
    spec = spec.strip()
    kind, _, rest = spec.partition(":")
    if kind == "hf":
        docs = list(iter_hf_documents(spec, max_chars))
        h = hashlib.sha256()
        for d in docs:
            h.update(d.encode())
        return TextSource(spec, "hf", docs, h.hexdigest())
    files: list[str] = []
    docs = []
    if kind == "synthetic":
        try:
            n = int(rest.replace("_", "")) if rest else DEFAULT_SYNTHETIC_WORDS
        except ValueError:
            raise SourceError(f"bad data source {spec!r}: expected synthetic[:N_WORDS], e.g. synthetic:500000") from None
        docs = synthetic.generate_documents(n, seed)
    elif kind == "jsonl":
        path, fieldname = jsonl_parts(rest)
        files = _resolve_files(path)
        for f in files:
            for lineno, row in iter_jsonl(f, error=SourceError):
                if fieldname not in row:
                    raise SourceError(f"{f}:{lineno}: no field {fieldname!r} in this JSON line")
                if not isinstance(row[fieldname], str):
                    raise SourceError(f"{f}:{lineno}: field {fieldname!r} is not a string")
                docs.append(row[fieldname])
    else:
        kind, files = "text", _resolve_files(spec)
        for f in files:
            text = read_text(f)  # not UTF-8: one line naming the file and the byte offset
            docs += [p for p in text.split("\n\n") if p.strip()] if split_blank_lines else [text]
    return TextSource(spec, kind, _truncate(docs, max_chars), source_key(spec, seed, max_chars), files)


def iter_hf_documents(spec: str, max_chars: int | None, progress: bool = True) -> Iterator[str]:
    """Stream the ``text`` field of a Hugging Face dataset's train split, up to ``max_chars`` characters."""
    kind, _, rest = spec.partition(":")
    if kind != "hf" or not rest:
        raise SourceError(f"bad data source {spec!r}: expected hf:NAME[:CONFIG]")
    if max_chars is None:
        raise SourceError(f"data source {spec!r} is streamed: set data.max_chars to bound how much is read")
    try:
        import datasets
    except ImportError:
        raise SourceError("hf: data sources need the `datasets` package (pip install datasets)") from None
    from headbudget.progress import ProgressBar

    name, _, config = rest.partition(":")
    ds = datasets.load_dataset(name, config or None, split="train", streaming=True)
    total = 0
    with ProgressBar(total=max_chars, unit="char", unit_scale=True, desc=f"reading {name}", disable=not progress) as bar:
        for i, row in enumerate(ds):
            text = row.get("text")
            if not isinstance(text, str):
                raise SourceError(f"{spec}: row {i} has no string field 'text'")
            text = text[: max_chars - total]
            total += len(text)
            bar.update(len(text))
            yield text
            if total >= max_chars:
                return

