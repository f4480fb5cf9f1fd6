"""Sliding-window perplexity of a causal LM (the Hugging Face perplexity guide's strided method): the
text tokenized once (no special tokens), windows of ``context`` tokens every ``stride`` tokens, each
scoring only the tokens the previous one did not, so every token after the first is scored once.

    >>> r = perplexity(model, tokenizer, text, context=1024, stride=512)   # doctest: +SKIP
    >>> r["ppl"], r["tokens_scored"]                                        # doctest: +SKIP
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from headbudget.progress import ProgressBar

__all__ = ["loss_by_context_length", "perplexity", "window_plan"]


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
    """Token-level mean negative log-likelihood (``loss``, nats) and ``ppl = exp(loss)`` of ``text`` (or
    ``input_ids``) with a sliding window.  ``max_windows`` scores only the first windows; ``context`` is
    capped at the model's positions; ``stride`` defaults to half of it."""
    if input_ids is None:
        if text is None:
            raise ValueError("perplexity needs text or input_ids")
        input_ids = tokenizer.encode(text, add_special_tokens=False)
    ids_t = torch.as_tensor(input_ids, dtype=torch.long).flatten()
    cfg = getattr(model, "config", None)
    n_pos = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None)
    if n_pos is not None and context > int(n_pos):
        context = int(n_pos)
        stride = None if stride is None else min(stride, context)
    stride = max(1, context // 2) if stride is None else stride
    plan = window_plan(len(ids_t), context, stride)[:max_windows]
    if not plan:
        raise ValueError(f"text too short: {len(ids_t)} tokens, need at least 2")
    dev = torch.device(device) if device else next(model.parameters()).device
    was_training = model.training
    model.eval()
    nll_sum, n_scored, t0 = 0.0, 0, time.perf_counter()
    try:
        for begin, end, trg in ProgressBar(plan, desc="perplexity", disable=not progress, leave=False):
            window = ids_t[begin:end].to(dev)[None]
            logits = model(input_ids=window, use_cache=False).logits[0, -trg - 1: -1].float()
            nll_sum += float(torch.nn.functional.cross_entropy(logits, window[0, -trg:], reduction="sum"))
            n_scored += trg
    finally:
        model.train(was_training)
    loss = nll_sum / n_scored
    return {"loss": loss, "ppl": math.exp(loss), "tokens_scored": n_scored,
            "tokens_total": int(len(ids_t)), "windows": len(plan), "context": context,
            "stride": stride, "seconds": round(time.perf_counter() - t0, 3)}


@torch.inference_mode()
def loss_by_context_length(model: torch.nn.Module, input_ids: torch.Tensor | list[int], *,
                           lengths: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 127), every: int = 16,
                           max_targets: int | None = 2048, batch_size: int = 64) -> dict[str, Any]:
    """How much a model gains from more left context: the same targets (positions ``max(lengths)``,
    ``+ every``, ..., at most ``max_targets``) scored with only the ``k`` tokens before each, per ``k`` in
    ``lengths``; ``gain_vs_shortest[k]``: mean paired (loss at the shortest context - loss at ``k``),
    ``gain_sem`` its standard error.

        >>> r = loss_by_context_length(model, ids, lengths=(1, 4, 127))     # doctest: +SKIP
        >>> r["loss"], r["gain_vs_shortest"]                                # doctest: +SKIP
    """
    ids_t = torch.as_tensor(input_ids, dtype=torch.long).flatten()
    lengths = tuple(sorted({int(k) for k in lengths}))
    if not lengths or lengths[0] < 1 or every < 1:
        raise ValueError(f"lengths must be >= 1 and every >= 1, got lengths={lengths}, every={every}")
    targets = torch.arange(lengths[-1], max(len(ids_t), lengths[-1]), every)[:max_targets]
    if len(targets) < 2:
        raise ValueError(f"loss_by_context_length needs at least {lengths[-1] + every + 1} tokens for "
                         f"context {lengths[-1]}, got {len(ids_t)}")
    dev = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nll = torch.empty(len(lengths), len(targets), dtype=torch.float64)
    try:
        for i, k in enumerate(lengths):
            for b in range(0, len(targets), batch_size):
                t = targets[b: b + batch_size]
                x = torch.stack([ids_t[j - k: j] for j in t.tolist()]).to(dev)
                logits = model(input_ids=x, use_cache=False, logits_to_keep=1).logits[:, -1].float()
                nll[i, b: b + len(t)] = torch.nn.functional.cross_entropy(
                    logits, ids_t[t].to(dev), reduction="none").double().cpu()
    finally:
        model.train(was_training)
    gain = nll[0][None] - nll  # paired by target
    n = len(targets)
    return {"lengths": list(lengths), "targets": n, "every": every, "loss": nll.mean(1).tolist(),
            "gain_vs_shortest": gain.mean(1).tolist(),
            "gain_sem": (gain.std(1, unbiased=True) / n ** 0.5).tolist()}
