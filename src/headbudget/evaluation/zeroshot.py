"""Zero-shot multiple-choice scoring with lm-evaluation-harness's numbers, faster.

The score of a choice is the summed log-likelihood of its continuation tokens given its context;
``acc`` picks the highest score, ``acc_norm`` the highest score divided by the choice's length in
characters; standard errors are sample standard deviation / sqrt(n).  Tokenization follows the
harness's ``hf`` backend: trailing spaces of the context move to the continuation, the continuation's
tokens are ``encode(context + continuation)[len(encode(context)):]`` with the tokenizer's default
special tokens (none when the text already starts with the BOS string), and over-long inputs are cut
from the left to ``max_length + 1`` tokens.

Speed: the choices of one item share a token prefix (the context; for winogrande the sentence up to
the blank).  ``strategy="prefix"`` runs that prefix once with the KV cache and scores all choices'
remaining tokens in one right-padded batch (two forward passes per item, no repeated context); the
first item is checked against the plain computation and the scorer falls back to
``strategy="full"`` (every choice's full sequence, batched across items sorted by length) when a
model's cache cannot be reused.

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from headbudget.evaluation.tasks import MCExample, get_task, load_examples

DEFAULT_MAX_LENGTH = 2048  # the harness's default when neither config nor tokenizer says


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


def _repeat_cache(past: Any, n: int) -> Any:
    """``past`` (a transformers Cache or a tuple of per-layer (k, v)) with its batch repeated n times."""
    if n == 1:
        return past
    if hasattr(past, "batch_repeat_interleave"):
        past.batch_repeat_interleave(n)
        return past
    if isinstance(past, (tuple, list)):
        return type(past)(_repeat_cache(p, n) if not torch.is_tensor(p)
                          else p.expand(n, *p.shape[1:]) for p in past)
    raise TypeError(f"cannot repeat a KV cache of type {type(past).__name__}")


def _forward_params(model: torch.nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


class Scorer:
    """Log-likelihood of continuations for a causal LM.

    ``strategy``: ``"prefix"`` (shared prefix once through the KV cache, then all choices' remaining
    tokens in one padded batch) or ``"full"`` (every choice's whole sequence, batched across items,
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
    def _sequences(self, ex: MCExample) -> list[tuple[list[int], int]]:
        """(input ids = (ctx + cont)[-(max_len+1):][:-1], number of continuation tokens) per choice."""
        out = []
        for ctx_text, cont_text in zip(ex.contexts, ex.continuations, strict=True):
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
    def _gather(logp: torch.Tensor, targets: list[int]) -> float:
        t = torch.tensor(targets, dtype=torch.long, device=logp.device)
        return float(logp.gather(-1, t[:, None]).sum())

    def _score_prefix(self, seqs: list[tuple[list[int], int]]) -> list[float] | None:
        """Scores of one item's choices through the shared prefix; None when there is none."""
        inputs = [s[:-1] for s, _ in seqs]
        p = _common_prefix_len(inputs)
        if p == 0:
            return None
        first_needed = min(len(s) - c - 1 for s, c in seqs)
        lo = min(first_needed, p)
        extra = {"logits_to_keep": p - lo} if self._can_trim_logits and p > lo else {}
        out = self._forward(torch.tensor([inputs[0][:p]]), use_cache=True, **extra)
        past = getattr(out, "cache", None)
        if past is None:
            past = getattr(out, "past_key_values", None)
        if past is None:
            raise TypeError("the model returned no KV cache")
        logits = out.logits[0, -(p - lo):] if p > lo else out.logits[0, :0]
        pre_lp = torch.log_softmax(logits.float(), dim=-1)
        suffixes = [x[p:] for x in inputs]
        ls = max(len(x) for x in suffixes)
        suf_lp = None
        if ls > 0:
            n = len(suffixes)
            batch = torch.zeros((n, ls), dtype=torch.long)
            for i, x in enumerate(suffixes):
                batch[i, : len(x)] = torch.tensor(x, dtype=torch.long)
            self.stats.tokens += sum(len(x) for x in suffixes)
            out2 = self._forward(batch, use_cache=True, **{self._cache_kw: _repeat_cache(past, n)})
            suf_lp = torch.log_softmax(out2.logits.float(), dim=-1)
        self.stats.tokens += p
        scores = []
        for i, (s, c) in enumerate(seqs):
            start, end = len(s) - c - 1, len(s) - 1  # logits positions predicting the continuation
            parts = []
            if start < p:
                parts.append(pre_lp[start - lo: min(end, p) - lo])
            if end > p:
                assert suf_lp is not None
                parts.append(suf_lp[i, max(start, p) - p: end - p])
            scores.append(self._gather(torch.cat(parts), s[len(s) - c:]))
        return scores

    def _score_full(self, rows: list[tuple[list[int], int]]) -> list[float]:
        """Scores of many (sequence, n_cont) rows, batched by length (longest first), right-padded."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        scores = [0.0] * len(rows)
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

    @torch.inference_mode()
    def score(self, examples: Sequence[MCExample], desc: str = "scoring") -> list[list[float]]:
        """Summed log-likelihood of every choice of every example."""
        was_training = self.model.training
        self.model.eval()
        try:
            seqs = [self._sequences(ex) for ex in examples]
            if self.strategy == "full":
                flat = [row for item in seqs for row in item]
                flat_scores = self._score_full(flat)
                out, k = [], 0
                for item in seqs:
                    out.append(flat_scores[k: k + len(item)])
                    k += len(item)
                return out
            results: list[list[float] | None] = []
            pending: list[int] = []
            for i, item in enumerate(tqdm(seqs, desc=desc, disable=not self.progress, leave=False)):
                got = self._try_prefix(item)
                results.append(got)
                if got is None:
                    pending.append(i)
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

    def _try_prefix(self, item: list[tuple[list[int], int]]) -> list[float] | None:
        if self.strategy != "prefix":
            return None
        if not self._prefix_checked:
            # First item: check the cached path against the plain one; fall back if they disagree.
            self._prefix_checked = True
            try:
                got = self._score_prefix(item)
            except (TypeError, AttributeError, RuntimeError, ValueError) as exc:
                self._fall_back(f"KV-cache scoring failed ({type(exc).__name__}: {exc})")
                return None
            if got is not None:
                ref = self._score_full(item)
                if not np.allclose(got, ref, rtol=1e-4, atol=1e-3):
                    self._fall_back(f"KV-cache scores differ from plain scores ({got} vs {ref})")
                    return None
            return got
        return self._score_prefix(item)

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
