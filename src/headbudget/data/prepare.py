"""Prepare a source for training: tokenize once into train/val memmaps, cached by content.

A prepared directory holds ``train.bin``/``val.bin`` (flat ids, each document followed by the end-of-text id),
``tokenizer/`` and ``meta.json``, written last (every file goes to a temporary name first), so a directory
with a meta file is complete; an unchanged source + tokenizer + split reuses it.  See docs/training.md.

    >>> import tempfile
    >>> d = prepare_data("synthetic:2000", "byte", tempfile.mkdtemp(), progress=False)
    >>> d.meta["dtype"], d.meta["train_tokens"] > d.meta["val_tokens"] > 0
    ('uint16', True)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from headbudget.data.sources import read_source, source_key
from headbudget.io import atomic_write_json
from headbudget.models.tokenizers import Tokenizer, make_tokenizer, read_tokenizer

PREP_VERSION = 1
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "headbudget", "data")
_CHUNK_CHARS = 1 << 20


@dataclass
class PreparedData:
    """A prepared dataset directory; ``train``/``val`` open read-only memmaps."""

    directory: Path
    meta: dict[str, Any]
    tokenizer: Tokenizer
    reused: bool = False

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    def tokens(self, split: str) -> np.memmap:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        return np.memmap(self.directory / f"{split}.bin", dtype=self.dtype, mode="r")

    @property
    def train(self) -> np.memmap:
        return self.tokens("train")

    @property
    def val(self) -> np.memmap:
        return self.tokens("val")


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocab <= 65,535), else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def default_cache_dir() -> Path:
    return Path(os.environ.get("HEADBUDGET_DATA_CACHE", os.path.expanduser(DEFAULT_CACHE_DIR)))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[-40:] or "data"


def split_documents(docs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Deterministic train/val split: the last ``val_fraction`` of documents, or of the text when the
    source has fewer than 20 documents (cut at a line boundary)."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    if len(docs) >= 20:
        n_val = max(1, math.ceil(len(docs) * val_fraction))
        return docs[:-n_val], docs[-n_val:]
    text = "\n\n".join(docs)
    cut = int(len(text) * (1 - val_fraction))
    nl = text.find("\n", cut)
    cut = nl + 1 if 0 <= nl < len(text) - 1 else cut
    if cut <= 0 or cut >= len(text):
        raise ValueError(f"source is too small to split off a validation set ({len(text)} characters)")
    return [text[:cut]], [text[cut:]]


def _pieces(doc: str) -> list[str]:
    """Cut very long documents at line boundaries so tokenizing shows progress and bounds memory."""
    if len(doc) <= _CHUNK_CHARS:
        return [doc]
    out, start = [], 0
    while start < len(doc):
        end = doc.find("\n", start + _CHUNK_CHARS)
        end = len(doc) if end < 0 else end + 1
        out.append(doc[start:end])
        start = end
    return out


class _TokenWriter:
    """Append documents' token ids (+ EOS) to a temporary file; ``close`` renames it into place."""

    def __init__(self, path: Path, tok: Tokenizer, dtype: np.dtype, bar: Any = None) -> None:
        self.path, self.tok, self.dtype, self.bar = path, tok, dtype, bar
        self.tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        self.f = open(self.tmp, "wb")
        self.n = self.n_docs = 0
        self.batch: list[str] = []
        self.ends: list[bool] = []  # whether the piece closes a document (then EOS follows)
        self.limit = np.iinfo(dtype).max

    def add(self, doc: str) -> None:
        pieces = _pieces(doc)
        for i, piece in enumerate(pieces):
            self.batch.append(piece)
            self.ends.append(i == len(pieces) - 1)
            if len(self.batch) >= 512 or sum(len(b) for b in self.batch) >= _CHUNK_CHARS:
                self.flush()
        self.n_docs += 1

    def flush(self) -> None:
        if not self.batch:
            return
        for ids, end in zip(self.tok.encode_batch(self.batch), self.ends):
            arr = np.asarray(ids + ([self.tok.eos_id] if end else []), dtype=np.int64)
            if arr.size and (arr.max() > self.limit or arr.min() < 0):
                raise ValueError(f"token id {int(arr.max())} does not fit {self.dtype} ({self.tok.spec})")
            self.f.write(arr.astype(self.dtype).tobytes())
            self.n += arr.size
        if self.bar is not None:
            self.bar.update(sum(len(b) for b in self.batch))
        self.batch.clear()
        self.ends.clear()

    def close(self) -> int:
        self.flush()
        self.f.close()
        os.replace(self.tmp, self.path)
        return self.n


def _write_tokens(path: Path, docs: list[str], tok: Tokenizer, dtype: np.dtype, desc: str,
                  progress: bool) -> int:
    from headbudget.progress import ProgressBar

    with ProgressBar(total=sum(len(d) for d in docs), unit="char", unit_scale=True, desc=desc,
                     disable=not progress, leave=False) as bar:
        w = _TokenWriter(path, tok, dtype, bar)
        for doc in docs:
            w.add(doc)
        return w.close()


#: characters of a streamed source used to train a ``bpe:N`` tokenizer
BPE_TRAIN_CHARS = 200_000_000


def _prepare_streamed(source: str, tokenizer: str, directory: Path, *, val_fraction: float,
                      max_chars: int | None, progress: bool) -> tuple[dict[str, Any], Tokenizer]:
    """``hf:`` sources: one streaming pass, every k-th document to validation (k = 1/val_fraction),
    memory bounded by a batch (plus the BPE training sample when the tokenizer is ``bpe:N``)."""
    from headbudget.data.sources import iter_hf_documents

    if not 0 < val_fraction < 1:
        raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    k = max(2, round(1 / val_fraction))
    train_texts = None
    if tokenizer.strip().startswith("bpe:"):
        train_texts, total = [], 0
        for i, doc in enumerate(iter_hf_documents(source, max_chars, progress=False)):
            if i % k != k - 1:
                train_texts.append(doc)
                total += len(doc)
            if total >= BPE_TRAIN_CHARS:
                break
    tok = make_tokenizer(tokenizer, train_texts=train_texts)
    dtype = token_dtype(tok.vocab_size)
    h = hashlib.sha256()
    train_w, val_w = (_TokenWriter(directory / f"{s}.bin", tok, dtype) for s in ("train", "val"))
    chars = [0, 0]
    for i, doc in enumerate(iter_hf_documents(source, max_chars, progress=progress)):
        h.update(doc.encode())
        is_val = i % k == k - 1
        (val_w if is_val else train_w).add(doc)
        chars[is_val] += len(doc)
    n_train, n_val = train_w.close(), val_w.close()
    if n_val == 0:
        raise ValueError(f"{source}: too few documents for a validation split (every {k}th document)")
    meta = {"source_kind": "hf", "source_files": [], "content_hash": h.hexdigest(),
            "train_documents": train_w.n_docs, "val_documents": val_w.n_docs,
            "train_chars": chars[0], "val_chars": chars[1], "train_tokens": n_train, "val_tokens": n_val}
    return meta, tok


def prepare_data(source: str, tokenizer: str = "byte", cache_dir: str | os.PathLike | None = None, *,
                 seed: int = 0, val_fraction: float = 0.05, max_chars: int | None = None,
                 split_blank_lines: bool = False, progress: bool = True, force: bool = False) -> PreparedData:
    """Tokenize ``source`` with ``tokenizer`` into ``cache_dir/<slug>-<key>/``, or reuse it.  ``seed`` only
    matters for the synthetic source; ``force`` rebuilds even when cached."""
    cache = Path(os.path.expanduser(str(cache_dir))) if cache_dir is not None else default_cache_dir()
    key_src = source_key(source, seed, max_chars)
    tok_key = tokenizer.strip()
    if tok_key.startswith("gpt2"):
        tok_key = "gpt2"  # the folder holding the files does not change the ids
    key = f"v{PREP_VERSION}|{key_src}|{tok_key}|{val_fraction}|{split_blank_lines}"
    key = hashlib.sha256(key.encode()).hexdigest()
    directory = cache / f"{_slug(source)}-{_slug(tok_key)}-{key[:12]}"
    meta_path = directory / "meta.json"
    if meta_path.is_file() and not force:
        meta = json.loads(meta_path.read_text())
        dtype = np.dtype(meta.get("dtype", "uint16"))
        if meta.get("key") == key and all(
                (directory / f"{s}.bin").is_file()
                and (directory / f"{s}.bin").stat().st_size == meta[f"{s}_tokens"] * dtype.itemsize
                for s in ("train", "val")):
            return PreparedData(directory, meta, read_tokenizer(directory / "tokenizer"), reused=True)

    directory.mkdir(parents=True, exist_ok=True)
    if meta_path.exists():
        meta_path.unlink()  # an incomplete/stale directory is rebuilt
    if source.strip().startswith("hf:"):
        counts, tok = _prepare_streamed(source, tokenizer, directory, val_fraction=val_fraction,
                                        max_chars=max_chars, progress=progress)
    else:
        src = read_source(source, seed=seed, max_chars=max_chars, split_blank_lines=split_blank_lines)
        train_docs, val_docs = split_documents(src.documents, val_fraction)
        tok = make_tokenizer(tokenizer, train_texts=train_docs)
        dtype = token_dtype(tok.vocab_size)
        counts = {"source_kind": src.kind, "source_files": src.files, "content_hash": src.content_hash,
                  "train_documents": len(train_docs), "val_documents": len(val_docs),
                  "train_chars": sum(len(d) for d in train_docs), "val_chars": sum(len(d) for d in val_docs),
                  "train_tokens": _write_tokens(directory / "train.bin", train_docs, tok, dtype,
                                                "tokenizing train", progress),
                  "val_tokens": _write_tokens(directory / "val.bin", val_docs, tok, dtype, "tokenizing val",
                                              progress)}
    tok.save(directory / "tokenizer")
    meta = {"key": key, "prep_version": PREP_VERSION, "source": source,
            "seed": seed if counts["source_kind"] == "synthetic" else None, "max_chars": max_chars,
            "tokenizer": tok.spec, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
            "dtype": token_dtype(tok.vocab_size).name, "val_fraction": val_fraction, **counts}
    atomic_write_json(meta_path, meta)
    return PreparedData(directory, meta, tok, reused=False)
