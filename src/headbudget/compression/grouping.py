"""Head grouping: merge heads into groups that share one key/value head (MHA -> GQA).

A group's key and value projections (weights and biases) become the mean of its members'; queries and
outputs are untouched, except that query heads (and the matching output columns: exact) are permuted to make
every group contiguous, as the model stores them; the permutation is returned.  Groups are adjacent
(``adjacent_groups``) or explicit, e.g. CAHP's clusters (``[[0, 3], [1, 2]]``), and may differ in size.

    >>> from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    >>> m = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", "uniform", vocab_size=64))
    >>> info = group_heads(m, [adjacent_groups(4, 2)] * 4)
    >>> m.transformer.h[0].attn.n_kv_heads, m.transformer.h[0].attn.projections()["k"][0].shape[0]
    (2, 64)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from headbudget.compression.svd import CompressionError


def adjacent_groups(n_heads: int, n_groups: int) -> list[list[int]]:
    """Contiguous groups of equal size: ``adjacent_groups(4, 2) == [[0, 1], [2, 3]]``."""
    if n_groups <= 0 or n_heads % n_groups:
        raise CompressionError(f"{n_groups} groups do not divide {n_heads} heads evenly")
    size = n_heads // n_groups
    return [list(range(g * size, (g + 1) * size)) for g in range(n_groups)]


def check_groups(groups: Sequence[Sequence[int]], n_heads: int, layer: int) -> list[list[int]]:
    """Validate a partition of ``range(n_heads)`` into non-empty groups; returns it as lists."""
    gs = [[int(h) for h in g] for g in groups]
    flat = [h for g in gs for h in g]
    if not gs or any(not g for g in gs):
        raise CompressionError(f"layer {layer}: groups must be non-empty lists of head indices, got {groups!r}")
    bad = [h for h in flat if not 0 <= h < n_heads]
    if bad:
        raise CompressionError(f"layer {layer}: head {bad[0]} out of range (layer has {n_heads} heads)")
    if sorted(flat) != list(range(n_heads)):
        dup = sorted({h for h in flat if flat.count(h) > 1})
        missing = sorted(set(range(n_heads)) - set(flat))
        raise CompressionError(f"layer {layer}: groups must cover every head exactly once "
                               f"(repeated {dup}, missing {missing})")
    return gs


def groups_from_labels(labels: Sequence[int]) -> list[list[int]]:
    """Cluster labels per head (e.g. CAHP's) -> groups: ``[0, 1, 0, 1] -> [[0, 2], [1, 3]]``."""
    labels = [int(lab) for lab in labels]
    return [[h for h, lab in enumerate(labels) if lab == k] for k in sorted(set(labels))]


@torch.no_grad()
def group_layer(attn: nn.Module, groups: Sequence[Sequence[int]], layer: int = 0) -> dict[str, Any]:
    """Merge one layer's heads into the given K/V groups, in place; returns the query-head order."""
    H = attn.n_heads
    if attn.n_kv_heads != H:
        raise CompressionError(f"layer {layer}: already grouped ({attn.n_kv_heads} kv heads for {H} heads); "
                               "grouping starts from multi-head attention")
    gs = check_groups(groups, H, layer)
    order = [h for g in gs for h in g]
    dq, dv = attn.qk_head_dim, attn.v_head_dim

    def rows(idx: Sequence[int], width: int) -> torch.Tensor:
        return torch.cat([torch.arange(i * width, (i + 1) * width) for i in idx])

    p = attn.projections()

    def pooled(wb: tuple[torch.Tensor, torch.Tensor | None], width: int):
        w, b = wb
        w = torch.cat([w[rows(g, width)].view(len(g), width, -1).mean(0) for g in gs])
        b = None if b is None else torch.cat([b[rows(g, width)].view(len(g), width).mean(0) for g in gs])
        return w, b

    sizes = [len(g) for g in gs]
    spec = dict(attn.spec, n_kv_heads=len(gs), kv_groups=sizes if len(set(sizes)) > 1 else None)
    qi = rows(order, dq)
    attn.set_projections(spec, (p["q"][0][qi], None if p["q"][1] is None else p["q"][1][qi]),
                         pooled(p["k"], dq), pooled(p["v"], dv), (p["o"][0][:, rows(order, dv)], p["o"][1]))
    return {"groups": gs, "head_order": order}


def group_heads(model: nn.Module, groups: Sequence[Sequence[Sequence[int]] | None]) -> dict[str, Any]:
    """Group every layer's heads (``groups[i]`` for layer i; None leaves a layer as it is), in place; all
    layers are checked before any is changed; the config's schedule gets the new ``n_kv_heads``."""
    blocks = model.transformer.h
    if len(groups) != len(blocks):
        raise CompressionError(f"need one group list per layer ({len(blocks)}), got {len(groups)}")
    for i, (block, g) in enumerate(zip(blocks, groups)):
        if g is not None:
            check_groups(g, block.attn.n_heads, i)
    per_layer = [None if g is None else group_layer(b.attn, g, i)
                 for i, (b, g) in enumerate(zip(blocks, groups))]
    model.sync_schedule()
    return {"per_layer": per_layer}
