"""Load a causal LM and its tokenizer for evaluation: headbudget checkpoints, Hugging Face names or
directories, and GGUF files.

    >>> from headbudget.evaluation.loading import load_model_and_tokenizer
    >>> model, tok = load_model_and_tokenizer("/tmp/smol", gguf_file="smollm2.gguf")  # doctest: +SKIP
    >>> model, tok = load_model_and_tokenizer("runs/prism", tokenizer="../shared/data/tokenizers/gpt2")
    ...                                                                              # doctest: +SKIP

``tokenizer`` may be a tokenizer directory or hub name, or a directory holding GPT-2's
``encoder.json`` + ``vocab.bpe`` (built offline as a ``GPT2TokenizerFast``).  When omitted, the
model directory's own tokenizer is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def gpt2_tokenizer_from_files(directory: str | Path) -> Any:
    """GPT-2's byte-level BPE from ``encoder.json`` and ``vocab.bpe`` (offline)."""
    import json

    from transformers import GPT2TokenizerFast

    d = Path(directory)
    vocab = json.loads((d / "encoder.json").read_text(encoding="utf-8"))
    lines = (d / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split()) for line in lines if line.strip() and not line.startswith("#version")]
    tok = GPT2TokenizerFast(vocab=vocab, merges=merges)
    tok.pad_token = tok.eos_token
    return tok


def headbudget_saved_tokenizer(directory: str | Path) -> Any | None:
    """The Hugging Face form of a tokenizer saved by ``headbudget train`` (``MODEL/tokenizer/``, the folder
    itself, or the run folder's ``tokenizer/``), with the same ids; None when there is none."""
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from headbudget.data.tokenizers import SPEC_FILE

    p = Path(directory)
    for d in (p / "tokenizer", p, p.parent / "tokenizer"):
        if not (d / SPEC_FILE).is_file():
            continue
        spec = json.loads((d / SPEC_FILE).read_text())["spec"]
        kind, _, arg = spec.partition(":")
        if kind == "bpe":
            tok = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), eos_token="<|endoftext|>")
        elif kind == "gpt2":
            tok = gpt2_tokenizer_from_files(d if (d / "encoder.json").is_file() else arg)
        elif kind == "hf":
            tok = AutoTokenizer.from_pretrained(str(d))
        else:
            raise ValueError(f"{d}: the model's {spec!r} tokenizer has no Hugging Face form; evaluation needs "
                             "a bpe:N, gpt2 or hf: tokenizer (pass --tokenizer)")
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        return tok
    return None


def load_tokenizer(spec: str | Path, gguf_file: str | None = None) -> Any:
    """A tokenizer from a directory, hub name, GGUF model directory or GPT-2 BPE files."""
    from transformers import AutoTokenizer

    p = Path(spec)
    if p.is_dir():
        saved = headbudget_saved_tokenizer(p)
        if saved is not None:
            return saved
    if p.is_dir() and (p / "encoder.json").is_file() and (p / "vocab.bpe").is_file() \
            and not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
        return gpt2_tokenizer_from_files(p)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        return AutoTokenizer.from_pretrained(str(spec), **kwargs)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from {spec!r} ({str(exc).splitlines()[0]}); "
                         "pass --tokenizer DIR (a tokenizer directory, or one with GPT-2's "
                         "encoder.json and vocab.bpe)") from None


def load_model(name_or_path: str | Path, *, gguf_file: str | None = None,
               device: str | None = None, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` (headbudget models are registered with it)."""
    from transformers import AutoModelForCausalLM

    import headbudget  # noqa: F401  (registers the headbudget model type when present)

    try:
        from headbudget.models import register_auto_classes

        register_auto_classes()
    except ImportError:  # pragma: no cover - models layer absent
        pass
    kwargs: dict[str, Any] = {}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:
        model = AutoModelForCausalLM.from_pretrained(str(name_or_path), **kwargs)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load model {str(name_or_path)!r}: "
                         f"{str(exc).splitlines()[0]}") from None
    if device:
        model.to(device)
    model.eval()
    return model


def load_model_and_tokenizer(name_or_path: str | Path, *, tokenizer: str | Path | None = None,
                             gguf_file: str | None = None, device: str | None = None,
                             dtype: torch.dtype | None = None) -> tuple[torch.nn.Module, Any]:
    """Model and tokenizer; the tokenizer comes from ``tokenizer`` or else from the model's place."""
    model = load_model(name_or_path, gguf_file=gguf_file, device=device, dtype=dtype)
    tok = load_tokenizer(tokenizer if tokenizer is not None else name_or_path,
                         gguf_file=None if tokenizer is not None else gguf_file)
    return model, tok
