"""Tokenizers by spec string: ``byte``, ``bpe:N``, ``gpt2[:DIR]``, ``hf:NAME_OR_PATH``.

:func:`read_tokenizer` reads a saved one back, so a run directory carries the exact tokenizer its model
was trained with; ``save`` also writes the Hugging Face form (``to_hf()``, same ids) for ``AutoTokenizer``.

    >>> tok = make_tokenizer("byte")
    >>> tok.decode(tok.encode("héllo")), tok.vocab_size, tok.eos_id
    ('héllo', 257, 256)
    >>> tok.to_hf()("héllo", add_special_tokens=False)["input_ids"] == tok.encode("héllo")
    True
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from headbudget.io import atomic_write_text, read_text, regular_file

#: Default folder of the offline GPT-2 BPE files (relative to the project root / current directory).
DEFAULT_GPT2_DIR = "../shared/data/tokenizers/gpt2"
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
SPEC_FILE = "tokenizer_spec.json"
EOS_TOKEN = "<|endoftext|>"


class TokenizerError(ValueError):
    """A bad tokenizer spec or missing tokenizer files (one-line message)."""


def _fast(raw: Any, split_special_tokens: bool) -> Any:
    """A ``PreTrainedTokenizerFast`` around a ``tokenizers.Tokenizer`` whose end-of-text is ``EOS_TOKEN``;
    ``split_special_tokens``: is the literal "<|endoftext|>" plain text (byte) or end-of-text (a BPE)?"""
    from transformers import PreTrainedTokenizerFast

    raw.add_special_tokens([EOS_TOKEN])
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                   bos_token=EOS_TOKEN, unk_token=None, split_special_tokens=split_special_tokens)


class Tokenizer:
    """Common interface.  ``spec`` is the string that built it (recorded in meta files)."""

    spec: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def save(self, directory: str | os.PathLike) -> Path:
        """Write what :func:`read_tokenizer` needs, and the Hugging Face form, into ``directory``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.to_hf().save_pretrained(str(d))
        spec = {"spec": self.spec, "vocab_size": self.vocab_size, "eos_id": self.eos_id}
        atomic_write_text(d / SPEC_FILE, json.dumps(spec, indent=2))
        return d

    def to_hf(self) -> Any:
        """The Hugging Face fast tokenizer with the same ids (pad token = EOS)."""
        raise NotImplementedError

    def fingerprint(self) -> str:
        """A string that changes whenever the token ids would change (used in cache keys)."""
        return self.spec


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0..255 plus an end-of-document token 256."""

    def __init__(self) -> None:
        self.spec, self.vocab_size, self.eos_id = "byte", 257, 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def to_hf(self) -> Any:
        # A byte-level BPE without merges: every byte is its own token, id = byte value, so the ids
        # equal encode()'s; GPT-2's byte -> printable-character map makes the vocabulary plain strings.
        from tokenizers import Tokenizer as RawTokenizer
        from tokenizers import decoders, models, pre_tokenizers
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        vocab = {ch: b for b, ch in bytes_to_unicode().items()}
        vocab[EOS_TOKEN] = self.eos_id
        raw = RawTokenizer(models.BPE(vocab=vocab, merges=[]))
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        raw.decoder = decoders.ByteLevel()
        return _fast(raw, split_special_tokens=True)


class BPETokenizer(Tokenizer):
    """A byte-level BPE trained with Hugging Face ``tokenizers`` (``bpe:N``)."""

    EOS = EOS_TOKEN

    def __init__(self, tokenizer: Any, spec: str) -> None:
        self.tk, self.spec, self.vocab_size = tokenizer, spec, tokenizer.get_vocab_size()
        self.eos_id = tokenizer.token_to_id(self.EOS)
        if self.eos_id is None:
            raise TokenizerError(f"BPE tokenizer for {spec!r} has no {self.EOS} token")

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        from tokenizers import ByteLevelBPETokenizer

        if vocab_size < 257 + 1:
            raise TokenizerError(f"bpe:{vocab_size}: a byte-level BPE needs at least 258 tokens")
        tk = ByteLevelBPETokenizer()
        tk.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[cls.EOS],
                               show_progress=False)
        return cls(tk, f"bpe:{vocab_size}")

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tk.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tk.decode(list(ids))

    def to_hf(self) -> Any:
        from tokenizers import Tokenizer as RawTokenizer

        return _fast(RawTokenizer.from_str(self.tk._tokenizer.to_str()), split_special_tokens=False)

    def fingerprint(self) -> str:
        import hashlib

        return self.spec + ":" + hashlib.sha256(self.tk._tokenizer.to_str().encode()).hexdigest()[:16]


class TiktokenGPT2(Tokenizer):
    """GPT-2's BPE through tiktoken, built offline from ``encoder.json`` + ``vocab.bpe``."""

    def __init__(self, directory: str | os.PathLike = DEFAULT_GPT2_DIR) -> None:
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks

        d = Path(directory)
        enc_json, vocab_bpe = _gpt2_files(d, "give gpt2:DIR with encoder.json and vocab.bpe")
        ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=str(vocab_bpe), encoder_json_file=str(enc_json))
        self.enc = tiktoken.Encoding("gpt2-offline", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                     special_tokens={"<|endoftext|>": 50256})
        self.directory, self.spec, self.vocab_size, self.eos_id = d, f"gpt2:{d}", self.enc.n_vocab, 50256

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self.enc.decode(list(ids))

    def save(self, directory: str | os.PathLike) -> Path:
        import shutil

        d = super().save(directory)
        for name in ("encoder.json", "vocab.bpe"):
            shutil.copyfile(self.directory / name, d / name)
        return d

    def to_hf(self) -> Any:
        return gpt2_hf_tokenizer(self.directory)

    def fingerprint(self) -> str:
        return "gpt2"  # the GPT-2 BPE is fixed; its folder does not change the ids


class HFTokenizer(Tokenizer):
    """Any ``transformers.AutoTokenizer`` (``hf:NAME_OR_PATH``)."""

    def __init__(self, name: str) -> None:
        from transformers import AutoTokenizer

        try:
            self.tk = AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"hf tokenizer {name!r} could not be loaded: {str(exc).splitlines()[0]}") from None
        self.spec, self.vocab_size = f"hf:{name}", len(self.tk)
        ids = (self.tk.eos_token_id, self.tk.sep_token_id, self.vocab_size - 1)  # the first that is set
        self.eos_id = int(next(i for i in ids if i is not None))

    def encode(self, text: str) -> list[int]:
        return self.tk(text, add_special_tokens=False)["input_ids"]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.tk(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tk.decode(list(ids))

    def to_hf(self) -> Any:
        return self.tk


def gpt2_hf_tokenizer(directory: str | os.PathLike) -> Any:
    """GPT-2's byte-level BPE as a ``GPT2TokenizerFast``, built offline from ``encoder.json`` + ``vocab.bpe``.

    >>> gpt2_hf_tokenizer("../shared/data/tokenizers/gpt2")("hello world")["input_ids"]  # doctest: +SKIP
    [31373, 995]
    """
    from transformers import GPT2TokenizerFast

    hint = "a GPT-2 tokenizer folder holds encoder.json and vocab.bpe"
    enc_json, vocab_bpe = _gpt2_files(Path(directory), hint)
    vocab, lines = _read_json(enc_json), read_text(vocab_bpe).splitlines()  # encoder.json's errors first
    merges = [tuple(line.split()) for line in lines if line.strip() and not line.startswith("#version")]
    tok = GPT2TokenizerFast(vocab=vocab, merges=merges)
    tok.pad_token = tok.eos_token
    return tok


def _gpt2_files(d: Path, hint: str) -> tuple[Path, Path]:
    """``encoder.json`` and ``vocab.bpe`` of a GPT-2 folder, present and regular files (FIFOs would block)."""
    for f in (d / "encoder.json", d / "vocab.bpe"):
        if not f.exists():
            raise TokenizerError(f"gpt2 tokenizer: {f} not found ({hint})")
        regular_file(f, TokenizerError)
    return d / "encoder.json", d / "vocab.bpe"


def _read_json(path: Path) -> Any:
    """A tokenizer's JSON file; a FIFO, malformed or too deeply nested file is one TokenizerError naming it."""
    regular_file(path, TokenizerError)
    try:
        return json.loads(read_text(path))  # not UTF-8: names the file, offset and line
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    except RecursionError:
        raise TokenizerError(f"{path}: JSON nested too deeply to read") from None


def make_tokenizer(spec: str, train_texts: Iterable[str] | None = None) -> Tokenizer:
    """Build a tokenizer from its spec; ``bpe:N`` trains on ``train_texts`` (required for it).

    >>> make_tokenizer("bpe:300", ["the dog runs . the dogs run ."] * 50).vocab_size <= 300
    True
    """
    spec = spec.strip()
    kind, _, arg = spec.partition(":")
    if kind == "byte" and not arg:
        return ByteTokenizer()
    if kind == "bpe":
        try:
            n = int(arg)
        except ValueError:
            raise TokenizerError(f"bad tokenizer {spec!r}: expected bpe:VOCAB_SIZE, e.g. bpe:4096") from None
        if train_texts is None:
            raise TokenizerError(f"tokenizer {spec!r} must be trained: give the training text")
        return BPETokenizer.train(train_texts, n)
    if kind == "gpt2":
        return TiktokenGPT2(arg or DEFAULT_GPT2_DIR)
    if kind == "hf" and arg:
        return HFTokenizer(arg)
    raise TokenizerError(f"unknown tokenizer {spec!r}; use byte, bpe:N, gpt2[:DIR] or hf:NAME_OR_PATH")


def read_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """Read back a tokenizer written by :meth:`Tokenizer.save` (headbudget's own form, for data preparation).

    >>> read_tokenizer(make_tokenizer("byte").save("/tmp/tok")).encode("ab")  # doctest: +SKIP
    [97, 98]
    """
    d = Path(directory)
    f = d / SPEC_FILE
    if not f.exists():
        raise TokenizerError(f"{d} holds no saved tokenizer ({SPEC_FILE} missing)")
    info = _read_json(f)
    spec = info.get("spec") if isinstance(info, dict) else None
    if not isinstance(spec, str):
        raise TokenizerError(f"{f}: no tokenizer spec in it (expected an object with a \"spec\" string)")
    kind = spec.split(":", 1)[0]
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        from tokenizers import Tokenizer as RawTokenizer
        from tokenizers.implementations import BaseTokenizer

        raw_file = regular_file(d / "tokenizer.json", TokenizerError)
        _read_json(raw_file)  # the Rust reader's errors name no file
        try:
            raw = RawTokenizer.from_file(str(raw_file))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file
            raise TokenizerError(f"{raw_file}: not a tokenizers file ({str(exc).splitlines()[0]})") from None
        return BPETokenizer(BaseTokenizer(raw), spec)
    if kind in ("gpt2", "hf"):
        tok = TiktokenGPT2(d) if kind == "gpt2" else HFTokenizer(str(d))
        tok.spec = spec
        return tok
    raise TokenizerError(f"{f}: unknown tokenizer spec {spec!r}")
