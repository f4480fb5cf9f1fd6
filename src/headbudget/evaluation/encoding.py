"""Requests tokenized as lm-evaluation-harness's ``hf`` backend tokenizes them: trailing spaces of the context move to the continuation, the continuation's
tokens are ``encode(context + continuation)[len(encode(context)):]`` with the tokenizer's default
special tokens (none when the text already starts with the BOS string), and over-long inputs are cut
from the left to ``max_length + 1`` tokens.

    >>> enc = HarnessEncoder(tokenizer)                                  # doctest: +SKIP
    >>> enc.pair("Question: 2+2\\nAnswer: ", "4")   # the space moves to the continuation  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

DEFAULT_MAX_LENGTH = 2048  # the harness's default when neither config nor tokenizer says


def model_max_length(model: Any, tokenizer: Any = None, default: int = DEFAULT_MAX_LENGTH) -> int:
    """Context length as the harness resolves it: config n_positions / max_position_embeddings /
    n_ctx, then the tokenizer's ``model_max_length`` (unless unset), then ``default``."""
    cfg = getattr(getattr(model, "config", None), "text_config", None) or getattr(model, "config", None)
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(cfg, attr, None)
        if value is not None:
            return int(value)
    mml = getattr(tokenizer, "model_max_length", None)
    return int(mml) if mml is not None and mml < 10**20 else default  # 1e30: the tokenizer's "unset"


class HarnessEncoder:
    """Encodes ``(context, continuation)`` pairs as the harness's ``hf`` backend does; ``add_bos_token=None``
    keeps the tokenizer's own default for special tokens (the harness's default)."""

    def __init__(self, tokenizer: Any, add_bos_token: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.add_bos_token = add_bos_token
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        self.prefix_token_id: int | None = prefix
        self._prefix_str = tokenizer.decode(prefix) if prefix is not None else None
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        key = text if add_special_tokens is None else f"{add_special_tokens}\0{text}"
        if key in self._cache:
            return self._cache[key]
        special = add_special_tokens
        if special is None:  # no second BOS when the text starts with its string
            special = False if self._prefix_str and text.startswith(self._prefix_str) else self.add_bos_token
        kwargs = {} if special is None else {"add_special_tokens": special}
        ids = list(self.tokenizer.encode(text, **kwargs))
        if len(self._cache) < 200_000:
            self._cache[key] = ids
        return ids

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of the context and of the continuation (both non-empty)."""
        if context == "":
            cont = self.encode(continuation, add_special_tokens=False)
            if self.prefix_token_id is None:
                raise ValueError("empty context and the tokenizer has no BOS/EOS token to condition on")
            if cont and cont[0] == self.prefix_token_id:
                return cont[:1], cont[1:]
            return [self.prefix_token_id], cont
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole, ctx = self.encode(context + continuation), self.encode(context)
        return ctx, whole[len(ctx):]
