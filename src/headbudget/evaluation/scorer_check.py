"""The fast path's self-check: which kind of unit the scorer built (:func:`_unit_kind`), and how far
one token's log-probability on the fast path may be from the plain computation's
(:func:`logprob_tolerance`, checked by :func:`verify_units`).  :class:`~headbudget.evaluation.scorer.Scorer`
checks the first unit of each kind it meets, per model dtype and device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

CHECK_EPS_FACTOR = 128  # self-check tolerance per token, in the model dtype's machine epsilons
CHECK_MIN_TOLERANCE = 1e-3  # its floor (float32 rounding of a sum over a long context)


def logprob_tolerance(dtype: torch.dtype) -> float:
    """Largest difference, in nats, allowed between one token's log-probability on the fast path and on the
    plain path, both at ``dtype``.  The paths run the same weights on differently shaped batches (a trie row
    with a 4-D mask vs right-padded sequences), so their sums round differently (a bf16 logit near 20 is a
    multiple of 0.125).  Measured on SmolLM2-135M (200 units of piqa, arc_easy, hellaswag, winogrande,
    256-token wikitext windows), the largest per-token difference was 0.65 nats in bf16, 0.05 in fp16 and
    3e-5 in fp32.  ``CHECK_EPS_FACTOR`` x eps (bf16 1.0, fp16 0.125, fp32 the 1e-3 floor) keeps those on
    the fast path, while a model that ignores the tree mask was off by 4.5 to 17 nats on every branched trie.

        >>> logprob_tolerance(torch.bfloat16), logprob_tolerance(torch.float16), logprob_tolerance(torch.float32)
        (1.0, 0.125, 0.001)
    """
    return max(CHECK_MIN_TOLERANCE, CHECK_EPS_FACTOR * torch.finfo(dtype).eps)


class _TreeMismatch(RuntimeError):
    """The tree scores of the self-check differ from the plain ones."""


def _unit_kind(source: str, position_in_row: int, n_choices: int, masked: bool) -> str:
    """What the fast path did to a unit: a unit after another in its row relies on the mask to hide that
    unit's tokens, a unit of several choices to hide its other branches, a lone sequence only on causal
    order (without a mask when the pass has only such).  ``source``: "loglikelihood" or "rolling window"."""
    if position_in_row > 0:
        layout = "row shared with another document"
    elif n_choices > 1:
        layout = "branched trie"
    else:
        layout = "unbranched row" if masked else "unbranched row without mask"
    return f"{layout} ({source})"


def verify_units(units: dict[str, tuple[list[tuple[list[int], int]], list[torch.Tensor]]],
                 plain_token_logprobs: Callable[[list[tuple[list[int], int]]],
                                                Iterable[tuple[int, torch.Tensor, bool]]],
                 dtype: torch.dtype) -> None:
    """Compare the tree log-probabilities of one unit per kind (``kind -> (its rows, their tree
    log-probabilities)``) with the plain computation of its rows, all in the same plain passes;
    :class:`_TreeMismatch` when a token differs by more than :func:`logprob_tolerance` at ``dtype``.

        >>> verify_units({"branched trie (loglikelihood)": ([([1, 2, 3], 1)], [torch.tensor([-0.5])])},
        ...              lambda rows: [(0, torch.tensor([-0.5]), True)], torch.float32)
    """
    tol = logprob_tolerance(dtype)
    kinds = list(units)
    rows = [r for kind in kinds for r in units[kind][0]]
    tree = [t for kind in kinds for t in units[kind][1]]
    owner = [kind for kind in kinds for _ in units[kind][0]]
    worst = dict.fromkeys(kinds, 0.0)
    for i, plain, _ in plain_token_logprobs(rows):
        diff = float((tree[i] - plain.cpu()).abs().max())
        worst[owner[i]] = diff if diff != diff else max(worst[owner[i]], diff)  # keep a NaN
    for kind in kinds:
        if not worst[kind] <= tol:
            name = str(dtype).removeprefix("torch.")
            raise _TreeMismatch(f"the tree scores of a {kind} differ from the plain scores by up "
                                f"to {worst[kind]:.3g} nats per token (tolerance {tol:.3g} at {name})")
