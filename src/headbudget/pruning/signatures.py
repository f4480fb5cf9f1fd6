"""Attention signatures of heads and the distances CAHP clusters them by.

Two kinds, computed in one streaming pass over the data (docs/pruning.md, "The algorithm"):

* **class-conditional** (the paper's): every head's attention maps, cut to the real tokens and resized
  to a ``B x B`` grid, accumulated per class as a running mean and variance per cell; :func:`jm_features`
  turns them into one vector per head, the per-cell Jeffries–Matusita distance for every class pair.
* **label-free** (for language models): every head's *pooled* attention, rows renormalised;
  :func:`js_distance_matrix` compares heads by the Jensen–Shannon divergence of their rows.

    >>> import torch
    >>> acc = ClassSignatureAccumulator(n_classes=2, n_heads=3, grid=4)
    >>> maps = [torch.softmax(torch.randn(3, 5, 5), -1) for _ in range(4)]
    >>> acc.update(resize_maps(maps, 4), torch.tensor([0, 1, 0, 1]))
    >>> jm_features(acc.mean, acc.var).shape      # 3 heads, 1 class pair x 16 cells
    (3, 16)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["ClassSignatureAccumulator", "Signatures", "bhattacharyya_gaussian", "jeffries_matusita",
           "jm_features", "js_distance_matrix", "real_token_maps", "resize_maps", "collect_signatures"]

DEFAULT_GRID = 32
DEFAULT_EPS = 0.0
#: the fewest key columns a regrouped forward of collect_signatures computes: on AVX-512, attention over
#: fewer than 16 keys (one float32 vector) rounds differently (1e-6 off the padded batch's maps, enough to
#: move CAHP's knee); keeping 16 columns of the batch's own padding gives the padded maps bit for bit.
MIN_WIDTH = 16
DEFAULT_VAR_FLOOR = 1e-6  # the published code: max(var, 1e-6); var_floor=None, eps=1e-10 is the old var + 1e-10
_Num = torch.Tensor | np.ndarray | float


# --------------------------------------------------------------------------- grids
def resize_maps(maps: Sequence[torch.Tensor], grid: int = DEFAULT_GRID) -> torch.Tensor:
    """Resize a list of ``(H, L_i, L_i)`` attention maps (one per input, real tokens only) to ``(N, H, grid,
    grid)`` with bilinear interpolation (``align_corners=False``), one call per distinct length."""
    if not maps:
        raise ValueError("resize_maps: no attention maps given")
    by_len: dict[int, list[int]] = {}
    for i, m in enumerate(maps):
        if m.dim() != 3 or m.shape[-1] != m.shape[-2]:
            raise ValueError(f"resize_maps: map {i} has shape {tuple(m.shape)}, expected (H, L, L)")
        by_len.setdefault(int(m.shape[-1]), []).append(i)
    out: dict[int, torch.Tensor] = {}
    for idx in by_len.values():
        stack = torch.stack([maps[i] for i in idx]).float()
        out.update(zip(idx, F.interpolate(stack, size=(grid, grid), mode="bilinear", align_corners=False)))
    return torch.stack([out[i] for i in range(len(maps))])


def real_token_maps(attentions: Sequence[torch.Tensor],
                    attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Cut every input's attention maps to its real tokens.

    ``attentions`` is one ``(B, H_l, T, T)`` tensor per layer (head counts may differ between layers);
    ``attention_mask`` is ``(B, T)`` with 1 for real tokens (any padding or holes).  Returns one
    ``(sum_l H_l, L_i, L_i)`` tensor per input, heads in layer order, padding rows and columns removed.
    """
    if not attentions:
        raise ValueError("real_token_maps: the model returned no attention maps")
    stacked = torch.cat([a.detach() for a in attentions], dim=1)  # (B, H_total, T, T)
    bsz, _, t, _ = stacked.shape
    if attention_mask is None:
        return [stacked[i] for i in range(bsz)]
    if attention_mask.shape != (bsz, t):
        raise ValueError(f"real_token_maps: attention_mask has shape {tuple(attention_mask.shape)}, "
                         f"attention maps need ({bsz}, {t})")
    maps = []
    for i in range(bsz):
        keep = attention_mask[i].to(torch.bool).nonzero(as_tuple=True)[0].to(stacked.device)
        if keep.numel() == 0:
            raise ValueError(f"real_token_maps: input {i} of the batch has no real tokens")
        maps.append(stacked[i][:, keep][:, :, keep])
    return maps


# --------------------------------------------------------------------------- streaming stats
class ClassSignatureAccumulator:
    """Streaming per-class mean and variance of every cell of every head's grid: Chan et al.'s parallel
    update (exact, float64, independent of the batching); ``var`` is the sample variance (``ddof=1``, the
    published code's ``torch.var``) or the population variance (``ddof=0``)."""

    def __init__(self, n_classes: int, n_heads: int, grid: int = DEFAULT_GRID, ddof: int = 1) -> None:
        if ddof not in (0, 1):
            raise ValueError(f"ddof must be 0 (population) or 1 (sample variance), got {ddof}")
        if n_classes < 1:
            raise ValueError(f"n_classes must be >= 1, got {n_classes}")
        self.n_classes, self.n_heads, self.grid, self.ddof = n_classes, n_heads, grid, ddof
        shape = (n_classes, n_heads, grid, grid)
        self.count = torch.zeros(n_classes, dtype=torch.float64)
        self.mean = torch.zeros(shape, dtype=torch.float64)
        self.m2 = torch.zeros(shape, dtype=torch.float64)

    def update(self, grids: torch.Tensor, labels: torch.Tensor | Sequence[int]) -> None:
        """Add ``grids`` ``(N, H, B, B)`` with class ``labels`` ``(N,)``."""
        grids = grids.detach().to("cpu", torch.float64)
        labels = torch.as_tensor(labels, dtype=torch.long).cpu()
        if grids.shape[1:] != (self.n_heads, self.grid, self.grid):
            raise ValueError(f"signature grids have shape {tuple(grids.shape[1:])}, "
                             f"expected ({self.n_heads}, {self.grid}, {self.grid})")
        if labels.numel() != grids.shape[0]:
            raise ValueError(f"{labels.numel()} labels for {grids.shape[0]} attention grids")
        for c in labels.unique().tolist():
            if not 0 <= c < self.n_classes:
                raise ValueError(f"label {c} outside 0..{self.n_classes - 1}")
            x = grids[labels == c]
            n_a, n_b = float(self.count[c]), float(x.shape[0])
            mean_b = x.mean(0)
            m2_b = ((x - mean_b) ** 2).sum(0)
            n = n_a + n_b
            delta = mean_b - self.mean[c]
            self.mean[c] += delta * (n_b / n)
            self.m2[c] += m2_b + delta**2 * (n_a * n_b / n)
            self.count[c] = n

    @property
    def var(self) -> torch.Tensor:
        """Variance per class and cell with ``ddof`` (zeros for classes never seen or seen once)."""
        return self.m2 / (self.count - self.ddof).clamp(min=1.0).view(-1, 1, 1, 1)

    def missing_classes(self) -> list[int]:
        return [c for c in range(self.n_classes) if self.count[c] == 0]


# --------------------------------------------------------------------------- distances
def bhattacharyya_gaussian(mu1: _Num, var1: _Num, mu2: _Num, var2: _Num, eps: float = DEFAULT_EPS,
                           var_floor: float | None = DEFAULT_VAR_FLOOR) -> torch.Tensor:
    """Bhattacharyya distance between univariate Gaussians N(mu1, var1) and N(mu2, var2), elementwise.

    ``D_B = 1/4 (mu1 - mu2)^2 / (s1^2 + s2^2) + 1/2 ln((s1^2 + s2^2) / (2 s1 s2))``; both variances
    are floored at ``var_floor`` (``max(var, 1e-6)``, as the published code; ``None``: no floor) and
    then ``eps`` is added (``var_floor=None, eps=1e-10`` is headbudget's earlier ``var + 1e-10``), so
    cells where a class never varies stay finite.

    >>> round(float(bhattacharyya_gaussian(0.0, 1.0, 1.0, 1.0)), 6)
    0.125
    """
    mu1, var1, mu2, var2 = (torch.as_tensor(v, dtype=torch.float64) for v in (mu1, var1, mu2, var2))
    if var_floor is not None:
        var1, var2 = var1.clamp(min=var_floor), var2.clamp(min=var_floor)
    v1, v2 = var1 + eps, var2 + eps
    s = v1 + v2
    return 0.25 * (mu1 - mu2) ** 2 / s + 0.5 * torch.log(s / (2.0 * torch.sqrt(v1 * v2)))


def jeffries_matusita(mu1: _Num, var1: _Num, mu2: _Num, var2: _Num, eps: float = DEFAULT_EPS,
                      var_floor: float | None = DEFAULT_VAR_FLOOR) -> torch.Tensor:
    """Jeffries–Matusita distance ``2 (1 - exp(-D_B))`` (in [0, 2]) between univariate Gaussians."""
    return 2.0 * (1.0 - torch.exp(-bhattacharyya_gaussian(mu1, var1, mu2, var2, eps, var_floor)))


def jm_features(mean: torch.Tensor, var: torch.Tensor, eps: float = DEFAULT_EPS,
                classes: Sequence[int] | None = None,
                var_floor: float | None = DEFAULT_VAR_FLOOR) -> np.ndarray:
    """One feature vector per head: per-cell JM distances for every pair of classes, concatenated.

    ``mean``/``var`` are ``(C, H, B, B)`` (from :class:`ClassSignatureAccumulator`).  Returns a float64
    array ``(H, n_pairs * B * B)``; pairs in ``itertools.combinations`` order of ``classes`` (default all).
    """
    if mean.shape != var.shape or mean.dim() != 4:
        raise ValueError(f"mean/var must both be (C, H, B, B), got {tuple(mean.shape)} and {tuple(var.shape)}")
    classes = list(range(mean.shape[0])) if classes is None else list(classes)
    if len(classes) < 2:
        raise ValueError("class-conditional signatures need at least two classes; use label-free mode")
    parts = [jeffries_matusita(mean[a], var[a], mean[b], var[b], eps, var_floor).reshape(mean.shape[1], -1)
             for a, b in itertools.combinations(classes, 2)]
    return torch.cat(parts, dim=1).numpy()


def row_distributions(grids: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Renormalise every query row of ``(..., B, B)`` grids to a probability distribution."""
    grids = grids.clamp(min=0.0)
    return grids / grids.sum(-1, keepdim=True).clamp(min=eps)


def js_distance_matrix(pooled: torch.Tensor, eps: float = 1e-12) -> np.ndarray:
    """Head-to-head Jensen–Shannon divergence (natural log, in [0, ln 2]) averaged over query rows of the
    pooled attention ``(H, B, B)``: a symmetric ``(H, H)`` float64 matrix with a zero diagonal."""
    p = row_distributions(pooled.to(torch.float64), eps)
    n = p.shape[0]
    out = torch.zeros(n, n, dtype=torch.float64)

    def kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.where(a > 0, a * (torch.log(a.clamp(min=eps)) - torch.log(b.clamp(min=eps))), 0.0).sum(-1)

    for i in range(n):
        m = 0.5 * (p[i : i + 1] + p[i:])
        js = 0.5 * kl(p[i : i + 1], m) + 0.5 * kl(p[i:], m)  # (n - i, B)
        out[i, i:] = js.mean(-1)
    out = torch.triu(out, diagonal=1)
    out = out + out.T
    out.fill_diagonal_(0.0)
    return out.clamp(min=0.0).numpy()


# --------------------------------------------------------------------------- one pass
@dataclass
class Signatures:
    """The result of :func:`collect_signatures`: ``mean``/``var``/``count`` per class (one in label-free mode,
    ``mean[0]`` the pooled row-normalised attention); ``heads``: ``(layer, head)`` of every row, in order."""

    mean: torch.Tensor
    var: torch.Tensor
    count: torch.Tensor
    heads: list[tuple[int, int]]
    grid: int
    label_free: bool

    def features(self, eps: float = DEFAULT_EPS, var_floor: float | None = DEFAULT_VAR_FLOOR) -> np.ndarray:
        """JM features (class-conditional mode), over the pairs of classes that occurred in the data."""
        if self.label_free:
            raise ValueError("label-free signatures have no classes: use distances()")
        present = [c for c in range(self.mean.shape[0]) if self.count[c] > 0]
        return jm_features(self.mean, self.var, eps, classes=present, var_floor=var_floor)

    def distances(self) -> np.ndarray:
        """JS-divergence matrix between heads (label-free mode)."""
        return js_distance_matrix(self.mean[0])


def collect_signatures(attention_fn: Callable[[Mapping[str, torch.Tensor]], Sequence[torch.Tensor]],
                       batches: Iterable[Mapping[str, torch.Tensor]], head_counts: Sequence[int],
                       n_classes: int | None, grid: int = DEFAULT_GRID, label_key: str = "labels",
                       progress: bool = True, total: int | None = None, ddof: int = 1,
                       legacy: bool = False) -> Signatures:
    """Stream over ``batches`` once and accumulate every head's signature.

    ``attention_fn(batch)`` returns per-layer ``(B, H_l, T, T)`` probabilities and must treat every input
    independently (a model in eval mode).  ``n_classes=None`` selects label-free mode.  Real tokens come
    from ``batch["attention_mask"]`` (all tokens when absent).

    Right-padded batches (real tokens a prefix of every row, every tensor ``(B,)`` or ``(B, T)``) are cut
    to their real tokens and regrouped by length, at most as many tokens per forward as the largest given
    batch, so (almost) no padding is computed; inputs shorter than :data:`MIN_WIDTH` keep that many
    columns.  The signatures equal the per-batch path's (``legacy=True``, which any other batch takes) up
    to float32 rounding of the forward (bit for bit on the AVX-512 CPU it was measured on).

        >>> layers = [torch.softmax(torch.randn(2, 3, 5, 5), -1)]
        >>> batch = {"attention_mask": torch.ones(2, 5, dtype=torch.long), "labels": torch.tensor([0, 1])}
        >>> collect_signatures(lambda b: layers, [batch], [3], 2, grid=4, progress=False).mean.shape
        torch.Size([2, 3, 4, 4])
    """
    from headbudget.progress import ProgressBar

    label_free = n_classes is None
    acc = ClassSignatureAccumulator(1 if label_free else int(n_classes), int(sum(head_counts)), grid, ddof)
    heads = [(layer, h) for layer, n in enumerate(head_counts) for h in range(n)]

    def forward(batch: Mapping[str, torch.Tensor]) -> Sequence[torch.Tensor]:
        with torch.no_grad():
            attn = attention_fn(batch)
        got = [int(a.shape[1]) for a in attn]
        if got != list(head_counts):
            raise ValueError(f"attention maps have head counts {got}, the adapter reported {list(head_counts)}")
        return attn

    def labels_of(batch: Mapping[str, torch.Tensor], n: int) -> torch.Tensor:
        if label_free:
            return torch.zeros(n, dtype=torch.long)
        if label_key not in batch:
            raise ValueError(f"class-conditional signatures need '{label_key}' in every batch")
        return batch[label_key]

    def add(grids: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> None:
        acc.update(row_distributions(grids) if label_free else grids, labels_of(batch, grids.shape[0]))

    by_length: dict[tuple, list[dict[str, torch.Tensor]]] = {}
    token_budget = 0
    for batch in ProgressBar(batches, desc="signatures", total=total, disable=not progress, leave=False):
        split = None if legacy else _split_right_padded(batch)
        if split is None:  # the per-batch path: crop every input's maps, resize per distinct length
            add(resize_maps(real_token_maps(forward(batch), batch.get("attention_mask")), grid), batch)
            continue
        labels_of(batch, 0)  # a missing label fails now, not after the whole pass
        token_budget = max(token_budget, int(batch["attention_mask"].numel()))
        for key, part in split:
            by_length.setdefault(key, []).append(part)
    chunks = _length_chunks(by_length, token_budget)
    for length, chunk in ProgressBar(chunks, desc="signatures (by length)", disable=not progress or not chunks, leave=False):
        add(_prefix_grids(forward(chunk), chunk, length, grid), chunk)
    _check_counts(acc, label_free)
    return Signatures(acc.mean, acc.var, acc.count, heads, grid, label_free)


def _check_counts(acc: ClassSignatureAccumulator, label_free: bool) -> None:
    if acc.count.sum() == 0:
        raise ValueError("collect_signatures: the data yielded no batches")
    if not label_free and acc.n_classes - len(acc.missing_classes()) < 2:
        raise ValueError(f"only classes {[c for c in range(acc.n_classes) if acc.count[c] > 0]} occur in the "
                         "signature data; class-conditional signatures need at least two (use more data)")


def _length_chunks(by_length: dict[tuple, list[dict[str, torch.Tensor]]],
                   token_budget: int) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """``[(length, inputs)]``: the parts of each length joined, then cut to at most ``token_budget`` tokens."""
    chunks = []
    for key in sorted(by_length, key=lambda k: k[:2]):
        parts = by_length[key]
        joined = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        n, width = int(joined["attention_mask"].shape[0]), key[1]
        step = max(1, token_budget // width)
        chunks += [(key[0], {k: v[i : i + step] for k, v in joined.items()}) for i in range(0, n, step)]
    return chunks


def _prefix_grids(attn: Sequence[torch.Tensor], chunk: Mapping[str, torch.Tensor], length: int,
                  grid: int) -> torch.Tensor:
    """``(B, H_total, grid, grid)`` of maps whose ``length`` real tokens come first in every row."""
    n, width = (int(d) for d in chunk["attention_mask"].shape)
    for a in attn:
        if tuple(a.shape) != (n, a.shape[1], width, width):
            raise ValueError(f"attention maps have shape {tuple(a.shape)} for a batch of {n} x {width} tokens")
    # one crop for all rows; all heads go through one interpolate call, as in resize_maps: its float32
    # rounding depends on the channel count
    maps = torch.cat([a[:, :, :length, :length] for a in attn], dim=1).float()
    return F.interpolate(maps, size=(grid, grid), mode="bilinear", align_corners=False)


def _split_right_padded(batch: Mapping[str, Any]) -> list[tuple[tuple, dict[str, torch.Tensor]]] | None:
    """The batch's inputs cut to their real tokens and grouped by length, as ``[(key, part)]`` with ``key =
    (length, width, input names and ranks)``, keeping ``width = max(length, min(T, MIN_WIDTH))`` columns.
    ``None`` for no mask, left padding (cutting would move the positions), an empty row, or an input that
    is not a ``(B,)`` or ``(B, T)`` tensor."""
    mask = batch.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return None
    bsz, t = mask.shape
    if any(not isinstance(v, torch.Tensor) or v.dim() not in (1, 2) or v.shape[0] != bsz
           or (v.dim() == 2 and v.shape[1] != t) for v in batch.values()):
        return None
    real = mask.to(torch.bool)
    lengths = real.sum(1)
    if bool((lengths == 0).any()) or not torch.equal(real, torch.arange(t, device=real.device) < lengths[:, None]):
        return None
    names = tuple(sorted((k, v.dim()) for k, v in batch.items()))
    out = []
    for length in lengths.unique().tolist():
        width = max(length, min(t, MIN_WIDTH))
        rows = (lengths == length).nonzero(as_tuple=True)[0]
        part = {k: (v[rows, :width] if v.dim() == 2 else v[rows]) for k, v in batch.items()}
        out.append(((int(length), int(width), names), part))
    return out
