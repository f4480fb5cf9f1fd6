"""Sliding-window perplexity of a causal LM (the Hugging Face perplexity guide's strided method): the
text tokenized once (no special tokens), windows of ``context`` tokens every ``stride`` tokens, each
scoring only the tokens the previous one did not, so every token after the first is scored once.

    >>> r = perplexity(model, tokenizer, text, context=1024, stride=512)   # doctest: +SKIP
    >>> r["ppl"], r["tokens_scored"]                                        # doctest: +SKIP

:func:`run_perplexity` is ``headbudget perplexity``'s whole run from its :class:`PerplexitySettings`: the
model loaded, the text read and scored, and with ``context_lengths`` :func:`loss_by_context_length` too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from headbudget.io import read_text
from headbudget.loading import ModelSettings
from headbudget.progress import ProgressBar
from headbudget.typed_config import option

if TYPE_CHECKING:
    import torch

__all__ = ["PerplexitySettings", "loss_by_context_length", "perplexity", "run_perplexity", "window_plan"]


@dataclass(kw_only=True)
class PerplexitySettings(ModelSettings):
    """``headbudget perplexity``'s settings: the model (:class:`~headbudget.loading.ModelSettings`), the text,
    the windows, the context lengths and the output, each field one flag of the same name.

        >>> settings = PerplexitySettings(model="runs/prism", data="wikitext2_valid.tokens", context=256,
        ...                               context_lengths="1,4,16", quiet=True)
        >>> run_perplexity(settings)["by_context_length"]["gain_vs_shortest"]   # doctest: +SKIP
    """

    data: str = option(help="text file, or HF dataset NAME[:CONFIG]")
    split: str = option("test", help="HF split")
    context: int = option(1024, help="window length in tokens")
    stride: int | None = option(None, help="window step (default: half the context)")
    max_windows: int | None = option(None, help="score only the first N windows")
    context_lengths: str | None = option(
        None, help="also score the same targets with each of these tokens of left context (e.g. 1,4,16,127): how "
                   "much the model gains from its context (paired by target)")
    json: str | None = option(None, help="also write the result (loss, ppl, windows, ...) to this JSON file")
    quiet: bool = option(False, help="no progress bar")


def _context_lengths(settings: PerplexitySettings) -> list[int] | None:
    """``--context-lengths`` as integers, shortest first (the gains are against the shortest), or None; a bad
    list, a repeated length or one not below ``--context`` is one error line naming the flag."""
    text = settings.context_lengths
    if not text:
        return None
    try:
        lengths = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--context-lengths: expected a comma list of integers, got {text!r}") from None
    if not lengths or any(k <= 0 for k in lengths):
        raise ValueError(f"--context-lengths: expected positive integers, got {text!r}")
    twice = next((k for i, k in enumerate(lengths) if k in lengths[:i]), None)
    if twice is not None:
        raise ValueError(f"--context-lengths: {twice} is given twice in {text!r}")
    lengths = sorted(lengths)
    if lengths[-1] >= settings.context:
        raise ValueError(f"--context-lengths: {lengths[-1]} is not below --context {settings.context}")
    return lengths


def run_perplexity(settings: PerplexitySettings, *,
                   on_scored: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """``headbudget perplexity``: :func:`perplexity` of ``settings.data`` and, with ``context_lengths``,
    :func:`loss_by_context_length` of the same ids (``"by_context_length"``), the flags checked before anything
    loads; returns what ``--json`` holds.  ``on_scored(result)``: as soon as the perplexity is known.

        >>> r = run_perplexity(PerplexitySettings(model="runs/prism", data="valid.txt", context=256))  # doctest: +SKIP
        >>> r["loss"], r["ppl"], r["windows"]                                                           # doctest: +SKIP
    """
    lengths = _context_lengths(settings)
    settings.resolved_device()  # a bad --device or --dtype: one error line before the text is read
    text = read_text(settings.data, split=settings.split)
    model, tok = settings.load()
    ids = tok.encode(text, add_special_tokens=False)  # once, for both scorings
    res = perplexity(model, tok, input_ids=ids, context=settings.context, stride=settings.stride,
                     max_windows=settings.max_windows, progress=not settings.quiet)
    if on_scored is not None:
        on_scored(res)
    if lengths:
        if lengths[-1] >= res["context"]:  # the model has fewer positions than --context
            raise ValueError(f"--context-lengths: {lengths[-1]} is not below the model's {res['context']} "
                             "positions")
        res["by_context_length"] = loss_by_context_length(model, ids, lengths=tuple(lengths),
                                                          every=max(1, len(ids) // 2048))
    return dict(res, model=str(settings.model), data=str(settings.data))


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


def perplexity(model: torch.nn.Module, tokenizer: Any, text: str | None = None, *,
               input_ids: torch.Tensor | list[int] | None = None, context: int = 1024,
               stride: int | None = None, max_windows: int | None = None, device: str | None = None,
               progress: bool = True) -> dict[str, Any]:
    """Token-level mean negative log-likelihood (``loss``, nats) and ``ppl = exp(loss)`` of ``text`` (or
    ``input_ids``) with a sliding window.  ``max_windows`` scores only the first windows; ``context`` is
    capped at the model's positions; ``stride`` defaults to half of it."""
    import torch

    from headbudget.devices import scoring_mode

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
    nll_sum, n_scored, t0 = 0.0, 0, time.perf_counter()
    with scoring_mode(model):
        for begin, end, trg in ProgressBar(plan, desc="perplexity", disable=not progress, leave=False):
            window = ids_t[begin:end].to(dev)[None]
            logits = model(input_ids=window, use_cache=False).logits[0, -trg - 1: -1].float()
            nll_sum += float(torch.nn.functional.cross_entropy(logits, window[0, -trg:], reduction="sum"))
            n_scored += trg
    loss = nll_sum / n_scored
    return {"loss": loss, "ppl": math.exp(loss), "tokens_scored": n_scored,
            "tokens_total": int(len(ids_t)), "windows": len(plan), "context": context,
            "stride": stride, "seconds": round(time.perf_counter() - t0, 3)}


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
    import torch

    from headbudget.devices import scoring_mode

    ids_t = torch.as_tensor(input_ids, dtype=torch.long).flatten()
    lengths = tuple(sorted({int(k) for k in lengths}))
    if not lengths or lengths[0] < 1 or every < 1:
        raise ValueError(f"lengths must be >= 1 and every >= 1, got lengths={lengths}, every={every}")
    targets = torch.arange(lengths[-1], max(len(ids_t), lengths[-1]), every)[:max_targets]
    if len(targets) < 2:
        raise ValueError(f"loss_by_context_length needs at least {lengths[-1] + every + 1} tokens for "
                         f"context {lengths[-1]}, got {len(ids_t)}")
    dev = next(model.parameters()).device
    nll = torch.empty(len(lengths), len(targets), dtype=torch.float64)
    with scoring_mode(model):
        for i, k in enumerate(lengths):
            for b in range(0, len(targets), batch_size):
                t = targets[b: b + batch_size]
                x = torch.stack([ids_t[j - k: j] for j in t.tolist()]).to(dev)
                logits = model(input_ids=x, use_cache=False, logits_to_keep=1).logits[:, -1].float()
                nll[i, b: b + len(t)] = torch.nn.functional.cross_entropy(
                    logits, ids_t[t].to(dev), reduction="none").double().cpu()
    gain = nll[0][None] - nll  # paired by target
    n = len(targets)
    return {"lengths": list(lengths), "targets": n, "every": every, "loss": nll.mean(1).tolist(),
            "gain_vs_shortest": gain.mean(1).tolist(),
            "gain_sem": (gain.std(1, unbiased=True) / n ** 0.5).tolist()}
