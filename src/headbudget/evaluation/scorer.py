"""The log-likelihood engine behind ``headbudget eval``: continuations scored through token tries.

``strategy="prefix"`` (the default): the choices of one document share a token prefix (the
context; for winogrande the sentence up to the blank), and documents given the same few-shot
context share a longer one.  Their sequences are merged into a token trie laid out depth-first in
one row (:func:`headbudget.evaluation.token_trie.trie_layout`); token ``a`` attends to token ``b`` iff ``b`` is ``a`` or one of its
ancestors, passed as a 4-D attention mask with every token's own position, so each choice sees
exactly the keys of its plain sequence and every shared token runs once.  Short tries share rows,
neighbouring documents with a long common prefix share rows under one copy of it, and the output
projection and log-softmax run only where a continuation token is scored (a small model spends about
a fifth of its per-token work there; lm-eval's hf backend computes it at every position).

The fast path is checked, not trusted: the first unit of every kind it builds (a branched trie, an
unbranched row with or without a mask, a unit sharing its row with another document's, each for
log-likelihood requests and for rolling windows) is compared with the plain computation, token by
token, for every model dtype and device the scorer meets, whatever order the requests come in
(:meth:`Scorer._verify`, the check in :mod:`headbudget.evaluation.scorer_check`).  A model that
ignores 4-D masks or positions, or whose fast path raises, falls back to ``strategy="full"`` (every
choice's whole sequence, batched by length) with one warning naming the model and the reason.

    >>> scorer = Scorer(model, tokenizer, batch_size=16)                   # doctest: +SKIP
    >>> scorer.score_pairs([[("Q: 2+2\\nA:", " 4"), ("Q: 2+2\\nA:", " 5")]])   # doctest: +SKIP
    [[(-3.1, True), (-7.4, False)]]
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from headbudget.evaluation.encoding import HarnessEncoder, model_max_length
from headbudget.evaluation.scorer_check import _TreeMismatch, _unit_kind, verify_units
from headbudget.evaluation.tasks import MCExample
from headbudget.evaluation.token_trie import common_prefix_len as _common_prefix_len
from headbudget.evaluation.token_trie import trie_layout
from headbudget.progress import ProgressBar

# Rows of (scored positions, vocab) logits computed at once (bounds memory: 512 x 50k floats = 100 MB).
HEAD_ROWS = 512
# Shortest row of a tree pass: short trees share rows, so a pass is not mostly fixed cost.
MIN_ROW_TOKENS = 64
# Neighbouring items (in token order) sharing this many leading tokens (a fixed few-shot context, a
# long instruction) share rows, each up to its first item's trie plus SHARED_ROW_EXTRA_TOKENS (long
# rows cost attention work on masked keys: at 1k tokens about a third more per token).
SHARE_MIN_TOKENS = 32
SHARED_ROW_EXTRA_TOKENS = 512
# Largest attention mask of one pass (rows x L x L entries; 2**27 floats = 512 MB).
MASK_ELEMENTS = 2**27


@dataclass
class ScoreStats:
    """Counters of one scoring run (``forward_passes`` is printed by the CLI)."""

    forward_passes: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    strategy: str = "prefix"
    fallbacks: list[str] = field(default_factory=list)
    #: the unit kinds checked against the plain computation, as "kind (dtype, device)"
    checked: list[str] = field(default_factory=list)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


# Config fields of models whose logits are more than ``lm_head(decoder(x))`` (soft-capping, scaling).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_logit_scale")


def _split_output_head(model: torch.nn.Module) -> tuple[Any, torch.nn.Module | None]:
    """``(decoder, output projection)`` when ``model``'s logits are ``head(decoder(...)[0])``, so
    that the projection (a fifth of a small model's work per token, and the (tokens, vocab)
    log-softmax) can run at the scored positions only; ``(None, None)`` otherwise."""
    try:
        head = model.get_output_embeddings()
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, TypeError):
        return None, None
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    if (type(head) is not torch.nn.Linear or decoder is None or decoder is model
            or any(getattr(cfg, a, None) not in (None, 1, 1.0) for a in _LOGIT_TRANSFORMS)):
        return None, None
    return decoder, head


def _attention_window(model: torch.nn.Module) -> int | None:
    """The sliding-window width that every attention layer applies, None for full attention.  A
    model mixing windowed and full layers (Gemma 2/3 ``layer_types``) gets 0: one tree mask cannot
    describe both, so such a model is scored with ``strategy="full"``."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    window = getattr(cfg, "sliding_window", None) or getattr(cfg, "attention_window", None)
    if getattr(cfg, "use_sliding_window", True) is False or not isinstance(window, int):
        return None
    kinds = set(getattr(cfg, "layer_types", None) or [])
    return 0 if len(kinds) > 1 else window


class Scorer:
    """Log-likelihood of continuations for a causal LM.

    ``strategy``: ``"prefix"`` (each item -- an example's choices -- as one token tree, its shared
    prefix once; trees packed into ``batch_size`` rows per forward pass; see :meth:`_score_trees`)
    or ``"full"`` (every choice's whole sequence, ``batch_size`` sequences per pass, sorted by
    length; the plain computation that ``"prefix"`` is checked against).

        >>> scorer = Scorer(model, tokenizer, batch_size=16)                 # doctest: +SKIP
        >>> scorer.score_pairs([[("Q: 2+2\\nA:", " 4"), ("Q: 2+2\\nA:", " 5")]])  # doctest: +SKIP
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
        #: compare the first unit of each kind with the plain computation (tests turn it off to
        #: count the fast path's own passes)
        self._check = True
        self._checked: set[tuple[str, torch.dtype, str, bool]] = set()  # (kind, dtype, device, head split)
        self._dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        self._decoder, self._head = _split_output_head(model)
        self._window = _attention_window(model)

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

    # -- one pass per batch of item trees ----------------------------------------------------------
    #: an item's sequences as one depth-first row (:func:`headbudget.evaluation.token_trie.trie_layout`)
    _layout = staticmethod(trie_layout)

    def _units(self, item: list[tuple[list[int], int]]) -> list[list[int]]:
        """Choice indices per unit, so that no unit's tree is longer than the model's context (a
        long item's choices are spread over several units, each with its own copy of the prefix)."""
        inputs = [s[:-1] for s, _ in item]
        q = _common_prefix_len(inputs)
        parts: list[list[int]] = []
        length = self.max_length + 1
        for j, inp in enumerate(inputs):
            extra = len(inp) - q
            if parts and length + extra <= self.max_length:
                parts[-1].append(j)
                length += extra
            else:
                parts.append([j])
                length = len(inp)
        return parts

    def _score_trees(self, items: list[list[tuple[list[int], int]]], desc: str = "scoring",
                     source: str = "loglikelihood") -> list[list[tuple[float, bool]]]:
        """Scores of many items through token tries (see :meth:`_layout`): each row of a pass is the
        trie of a few items' choices (see :meth:`_passes`), so a prefix shared by an item's choices, or
        by several items (a fixed few-shot context), runs once, in the same pass as what follows it.
        The output projection runs only at the scored positions.  The first unit of each kind (see
        :func:`_unit_kind`) not yet checked at the model's dtype and device is compared with the plain
        computation (:meth:`_verify`, which raises :class:`_TreeMismatch` on a difference)."""
        units = [(i, part) for i, item in enumerate(items) for part in self._units(item)]
        scores: list[list[tuple[float, bool]]] = [[(0.0, False)] * len(item) for item in items]
        with ProgressBar(total=len(items), desc=desc, disable=not self.progress, leave=False) as bar:
            for rows in self._passes(items, units):
                got, token_lls, masked = self._tree_pass([[(items[i], part) for i, part in row]
                                                          for row in rows])
                k = 0
                unchecked: dict[str, tuple[list[tuple[list[int], int]], list[torch.Tensor]]] = {}
                for row in rows:
                    for position, (i, part) in enumerate(row):
                        for j, v in zip(part, got[k], strict=True):
                            scores[i][j] = v
                        # a shared row is checked at its last unit, the one behind the most tokens
                        # that are not its own
                        if self._check and (position == 0 or position == len(row) - 1):
                            kind = _unit_kind(source, position, len(part), masked)
                            if self._check_key(kind) not in self._checked and kind not in unchecked:
                                unchecked[kind] = ([items[i][j] for j in part], token_lls[k])
                        k += 1
                if unchecked:
                    self._verify(unchecked)
                bar.update(sum(1 for row in rows for _, part in row if part[0] == 0))
        return scores

    def _check_key(self, kind: str) -> tuple[str, torch.dtype, str, bool]:
        return kind, self._dtype, str(self.device), self._head is not None

    def _verify(self, units: dict[str, tuple[list[tuple[list[int], int]], list[torch.Tensor]]]) -> None:
        """:func:`verify_units` of one unit per kind; then the kinds count as checked at this dtype,
        device and output-head split."""
        verify_units(units, self._plain_token_logprobs, self._dtype)
        dtype = str(self._dtype).removeprefix("torch.")
        for kind in units:
            self._checked.add(self._check_key(kind))
            self.stats.checked.append(f"{kind} ({dtype}, {self.device})")

    def _passes(self, items: list[list[tuple[list[int], int]]],
                units: list[tuple[int, list[int]]]) -> Iterator[list[list[tuple[int, list[int]]]]]:
        """Units per row per pass.  Units in token order; runs of neighbours that share at least
        :data:`SHARE_MIN_TOKENS` leading tokens become rows of up to their first unit's tokens plus
        :data:`SHARED_ROW_EXTRA_TOKENS`; then, longest first, a pass takes at most ``batch_size``
        rows (fewer when their (L, L) masks would exceed :data:`MASK_ELEMENTS`) of ``L`` = max(its
        longest row, :data:`MIN_ROW_TOKENS`) tokens, each topped up with the shortest rows that fit."""
        def size(u: tuple[int, list[int]]) -> int:  # trie tokens: sorted lengths minus shared prefixes
            seqs = sorted(items[u[0]][j][0][:-1] for j in u[1])
            return len(seqs[0]) + sum(len(b) - _common_prefix_len([a, b]) for a, b in zip(seqs, seqs[1:]))

        firsts = [items[i][part[0]][0][:-1] for i, part in units]  # each unit's first choice's input
        groups: list[list[tuple[int, list[int]]]] = []
        lengths: list[int] = []
        prev: list[int] = []
        cap = 0
        for k in sorted(range(len(units)), key=firsts.__getitem__):
            n = size(units[k])
            shared = _common_prefix_len([prev, firsts[k]]) if groups else 0
            if shared >= SHARE_MIN_TOKENS and lengths[-1] + n - shared <= cap:
                groups[-1].append(units[k])
                lengths[-1] += n - shared
            else:
                groups.append([units[k]])
                lengths.append(n)
                cap = n + SHARED_ROW_EXTRA_TOKENS
            prev = firsts[k]
        order = sorted(range(len(groups)), key=lambda g: -lengths[g])
        lo, hi = 0, len(order)
        while lo < hi:
            width = max(lengths[order[lo]], MIN_ROW_TOKENS)
            n_rows = min(self.batch_size, max(1, MASK_ELEMENTS // width ** 2))
            rows = []
            while lo < hi and len(rows) < n_rows:
                row, used = list(groups[order[lo]]), lengths[order[lo]]
                lo += 1
                while lo < hi and used + lengths[order[hi - 1]] <= width:
                    hi -= 1
                    row += groups[order[hi]]
                    used += lengths[order[hi]]
                rows.append(row)
            yield rows

    def _tree_pass(self, rows: list[list[tuple[list[tuple[list[int], int]], list[int]]]]
                   ) -> tuple[list[list[tuple[float, bool]]], list[list[torch.Tensor]], bool]:
        """One forward pass; a row is the trie of its units' choices, a unit ``(item, choices)``.
        Returns (log-likelihood, is_greedy) per choice of each unit, units in row order; the
        log-probability of each continuation token, in the same layout; whether a mask was used."""
        layouts = [self._layout([item[j][0][:-1] for item, part in row for j in part]) for row in rows]
        B, T = len(rows), max(len(lay[0]) for lay in layouts)
        ids = torch.zeros((B, T), dtype=torch.long)
        pos = torch.zeros((B, T), dtype=torch.long)
        ends = torch.arange(1, T + 1).repeat(B, 1)  # pads: a subtree of their own
        flat_index: list[int] = []
        targets: list[int] = []
        n_cont: list[int] = []
        for r, (row, (t_ids, t_pos, t_ends, where)) in enumerate(zip(rows, layouts, strict=True)):
            n = len(t_ids)
            ids[r, :n] = torch.tensor(t_ids, dtype=torch.long)
            pos[r, :n] = torch.tensor(t_pos, dtype=torch.long)
            ends[r, :n] = torch.tensor(t_ends, dtype=torch.long)
            self.stats.tokens += n
            k = 0
            for item, part in row:
                for j in part:
                    s, c = item[j]
                    flat_index += [r * T + x for x in where[k][len(s) - c - 1:]]
                    targets += s[len(s) - c:]
                    n_cont.append(c)
                    k += 1
        mask = None  # every row one unbranched, unpadded sequence (perplexity windows): plain causal
        if not bool((ends == T).all()):
            key = torch.arange(T)
            # query a sees key b iff b <= a < ends[b]: b is a itself or one of its ancestors
            allowed = (key[None, None, :] <= key[None, :, None]) & (key[None, :, None] < ends[:, None, :])
            if self._window is not None:  # sliding-window attention counts positions, not indices
                allowed &= (pos[:, :, None] - pos[:, None, :]) < self._window
            mask = torch.zeros((B, 1, T, T), dtype=self._dtype).masked_fill_(
                ~allowed[:, None], torch.finfo(self._dtype).min)
        hidden, head = self._tree_forward(ids, mask, pos, torch.tensor(flat_index))
        tgt = torch.tensor(targets, dtype=torch.long, device=self.device)
        ll = torch.empty(len(targets), dtype=torch.float32)
        greedy = torch.empty(len(targets), dtype=torch.bool)
        for a in range(0, len(targets), HEAD_ROWS):  # bound the (rows, vocab) logits in memory
            logits = head(hidden[a: a + HEAD_ROWS]).float()
            t = tgt[a: a + HEAD_ROWS]
            ll[a: a + HEAD_ROWS] = torch.log_softmax(logits, -1).gather(-1, t[:, None])[:, 0].cpu()
            greedy[a: a + HEAD_ROWS] = (logits.argmax(-1) == t).cpu()
        out: list[list[tuple[float, bool]]] = []
        token_lls: list[list[torch.Tensor]] = []
        a = k = 0
        for row in rows:
            for _, part in row:
                unit, unit_lls = [], []
                for _ in part:
                    c = n_cont[k]
                    unit.append((float(ll[a: a + c].sum()), bool(greedy[a: a + c].all())))
                    unit_lls.append(ll[a: a + c])
                    a, k = a + c, k + 1
                out.append(unit)
                token_lls.append(unit_lls)
        return out, token_lls, mask is not None

    def _tree_forward(self, ids: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor,
                      index: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The model on a packed batch: the rows ``index`` (into the flattened batch) of the last
        hidden states and the output projection to apply to them (or of the logits, with the
        identity, when the model's logits are not ``head(decoder(x))``)."""
        dev = self.device
        self.stats.forward_passes += 1
        self.stats.padded_tokens += ids.numel()
        kwargs = {"input_ids": ids.to(dev), "attention_mask": None if mask is None else mask.to(dev),
                  "position_ids": pos.to(dev), "use_cache": False}
        if self._head is not None:  # the decoder alone, then the output projection where scored
            out = self._decoder(**kwargs)
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
            head = self._head
        else:
            hidden, head = self.model(**kwargs).logits, _identity
        return hidden.reshape(ids.numel(), -1)[index.to(dev)], head

    def _score_full(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """Scores of many (sequence, n_cont) rows, batched by length (longest first), right-padded."""
        scores: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for i, token_lls, greedy in self._plain_token_logprobs(rows):
            scores[i] = (float(token_lls.sum()), greedy)
        return scores

    def _plain_token_logprobs(self, rows: list[tuple[list[int], int]]
                              ) -> Iterator[tuple[int, torch.Tensor, bool]]:
        """``(row index, log-probability of each continuation token, is_greedy)`` of every
        (sequence, n_cont) row: the model's own logits on whole sequences, batched by length (longest
        first), right-padded (the plain computation)."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
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
                t = torch.tensor(s[len(s) - c:], dtype=torch.long, device=lp.device)
                yield i, lp.gather(-1, t[:, None])[:, 0], bool((lp.argmax(-1) == t).all())

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
        return [item[0] for item in self._score_items([[(list(s), n)] for s, n in rows], desc,
                                                       source="rolling window")]

    @torch.inference_mode()
    def _score_items(self, seqs: list[list[tuple[list[int], int]]], desc: str,
                     source: str = "loglikelihood") -> list[list[tuple[float, bool]]]:
        was_training = self.model.training
        self.model.eval()
        # the model may have been cast since the scorer was made: masks and checks follow it
        self._dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), self._dtype)
        try:
            if self.strategy == "full":
                flat = [row for item in seqs for row in item]
                flat_scores = self._score_full(flat)
                out, k = [], 0
                for item in seqs:
                    out.append(flat_scores[k: k + len(item)])
                    k += len(item)
                return out
            got = self._try_trees(seqs, desc, source)
            return got if got is not None else self._score_items(seqs, desc, source)  # now "full"
        finally:
            self.model.train(was_training)

    def _try_trees(self, items: list[list[tuple[list[int], int]]], desc: str = "scoring",
                   source: str = "loglikelihood") -> list[list[tuple[float, bool]]] | None:
        """Tree scoring, each unit kind checked against the plain computation when first met (see
        :meth:`_verify`).  On a difference or an error from the model, retry with the model's own
        logits (when the output projection was split off), then fall back to ``full`` (None)."""
        if self._window == 0:
            self._fall_back("the model mixes sliding-window and full attention layers")
            return None
        while True:
            try:
                return self._score_trees(items, desc=desc, source=source)
            except _TreeMismatch as exc:
                why = str(exc)
            except torch.OutOfMemoryError:
                raise  # the plain path needs more memory still: say so, do not retry
            except (TypeError, AttributeError, RuntimeError, ValueError, IndexError, KeyError) as exc:
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                why = f"tree scoring failed ({type(exc).__name__}: {first})"
            if self._head is None:
                self._fall_back(why)
                return None
            self._decoder, self._head = None, None  # the decoder/head split was the problem?

    def _fall_back(self, why: str) -> None:
        name = type(self.model).__name__
        dtype = str(self._dtype).removeprefix("torch.")
        warnings.warn(f"{name} ({dtype}, {self.device}): {why}; scoring every choice in full instead",
                      stacklevel=3)
        self.stats.fallbacks.append(why)
        self.strategy = "full"
        self.stats.strategy = "full"
