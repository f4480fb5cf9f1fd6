"""Low-rank head reduction: per-head truncated SVD of the bilinear forms W_Q^T W_K and W_V^T W_O.

For head h with query/key projections ``W_Q,h, W_K,h`` (``qk_dim x d``) the attention logit between
a query input x and a key input y is ``(W_Q x + b_Q) . (W_K y + b_K) * scale``.  Expanding, the terms
``x^T W_Q^T b_K`` and ``b_Q . b_K`` depend on the query only, so they shift every logit of a query row
by the same amount and cancel in the softmax.  What the model computes is therefore exactly the
bilinear form of the augmented matrix

    M = [W_Q | b_Q]^T [W_K | 0]          ((d+1) x (d+1), rank <= qk_dim)

on ``[x; 1]`` and ``[y; 1]``.  Its rank-r truncated SVD ``M_r = U_r S_r V_r^T`` is split
``sqrt(S)`` to each side: the new query projection is ``(U_r S_r^1/2)^T`` (its last column becomes
the query bias, so the query bias is kept *exactly*), the new key projection ``(V_r S_r^1/2)^T`` (its
bias is zero).  At full rank the logits equal the original ones up to those per-row constants, so the
attention probabilities and the model's output are unchanged.  The softmax scale stays
``1/sqrt(head_dim)`` (the schedule keeps ``head_dim``; only ``qk_head_dim`` shrinks).

The value/output path: head h adds ``P (X W_V,h^T + 1 b_V,h^T) W_O,h^T`` to the output; rows of P sum
to one, so the value bias contributes the constant ``W_O,h b_V,h``, which is folded into the output
projection's bias (exact; when the output projection has no bias the value bias joins the SVD as an
augmented row instead).  ``W_V,h^T W_O,h^T`` (``d x d``, rank <= v_dim) is truncated likewise.
(Caveat: a head gate from ``head_mask`` no longer scales the folded value-bias term.)

Factorisations are computed through thin QR decompositions in float64 (``M = Q_a (R_a R_b^T) Q_b^T``)
so only an ``r x r`` SVD per head is needed.

    >>> from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    >>> m = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", "uniform", vocab_size=64))
    >>> info = svd_compress(m, qk_ranks=[8, 8, 4, 4], v_ranks=[8, 8, 4, 4])
    >>> m.config.head_schedule[3].qk_head_dim, m.transformer.h[3].attn.projections()["q"][0].shape[0]
    (4, 16)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ROTARY_HINTS = ("rope_theta", "rotary_dim", "rotary_pct", "rope_scaling", "rotary_emb_base")


class CompressionError(ValueError):
    """A model or request the compressor cannot handle; the message names the layer and the reason."""


def rotary_reason(model: Any) -> str | None:
    """Why QK SVD is impossible for this model (rotary position embeddings), or None."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    if getattr(cfg, "model_type", None) == "headbudget":  # the config says it directly
        pos_type = "rotary" if cfg.position == "rotary" else ""
        hints = []
    else:
        pos_type = str(getattr(cfg, "position_embedding_type", "") or "")
        hints = [h for h in ROTARY_HINTS if getattr(cfg, h, None) is not None]
    if "rot" in pos_type.lower() or "rope" in pos_type.lower() or hints:
        what = f"position_embedding_type={pos_type!r}" if pos_type else ", ".join(hints)
        return (f"model_type {getattr(cfg, 'model_type', '?')!r} uses rotary position embeddings ({what}): "
                "q and k are rotated by position, so the logit is not the fixed bilinear form "
                "x^T W_Q^T W_K y that QK SVD truncates")
    return None


@dataclass
class HeadFactors:
    """Full-rank factors of one head's form ``M = A^T B`` with ``A = (U S^1/2)^T``, ``B = (V S^1/2)^T``.

    ``left``: ``(k, n_in)``; ``right``: ``(k, n_out)``; ``sigma``: the k singular values, descending.
    Keeping the first r rows of ``left``/``right`` gives the best rank-r approximation of ``M``.
    """

    left: torch.Tensor
    right: torch.Tensor
    sigma: torch.Tensor

    def product(self, rank: int | None = None) -> torch.Tensor:
        r = self.sigma.numel() if rank is None else rank
        return self.left[:r].T @ self.right[:r]

    def tail_norm(self, rank: int) -> float:
        """Frobenius norm of ``M - M_r``: sqrt of the sum of the squared dropped singular values."""
        return float(self.sigma[rank:].pow(2).sum().sqrt())


def factor_product(a_t: torch.Tensor, b_t: torch.Tensor) -> HeadFactors:
    """Factor ``M = a_t @ b_t.T`` (``a_t``: ``n x k``, ``b_t``: ``m x k``) by its SVD, via thin QR."""
    a_t, b_t = a_t.double(), b_t.double()
    qa, ra = torch.linalg.qr(a_t)
    qb, rb = torch.linalg.qr(b_t)
    u, s, vh = torch.linalg.svd(ra @ rb.T)
    root = s.clamp_min(0).sqrt()
    left = (qa @ u * root).T  # (k, n)
    right = (qb @ vh.T * root).T  # (k, m)
    return HeadFactors(left=left, right=right, sigma=s)


def _head_rows(weight: torch.Tensor, bias: torch.Tensor | None, h: int, dim: int, with_bias: bool) -> torch.Tensor:
    """Rows of head h as ``(dim, d+1)``: ``[W_h | b_h]`` (or ``[W_h | 0]``)."""
    w = weight[h * dim:(h + 1) * dim].double()
    col = bias[h * dim:(h + 1) * dim].double() if (with_bias and bias is not None) else w.new_zeros(dim)
    return torch.cat([w, col[:, None]], dim=1)


def kv_groups_of(attn: nn.Module) -> list[list[int]]:
    """Query heads served by each key/value head, in order (``[[0], [1], ...]`` for multi-head attention)."""
    groups: list[list[int]] = [[] for _ in range(attn.n_kv_heads)]
    for h, g in enumerate(attn.kv_index):
        groups[g].append(h)
    return groups


@torch.no_grad()
def layer_factors(attn: nn.Module, layer: int = 0, qk: bool = True) -> dict[str, list[HeadFactors]]:
    """Full-rank QK factors of every query head (``qk=True``) and VO factors of every key/value head.

    A key/value head shared by several query heads (grouped-query attention) gets one VO form for all of
    them, ``[W_V,g | b_V,g]^T [W_O,h1^T ... W_O,hn^T]``, so its value rows stay shared after truncation.
    """
    H, KV = attn.n_heads, attn.n_kv_heads
    if qk and KV != H:
        raise CompressionError(
            f"layer {layer}: the query/key form needs one key/value head per query head, but the layer has "
            f"{H} query heads sharing {KV} key/value heads (only the value/output path can be reduced)"
        )
    dq, dv = attn.qk_head_dim, attn.v_head_dim
    p = attn.projections()
    (qw, qb), (kw, kb), (vw, vb), (ow, ob) = p["q"], p["k"], p["v"], p["o"]
    fold_v_bias = ob is not None
    qk_f, vo = [], []
    if qk:
        for h in range(H):
            a = _head_rows(qw, qb, h, dq, True)  # query bias kept exactly
            b = _head_rows(kw, kb, h, dq, False)  # key bias is softmax-invariant: dropped
            qk_f.append(factor_product(a.T, b.T))
    for g, heads in enumerate(kv_groups_of(attn)):
        av = _head_rows(vw, vb, g, dv, not fold_v_bias)
        wo = torch.cat([ow[:, h * dv:(h + 1) * dv] for h in heads]).double()  # (len(heads) * d, dv)
        vo.append(factor_product(av.T, wo))
    return {"qk": qk_f, "vo": vo}


@torch.no_grad()
def compress_layer(attn: nn.Module, qk_rank: int, v_rank: int, layer: int = 0,
                   factors: dict[str, list[HeadFactors]] | None = None) -> dict[str, Any]:
    """Replace one layer's q/k/v/o by rank-``qk_rank`` / rank-``v_rank`` factors, in place.

    ``qk_rank`` equal to the current query/key width leaves q and k untouched (the only choice for
    rotary or grouped-query layers).  Returns Frobenius errors of the truncated forms, per query head for
    QK and per key/value head for VO (``qk_error``/``vo_error``, relative ``*_rel_error``).
    """
    H, dq, dv = attn.n_heads, attn.qk_head_dim, attn.v_head_dim
    for name, r, full in (("qk", qk_rank, dq), ("v", v_rank, dv)):
        if not isinstance(r, int) or not 1 <= r <= full:
            raise CompressionError(f"layer {layer}: {name} rank must be an integer in [1, {full}], got {r!r}")
    reduce_qk = qk_rank < dq
    f = factors or layer_factors(attn, layer, qk=reduce_qk)
    p = attn.projections()
    (qw, qb), (kw, kb), vb, (ow, ob) = p["q"], p["k"], p["v"][1], p["o"]
    d = qw.shape[1]
    has_bias = qb is not None
    o_bias = ob.double().clone() if ob is not None else None
    qk_err, vo_err, qk_rel, vo_rel = [], [], [], []

    def record(sig: torch.Tensor, r: int, err: list, rel: list) -> None:
        tail = float(sig[r:].pow(2).sum().sqrt())
        err.append(tail)
        rel.append(tail / max(float(sig.pow(2).sum().sqrt()), 1e-30))

    if reduce_qk:
        qa = torch.cat([f["qk"][h].left[:qk_rank] for h in range(H)])
        ka = torch.cat([f["qk"][h].right[:qk_rank] for h in range(H)])
        q, k = (qa[:, :d], qa[:, d] if has_bias else None), (ka[:, :d], ka[:, d] if has_bias else None)
        for fq in f["qk"]:
            record(fq.sigma, qk_rank, qk_err, qk_rel)
    else:
        q, k = (qw, qb), (kw, kb)
    v_rows, o_cols = [], [None] * H
    for g, heads in enumerate(kv_groups_of(attn)):
        fv = f["vo"][g]
        v_rows.append(fv.left[:v_rank])
        for i, h in enumerate(heads):  # the right factor stacks the output columns of every query head
            o_cols[h] = fv.right[:v_rank, i * d:(i + 1) * d]
            if o_bias is not None and vb is not None:  # rows of P sum to one: the value bias is a constant
                o_bias += ow[:, h * dv:(h + 1) * dv].double() @ vb[g * dv:(g + 1) * dv].double()
        record(fv.sigma, v_rank, vo_err, vo_rel)
    va = torch.cat(v_rows)
    dtype = qw.dtype

    def part(w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return w.to(dtype), None if b is None else b.to(dtype)

    v_bias = va[:, d] if (has_bias and o_bias is None) else (va.new_zeros(va.shape[0]) if has_bias else None)
    spec = dict(attn.spec, qk_head_dim=qk_rank, v_head_dim=v_rank)
    attn.set_projections(spec, part(*q), part(*k), part(va[:, :d], v_bias), part(torch.cat(o_cols).T, o_bias))
    return {"qk_error": qk_err, "vo_error": vo_err, "qk_rel_error": qk_rel, "vo_rel_error": vo_rel}


def svd_compress(model: nn.Module, qk_ranks: Sequence[int], v_ranks: Sequence[int] | None = None,
                 progress: bool = False) -> dict[str, Any]:
    """Compress every layer of a headbudget model in place to the given per-layer ranks.

    ``v_ranks`` defaults to ``qk_ranks``.  The config's schedule is updated (``neutral=False``,
    per-layer ``qk_head_dim``/``v_head_dim``), so ``save_pretrained``/``from_pretrained`` round-trip.
    A qk rank equal to the layer's query/key width leaves q and k as they are, which rotary and
    grouped-query layers require (their value/output path is still reduced).  Raises
    :class:`CompressionError` for a reduced qk rank on such layers and for bad ranks.
    """
    blocks = model.transformer.h
    v_ranks = list(qk_ranks) if v_ranks is None else list(v_ranks)
    reason = rotary_reason(model)
    if reason and any(int(r) < b.attn.qk_head_dim for r, b in zip(qk_ranks, blocks)):
        raise CompressionError(f"SVD of the query/key form refused: {reason}; keep qk ranks at full width "
                               "(the value/output path can still be reduced)")
    if len(qk_ranks) != len(blocks) or len(v_ranks) != len(blocks):
        raise CompressionError(f"need one rank per layer ({len(blocks)}), got {len(qk_ranks)} qk and "
                               f"{len(v_ranks)} v ranks")
    from headbudget.progress import ProgressBar

    per_layer = []
    for i, block in enumerate(ProgressBar(blocks, desc="svd", disable=not progress, leave=False)):
        info = compress_layer(block.attn, int(qk_ranks[i]), int(v_ranks[i]), i)
        per_layer.append(info)
    model.sync_schedule()
    return {"per_layer": per_layer}
