"""Per-layer budgets at a fixed total kept fraction: uniform, later_layers_first, earlier_layers_first.

Keep factors fall linearly over depth from ``c * (1 + s)`` to ``c * (1 - s)`` (``s = strength``) for
``later_layers_first`` (later layers keep less, which the theory predicts costs least;
``earlier_layers_first`` mirrors it), capped at 1 and floored at the smallest allowed size, ``c`` chosen so
the total matches ``keep``; sizes are then rounded to allowed values and fitted to the total.  See
docs/allocation.md.

    >>> allocate([64] * 4, 0.5, "later_layers_first")
    [48, 37, 27, 16]
    >>> allocate([12] * 6, 0.5, "earlier_layers_first", candidates=[divisors(12)] * 6)
    [2, 4, 6, 6, 6, 12]
"""

from __future__ import annotations

from collections.abc import Sequence

from headbudget.compression.svd import CompressionError

ALLOCATIONS = ("uniform", "later_layers_first", "earlier_layers_first")


def keep_profile(n_layers: int, allocation: str, strength: float = 0.5) -> list[float]:
    """Relative keep factor per layer (mean 1 before capping)."""
    if allocation not in ALLOCATIONS:
        raise CompressionError(f"unknown allocation {allocation!r}; choose from {', '.join(ALLOCATIONS)}")
    if not 0 <= strength < 1:
        raise CompressionError(f"allocation strength must be in [0, 1), got {strength}")
    if allocation == "uniform" or n_layers == 1:
        return [1.0] * n_layers
    ramp = [1 + strength * (1 - 2 * i / (n_layers - 1)) for i in range(n_layers)]  # 1+s .. 1-s
    return ramp if allocation == "later_layers_first" else ramp[::-1]


def allocate(full: Sequence[int], keep: float, allocation: str = "uniform", *,
             candidates: Sequence[Sequence[int]] | None = None, weights: Sequence[float] | None = None,
             strength: float = 0.5) -> list[int]:
    """Per-layer kept sizes (ranks, or kv-head counts) with ``sum(size * weight) ~= keep * sum(full * weight)``.

    ``candidates[i]`` lists the sizes layer i may take (default ``1..full[i]``); ``weights[i]`` is the
    cost of one unit in layer i (default 1, e.g. heads x 2 x d_model for a rank unit).
    """
    if not 0 < keep <= 1:
        raise CompressionError(f"--keep-ratio must be in (0, 1], got {keep}")
    n = len(full)
    w = [1.0] * n if weights is None else [float(x) for x in weights]
    cands = [sorted(set(int(c) for c in cs)) for cs in candidates] if candidates is not None else \
        [list(range(1, f + 1)) for f in full]
    prof = keep_profile(n, allocation, strength)
    target = keep * sum(f * wi for f, wi in zip(full, w))
    floor = [cs[0] / f for cs, f in zip(cands, full)]

    def shares(c: float) -> list[float]:
        return [min(1.0, max(fl, c * p)) for fl, p in zip(floor, prof)]

    def total(c: float) -> float:
        return sum(s * f * wi for s, f, wi in zip(shares(c), full, w))

    lo, hi = 0.0, 1.0 / min(prof)
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) < target else (lo, mid)
    cont = [s * f for s, f in zip(shares((lo + hi) / 2), full)]
    # nearest allowed size, then single moves to neighbouring sizes while they bring the total closer
    idx = [min(range(len(cs)), key=lambda j, cs=cs, t=t: (abs(cs[j] - t), cs[j])) for cs, t in zip(cands, cont)]
    cur = sum(cands[i][idx[i]] * w[i] for i in range(n))
    for _ in range(10_000):
        err = target - cur
        moves = [(i, j, (cands[i][j] - cands[i][idx[i]]) * w[i]) for i in range(n)
                 for j in (idx[i] - 1, idx[i] + 1) if 0 <= j < len(cands[i])]
        # the move that brings the total closest; ties: the one its layer's continuous size leans to most
        better = [((abs(err - ch), -(cont[i] - cands[i][idx[i]]) * (1 if ch > 0 else -1)), i, j, ch)
                  for i, j, ch in moves if abs(err - ch) < abs(err) - 1e-9]
        if not better:
            break
        _, i, j, change = min(better)
        idx[i] = j
        cur += change
    return [cands[i][idx[i]] for i in range(n)]


def divisors(n: int) -> list[int]:
    """Allowed kv-head counts for a layer of n heads."""
    return [g for g in range(1, n + 1) if n % g == 0]
