"""Rankings that hold: per-seed values -> mean and spread, and a "best method" only where it is best on every text.

:func:`spread` summarises one method's per-seed values on one text (or task); :func:`rank_methods` names a
method best only if it beats every other on every text, by mean (``rule="mean"``) or -- stricter -- with
non-overlapping min-max ranges (``rule="range"``; :data:`RULES`).  Otherwise tables print "no method best".

    >>> values = {"cahp": {"wiki": [51.0, 53.0], "movies": [90.0, 86.0]},
    ...           "fisher": {"wiki": [60.0, 62.0], "movies": [67.0, 68.0]}}
    >>> rank_methods(values, lower_is_better=True)["per_text"]      # so no method is best
    {'wiki': 'cahp', 'movies': 'fisher'}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["NO_BEST", "RULES", "format_spread", "rank_methods", "ranking_markdown", "spread"]

NO_BEST = "no method best"
RULES = {
    "mean": "a method is best only if its mean over the seeds is better than every other method's mean on every text",
    "range": "a method is best only if, on every text, its worst seed is better than every other method's best "
             "seed (min-max ranges do not overlap)",
}


def spread(values: Sequence[float]) -> dict[str, Any]:
    """``{"n", "mean", "std" (sample, ddof 1; 0.0 for one value), "min", "max", "values"}`` of the values.

        >>> spread([1.0, 2.0, 3.0])["std"], spread([1.0, 2.0, 3.0])["mean"]
        (1.0, 2.0)
    """
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("spread of no values")
    n = len(vals)
    mean = math.fsum(vals) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
    return {"n": n, "mean": mean, "std": std, "min": min(vals), "max": max(vals), "values": vals}


def format_spread(s: Mapping[str, Any], digits: int = 2, brackets: bool = False) -> str:
    """``mean ± std`` (with ``[min–max]`` when ``brackets``) of a :func:`spread`; one value alone, as there is
    no spread to show from one seed (a "± 0" would read as "no variation").

        >>> format_spread(spread([1.0, 2.0, 3.0])), format_spread(spread([1.5]), brackets=True)
        ('2.00 ± 1.00', '1.50')
    """
    if s["n"] < 2:
        return f"{s['mean']:.{digits}f}"
    out = f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}"
    return out + (f" [{s['min']:.{digits}f}–{s['max']:.{digits}f}]" if brackets else "")


def _better(a: float, b: float, lower_is_better: bool) -> bool:
    return a < b if lower_is_better else a > b


def rank_methods(values: Mapping[str, Mapping[str, Sequence[float]]], *, lower_is_better: bool,
                 rule: str = "mean") -> dict[str, Any]:
    """Apply the ranking rule (module docstring) to ``values[method][text] = [per-seed values]`` (the
    same texts for every method): ``{"best", "label", "per_text", "rule", "rule_text", "lower_is_better"}``,
    ``per_text`` naming each text's own winner (None on a tie or overlapping ranges)."""
    if rule not in RULES:
        raise ValueError(f"ranking rule must be one of {', '.join(RULES)}, got {rule!r}")
    methods = list(values)
    if len(methods) < 2:
        raise ValueError(f"ranking needs at least two methods, got {methods}")
    texts = list(values[methods[0]])
    for m in methods:
        if list(values[m]) != texts:
            raise ValueError(f"method {m}: scored on {list(values[m])}, the others on {texts}")
    stats = {m: {t: spread(values[m][t]) for t in texts} for m in methods}

    def beats(x: str, y: str, t: str) -> bool:
        sx, sy = stats[x][t], stats[y][t]
        if rule == "mean":
            return _better(sx["mean"], sy["mean"], lower_is_better)
        worst_x = sx["max"] if lower_is_better else sx["min"]
        best_y = sy["min"] if lower_is_better else sy["max"]
        return _better(worst_x, best_y, lower_is_better)

    per_text = {t: next((x for x in methods if all(beats(x, y, t) for y in methods if y != x)), None)
                for t in texts}
    first = per_text[texts[0]] if texts else None
    best = first if first is not None and all(per_text[t] == first for t in texts) else None
    return {"best": best, "label": best if best is not None else NO_BEST, "per_text": per_text, "rule": rule,
            "rule_text": RULES[rule], "lower_is_better": lower_is_better}


def ranking_markdown(values: Mapping[str, Mapping[str, Sequence[float]]], *, lower_is_better: bool,
                     rule: str = "mean", digits: int = 2) -> str:
    """A table ``method | text: mean ± std [min–max] | ...`` with each text's winner in bold, then the
    verdict line (``best: X`` or ``no method best``) and the rule."""
    rank = rank_methods(values, lower_is_better=lower_is_better, rule=rule)
    methods = list(values)
    texts = list(values[methods[0]])
    lines = ["| method | " + " | ".join(texts) + " |", "|---|" + "---:|" * len(texts)]
    for m in methods:
        cells = [format_spread(spread(values[m][t]), digits, brackets=True) for t in texts]
        cells = [f"**{c}**" if rank["per_text"][t] == m else c for c, t in zip(cells, texts)]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    n = max(len(values[m][t]) for m in methods for t in texts)
    over = f"mean ± sample std [min–max] over {n} seeds" if n > 1 else "one seed, no spread"
    lines += ["", f"Ranking ({'lower' if lower_is_better else 'higher'} is better; {over}): **{rank['label']}** "
              f"-- rule: {rank['rule_text']}."]
    return "\n".join(lines) + "\n"
