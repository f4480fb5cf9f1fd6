"""Zero-shot multiple-choice scoring with lm-evaluation-harness's numbers, faster.

The score of a choice is the summed log-likelihood of its continuation tokens given its context;
``acc`` picks the highest score, ``acc_norm`` the highest score divided by the choice's length in
characters; standard errors are sample standard deviation / sqrt(n).  Tokenization follows the
harness's ``hf`` backend: trailing spaces of the context move to the continuation, the continuation's
tokens are ``encode(context + continuation)[len(encode(context)):]`` with the tokenizer's default
special tokens (none when the text already starts with the BOS string), and over-long inputs are cut
from the left to ``max_length + 1`` tokens.

Speed: the choices of one item share a token prefix (the context; for winogrande the sentence up to
the blank).  ``strategy="prefix"`` batches across items: items sorted by prefix length run their
prefixes ``batch_size`` at a time in right-padded passes with the KV cache (exact for a causal model);
the keys/values of a window of ``PREFIX_WINDOW_GROUPS * batch_size`` items are kept, expanded to one
row per choice, and all the window's choices (sorted by length) are scored in padded passes of at
most ``batch_size`` rows, positions continuing each row's own prefix and an attention mask hiding the
padding.  A window of ``w`` items with ``k`` choices each costs about ``(1 + k) * w / batch_size``
passes instead of ``2 * w``.  After the first window one padded item is checked against the plain
computation and the scorer falls back to ``strategy="full"`` (every choice's full sequence, batched
across items sorted by length) when a model's cache cannot be reused.

    >>> from headbudget.evaluation import evaluate_tasks
    >>> report = evaluate_tasks(model, tokenizer, ["piqa"], data_dir="../shared/data/zeroshot",
    ...                         limit=100)                        # doctest: +SKIP
    >>> report["results"]["piqa"]["acc"]                          # doctest: +SKIP
"""

from __future__ import annotations

import inspect
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from headbudget.evaluation.tasks import MCExample, get_task, load_examples

DEFAULT_MAX_LENGTH = 2048  # the harness's default when neither config nor tokenizer says
# strategy="prefix": items whose prefix caches are kept together (in units of batch_size), so that
# their choices can be sorted by length across prefix passes (less padding, bounded memory).
PREFIX_WINDOW_GROUPS = 4
# A forward pass's fixed cost (reading every weight once) in tokens' worth of compute, roughly, for
# a small model on one CPU thread: padding a pass by more than this is worse than one more pass.
PASS_COST_TOKENS = 16


# --------------------------------------------------------------------------------------------
# Tokenization (the harness's hf backend)


def model_max_length(model: Any, tokenizer: Any = None, default: int = DEFAULT_MAX_LENGTH) -> int:
    """Context length as the harness resolves it: config n_positions / max_position_embeddings /
    n_ctx, then the tokenizer's ``model_max_length`` (unless unset), then ``default``."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(cfg, attr, None)
        if value is not None:
            return int(value)
    mml = getattr(tokenizer, "model_max_length", None)
    if mml is not None and mml < 10**20:
        return int(mml)
    return default


class HarnessEncoder:
    """Encodes ``(context, continuation)`` pairs the way the harness's ``hf`` backend does.

    ``add_bos_token=None`` uses the tokenizer's own default for special tokens (the harness's default).
    """

    def __init__(self, tokenizer: Any, add_bos_token: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.add_bos_token = add_bos_token
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        self.prefix_token_id: int | None = prefix
        self._prefix_str = tokenizer.decode(prefix) if prefix is not None else None
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        key = text if add_special_tokens is None else f"{add_special_tokens}\0{text}"
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        kwargs: dict[str, bool] = {}
        if add_special_tokens is not None:
            kwargs["add_special_tokens"] = add_special_tokens
        elif self.add_bos_token is not None:
            kwargs["add_special_tokens"] = self.add_bos_token
        if add_special_tokens is None and self._prefix_str and text.startswith(self._prefix_str):
            kwargs["add_special_tokens"] = False
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
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        whole = self.encode(context + continuation)
        ctx = self.encode(context)
        return ctx, whole[len(ctx):]


# --------------------------------------------------------------------------------------------
# Scoring


@dataclass
class ScoreStats:
    """Counters of one scoring run (``forward_passes`` is printed by the CLI)."""

    forward_passes: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    strategy: str = "prefix"
    fallbacks: list[str] = field(default_factory=list)


def _common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    first = seqs[0]
    n = min(len(s) for s in seqs)
    for i in range(n):
        t = first[i]
        if any(s[i] != t for s in seqs[1:]):
            return i
    return n


class _CacheMismatch(RuntimeError):
    """The cached scores of the self-check differ from the plain ones."""


def _cache_tensors(past: Any, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(keys, values)`` of shape (batch, heads, ``length``, dim) from a KV cache.

    Accepts a transformers ``DynamicCache`` made of plain (non-sliding) ``DynamicLayer``s, or the
    legacy tuple of per-layer ``(k, v)``; anything else raises TypeError (the caller falls back).
    """
    if past is None:
        raise TypeError("the model returned no KV cache")
    if isinstance(past, (tuple, list)):
        kv = [(layer[0], layer[1]) for layer in past]
    else:
        from transformers.cache_utils import DynamicCache, DynamicLayer

        if type(past) is not DynamicCache or any(type(layer) is not DynamicLayer
                                                  for layer in past.layers):
            raise TypeError(f"cannot expand a KV cache of type {type(past).__name__} "
                            f"({sorted({type(x).__name__ for x in getattr(past, 'layers', [])})})")
        kv = [(layer.keys, layer.values) for layer in past.layers]
    for i, (k, v) in enumerate(kv):
        if k.dim() != 4 or k.shape[-2] != length or v.shape[-2] != length:
            raise TypeError(f"KV cache layer {i} has shape {tuple(k.shape)}, expected length "
                            f"{length} on dim -2")
    return kv


def _build_cache(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A fresh ``DynamicCache`` holding ``kv`` (the forward appends to it; ``kv`` is not changed)."""
    from transformers.cache_utils import DynamicCache

    return DynamicCache(ddp_cache_data=kv)


def _forward_params(model: torch.nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


class Scorer:
    """Log-likelihood of continuations for a causal LM.

    ``strategy``: ``"prefix"`` (up to ``batch_size`` items' shared prefixes in one pass through the
    KV cache, then all their choices' remaining tokens in padded passes of ``batch_size`` rows) or
    ``"full"`` (every choice's whole sequence, batched across items,
    sorted by length so that padding is minimal).  ``batch_size`` bounds the rows of one forward pass.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, batch_size: int = 16,
                 strategy: str = "prefix", max_length: int | None = None,
                 add_bos_token: bool | None = None, device: str | torch.device | None = None,
                 progress: bool = True) -> None:
        if strategy not in ("prefix", "full"):
            raise ValueError(f"--strategy must be 'prefix' or 'full', got {strategy!r}")
        if batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
        self.model = model
        self.encoder = HarnessEncoder(tokenizer, add_bos_token)
        self.batch_size = batch_size
        self.strategy = strategy
        self.max_length = max_length or model_max_length(model, tokenizer)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.progress = progress
        self.stats = ScoreStats(strategy=strategy)
        self._prefix_checked = False
        params = _forward_params(model)
        # transformers >= 5.2x names the KV cache argument `cache`; older models `past_key_values`.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._can_trim_logits = "logits_to_keep" in params

    # -- model calls ----------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, **kwargs: Any) -> Any:
        self.stats.forward_passes += 1
        self.stats.padded_tokens += ids.numel()
        return self.model(input_ids=ids.to(self.device), **kwargs)

    # -- request building -----------------------------------------------------------------------
    def _sequences(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[list[int], int]]:
        """(input ids = (ctx + cont)[-(max_len+1):][:-1], number of continuation tokens) per
        ``(context, continuation)`` pair."""
        out = []
        for ctx_text, cont_text in pairs:
            ctx, cont = self.encoder.pair(ctx_text, cont_text)
            if not cont:
                raise ValueError(f"continuation {cont_text!r} encodes to no tokens")
            if len(cont) > self.max_length:
                raise ValueError(f"continuation of {len(cont)} tokens exceeds the model's "
                                 f"max length {self.max_length}")
            whole = (ctx + cont)[-(self.max_length + 1):]
            out.append((whole, len(cont)))
        return out

    # -- strategies -----------------------------------------------------------------------------
    @staticmethod
    def _gather(logp: torch.Tensor, targets: list[int]) -> tuple[float, bool]:
        """Summed log-probability of ``targets`` and whether each is the argmax (the harness's
        ``is_greedy``)."""
        t = torch.tensor(targets, dtype=torch.long, device=logp.device)
        return float(logp.gather(-1, t[:, None]).sum()), bool((logp.argmax(-1) == t).all())

    @staticmethod
    def _prefix_plan(item: list[tuple[list[int], int]]) -> int:
        """Length of the prefix run once for ``item``: the choices' common input tokens, cut where
        the first scored logit is needed (so every scored logit comes from the continuation pass)."""
        inputs = [s[:-1] for s, _ in item]
        first_needed = min(len(s) - c - 1 for s, c in item)
        return min(_common_prefix_len(inputs), first_needed)

    def _score_prefix_groups(self, items: list[list[tuple[list[int], int]]],
                             check: bool = False,
                             desc: str = "scoring") -> list[list[tuple[float, bool]]]:
        """Scores of many items through their shared prefixes, batched across items.

        Items (each with a non-empty prefix, see :meth:`_prefix_plan`) are sorted by prefix length
        and taken in windows of ``PREFIX_WINDOW_GROUPS * batch_size``.  In a window, passes of
        ``batch_size`` items run the prefixes right-padded with the KV cache (right padding is
        exact for a causal model: real positions never attend to later pads) and their keys and
        values are kept; then all the window's choices, sorted by continuation length, are scored
        in passes of at most ``batch_size`` rows on that cache (expanded to one row per choice),
        with ``position_ids = prefix_len + j`` and a ``(rows, past + T)`` attention mask hiding
        each row's prefix and continuation padding.  ``check``: after the first window, compare
        the item with prefix padding and the fewest tokens with :meth:`_score_full` and raise
        :class:`_CacheMismatch` if they differ.
        """
        plans = [self._prefix_plan(item) for item in items]
        order = sorted(range(len(items)), key=lambda i: -plans[i])
        scores: list[list[tuple[float, bool]]] = [[(0.0, False)] * len(item) for item in items]
        bar = tqdm(total=len(items), desc=desc, disable=not self.progress, leave=False)
        step = self.batch_size * PREFIX_WINDOW_GROUPS
        extra = {"logits_to_keep": 1} if self._can_trim_logits else {}
        for w in range(0, len(order), step):
            win = order[w: w + step]
            qs = [plans[i] for i in win]  # descending
            kv_win: list[tuple[torch.Tensor, torch.Tensor]] = []
            starts = [c[0] for c in self._chunks(list(range(len(win))), lambda r: 0,
                                                 lambda r, qs=qs: qs[r])]
            for g, g_end in zip(starts, [*starts[1:], len(win)], strict=True):
                group = win[g: g_end]
                width = qs[g]
                batch = torch.zeros((len(group), width), dtype=torch.long)
                for r, i in enumerate(group):
                    batch[r, : qs[g + r]] = torch.tensor(items[i][0][0][: qs[g + r]], dtype=torch.long)
                    self.stats.tokens += qs[g + r]
                out = self._forward(batch, use_cache=True, **extra)
                past = getattr(out, "cache", None)
                if past is None:
                    past = getattr(out, "past_key_values", None)
                kv = _cache_tensors(past, width)
                del out, past
                if not kv_win:  # the first group has the window's longest prefix
                    kv_win = [(k.new_zeros((len(win), *k.shape[1:])),
                               v.new_zeros((len(win), *v.shape[1:]))) for k, v in kv]
                for (kw, vw), (k, v) in zip(kv_win, kv, strict=True):
                    kw[g: g + len(group), :, :width] = k
                    vw[g: g + len(group), :, :width] = v
                del kv
            # one row per (item, choice), longest continuation first, chunked to bound the rows
            rows = [(r, j) for r, i in enumerate(win) for j in range(len(items[i]))]
            suf_len = {(r, j): len(items[win[r]][j][0]) - 1 - qs[r] for r, j in rows}
            rows.sort(key=lambda rj: -suf_len[rj])
            for chunk in self._chunks(rows, lambda rj, qs=qs: qs[rj[0]],
                                      suf_len.__getitem__):
                self._score_chunk(items, win, qs, kv_win, chunk, suf_len, scores)
            del kv_win
            if check and w == 0:
                padded = [r for r in range(len(win)) if qs[r] < qs[0]] or list(range(len(win)))
                r = min(padded, key=lambda r: sum(len(s) for s, _ in items[win[r]]))
                ref = [ll for ll, _ in self._score_full(items[win[r]])]
                got = [ll for ll, _ in scores[win[r]]]
                if not np.allclose(got, ref, rtol=1e-4, atol=1e-3):
                    bar.close()
                    raise _CacheMismatch(f"KV-cache scores differ from plain scores "
                                         f"({got} vs {ref})")
            bar.update(len(win))
        bar.close()
        return scores

    def _chunks(self, rows: list[Any], prefix: Callable[[Any], int],
                length: Callable[[Any], int]) -> list[list[Any]]:
        """Split ``rows`` (sorted by ``length``, longest first) into passes of at most
        ``batch_size`` rows whose padded length (longest ``prefix`` + longest ``length``) fits the
        model's context.  A row starts a new pass early when the padding that this saves for the
        rows that would still join the pass exceeds :data:`PASS_COST_TOKENS` (on a CPU a pad costs
        as much as a token; a pass costs a fixed read of all the weights on top)."""
        chunks: list[list[Any]] = []
        cur: list[Any] = []
        q_max = t_max = 0
        for n, row in enumerate(rows):
            q, t = max(q_max, prefix(row)), max(t_max, length(row))
            room = min(self.batch_size - len(cur), len(rows) - n)
            if cur and (len(cur) >= self.batch_size or q + t > self.max_length
                        or (t - length(row)) * room > PASS_COST_TOKENS):
                chunks.append(cur)
                cur, q, t = [], prefix(row), length(row)
            cur.append(row)
            q_max, t_max = q, t
        if cur:
            chunks.append(cur)
        return chunks

    def _score_chunk(self, items: list[list[tuple[list[int], int]]], group: list[int],
                     qs: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]],
                     chunk: list[tuple[int, int]], suf_len: dict[tuple[int, int], int],
                     scores: list[list[tuple[float, bool]]]) -> None:
        """One continuation pass: ``chunk`` rows (group row, choice) on the prefix cache ``kv``."""
        n = len(chunk)
        past_len = max(qs[r] for r, _ in chunk)
        width = max(suf_len[rj] for rj in chunk)
        ids = torch.zeros((n, width), dtype=torch.long)
        pos = torch.zeros((n, width), dtype=torch.long)
        mask = torch.zeros((n, past_len + width), dtype=torch.long)
        for k, (r, j) in enumerate(chunk):
            s = items[group[r]][j][0]
            q, t = qs[r], suf_len[(r, j)]
            ids[k, :t] = torch.tensor(s[q: q + t], dtype=torch.long)
            # pads repeat the last real position (never beyond the model's context)
            pos[k] = q + torch.arange(width).clamp(max=t - 1)
            mask[k, :q] = 1
            mask[k, past_len: past_len + t] = 1
            self.stats.tokens += t
        index = torch.tensor([r for r, _ in chunk], dtype=torch.long, device=kv[0][0].device)
        cache = _build_cache([(k[index, :, :past_len], v[index, :, :past_len]) for k, v in kv])
        dev = self.device
        out = self._forward(ids, attention_mask=mask.to(dev), position_ids=pos.to(dev),
                            use_cache=True, **{self._cache_kw: cache})
        logits = out.logits
        for k, (r, j) in enumerate(chunk):
            s, c = items[group[r]][j]
            q = qs[r]
            start, end = len(s) - c - 1, len(s) - 1  # input positions predicting the continuation
            lp = torch.log_softmax(logits[k, start - q: end - q].float(), dim=-1)
            scores[group[r]][j] = self._gather(lp, s[len(s) - c:])

    def _score_full(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """Scores of many (sequence, n_cont) rows, batched by length (longest first), right-padded."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        scores: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for b in range(0, len(order), self.batch_size):
            idx = order[b: b + self.batch_size]
            width = len(rows[idx[0]][0]) - 1
            batch = torch.zeros((len(idx), width), dtype=torch.long)
            for r, i in enumerate(idx):
                s = rows[i][0][:-1]
                batch[r, : len(s)] = torch.tensor(s, dtype=torch.long)
                self.stats.tokens += len(s)
            logits = self._forward(batch, use_cache=False).logits
            for r, i in enumerate(idx):
                s, c = rows[i]
                lp = torch.log_softmax(logits[r, len(s) - c - 1: len(s) - 1].float(), dim=-1)
                scores[i] = self._gather(lp, s[len(s) - c:])
        return scores

    def score(self, examples: Sequence[MCExample], desc: str = "scoring") -> list[list[float]]:
        """Summed log-likelihood of every choice of every example."""
        seqs = []
        for i, ex in enumerate(examples):
            try:
                seqs.append(self._sequences(list(zip(ex.contexts, ex.continuations, strict=True))))
            except ValueError as exc:  # name the task and the row (file:line), not just the problem
                raise ValueError(f"task {desc}, {ex.where or f'row {i + 1}'}: {exc}") from None
        return [[ll for ll, _ in row] for row in self._score_items(seqs, desc)]

    def score_pairs(self, items: Sequence[Sequence[tuple[str, str]]],
                    desc: str = "scoring") -> list[list[tuple[float, bool]]]:
        """``(log-likelihood, is_greedy)`` of every ``(context, continuation)`` pair; the pairs of
        one item (an example's choices) are scored through their shared prefix.

            >>> scorer.score_pairs([[("Q: 2+2\\nA:", " 4"), ("Q: 2+2\\nA:", " 5")]])  # doctest: +SKIP
            [[(-3.1, True), (-7.4, False)]]
        """
        return self._score_items([self._sequences(pairs) for pairs in items], desc)

    def score_rows(self, rows: Sequence[tuple[list[int], int]],
                   desc: str = "scoring") -> list[tuple[float, bool]]:
        """``(log-likelihood, is_greedy)`` of the last ``n`` tokens of each ``(token ids, n)`` row
        (ids already cut to ``max_length + 1``), whole rows batched by length: for rolling
        perplexity windows, which share no prefix."""
        return [item[0] for item in self._score_items([[(list(s), n)] for s, n in rows], desc)]

    @torch.inference_mode()
    def _score_items(self, seqs: list[list[tuple[list[int], int]]],
                     desc: str) -> list[list[tuple[float, bool]]]:
        was_training = self.model.training
        self.model.eval()
        try:
            if self.strategy == "full":
                flat = [row for item in seqs for row in item]
                flat_scores = self._score_full(flat)
                out, k = [], 0
                for item in seqs:
                    out.append(flat_scores[k: k + len(item)])
                    k += len(item)
                return out
            results: list[list[tuple[float, bool]] | None] = [None] * len(seqs)
            # a lone sequence has nothing to share: one full pass beats a prefix pass + a suffix pass
            cached = [i for i, item in enumerate(seqs) if len(item) > 1 and self._prefix_plan(item) > 0]
            if self.strategy == "prefix" and cached:
                got = self._try_prefix([seqs[i] for i in cached], desc)
                if got is not None:
                    for i, sc in zip(cached, got, strict=True):
                        results[i] = sc
            pending = [i for i, r in enumerate(results) if r is None]
            if pending:  # no shared prefix (or no usable cache): score them in length-sorted batches
                flat = [row for i in pending for row in seqs[i]]
                flat_scores = self._score_full(flat)
                k = 0
                for i in pending:
                    results[i] = flat_scores[k: k + len(seqs[i])]
                    k += len(seqs[i])
            return [r for r in results if r is not None]
        finally:
            self.model.train(was_training)

    def _try_prefix(self, items: list[list[tuple[list[int], int]]],
                    desc: str = "scoring") -> list[list[tuple[float, bool]]] | None:
        """Cross-item prefix scoring; None (after switching to ``full``) when the first window's
        cache cannot be used or its scores differ from the plain computation."""
        check = not self._prefix_checked
        self._prefix_checked = True
        if not check:
            return self._score_prefix_groups(items, desc=desc)
        try:
            return self._score_prefix_groups(items, check=True, desc=desc)
        except _CacheMismatch as exc:
            self._fall_back(str(exc))
        except (TypeError, AttributeError, RuntimeError, ValueError, IndexError) as exc:
            self._fall_back(f"KV-cache scoring failed ({type(exc).__name__}: {exc})")
        return None

    def _fall_back(self, why: str) -> None:
        warnings.warn(f"{why}; scoring every choice in full instead", stacklevel=3)
        self.stats.fallbacks.append(why)
        self.strategy = "full"
        self.stats.strategy = "full"


# --------------------------------------------------------------------------------------------
# Metrics


def mean_stderr(values: Sequence[float]) -> float:
    """Sample standard deviation / sqrt(n) (the harness's ``mean_stderr``); NaN when n < 2."""
    n = len(values)
    if n < 2:
        return float("nan")
    mu = sum(values) / n
    return math.sqrt(sum((x - mu) ** 2 for x in values) / (n - 1)) / math.sqrt(n)


def mc_metrics(examples: Sequence[MCExample], scores: Sequence[Sequence[float]],
               metrics: Sequence[str] = ("acc", "acc_norm")) -> tuple[dict[str, float], list[int]]:
    """``acc``/``acc_norm`` with standard errors, and the predictions by ``acc``.

    Ties go to the first choice (numpy's argmax), as in the harness.
    """
    acc, acc_norm, preds = [], [], []
    for ex, lls in zip(examples, scores, strict=True):
        lls_a = np.asarray(lls, dtype=np.float64)
        pred = int(np.argmax(lls_a))
        pred_norm = int(np.argmax(lls_a / np.asarray(ex.norm_lengths)))
        preds.append(pred)
        acc.append(1.0 if pred == ex.target else 0.0)
        acc_norm.append(1.0 if pred_norm == ex.target else 0.0)
    res: dict[str, float] = {"acc": float(np.mean(acc)), "acc_stderr": mean_stderr(acc)}
    if "acc_norm" in metrics:
        res["acc_norm"] = float(np.mean(acc_norm))
        res["acc_norm_stderr"] = mean_stderr(acc_norm)
    res["n"] = len(examples)
    return res, preds


def evaluate_tasks(model: torch.nn.Module, tokenizer: Any, tasks: Sequence[str], *,
                   data_dir: str | None = None, limit: int | None = None, batch_size: int = 16,
                   strategy: str = "prefix", device: str | None = None,
                   add_bos_token: bool | None = None, progress: bool = True,
                   scores_out: dict[str, list[list[float]]] | None = None) -> dict[str, Any]:
    """Evaluate ``model`` zero-shot on ``tasks``.

    Returns ``{"results": {task: {"acc", "acc_stderr", ["acc_norm", "acc_norm_stderr"], "n"}},
    "predictions": {task: [index chosen by acc, ...]}, "seconds": total, "task_seconds": {...},
    "forward_passes": {task: count}}``.  ``scores_out`` (optional) receives every choice's score.
    """
    if device is not None:
        model.to(device)
    report: dict[str, Any] = {"results": {}, "predictions": {}, "seconds": 0.0,
                              "task_seconds": {}, "forward_passes": {}}
    specs = [get_task(t) for t in tasks]  # unknown names fail before any work
    t_all = time.perf_counter()
    for spec in specs:
        t0 = time.perf_counter()
        examples = load_examples(spec, data_dir, limit)
        scorer = Scorer(model, tokenizer, batch_size=batch_size, strategy=strategy,
                        add_bos_token=add_bos_token, device=device, progress=progress)
        scores = scorer.score(examples, desc=spec.name)
        res, preds = mc_metrics(examples, scores, spec.metrics)
        report["results"][spec.name] = res
        report["predictions"][spec.name] = preds
        report["task_seconds"][spec.name] = round(time.perf_counter() - t0, 3)
        report["forward_passes"][spec.name] = scorer.stats.forward_passes
        if scores_out is not None:
            scores_out[spec.name] = scores
    report["seconds"] = round(time.perf_counter() - t_all, 3)
    return report


def format_table(report: dict[str, Any]) -> str:
    """An lm-eval-like markdown table of ``report["results"]``."""
    lines = ["|   Tasks   |  n  |Metric  |   |Value |   |Stderr|",
             "|-----------|----:|--------|---|-----:|---|-----:|"]
    for task, res in report["results"].items():
        first = True
        for m in ("acc", "acc_norm"):
            if m not in res:
                continue
            name = f"{task:<11}" if first else " " * 11
            n = f"{res['n']:>5}" if first else " " * 5
            lines.append(f"|{name}|{n}|{m:<8}|↑  |{res[m]:.4f}|±  |{res[m + '_stderr']:.4f}|")
            first = False
    return "\n".join(lines)
