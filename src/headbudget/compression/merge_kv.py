"""Merge key/value heads instead of cutting them: every query head is kept and reads a shared, fitted K/V head.

A layer with ``KV`` key/value heads becomes one with ``m`` (``m`` divides the query heads: plain
grouped-query attention, no head copies).  Query heads, in stored (kv-grouped) order, form ``m`` chunks;
chunk ``i`` reads merged head ``i``, replacing the original heads its queries read (its *members*).
Two rules (:data:`MERGE_RULES`):

``mean``: the plain mean of the members' K and V projections; queries and outputs untouched.  Queries do not
read another head's keys, so this costs a lot (SmolLM2-135M at one kv head per layer: hundreds of times the
dense perplexity).

``fitted``: shared keys/values fitted, queries and output projection re-fitted, all from one matrix per
layer, ``C = E[x~ x~^T]`` of the attention input ``x~ = [x; 1]`` (the constant carries the biases): every
projection ``P x~`` has covariance ``P C P^T``.  Identical members make both fits exact.

*Values*: the members' values, each weighted by its readers' output projections,
``W_g = (mean_h W_o,h^T W_o,h)^1/2`` (errors count where they land, in the residual stream), are stacked,
``[V_1 W_1 .. V_G W_G]``; the shared value ``V' = X~ A^T`` spans their top-``d_h`` principal subspace
(``A`` combines the members' ``[W_v | b_v]`` rows); each member is least-squares fitted, ``V_g ~= V' B_g``,
and ``B_g`` folds into its readers' outputs: ``W_o,h <- W_o,h B_g^T``.

*Keys without rotary (GPT-2)*: the same, members weighted by ``(mean_h E[q_h q_h^T])^1/2`` (the logit error
``q.(k - k^)`` is what matters), the map folded into the queries: ``k_g ~= T_g^T k'``, so
``[W_q | b_q] <- T_g [W_q | b_q]``.

*Keys with rotary (Llama, Mistral, Qwen2)*: only maps that commute with every position's rotation ``R(m)``
fold into the queries independently of ``m - n``.  HF's "rotate half" turns dims ``j`` and ``j + d_h/2``
together by ``m theta_j``; as a complex number, ``z -> z e^{i m theta_j}``, and the maps commuting with all
such rotations are per-plane complex scalars ``c`` (2x2 blocks ``[[a, -b], [b, a]]``).  So per plane each
member is fitted as ``z_g ~= c_g z'`` with one shared ``z' = sum_g alpha_g z_g``: a rank-1 complex fit,
member ``g`` weighted by the square root of its readers' mean energy in that plane (which minimises their
logit error).  As ``Re(conj(R(m) q) R(n) c z') = Re(conj(R(m) conj(c) q) R(n) z')`` for every ``m, n``,
``conj(c)`` (the block's transpose) folds into each reader's plane rows exactly.

    >>> from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    >>> m = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", "uniform", vocab_size=64))
    >>> grams = collect_grams(m, torch.randint(0, 64, (4, 32)))
    >>> info = merge_kv_model(m, [2, 2, 1, 1], "fitted", grams)
    >>> [b.attn.n_kv_heads for b in m.transformer.h], info["kv_values_per_token"]
    ([2, 2, 1, 1], 384)

:func:`layer_sensitivity` measures what merging one layer alone costs in calibration loss, and
:func:`allocate_kv` spends a KV-byte budget greedily on the layers where merging costs least.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from headbudget.compression.svd import CompressionError
from headbudget.progress import ProgressBar

MERGE_RULES = ("fitted", "mean")
KV_ALLOCATIONS = ("sensitivity", "uniform")


def allowed_counts(attn: nn.Module) -> list[int]:
    """Key/value head counts a layer may be merged to, largest first: divisors of its query heads that are at
    most its key/value heads (equal groups, no copies), and its own count: SmolLM2 (9 query, 3 kv heads)
    ``[3, 1]``; GPT-2 (12 heads, multi-head) ``[12, 6, 4, 3, 2, 1]``."""
    kv = attn.n_kv_heads
    return sorted({g for g in range(1, kv + 1) if attn.n_heads % g == 0} | {kv}, reverse=True)


def check_counts(model: nn.Module, counts: Sequence[int], flag: str = "--kv-heads") -> list[int]:
    """``counts`` (one per layer) checked against :func:`allowed_counts`; the error names the layer."""
    blocks = model.transformer.h
    if len(counts) != len(blocks):
        raise CompressionError(f"{flag}: {len(counts)} counts for {len(blocks)} layers")
    for i, (b, c) in enumerate(zip(blocks, counts)):
        ok = allowed_counts(b.attn)
        if int(c) not in ok:
            raise CompressionError(
                f"{flag} {c}: layer {i} has {b.attn.n_heads} query heads and {b.attn.n_kv_heads} key/value heads; "
                f"it can be merged to {', '.join(map(str, sorted(ok)))} (a count must divide the query heads "
                "and not exceed the key/value heads)")
    return [int(c) for c in counts]


def query_chunks(attn: nn.Module, count: int) -> list[list[int]]:
    """The query heads of each merged head: ``count`` contiguous chunks in the stored (kv-grouped) order."""
    size = attn.n_heads // count
    return [list(range(i * size, (i + 1) * size)) for i in range(count)]


def kv_values_per_token(model: nn.Module) -> int:
    """Key and value numbers one token adds to the cache (all layers), from the layout."""
    return sum(b.attn.n_kv_heads * (b.attn.qk_head_dim + b.attn.v_head_dim) for b in model.transformer.h)


@torch.no_grad()
def measured_kv_bytes_per_token(model: nn.Module, tokens: int = 4) -> int:
    """Bytes per token of the key/value cache tensors after one forward of ``tokens`` tokens (any decoder whose
    cache is a transformers ``Cache``: headbudget's or a plain Llama's)."""
    dev = next(model.parameters()).device
    out = model(torch.zeros(1, tokens, dtype=torch.long, device=dev), use_cache=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]  # transformers 5 renamed the field
    tensors = ([t for layer in cache.layers for t in (layer.keys, layer.values)] if hasattr(cache, "layers")
               else [*cache.key_cache, *cache.value_cache])  # older transformers: no .layers
    return sum(t.numel() * t.element_size() for t in tensors) // tokens


@torch.no_grad()
def collect_grams(model: nn.Module, windows: torch.Tensor, batch_size: int = 4) -> list[torch.Tensor]:
    """Per layer, ``E[x~ x~^T]`` (float64, ``(d+1, d+1)``) of the attention input ``x~ = [x; 1]`` (the output
    of the block's first norm) over every token of ``windows`` (``(n, T)`` token ids)."""
    blocks, d = model.transformer.h, model.config.n_embd
    grams = [torch.zeros(d + 1, d + 1, dtype=torch.float64) for _ in blocks]

    def hook(i: int, args: tuple) -> None:
        x = args[0].reshape(-1, d).to("cpu", torch.float64)
        xt = torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], 1)
        grams[i].add_(xt.T @ xt)

    handles = [b.attn.register_forward_pre_hook(lambda _m, a, i=i: hook(i, a)) for i, b in enumerate(blocks)]
    dev, count = next(model.parameters()).device, 0
    try:
        for s in range(0, len(windows), batch_size):
            batch = windows[s:s + batch_size].to(dev)
            model.transformer(batch)  # hidden states only: the LM head is not needed
            count += batch.numel()
    finally:
        for h in handles:
            h.remove()
    return [g / max(count, 1) for g in grams]


def _sqrtm(s: torch.Tensor) -> torch.Tensor:
    """Square root of a symmetric PSD matrix, with a tiny ridge so a zero direction keeps some weight."""
    s = (s + s.T) / 2
    s = s + torch.eye(len(s), dtype=s.dtype) * (1e-9 * float(s.trace()) / len(s) + 1e-30)
    e, v = torch.linalg.eigh(s)
    return (v * e.clamp_min(0).sqrt()) @ v.T


def _ls_maps(shared: torch.Tensor, members: Sequence[torch.Tensor], gram: torch.Tensor) -> list[torch.Tensor]:
    """Least-squares ``M_g`` with ``P_g x~ ~= M_g^T (shared x~)`` under ``E[x~ x~^T] = gram``."""
    a = shared @ gram @ shared.T
    a = a + torch.eye(len(a), dtype=a.dtype) * (1e-12 * float(a.trace()) / len(a) + 1e-30)
    return [torch.linalg.solve(a, shared @ gram @ p.T) for p in members]


def _weighted_pca(members: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], gram: torch.Tensor,
                  width: int) -> torch.Tensor:
    """Rows ``A`` (``width x (d+1)``) spanning the top-``width`` principal subspace of the weighted stacked
    outputs ``[P_1 x~ W_1 .. P_G x~ W_G]``: ``A = sum_g U_g^T W_g^T P_g``."""
    stacked = torch.cat([w.T @ p for p, w in zip(members, weights)])  # (G*width, d+1)
    cov = stacked @ gram @ stacked.T
    e, v = torch.linalg.eigh((cov + cov.T) / 2)
    u = v[:, e.argsort(descending=True)[:width]]  # (G*width, width)
    return u.T @ stacked


@dataclass
class GroupFit:
    """One merged head: its queries, the original kv heads they read (``members``), the shared key and value
    rows (``(width, d+1)``, last column the bias) and per member the maps folded into queries and outputs
    (``key_maps[g]``: ``T_g`` (width x width) without rotary, complex ``c_g`` per plane (``width/2``) with
    rotary; ``value_maps[g]``: ``B_g``).  Empty maps: identity (the mean rule)."""

    queries: list[int]
    members: list[int]
    key: torch.Tensor
    value: torch.Tensor
    rotary: bool
    key_maps: dict[int, torch.Tensor] = field(default_factory=dict)
    value_maps: dict[int, torch.Tensor] = field(default_factory=dict)
    key_coeffs: dict[int, torch.Tensor] = field(default_factory=dict)  # rotary: complex alpha_g per plane


def _augmented(attn: nn.Module) -> dict[str, torch.Tensor]:
    """``[W | b]`` of q, k and v (float64, zero bias column when the layer has none) and W_o (float64)."""
    p = attn.projections()
    out = {"o": p["o"][0].detach().to("cpu", torch.float64)}
    for name in ("q", "k", "v"):
        w, b = p[name]
        b = torch.zeros(len(w), dtype=w.dtype, device=w.device) if b is None else b
        out[name] = torch.cat([w, b[:, None]], 1).detach().to("cpu", torch.float64)
    return out


def fit_layer(attn: nn.Module, count: int, rule: str, gram: torch.Tensor | None, rotary: bool) -> list[GroupFit]:
    """The merged heads of one layer at ``count`` key/value heads (nothing is changed)."""
    if rule not in MERGE_RULES:
        raise CompressionError(f"unknown merge rule {rule!r}; choose from {', '.join(MERGE_RULES)}")
    if rule == "fitted" and gram is None:
        raise CompressionError("the fitted merge needs calibration statistics (collect_grams)")
    W, kv_index = _augmented(attn), attn.kv_index
    dq, dv = attn.qk_head_dim, attn.v_head_dim

    def rows(t: torch.Tensor, i: int, width: int) -> torch.Tensor:
        return t[i * width:(i + 1) * width]

    fits = []
    for queries in query_chunks(attn, count):
        members = list(dict.fromkeys(kv_index[h] for h in queries))
        ks = [rows(W["k"], g, dq) for g in members]
        vs = [rows(W["v"], g, dv) for g in members]
        if len(members) == 1 or rule == "mean":  # one original head is kept as it is (exact, no refit)
            fits.append(GroupFit(queries, members, torch.stack(ks).mean(0), torch.stack(vs).mean(0), rotary))
            continue
        readers = {g: [h for h in queries if kv_index[h] == g] for g in members}
        # values: members weighted by the output projections of their readers
        vw = [_sqrtm(sum(W["o"][:, h * dv:(h + 1) * dv].T @ W["o"][:, h * dv:(h + 1) * dv] for h in readers[g])
                     / len(readers[g])) for g in members]
        value = _weighted_pca(vs, vw, gram, dv)
        fit = GroupFit(queries, members, torch.empty(0), value, rotary)
        fit.value_maps = dict(zip(members, _ls_maps(value, vs, gram)))
        q_cov = {g: sum(rows(W["q"], h, dq) @ gram @ rows(W["q"], h, dq).T for h in readers[g]) / len(readers[g])
                 for g in members}
        if not rotary:
            fit.key = _weighted_pca(ks, [_sqrtm(q_cov[g]) for g in members], gram, dq)
            fit.key_maps = dict(zip(members, _ls_maps(fit.key, ks, gram)))
        else:
            fit.key, fit.key_coeffs, fit.key_maps = _fit_rotary_keys(ks, members, q_cov, gram, dq)
        fits.append(fit)
    return fits


def _fit_rotary_keys(ks: Sequence[torch.Tensor], members: Sequence[int], q_cov: dict[int, torch.Tensor],
                     gram: torch.Tensor, dq: int):
    """Per frequency plane ``j`` (dims ``j``, ``j + dq/2``): weighted rank-1 complex fit ``z_g ~= c_g z'``."""
    half = dq // 2
    key = torch.empty(dq, gram.shape[0], dtype=torch.float64)
    coeffs, maps = ({g: torch.empty(half, dtype=torch.complex128) for g in members} for _ in range(2))
    cgram = gram.to(torch.complex128)
    for j in range(half):
        planes = torch.stack([torch.complex(k[j], k[j + half]) for k in ks])  # (G, d+1): z_g = planes[g] . x~
        # mean query energy of the readers in this plane (rotation-invariant): E|q_j|^2 + E|q_{j+half}|^2
        w = torch.tensor([float(q_cov[g][j, j] + q_cov[g][j + half, j + half]) for g in members],
                         dtype=torch.float64).clamp_min(1e-30).sqrt()
        pw = planes * w[:, None].to(torch.complex128)
        m = pw.conj() @ cgram @ pw.T  # M_gh = E[conj(w_g z_g) w_h z_h]
        e, v = torch.linalg.eigh((m + m.conj().T) / 2)
        alpha = w.to(torch.complex128) * v[:, -1]  # z' = sum_g alpha_g z_g
        shared = alpha @ planes  # (d+1,) complex
        key[j], key[j + half] = shared.real, shared.imag
        norm = (shared.conj() @ cgram @ shared).real
        c = (shared.conj() @ cgram @ planes.T) / (norm + 1e-300)  # LS c_g = E[conj(z') z_g] / E|z'|^2
        for i, g in enumerate(members):
            coeffs[g][j], maps[g][j] = alpha[i], c[i]
    return key, coeffs, maps


def _fold_query(q_rows: torch.Tensor, fit: GroupFit, g: int) -> torch.Tensor:
    """A query head's ``[W_q | b_q]`` rows re-fitted to read the merged key instead of member ``g``."""
    if g not in fit.key_maps:
        return q_rows
    if not fit.rotary:
        return fit.key_maps[g] @ q_rows  # q.k_g ~= q.(T_g^T k') = (T_g q).k'
    c = fit.key_maps[g]
    a, b = c.real[:, None], c.imag[:, None]
    top, bottom = q_rows[:len(c)], q_rows[len(c):]
    # conj(c) z_q with z_q = top + i bottom: (a top + b bottom) + i (a bottom - b top)
    return torch.cat([a * top + b * bottom, a * bottom - b * top])


@torch.no_grad()
def merge_layer(attn: nn.Module, count: int, rule: str, gram: torch.Tensor | None, rotary: bool,
                layer: int = 0) -> list[GroupFit]:
    """Merge one layer's key/value heads to ``count``, in place; returns the fits."""
    check = allowed_counts(attn)
    if count not in check:
        raise CompressionError(f"layer {layer}: {count} key/value heads not allowed (allowed: "
                               f"{', '.join(map(str, sorted(check)))})")
    if count == attn.n_kv_heads and attn.kv_groups is None:
        return []  # nothing to merge
    fits = fit_layer(attn, count, rule, gram, rotary)
    W = _augmented(attn)
    dq, dv, d = attn.qk_head_dim, attn.v_head_dim, W["q"].shape[1] - 1
    q_new, o_new = W["q"].clone(), W["o"].clone()
    for fit in fits:
        for h in fit.queries:
            g = attn.kv_index[h]
            q_new[h * dq:(h + 1) * dq] = _fold_query(W["q"][h * dq:(h + 1) * dq], fit, g)
            if g in fit.value_maps:  # P_h V_g W_o,h^T ~= P_h V' (W_o,h B_g^T)^T
                o_new[:, h * dv:(h + 1) * dv] = W["o"][:, h * dv:(h + 1) * dv] @ fit.value_maps[g].T
    ref, has_bias = attn.qkv_proj.weight, attn.qkv_proj.bias is not None

    def pair(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = t.to(ref)
        return t[:, :d].contiguous(), (t[:, d].contiguous() if has_bias else None)

    attn.set_projections(dict(attn.spec, n_kv_heads=count, kv_groups=None), pair(q_new),
                         pair(torch.cat([f.key for f in fits])), pair(torch.cat([f.value for f in fits])),
                         (o_new.to(ref), attn.o_proj.bias))
    return fits


def is_rotary(model: nn.Module) -> bool:
    return getattr(model.config, "position", "learned") == "rotary"


@torch.no_grad()
def merge_kv_model(model: nn.Module, counts: Sequence[int], rule: str = "fitted",
                   grams: Sequence[torch.Tensor] | None = None) -> dict[str, Any]:
    """Merge every layer of a headbudget model to ``counts[i]`` key/value heads, in place (all counts are
    checked first); ``grams`` from :func:`collect_grams` on the unmerged model (needed by ``fitted``)."""
    blocks = model.transformer.h
    counts = check_counts(model, counts)
    if rule == "fitted" and (grams is None or len(grams) != len(blocks)):
        raise CompressionError("the fitted merge needs one calibration Gram matrix per layer (collect_grams)")
    before, per_layer, rotary = [b.attn.n_kv_heads for b in blocks], [], is_rotary(model)
    for i, (b, c) in enumerate(zip(blocks, counts)):
        fits = merge_layer(b.attn, c, rule, None if grams is None else grams[i], rotary, i)
        per_layer.append([{"queries": f.queries, "members": f.members} for f in fits])
    model.sync_schedule()
    return {"n_kv_heads_before": before, "n_kv_heads": counts, "merge_rule": rule, "groups": per_layer,
            "kv_values_per_token": kv_values_per_token(model)}


@torch.no_grad()
def calibration_loss(model: nn.Module, windows: torch.Tensor, batch_size: int = 4) -> float:
    """Mean next-token loss over ``windows`` (``(n, T)`` ids)."""
    dev = next(model.parameters()).device
    total, n = 0.0, 0
    for s in range(0, len(windows), batch_size):
        batch = windows[s:s + batch_size].to(dev)
        k = batch.shape[0] * (batch.shape[1] - 1)
        total += float(model(batch, labels=batch).loss) * k
        n += k
    return total / n


@torch.no_grad()
def layer_sensitivity(model: nn.Module, rule: str, grams: Sequence[torch.Tensor] | None, windows: torch.Tensor,
                      progress: bool = False) -> list[dict[int, float]]:
    """Per layer, the calibration-loss increase when that layer alone is merged to each allowed count
    (its own count: 0).  The model is left as it was."""
    blocks, base, rotary = model.transformer.h, calibration_loss(model, windows), is_rotary(model)
    out: list[dict[int, float]] = [{b.attn.n_kv_heads: 0.0} for b in blocks]
    jobs = [(i, c) for i, b in enumerate(blocks) for c in allowed_counts(b.attn) if c != b.attn.n_kv_heads]
    for i, c in ProgressBar(jobs, desc="layer sensitivity", disable=not progress):
        original = blocks[i].attn
        blocks[i].attn = copy.deepcopy(original)
        try:
            merge_layer(blocks[i].attn, c, rule, None if grams is None else grams[i], rotary, i)
            out[i][c] = calibration_loss(model, windows) - base
        finally:
            blocks[i].attn = original
    return out


def _spread_order(n: int) -> list[int]:
    """Layer indices in an order that spreads over depth (golden-ratio sequence): uniform's tie-break."""
    return sorted(range(n), key=lambda i: ((i + 1) * 0.6180339887498949) % 1.0)


def allocate_kv(allowed: Sequence[Sequence[int]], unit: Sequence[int], budget: float,
                sensitivity: Sequence[dict[int, float]] | None = None) -> list[int]:
    """Per-layer key/value head counts whose cache (``sum count_l * unit_l``, ``unit_l`` the values one kv head
    caches per token) is at most ``budget`` of today's (``allowed[l][0]``, the largest, is today's count).
    Greedy: each step lowers the layer whose next allowed count adds the least sensitivity per cache value
    saved (``sensitivity[l][count]``); without sensitivities (uniform), the one keeping the largest share of
    its heads, ties spread over depth.

    >>> allocate_kv([[3, 1]] * 4, [128] * 4, 2 / 3, [{3: 0, 1: 0.3}, {3: 0, 1: 0.1}, {3: 0, 1: 0.2}, {3: 0, 1: 0.4}])
    [3, 1, 1, 3]
    """
    if not 0 < budget <= 1:
        raise CompressionError(f"--kv-budget must be in (0, 1], got {budget}")
    allowed = [sorted(set(a), reverse=True) for a in allowed]
    full = total = sum(a[0] * u for a, u in zip(allowed, unit))
    idx = [0] * len(allowed)
    order = {layer: r for r, layer in enumerate(_spread_order(len(allowed)))}

    def step(i: int, a: list[int]) -> tuple[tuple[float, int], int, int]:  # ((cost, tie-break), layer, saved)
        cur, nxt = a[idx[i]], a[idx[i] + 1]
        saved = (cur - nxt) * unit[i]
        cost = -cur / a[0] if sensitivity is None else (sensitivity[i][nxt] - sensitivity[i][cur]) / saved
        return (cost, order[i]), i, saved

    while total > budget * full + 1e-9:
        best = min((step(i, a) for i, a in enumerate(allowed) if idx[i] + 1 < len(a)), default=None)
        if best is None:
            smallest = sum(a[-1] * u for a, u in zip(allowed, unit)) / full
            raise CompressionError(f"--kv-budget {budget}: the smallest reachable KV cache is {smallest:.4f} of "
                                   "today's (every layer at its fewest key/value heads)")
        _, i, saved = best
        idx[i] += 1
        total -= saved
    return [a[j] for a, j in zip(allowed, idx)]


def kv_units(model: nn.Module) -> list[int]:
    """Values one key/value head of each layer caches per token (key width + value width)."""
    return [b.attn.qk_head_dim + b.attn.v_head_dim for b in model.transformer.h]


__all__ = ["GroupFit", "KV_ALLOCATIONS", "MERGE_RULES", "allocate_kv", "allowed_counts", "calibration_loss",
           "check_counts", "collect_grams", "fit_layer", "kv_units", "kv_values_per_token", "layer_sensitivity",
           "measured_kv_bytes_per_token", "merge_kv_model", "merge_layer", "query_chunks"]

