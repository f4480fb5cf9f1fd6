"""Which heads may go together: the granularity of a head selection on grouped-query models.

A key/value head goes (and the KV cache shrinks) only when all of its query heads go, and kernels such as
SDPA's ``enable_gqa`` and llama.cpp need the same number of query heads on every key/value head of a layer.
:func:`apply_granularity` turns per-head scores into a kept set of one of three shapes: ``"head"`` (any
query heads, the method's own selection), ``"group"`` (whole key/value groups) or ``"balanced"`` (in every
layer the same number of query heads on each kept group).  For ``group`` and ``balanced`` a dynamic
programme over the layers picks one layout per layer whose total head count is the budget when some
combination reaches it, else the reachable total nearest to it (ties: the smaller); among those, the largest
summed score.  Every layer keeps at least one group unless ``layer_floor=False``.  See docs/pruning.md,
"Granularity on grouped-query models".

    >>> import numpy as np
    >>> scores = [np.array([5., 4, 0, 0, 2, 1]), np.array([1., 1, 0, 0, 9, 0])]
    >>> groups = [[0, 0, 1, 1, 2, 2], [0, 0, 1, 1, 2, 2]]   # 2 layers, 6 query heads on 3 kv heads each
    >>> apply_granularity("group", scores, groups, 6)       # 3 whole groups of the 6
    [0, 1, 4, 5, 10, 11]
    >>> apply_granularity("balanced", scores, groups, 6)    # layer 0: 2 per group x 2; layer 1: 1 x 2
    [0, 1, 4, 5, 6, 10]
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from headbudget.models.surgery import HeadAdapter

GRANULARITIES = ("head", "group", "balanced")

__all__ = ["GRANULARITIES", "apply_granularity", "kv_groups_of", "layer_layouts"]


def kv_groups_of(adapter: HeadAdapter) -> list[list[int]]:
    """Per layer, the key/value group of every current query head (:meth:`HeadAdapter.kv_group`)."""
    return [adapter.kv_group(li) for li in range(adapter.num_layers)]


def layer_layouts(granularity: str, scores: np.ndarray, groups: Sequence[int]) -> dict[int, tuple[float, list[int]]]:
    """``{head count: (summed score, kept heads)}`` of the best layout of each size one layer allows.

        >>> layer_layouts("balanced", np.array([3., 1, 2, 0]), [0, 0, 1, 1])
        {1: (3.0, [0]), 2: (5.0, [0, 2]), 4: (6.0, [0, 1, 2, 3])}
    """
    members: dict[int, list[int]] = {}
    for h, g in enumerate(groups):
        members.setdefault(int(g), []).append(h)
    ranked = [sorted(hs, key=lambda h: (-scores[h], h)) for hs in members.values()]  # best first, ties: lower
    best: dict[int, tuple[float, list[int]]] = {}

    def offer(heads: list[int]) -> None:
        value = float(sum(scores[h] for h in heads))
        if len(heads) not in best or value > best[len(heads)][0]:
            best[len(heads)] = (value, sorted(heads))

    if granularity == "group":  # 0/1 knapsack over whole groups, indexed by head count
        table: dict[int, tuple[float, list[int]]] = {0: (0.0, [])}
        for hs in ranked:
            value = float(sum(scores[h] for h in hs))
            for count, (v, kept) in list(table.items()):
                c = count + len(hs)
                if c not in table or v + value > table[c][0]:
                    table[c] = (v + value, kept + hs)
        for count, (_, kept) in table.items():
            if count:
                offer(kept)
    elif granularity == "balanced":  # s heads on each of the m best groups that have at least s heads
        for s in range(1, max(len(hs) for hs in ranked) + 1):
            eligible = sorted((hs[:s] for hs in ranked if len(hs) >= s),
                              key=lambda top: (-sum(scores[h] for h in top), top[0]))
            for m in range(1, len(eligible) + 1):
                offer([h for top in eligible[:m] for h in top])
    else:
        raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    return best


def apply_granularity(granularity: str, scores: Sequence[np.ndarray], groups: Sequence[Sequence[int]],
                      n_keep: int, kept: Sequence[int] | None = None, layer_floor: bool = True) -> list[int]:
    """Sorted flat indices of the heads kept at ``granularity`` (see the module docstring).

    ``scores`` and ``groups`` are per layer (higher score = more important; ``groups[l][h]`` the key/value
    head of query head ``h``); ``"head"`` returns ``kept`` unchanged (it must then be given).
    ``layer_floor=False`` (the baselines without the one-head-per-layer floor) lets a layer keep no group:

        >>> apply_granularity("group", [np.array([1., 1]), np.array([9., 9])], [[0, 0], [0, 0]], 2,
        ...                   layer_floor=False)
        [2, 3]
    """
    if granularity == "head":
        if kept is None:
            raise ValueError("granularity 'head' keeps the method's own selection: pass kept")
        return sorted(int(i) for i in kept)
    if len(scores) != len(groups):
        raise ValueError(f"scores cover {len(scores)} layers, groups {len(groups)}")
    flat_scores = np.concatenate([np.asarray(s, dtype=np.float64).reshape(-1) for s in scores])
    if not np.isfinite(flat_scores).all():
        raise ValueError("importance scores contain NaN or inf")
    per_layer = []
    for li, (s, g) in enumerate(zip(scores, groups)):
        if len(s) != len(g):
            raise ValueError(f"layer {li}: {len(s)} scores for {len(g)} query heads")
        layouts = layer_layouts(granularity, np.asarray(s, dtype=np.float64), g)
        per_layer.append(layouts if layer_floor else {0: (0.0, []), **layouts})
    # DP over layers: reachable total -> (summed score, chosen count per layer)
    reach: dict[int, tuple[float, list[int]]] = {0: (0.0, [])}
    for layouts in per_layer:
        nxt: dict[int, tuple[float, list[int]]] = {}
        for total, (value, chosen) in reach.items():
            for count, (v, _) in layouts.items():
                t = total + count
                if t not in nxt or value + v > nxt[t][0]:
                    nxt[t] = (value + v, chosen + [count])
        reach = nxt
    total = min(reach, key=lambda t: (abs(t - n_keep), t))
    starts = itertools.accumulate([0, *(len(s) for s in scores)])
    return sorted(start + h for layouts, count, start in zip(per_layer, reach[total][1], starts)
                  for h in layouts[count][1])
