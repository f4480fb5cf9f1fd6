"""Paired statistics of a comparison: per-seed differences and their Student-t interval
(:func:`paired_differences`), a decision rule with an equivalence margin (:func:`decide`) and what the seeds
can detect (:func:`min_detectable_difference`).

    >>> from headbudget.train.paired import decide, paired_differences
    >>> d = paired_differences({0: 2.9, 1: 3.0, 2: 3.1}, {0: 3.0, 1: 3.2, 2: 3.4})
    >>> decide(d["ci"], margin=0.5)
    'equivalent'
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats  # a dependency of scikit-learn, which headbudget requires

__all__ = ["decide", "holm", "min_detectable_difference", "paired_differences", "sample_std"]


def sample_std(values: Sequence[float]) -> float:
    """Standard deviation with n-1 (0 for fewer than two values)."""
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def paired_differences(values: dict[int, float], reference: dict[int, float],
                       confidence: float = 0.95) -> dict[str, Any]:
    """Per-seed differences ``values[seed] - reference[seed]`` over the seeds both have, their mean,
    standard deviation (n-1) and a two-sided Student-t interval for the mean difference.

    >>> d = paired_differences({0: 2.9, 1: 3.0, 2: 3.1}, {0: 3.0, 1: 3.2, 2: 3.4})
    >>> round(d["mean"], 6), round(d["std"], 6), [round(x, 6) for x in d["ci"]]
    (-0.2, 0.1, [-0.448414, 0.048414])
    """
    seeds = sorted(set(values) & set(reference))
    diffs = [float(values[s]) - float(reference[s]) for s in seeds]
    n = len(diffs)
    mean = float(np.mean(diffs)) if n else math.nan
    sd = sample_std(diffs)
    out: dict[str, Any] = {"seeds": seeds, "diffs": diffs, "n": n, "mean": mean, "std": sd,
                           "confidence": confidence, "ci": None, "t_crit": None, "t": None}
    if n >= 2:
        crit = float(stats.t.ppf(0.5 + confidence / 2, n - 1))
        half = crit * sd / math.sqrt(n)
        out.update(ci=[mean - half, mean + half], t_crit=crit, t=mean / (sd / math.sqrt(n)) if sd > 0 else None)
    return out


def min_detectable_difference(sd_diff: float, n: int, alpha: float = 0.05, power: float = 0.80) -> float:
    """The smallest true mean paired difference that a two-sided paired t-test at level ``alpha`` over ``n``
    seeds detects with probability ``power``, when per-seed differences have standard deviation ``sd_diff``
    (exact, from the noncentral t distribution). What a comparison of this many seeds can tell apart.

    >>> round(min_detectable_difference(1.0, 5), 3)
    1.682
    """
    from scipy import optimize

    if sd_diff <= 0:
        return 0.0
    df, crit = n - 1, float(stats.t.ppf(1 - alpha / 2, n - 1))

    def power_at(effect: float) -> float:
        nc = effect * math.sqrt(n) / sd_diff
        upper, lower = float(stats.nct.sf(crit, df, nc)), float(stats.nct.cdf(-crit, df, nc))
        return upper + (lower if math.isfinite(lower) else 0.0)  # the far tail is ~0 (scipy: NaN there)

    hi = sd_diff
    while power_at(hi) < power:  # bracket the root (a fixed wide bracket sends nct into NaN)
        hi *= 2
    return float(optimize.brentq(lambda e: power_at(e) - power, 1e-12, hi))


def decide(ci: Sequence[float] | None, margin: float | None = None) -> str:
    """What a paired 95% interval of (schedule - reference) loss says: ``lower``, ``higher``, ``equivalent``
    (the whole interval inside ±``margin``, a null result stated as firmly as a win) or ``inconclusive``;
    ``undecided`` with fewer than 2 seeds.

    >>> decide([-0.03, -0.01]), decide([-0.01, 0.02], margin=0.05), decide([-0.01, 0.08], margin=0.05)
    ('lower', 'equivalent', 'inconclusive')
    """
    if ci is None:
        return "undecided"
    lo, hi = ci
    if hi < 0:
        return "lower"
    if lo > 0:
        return "higher"
    if margin is not None and -margin < lo and hi < margin:
        return "equivalent"
    return "inconclusive"


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of a family of p-values (a ``None`` -- a comparison that could not be
    tested -- stays ``None`` and is not counted in the family): the ``i``-th smallest of ``m`` becomes
    ``max over j <= i of min(1, (m - j + 1) p_(j))``, so rejecting where the adjusted value is below ``alpha``
    holds the family-wise error rate at ``alpha``.

    >>> holm([0.01, 0.04, 0.03, None])
    [0.03, 0.06, 0.06, None]
    """
    present = sorted((float(p), i) for i, p in enumerate(pvalues) if p is not None)
    m = len(present)
    out: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(present):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out
