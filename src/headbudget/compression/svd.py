"""Low-rank head reduction: per-head truncated SVD of the bilinear forms W_Q^T W_K and W_V^T W_O.

Up to per-query-row constants (the key-bias terms, which cancel in the softmax) the logit of head h is the
bilinear form of ``M = [W_Q | b_Q]^T [W_K | 0]`` on ``[x; 1]``, ``[y; 1]``.  Its rank-r SVD is split
``sqrt(S)`` to each side into new q rows (last column: the query bias, kept exactly) and k rows (zero bias);
the softmax scale stays ``1/sqrt(head_dim)``.  ``W_V,h^T W_O,h^T`` is truncated likewise, the value bias
folded exactly into the output bias (attention rows sum to one; without an output bias it joins the SVD as
an augmented row; a ``head_mask`` gate no longer scales it).  At full rank the output is unchanged.
Factorisations go through thin QR in float64 (``M = Q_a (R_a R_b^T) Q_b^T``): one ``r x r`` SVD per head.
See docs/allocation.md (Compression) for the derivation.

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

from headbudget.progress import ProgressBar

ROTARY_HINTS = ("rope_theta", "rotary_dim", "rotary_pct", "rope_scaling", "rotary_emb_base")


class CompressionError(ValueError):
    """A model or request the compressor cannot handle; the message names the layer and the reason."""


def rotary_reason(model: Any) -> str | None:
    """Why QK SVD is impossible for this model (rotary position embeddings), or None."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    if getattr(cfg, "model_type", None) == "headbudget":  # the config says it directly
        pos_type, hints = "rotary" if cfg.position == "rotary" else "", []
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
    """Full-rank factors ``left = (U S^1/2)^T`` ``(k, n_in)``, ``right = (V S^1/2)^T`` ``(k, n_out)`` of one
    head's form ``M = left^T right``, ``sigma`` descending: the first r rows give the best rank-r fit."""

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
    qa, ra = torch.linalg.qr(a_t.double())
    qb, rb = torch.linalg.qr(b_t.double())
    u, s, vh = torch.linalg.svd(ra @ rb.T)
    root = s.clamp_min(0).sqrt()
    return HeadFactors(left=(qa @ u * root).T, right=(qb @ vh.T * root).T, sigma=s)  # (k, n), (k, m)


def _head_rows(weight: torch.Tensor, bias: torch.Tensor | None, h: int, dim: int, with_bias: bool) -> torch.Tensor:
    """Rows of head h as ``(dim, d+1)``: ``[W_h | b_h]`` (or ``[W_h | 0]``)."""
    w = weight[h * dim:(h + 1) * dim].double()
    col = bias[h * dim:(h + 1) * dim].double() if (with_bias and bias is not None) else w.new_zeros(dim)
    return torch.cat([w, col[:, None]], dim=1)


def kv_groups_of(attn: nn.Module) -> list[list[int]]:
    """Query heads served by each key/value head, in order (``[[0], [1], ...]`` for multi-head attention)."""
    return [[h for h, k in enumerate(attn.kv_index) if k == g] for g in range(attn.n_kv_heads)]


@torch.no_grad()
def layer_factors(attn: nn.Module, layer: int = 0, qk: bool = True) -> dict[str, list[HeadFactors]]:
    """Full-rank QK factors of every query head (``qk=True``) and VO factors of every key/value head; one
    shared by several query heads gets one form, ``[W_V,g | b_V,g]^T [W_O,h1^T ... W_O,hn^T]``."""
    H, KV = attn.n_heads, attn.n_kv_heads
    if qk and KV != H:
        raise CompressionError(
            f"layer {layer}: the query/key form needs one key/value head per query head, but the layer has "
            f"{H} query heads sharing {KV} key/value heads (only the value/output path can be reduced)"
        )
    dq, dv = attn.qk_head_dim, attn.v_head_dim
    p = attn.projections()
    (qw, qb), (kw, kb), (vw, vb), (ow, ob) = p["q"], p["k"], p["v"], p["o"]
    # the query bias is kept exactly; the key bias is softmax-invariant: dropped
    qk_f = [factor_product(_head_rows(qw, qb, h, dq, True).T, _head_rows(kw, kb, h, dq, False).T)
            for h in range(H)] if qk else []
    vo = []
    for g, heads in enumerate(kv_groups_of(attn)):  # an output bias takes the value bias (folded exactly)
        wo = torch.cat([ow[:, h * dv:(h + 1) * dv] for h in heads]).double()  # (len(heads) * d, dv)
        vo.append(factor_product(_head_rows(vw, vb, g, dv, ob is None).T, wo))
    return {"qk": qk_f, "vo": vo}


@torch.no_grad()
def compress_layer(attn: nn.Module, qk_rank: int, v_rank: int, layer: int = 0,
                   factors: dict[str, list[HeadFactors]] | None = None) -> dict[str, Any]:
    """Replace one layer's q/k/v/o by rank-``qk_rank`` / rank-``v_rank`` factors, in place (a full ``qk_rank``
    leaves q and k untouched); returns the Frobenius errors of the truncated forms per query head (QK) and per
    key/value head (VO): ``qk_error``/``vo_error``, relative ``*_rel_error``."""
    H, dq, dv = attn.n_heads, attn.qk_head_dim, attn.v_head_dim
    for name, r, full in (("qk", qk_rank, dq), ("v", v_rank, dv)):
        if not isinstance(r, int) or not 1 <= r <= full:
            raise CompressionError(f"layer {layer}: {name} rank must be an integer in [1, {full}], got {r!r}")
    reduce_qk = qk_rank < dq
    f = factors or layer_factors(attn, layer, qk=reduce_qk)
    p = attn.projections()
    (qw, qb), (kw, kb), vb, (ow, ob) = p["q"], p["k"], p["v"][1], p["o"]
    d, has_bias = qw.shape[1], qb is not None
    o_bias = ob.double().clone() if ob is not None else None
    qk_err = [fq.tail_norm(qk_rank) for fq in f["qk"]] if reduce_qk else []
    vo_err = [fv.tail_norm(v_rank) for fv in f["vo"]]
    q, k = (qw, qb), (kw, kb)
    if reduce_qk:
        qa = torch.cat([f["qk"][h].left[:qk_rank] for h in range(H)])
        ka = torch.cat([f["qk"][h].right[:qk_rank] for h in range(H)])
        q, k = ((t[:, :d], t[:, d] if has_bias else None) for t in (qa, ka))
    v_rows, o_cols = [], [None] * H
    for g, heads in enumerate(kv_groups_of(attn)):
        fv = f["vo"][g]
        v_rows.append(fv.left[:v_rank])
        for i, h in enumerate(heads):  # the right factor stacks the output columns of every query head
            o_cols[h] = fv.right[:v_rank, i * d:(i + 1) * d]
            if o_bias is not None and vb is not None:  # rows of P sum to one: the value bias is a constant
                o_bias += ow[:, h * dv:(h + 1) * dv].double() @ vb[g * dv:(g + 1) * dv].double()
    va = torch.cat(v_rows)

    def part(w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return w.to(qw.dtype), None if b is None else b.to(qw.dtype)

    v_bias = va[:, d] if (has_bias and o_bias is None) else (va.new_zeros(va.shape[0]) if has_bias else None)
    attn.set_projections(dict(attn.spec, qk_head_dim=qk_rank, v_head_dim=v_rank), part(*q), part(*k),
                         part(va[:, :d], v_bias), part(torch.cat(o_cols).T, o_bias))
    qk_rel, vo_rel = ([e / max(fac.tail_norm(0), 1e-30) for e, fac in zip(err, facs)]
                      for err, facs in ((qk_err, f["qk"]), (vo_err, f["vo"])))
    return {"qk_error": qk_err, "vo_error": vo_err, "qk_rel_error": qk_rel, "vo_rel_error": vo_rel}


def svd_compress(model: nn.Module, qk_ranks: Sequence[int], v_ranks: Sequence[int] | None = None,
                 progress: bool = False) -> dict[str, Any]:
    """Compress every layer of a headbudget model in place to per-layer ranks (``v_ranks``: default
    ``qk_ranks``) and update the schedule, so ``save_pretrained``/``from_pretrained`` round-trip.  Rotary and
    grouped-query layers need full qk ranks (their value/output path is still reduced): else, and for bad
    ranks, :class:`CompressionError`."""
    blocks = model.transformer.h
    v_ranks = list(qk_ranks) if v_ranks is None else list(v_ranks)
    reason = rotary_reason(model)
    if reason and any(int(r) < b.attn.qk_head_dim for r, b in zip(qk_ranks, blocks)):
        raise CompressionError(f"SVD of the query/key form refused: {reason}; keep qk ranks at full width "
                               "(the value/output path can still be reduced)")
    if len(qk_ranks) != len(blocks) or len(v_ranks) != len(blocks):
        raise CompressionError(f"need one rank per layer ({len(blocks)}), got {len(qk_ranks)} qk and "
                               f"{len(v_ranks)} v ranks")
    bar = ProgressBar(blocks, desc="svd", disable=not progress, leave=False)
    per_layer = [compress_layer(b.attn, int(qk_ranks[i]), int(v_ranks[i]), i) for i, b in enumerate(bar)]
    model.sync_schedule()
    return {"per_layer": per_layer}
