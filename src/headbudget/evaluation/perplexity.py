"""Sliding-window perplexity of a causal LM (the Hugging Face perplexity guide's strided method).

The text is tokenized once (no special tokens).  Windows of ``context`` tokens start every
``stride`` tokens; each window scores only the tokens that the previous window did not (the first
window scores all but its first token), so every token after the first is scored exactly once, with
up to ``context - stride`` tokens of left context.  The result is the token-level mean negative
log-likelihood (``loss``, nats) and ``ppl = exp(loss)``.

    >>> from headbudget.evaluation.perplexity import perplexity, read_text
    >>> r = perplexity(model, tokenizer, read_text("../shared/data/text/wikitext2_valid.tokens"),
    ...                context=1024, stride=512)                               # doctest: +SKIP
    >>> r["ppl"], r["tokens_scored"]                                        # doctest: +SKIP
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from headbudget.data.text import read_text  # re-exported: callers and docs import it from here

__all__ = ["perplexity", "read_text", "window_plan"]


def window_plan(n_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, n_target)`` windows: tokens ``[begin, end)`` are fed, the last ``n_target``
    positions are scored (the first window skips its first token, which has no context)."""
    if context < 2:
        raise ValueError(f"--context must be >= 2, got {context}")
    if not 1 <= stride <= context:
        raise ValueError(f"--stride must be in [1, context={context}], got {stride}")
    plan, prev_end, begin = [], 0, 0
    while begin < n_tokens:
        end = min(begin + context, n_tokens)
        # A window's first token has no context inside the window, so at most end-begin-1 targets;
        # with stride == context the first token of each later window goes unscored (as in HF's guide).
        trg = min(end - prev_end, end - begin - 1)
        if trg > 0:
            plan.append((begin, end, trg))
        prev_end = end
        if end == n_tokens:
            break
        begin += stride
    return plan


@torch.inference_mode()
def perplexity(model: torch.nn.Module, tokenizer: Any, text: str | None = None, *,
               input_ids: torch.Tensor | list[int] | None = None, context: int = 1024,
               stride: int | None = None, max_windows: int | None = None, device: str | None = None,
               progress: bool = True) -> dict[str, Any]:
    """Token-level loss and perplexity of ``text`` (or of ``input_ids``) with a sliding window.

    ``max_windows`` scores only the first windows (quick looks); the result says how many tokens
    were scored.  ``context`` is capped at the model's positions; ``stride`` defaults to half of it.
    """
    if input_ids is None:
        if text is None:
            raise ValueError("perplexity needs text or input_ids")
        ids = tokenizer.encode(text, add_special_tokens=False)
        input_ids = torch.tensor(ids, dtype=torch.long)
    ids_t = torch.as_tensor(input_ids, dtype=torch.long).flatten()
    n_pos = getattr(getattr(model, "config", None), "n_positions", None) or \
        getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if n_pos is not None and context > int(n_pos):
        context = int(n_pos)
        stride = None if stride is None else min(stride, context)
    stride = max(1, context // 2) if stride is None else stride
    plan = window_plan(len(ids_t), context, stride)
    if max_windows is not None:
        plan = plan[:max_windows]
    if not plan:
        raise ValueError(f"text too short: {len(ids_t)} tokens, need at least 2")
    dev = torch.device(device) if device else next(model.parameters()).device
    was_training = model.training
    model.eval()
    nll_sum, n_scored, t0 = 0.0, 0, time.perf_counter()
    try:
        for begin, end, trg in tqdm(plan, desc="perplexity", disable=not progress, leave=False):
            window = ids_t[begin:end].to(dev)[None]
            logits = model(input_ids=window, use_cache=False).logits[0, -trg - 1: -1].float()
            targets = window[0, -trg:]
            nll_sum += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
            n_scored += trg
    finally:
        model.train(was_training)
    loss = nll_sum / n_scored
    return {"loss": loss, "ppl": math.exp(loss), "tokens_scored": n_scored,
            "tokens_total": int(len(ids_t)), "windows": len(plan), "context": context,
            "stride": stride, "seconds": round(time.perf_counter() - t0, 3)}
