"""The log-likelihood engine behind ``headbudget eval``: continuations scored through token tries.

``strategy="prefix"`` (the default) merges one document's choices (and documents sharing a few-shot
context) into a token trie in one row, seen through a 4-D mask and per-token positions, so each choice
sees exactly the keys of its plain sequence while shared tokens run once.  The first unit of every kind
is checked against the plain computation (:mod:`headbudget.evaluation.scorer_check`); a model that fails
falls back to ``strategy="full"`` with one warning.  See docs/evaluation.md and :meth:`Scorer.score_pairs`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from headbudget.devices import scoring_mode
from headbudget.evaluation.encoding import HarnessEncoder, model_max_length
from headbudget.evaluation.scorer_check import _TreeMismatch, _unit_kind, verify_units
from headbudget.evaluation.tasks import MCExample
from headbudget.evaluation.token_trie import common_prefix_len as _common_prefix_len
from headbudget.evaluation.token_trie import trie_layout
from headbudget.progress import ProgressBar

HEAD_ROWS = 512  # rows of (scored positions, vocab) logits at once: 512 x 50k floats = 100 MB
MIN_ROW_TOKENS = 64  # shortest row of a tree pass: short trees share rows, so a pass is not mostly fixed cost
# Neighbouring items sharing this many leading tokens (a fixed few-shot context) share rows, each up to its
# first item's trie plus SHARED_ROW_EXTRA_TOKENS (long rows cost masked attention: at 1k tokens ~1/3 more).
SHARE_MIN_TOKENS = 32
SHARED_ROW_EXTRA_TOKENS = 512
MASK_ELEMENTS = 2**27  # largest attention mask of one pass (rows x L x L entries; 2**27 floats = 512 MB)


@dataclass
class ScoreStats:
    """Counters of one scoring run (``forward_passes`` is printed by the CLI)."""

    forward_passes: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    strategy: str = "prefix"
    fallbacks: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)  # unit kinds self-checked, as "kind (dtype, device)"


# Config fields of models whose logits are more than ``lm_head(decoder(x))`` (soft-capping, scaling).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_logit_scale")


def _split_output_head(model: torch.nn.Module) -> tuple[Any, torch.nn.Module | None]:
    """``(decoder, output projection)`` when ``model``'s logits are ``head(decoder(...)[0])``, so that the
    projection and log-softmax run at the scored positions only; ``(None, None)`` otherwise."""
    try:
        head = model.get_output_embeddings()
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, TypeError):
        return None, None
    cfg = getattr(getattr(model, "config", None), "text_config", None) or getattr(model, "config", None)
    if (type(head) is not torch.nn.Linear or decoder is None or decoder is model
            or any(getattr(cfg, a, None) not in (None, 1, 1.0) for a in _LOGIT_TRANSFORMS)):
        return None, None
    return decoder, head


def _attention_window(model: torch.nn.Module) -> int | None:
    """The sliding-window width of every attention layer, None for full attention, 0 for a model mixing
    both (Gemma 2/3 ``layer_types``: one tree mask cannot describe both, so it is scored in full)."""
    cfg = getattr(getattr(model, "config", None), "text_config", None) or getattr(model, "config", None)
    window = getattr(cfg, "sliding_window", None) or getattr(cfg, "attention_window", None)
    if getattr(cfg, "use_sliding_window", True) is False or not isinstance(window, int):
        return None
    return 0 if len(set(getattr(cfg, "layer_types", None) or [])) > 1 else window


class Scorer:
    """Log-likelihood of continuations for a causal LM.  ``strategy``: ``"prefix"`` (each item -- an
    example's choices -- as one token tree, trees packed into ``batch_size`` rows per pass) or ``"full"``
    (every choice's whole sequence, ``batch_size`` per pass: the plain computation)."""

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
        self._check = True  # self-check each unit kind (tests turn it off to count the fast path's passes)
        self._checked: set[tuple[str, torch.dtype, str, bool]] = set()  # (kind, dtype, device, head split)
        self._dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        self._decoder, self._head = _split_output_head(model)
        self._window = _attention_window(model)

    def _forward(self, ids: torch.Tensor, module: Any = None, **kwargs: Any) -> Any:
        """``module`` (default: the model) on ``ids``, counted in :attr:`stats`."""
        self.stats.forward_passes += 1
        self.stats.padded_tokens += ids.numel()
        return (self.model if module is None else module)(input_ids=ids.to(self.device), **kwargs)

    def _sequences(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[list[int], int]]:
        """``((ctx + cont)[-(max_length + 1):], number of continuation tokens)`` per pair."""
        out = []
        for ctx_text, cont_text in pairs:
            ctx, cont = self.encoder.pair(ctx_text, cont_text)
            if not cont:
                raise ValueError(f"continuation {cont_text!r} encodes to no tokens")
            if len(cont) > self.max_length:
                raise ValueError(f"continuation of {len(cont)} tokens exceeds the model's "
                                 f"max length {self.max_length}")
            out.append(((ctx + cont)[-(self.max_length + 1):], len(cont)))
        return out

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
        """Scores of many items through token tries (rows: :meth:`_passes`); the first unit of each kind
        (:func:`_unit_kind`) not yet checked at this dtype and device is checked (:meth:`_verify`)."""
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
                        # a shared row is checked at its last unit (behind the most tokens not its own)
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
        """:func:`verify_units`; then the kinds count as checked at this dtype, device and head split."""
        verify_units(units, self._plain_token_logprobs, self._dtype)
        dtype = str(self._dtype).removeprefix("torch.")
        for kind in units:
            self._checked.add(self._check_key(kind))
            self.stats.checked.append(f"{kind} ({dtype}, {self.device})")

    def _passes(self, items: list[list[tuple[list[int], int]]],
                units: list[tuple[int, list[int]]]) -> Iterator[list[list[tuple[int, list[int]]]]]:
        """Units per row per pass.  Units in token order; runs of neighbours sharing at least
        :data:`SHARE_MIN_TOKENS` leading tokens become rows (up to :data:`SHARED_ROW_EXTRA_TOKENS` past
        their first unit); then, longest first, a pass takes up to ``batch_size`` rows (masks within
        :data:`MASK_ELEMENTS`) of ``L`` = max(longest, :data:`MIN_ROW_TOKENS`) tokens, plus short rows."""
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
        """One forward pass, a row the trie of its units ``(item, choices)``: (log-likelihood, is_greedy) per
        choice of each unit in row order, each continuation token's log-probability alike, whether masked."""
        row_seqs = [[item[j] for item, part in row for j in part] for row in rows]
        layouts = [self._layout([s[:-1] for s, _ in seqs]) for seqs in row_seqs]
        B, T = len(rows), max(len(lay[0]) for lay in layouts)
        ids, pos = (torch.zeros((B, T), dtype=torch.long) for _ in range(2))
        ends = torch.arange(1, T + 1).repeat(B, 1)  # pads: a subtree of their own
        flat_index: list[int] = []
        targets: list[int] = []
        n_cont: list[int] = []
        for r, (seqs, (t_ids, t_pos, t_ends, where)) in enumerate(zip(row_seqs, layouts, strict=True)):
            n = len(t_ids)
            for dst, src in ((ids, t_ids), (pos, t_pos), (ends, t_ends)):
                dst[r, :n] = torch.tensor(src, dtype=torch.long)
            self.stats.tokens += n
            for (s, c), w in zip(seqs, where, strict=True):
                flat_index += [r * T + x for x in w[len(s) - c - 1:]]
                targets += s[len(s) - c:]
                n_cont.append(c)
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
        chunks = iter(zip(ll.split(n_cont), greedy.split(n_cont), strict=True))  # per choice
        units = [[next(chunks) for _ in part] for row in rows for _, part in row]
        out = [[(float(x.sum()), bool(g.all())) for x, g in unit] for unit in units]
        return out, [[x for x, _ in unit] for unit in units], mask is not None

    def _tree_forward(self, ids: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor,
                      index: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The model on a packed batch: rows ``index`` (of the flattened batch) of the last hidden states
        and the output projection to apply (or of the logits, with the identity, when not split)."""
        dev = self.device
        kwargs = {"attention_mask": None if mask is None else mask.to(dev), "position_ids": pos.to(dev),
                  "use_cache": False}
        if self._head is not None:  # the decoder alone, then the output projection where scored
            out = self._forward(ids, self._decoder, **kwargs)
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
            head = self._head
        else:
            hidden, head = self._forward(ids, **kwargs).logits, torch.nn.Identity()
        return hidden.reshape(ids.numel(), -1)[index.to(dev)], head

    def _plain_token_logprobs(self, rows: list[tuple[list[int], int]]
                              ) -> Iterator[tuple[int, torch.Tensor, bool]]:
        """``(row index, log-probability of each continuation token, is_greedy)`` of every (sequence,
        n_cont) row: the plain computation (whole sequences, longest first, right-padded)."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        for b in range(0, len(order), self.batch_size):
            idx = order[b: b + self.batch_size]
            batch = torch.zeros((len(idx), len(rows[idx[0]][0]) - 1), dtype=torch.long)  # longest first
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
        """``(log-likelihood, is_greedy)`` of the last ``n`` tokens of each ``(token ids, n)`` row (ids
        already cut to ``max_length + 1``): rolling perplexity windows, which share no prefix."""
        return [item[0] for item in self._score_items([[(list(s), n)] for s, n in rows], desc,
                                                       source="rolling window")]

    def _score_items(self, seqs: list[list[tuple[list[int], int]]], desc: str,
                     source: str = "loglikelihood") -> list[list[tuple[float, bool]]]:
        # the model may have been cast since the scorer was made: masks and checks follow it
        self._dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), self._dtype)
        with scoring_mode(self.model):
            if self.strategy == "full":  # every row whole, batched by length
                flat = [row for item in seqs for row in item]
                scores: list[tuple[float, bool]] = [(0.0, False)] * len(flat)
                for i, token_lls, greedy in self._plain_token_logprobs(flat):
                    scores[i] = (float(token_lls.sum()), greedy)
                it = iter(scores)
                return [[next(it) for _ in item] for item in seqs]
            got = self._try_trees(seqs, desc, source)
            return got if got is not None else self._score_items(seqs, desc, source)  # now "full"

    def _try_trees(self, items: list[list[tuple[list[int], int]]], desc: str = "scoring",
                   source: str = "loglikelihood") -> list[list[tuple[float, bool]]] | None:
        """Tree scoring (:meth:`_score_trees`); on a failed check or an error from the model, retry with the
        model's own logits (when the output projection was split off), then fall back to ``full`` (None)."""
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
        dtype = str(self._dtype).removeprefix("torch.")
        warnings.warn(f"{type(self.model).__name__} ({dtype}, {self.device}): {why}; scoring every choice in "
                      "full instead", stacklevel=3)
        self.stats.fallbacks.append(why)
        self.strategy = self.stats.strategy = "full"
