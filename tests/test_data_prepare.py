"""Data preparation (memmaps, meta, caching), sources, and (seed, step) batch sampling."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import names
from headbudget.data import prepare as prep
from headbudget.data.loader import train_batch, val_batches
from headbudget.data.prepare import prepare_data, split_documents, token_dtype
from headbudget.data.sources import SourceError, read_source
from headbudget.models.tokenizers import ByteTokenizer

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "data"


def test_prepare_writes_memmaps_and_meta_then_reuses(tmp_path):
    d = prepare_data(str(FIXTURES / "tiny.txt"), "byte", tmp_path, val_fraction=0.1, progress=False)
    assert not d.reused
    m = d.meta
    text = (FIXTURES / "tiny.txt").read_text(encoding="utf-8")
    n_bytes = len(text.encode())
    # one document split at a line boundary into train + val, each followed by EOS
    assert m["train_tokens"] + m["val_tokens"] == n_bytes + 2
    assert d.dtype == np.uint16 and m["dtype"] == "uint16"
    assert (d.directory / "train.bin").stat().st_size == 2 * m["train_tokens"]
    train = np.asarray(d.train)
    assert train[-1] == 256 and bytes(train[:-1].astype(np.uint8)) == text.encode()[: m["train_tokens"] - 1]
    again = prepare_data(str(FIXTURES / "tiny.txt"), "byte", tmp_path, val_fraction=0.1, progress=False)
    assert again.reused and again.directory == d.directory and again.meta == m


def test_changed_content_or_split_is_a_new_cache_entry(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text("alpha beta gamma\n" * 50)
    a = prepare_data(str(src), "byte", tmp_path / "cache", progress=False)
    src.write_text("alpha beta delta\n" * 50)
    b = prepare_data(str(src), "byte", tmp_path / "cache", progress=False)
    c = prepare_data(str(src), "byte", tmp_path / "cache", val_fraction=0.2, progress=False)
    assert len({a.directory, b.directory, c.directory}) == 3
    assert a.meta["content_hash"] != b.meta["content_hash"]


def test_incomplete_directory_is_rebuilt(tmp_path):
    d = prepare_data("synthetic:2000", "byte", tmp_path, progress=False)
    (d.directory / "val.bin").write_bytes(b"\x00\x00")  # truncated: size no longer matches meta
    again = prepare_data("synthetic:2000", "byte", tmp_path, progress=False)
    assert not again.reused and len(again.val) == d.meta["val_tokens"]


def test_uint32_when_vocab_exceeds_uint16(tmp_path, monkeypatch):
    class Big(ByteTokenizer):
        def __init__(self):
            super().__init__()
            self.spec, self.vocab_size, self.eos_id = "byte", 70000, 69999

    assert token_dtype(65535) == np.uint16 and token_dtype(65536) == np.uint32
    monkeypatch.setattr(prep, "make_tokenizer", lambda spec, train_texts=None: Big())
    d = prepare_data("synthetic:1000", "byte", tmp_path, progress=False)
    assert d.meta["dtype"] == "uint32" and d.train.dtype == np.uint32
    assert int(d.train[-1]) == 69999  # EOS beyond uint16 survives
    assert (d.directory / "train.bin").stat().st_size == 4 * d.meta["train_tokens"]


def test_synthetic_with_bpe_saves_the_trained_tokenizer(tmp_path):
    d = prepare_data("synthetic:3000", "bpe:300", tmp_path, seed=5, progress=False)
    assert d.meta["vocab_size"] == 300 and d.meta["seed"] == 5
    assert (d.directory / "tokenizer" / "tokenizer.json").is_file()
    docs = d.tokenizer.decode(np.asarray(d.val)).split("<|endoftext|>")
    assert docs[0].startswith("= ") and docs[0].rstrip().endswith("=")
    assert d.meta["val_documents"] == sum(1 for x in np.asarray(d.val) if x == d.meta["eos_id"])


def test_jsonl_source_and_error_naming_file_and_line():
    src = read_source(f"jsonl:{FIXTURES / 'tiny.jsonl'}:body")
    assert len(src.documents) == 40 and src.documents[3].startswith("document 3: ")
    with pytest.raises(SourceError, match=names(f"{FIXTURES / 'bad.jsonl'}:2", "body")):
        read_source(f"jsonl:{FIXTURES / 'bad.jsonl'}:body")
    with pytest.raises(SourceError, match=names("/nonexistent/*.txt")):
        read_source("/nonexistent/*.txt")


def test_glob_source_reads_every_file(tmp_path):
    for i in range(3):
        (tmp_path / f"p{i}.txt").write_text(f"file {i}\n")
    src = read_source(str(tmp_path / "p*.txt"))
    assert src.documents == ["file 0\n", "file 1\n", "file 2\n"]
    shutil.copy(FIXTURES / "tiny.txt", tmp_path / "p9.txt")
    assert len(read_source(str(tmp_path / "p*.txt")).documents) == 4


def test_split_documents_by_document_or_by_text():
    docs = [f"doc {i}" for i in range(40)]
    train, val = split_documents(docs, 0.1)
    assert train == docs[:36] and val == docs[36:]
    train, val = split_documents(["a\nb\nc\nd\n" * 10], 0.25)
    assert "".join(train + val) == "a\nb\nc\nd\n" * 10 and train[0].endswith("\n")


def test_batches_are_a_function_of_seed_and_step_and_split_across_ranks():
    toks = np.arange(5000, dtype=np.uint16)
    x1, y1 = train_batch(toks, seed=1, step=7, batch_size=8, context=16)
    x2, _ = train_batch(toks, seed=1, step=7, batch_size=8, context=16)
    x3, _ = train_batch(toks, seed=1, step=8, batch_size=8, context=16)
    assert (x1 == x2).all() and not (x1 == x3).all()
    assert (y1 == x1 + 1).all()  # targets are the next tokens
    # grad_accum=2 x world=2: the four chunks concatenate to the global batch, in order
    parts = [train_batch(toks, seed=1, step=7, batch_size=8, context=16, micro=m, n_micro=2, rank=r,
                         world_size=2)[0] for m in range(2) for r in range(2)]
    assert all(p.shape == (2, 16) for p in parts)
    assert (np.concatenate(parts) == x1.numpy()).all()
    with pytest.raises(ValueError, match=names("train.batch_size=6", 4)):
        train_batch(toks, seed=1, step=0, batch_size=6, context=16, n_micro=4)


def test_val_batches_are_fixed_and_cover_the_split():
    toks = np.arange(1000, dtype=np.uint16)
    vb = val_batches(toks, n_batches=3, batch_size=4, context=10)
    assert len(vb) == 3 and int(vb[0][0][0, 0]) == 0 and int(vb[-1][1][-1, -1]) == 999
    r1 = val_batches(toks, n_batches=3, batch_size=4, context=10, rank=1, world_size=2)
    assert (r1[0][0] == vb[0][0][2:]).all()
    with pytest.raises(ValueError, match=names(5, 12)):  # 5 tokens, fewer than context + 2
        val_batches(toks[:5], n_batches=1, batch_size=1, context=10)


def test_meta_json_is_complete(tmp_path):
    d = prepare_data("synthetic:1000", "byte", tmp_path, progress=False)
    meta = json.loads((d.directory / "meta.json").read_text())
    for k in ("source", "tokenizer", "train_tokens", "val_tokens", "content_hash", "dtype", "key"):
        assert k in meta
    assert not [p for p in d.directory.iterdir() if p.name.startswith(".")]  # no temp files left


def test_streamed_hf_source_splits_every_kth_document(tmp_path, monkeypatch):
    """hf: sources are streamed (no network here: the stream is replaced by local documents)."""
    from headbudget.data import sources

    docs = [f"document number {i} about heads." for i in range(40)]

    def fake_stream(spec, max_chars, progress=True):
        assert spec == "hf:fake/corpus" and max_chars == 10_000
        yield from docs

    monkeypatch.setattr(sources, "iter_hf_documents", fake_stream)
    d = prepare_data("hf:fake/corpus", "bpe:280", tmp_path, val_fraction=0.1, max_chars=10_000, progress=False)
    assert d.meta["val_documents"] == 4 and d.meta["train_documents"] == 36  # every 10th document
    val = np.asarray(d.val)
    assert d.tokenizer.decode(val) == "".join(docs[9::10])  # special tokens are dropped when decoding
    assert int((val == d.meta["eos_id"]).sum()) == 4
    assert d.meta["source_kind"] == "hf" and len(d.meta["content_hash"]) == 64
    assert prepare_data("hf:fake/corpus", "bpe:280", tmp_path, val_fraction=0.1, max_chars=10_000,
                        progress=False).reused
    monkeypatch.undo()
    with pytest.raises(SourceError, match=names("hf:some/dataset", "data.max_chars")):
        next(sources.iter_hf_documents("hf:some/dataset", None))
