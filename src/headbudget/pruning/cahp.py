"""CAHP: complementary attention-head pruning (embedding, clustering, knee, representatives; the embedding,
clustering and knee are :mod:`headbudget.pruning.clustering`).

Given one signature per head (JM feature vectors, or a JS-divergence matrix in label-free mode) and one
salience score per head, :func:`select_heads` picks a complementary subset: t-SNE to 2-D, k-medoids for
every k scored by the Mean Simplified Silhouette, the Kneedle knee of MSS vs k (or a forced ``keep``), per
cluster the most salient head, then at least one head per layer (:func:`ensure_one_per_layer`).  The
steps and their published settings: docs/pruning.md, "The algorithm".

    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> feats = np.concatenate([rng.normal(c, 0.05, (6, 8)) for c in range(4)])  # 4 groups of heads
    >>> heads = [(i // 12, i % 12) for i in range(24)]
    >>> res = select_heads(feats, heads, salience=rng.random(24), seed=0)
    >>> res.knee_k >= 2 and len(res.kept) >= res.knee_k
    True
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from headbudget.pruning.clustering import Clustering, cluster_sweep, embed_heads, find_knee
from headbudget.pruning.job import CahpSettings

if TYPE_CHECKING:
    from headbudget.models.surgery import HeadAdapter

__all__ = ["ALLOCATIONS", "CAHPSelection", "LM_DEFAULTS", "REPRESENTATIVES", "allocate_by_importance",
           "ensure_one_per_layer", "kept_by_layer", "representatives", "select_heads"]

ALLOCATIONS = ("cluster", "importance")
REPRESENTATIVES = ("salience", "fisher")
# Label-free (task lm) defaults, measured on SmolLM2-135M (docs/pruning.md): one representative per
# cluster (the published selection) keeps 1.5-5x worse perplexity than Fisher; clustering into 30
# groups and allocating the head count by summed Fisher importance beats or matches it.
LM_DEFAULTS = {"representative": "fisher", "allocation": "importance", "n_clusters": 30}


def representatives(labels: Sequence[int], salience: Sequence[float]) -> list[int]:
    """Index of the most salient member of every cluster (ties: lowest index), sorted."""
    labels, sal = np.asarray(labels), np.asarray(salience, dtype=np.float64)
    clusters = (np.flatnonzero(labels == c) for c in np.unique(labels))
    return sorted(int(members[np.argmax(sal[members])]) for members in clusters)


def allocate_by_importance(labels: Sequence[int], importance: Sequence[float], keep: int) -> list[int]:
    """Keep ``keep`` heads spread over clusters by importance (``allocation="importance"``): sorted indices.

    Every cluster first gets one slot; each further slot goes to the open cluster (one with members left)
    whose share of ``keep`` by summed importance (``keep * mass_c / mass``) most exceeds its slots so far
    (ties: lowest label).  Each cluster keeps its most important members (ties: lowest index).

    >>> allocate_by_importance([0, 0, 0, 1, 1], [5.0, 4.0, 3.0, 0.2, 0.1], 3)
    [0, 1, 3]
    """
    labels, imp = np.asarray(labels), np.asarray(importance, dtype=np.float64)
    if imp.shape != labels.shape:
        raise ValueError(f"{imp.size} importance scores for {labels.size} heads")
    clusters = np.unique(labels)
    if not len(clusters) <= keep <= len(labels):
        raise ValueError(f"cannot keep {keep} heads in {len(clusters)} clusters of {len(labels)} heads "
                         f"(need {len(clusters)}..{len(labels)})")
    members = [np.flatnonzero(labels == c) for c in clusters]
    size = np.array([len(m) for m in members])
    mass = np.array([imp[m].clip(min=0).sum() for m in members])
    share = mass / mass.sum() * keep if mass.sum() > 0 else size / size.sum() * keep
    quota = np.ones(len(clusters), dtype=int)
    for _ in range(keep - len(clusters)):
        want = np.where(quota < size, share - quota, -np.inf)
        quota[int(np.argmax(want))] += 1
    return sorted(int(i) for m, q in zip(members, quota) for i in sorted(m, key=lambda i: (-imp[i], i))[:q])


def _allocated(labels: np.ndarray, keep: int, heads: Sequence[tuple[int, int]],
               scores: np.ndarray) -> tuple[list[int], list[int]]:
    """``(kept, rescued)``: :func:`allocate_by_importance`, every empty layer rescued, then the least
    important heads dropped (never a layer's last) until ``keep`` remain."""
    kept, rescued = ensure_one_per_layer(allocate_by_importance(labels, scores, keep), heads, scores)
    while len(kept) > keep:
        per_layer = Counter(heads[i][0] for i in kept)
        kept.remove(min((i for i in kept if per_layer[heads[i][0]] > 1), key=lambda i: (scores[i], -i)))
    return kept, rescued


def ensure_one_per_layer(kept: Sequence[int], heads: Sequence[tuple[int, int]],
                         salience: Sequence[float]) -> tuple[list[int], list[int]]:
    """Add each layer's most salient head when none of its heads is kept: ``(kept + rescued sorted,
    rescued)`` (indices into ``heads``)."""
    sal = np.asarray(salience, dtype=np.float64)
    kept_set = {int(i) for i in kept}
    rescued = []
    for layer in sorted({layer for layer, _ in heads}):
        members = [i for i, (lay, _) in enumerate(heads) if lay == layer]
        if not kept_set.intersection(members):
            rescued.append(max(members, key=lambda i: (sal[i], -i)))
    return sorted(kept_set.union(rescued)), rescued


def kept_by_layer(kept: Sequence[int], heads: Sequence[tuple[int, int]], n_layers: int | None = None) -> dict[int, list[int]]:
    """``{layer: [head, ...]}`` of the kept indices (every layer present, sorted)."""
    n_layers = (max(layer for layer, _ in heads) + 1) if n_layers is None else n_layers
    out: dict[int, list[int]] = {layer: [] for layer in range(n_layers)}
    for i in kept:
        out[heads[i][0]].append(heads[i][1])
    return {layer: sorted(v) for layer, v in out.items()}


@dataclass
class CAHPSelection:
    """Everything CAHP decided, for reports and plots."""

    kept: list[int]                       # indices into heads, sorted
    heads: list[tuple[int, int]]
    knee_k: int
    mss: list[tuple[int, float]]
    embedding: np.ndarray
    labels: np.ndarray                    # cluster of every head at knee_k
    medoids: np.ndarray
    rescued: list[int]
    salience: np.ndarray
    knee_source: str = "mss"              # "mss", "keep", "accuracy" or "fallback-max-mss"
    accuracy_curve: list[tuple[int, int, float]] = field(default_factory=list)  # (k, heads kept, acc)

    @property
    def kept_by_layer(self) -> dict[int, list[int]]:
        return kept_by_layer(self.kept, self.heads)


def select_heads(features: np.ndarray | None, heads: Sequence[tuple[int, int]], salience: Sequence[float], *,
                 distances: np.ndarray | None = None, keep: int | None = None, poly_degree: int = 6,
                 perplexity: float = 10.0, mss_variant: str = "mean", seed: int = 42,
                 accuracy_fn: Callable[[list[int]], float] | None = None,
                 accuracy_ks: Sequence[int] | None = None, progress: bool = False,
                 tsne_dtype: str = "float32", scores: Sequence[float] | None = None,
                 allocation: str = "cluster", n_clusters: int | None = None) -> CAHPSelection:
    """Run CAHP's selection on precomputed signatures.

    ``keep`` forces the number of heads kept: the largest k whose cluster representatives plus rescued
    heads number at most ``keep`` (exactly ``keep`` unless rescues make that impossible).
    ``accuracy_fn(kept_indices) -> accuracy`` switches the knee to measured accuracy vs heads kept
    (``--curve accuracy``), evaluated at ``accuracy_ks`` (default every k).

    ``scores`` (default ``salience``) picks each cluster's representative and each rescued layer's
    head (e.g. Fisher importance).  ``allocation="importance"`` clusters the heads into
    ``n_clusters`` groups (default 30) and spreads the head count over them by summed ``scores``
    (:func:`allocate_by_importance`) instead of one head per cluster; the count is ``keep``, or,
    without it, the head count of the knee's one-per-cluster selection.
    """
    heads, sal, rep = _selection_inputs(heads, salience, scores, allocation)
    n = len(heads)
    emb = embed_heads(features, distances=distances, perplexity=perplexity, seed=seed, dtype=tsne_dtype)
    if keep is not None:
        n_layers = len({layer for layer, _ in heads})
        lo = max(2, n_layers)
        if not lo <= keep < n:
            raise ValueError(f"--keep must be between {lo} and {n - 1} for a model with {n} heads in {n_layers} layers, got {keep}")

    def n_groups(count: int) -> int:  # the clusters an importance allocation of ``count`` heads spreads over
        return max(2, min(n_clusters or LM_DEFAULTS["n_clusters"], count, n - 1))

    if allocation == "importance" and keep is not None:  # no sweep: one clustering at the allocation's k
        k = n_groups(keep)
        (chosen,) = cluster_sweep(emb, ks=[k], seed=seed, variant=mss_variant)
        kept, rescued = _allocated(chosen.labels, keep, heads, rep)
        return CAHPSelection(kept=kept, heads=heads, knee_k=k, mss=[(k, chosen.mss)], embedding=emb,
                             labels=chosen.labels, medoids=chosen.medoids, rescued=rescued, salience=sal,
                             knee_source="keep")
    sweep = cluster_sweep(emb, seed=seed, variant=mss_variant, progress=progress)
    by_k = {c.k: c for c in sweep}
    mss = [(c.k, c.mss) for c in sweep]
    knee_k, source, curve = _choose_k(by_k, mss, heads, rep, keep, accuracy_fn, accuracy_ks, poly_degree)
    chosen = by_k[knee_k]
    kept, rescued = ensure_one_per_layer(representatives(chosen.labels, rep), heads, rep)
    if allocation == "importance":  # the knee sets the count, the importance allocation the heads
        chosen = by_k[n_groups(len(kept))]
        kept, rescued = _allocated(chosen.labels, len(kept), heads, rep)
    return CAHPSelection(kept=kept, heads=heads, knee_k=knee_k, mss=mss, embedding=emb, labels=chosen.labels,
                         medoids=chosen.medoids, rescued=rescued, salience=sal, knee_source=source,
                         accuracy_curve=curve)


def _selection_inputs(heads: Sequence[tuple[int, int]], salience: Sequence[float], scores: Sequence[float] | None,
                      allocation: str) -> tuple[list[tuple[int, int]], np.ndarray, np.ndarray]:
    """``(heads, salience, representative scores)`` as checked arrays (a one-line ``ValueError`` otherwise)."""
    if allocation not in ALLOCATIONS:
        raise ValueError(f"unknown allocation {allocation!r}; choose from {', '.join(ALLOCATIONS)}")
    heads = [tuple(map(int, h)) for h in heads]  # type: ignore[misc]
    n = len(heads)
    sal = np.asarray(salience, dtype=np.float64)
    if sal.shape != (n,):
        raise ValueError(f"salience has {sal.size} values for {n} heads")
    if n < 4:
        raise ValueError(f"CAHP needs at least 4 heads to cluster, the model has {n}")
    rep = sal if scores is None else np.asarray(scores, dtype=np.float64)
    if rep.shape != (n,):
        raise ValueError(f"scores has {rep.size} values for {n} heads")
    return list(heads), sal, rep


def _choose_k(by_k: Mapping[int, Clustering], mss: list[tuple[int, float]], heads: Sequence[tuple[int, int]],
              rep: np.ndarray, keep: int | None, accuracy_fn: Callable[[list[int]], float] | None,
              accuracy_ks: Sequence[int] | None, poly_degree: int) -> tuple[int, str, list[tuple[int, int, float]]]:
    """The number of clusters ``(k, where it came from, accuracy curve)``: the largest k whose selection fits a
    forced ``keep``, the knee of measured accuracy vs heads kept, or the knee of MSS vs k."""
    curve: list[tuple[int, int, float]] = []
    if keep is not None:
        for k in range(min(keep, len(heads) - 1), 1, -1):
            if len(ensure_one_per_layer(representatives(by_k[k].labels, rep), heads, rep)[0]) <= keep:
                return k, "keep", curve
        return 2, "keep", curve
    if accuracy_fn is not None:
        ks = sorted(by_k) if accuracy_ks is None else sorted(set(accuracy_ks))
        for k in ks:
            kept, _ = ensure_one_per_layer(representatives(by_k[k].labels, rep), heads, rep)
            curve.append((k, len(kept), float(accuracy_fn(kept))))
        knee = find_knee([c[1] for c in curve], [c[2] for c in curve], poly_degree)
        if knee is None:
            return max(curve, key=lambda c: (c[2], -c[0]))[0], "fallback-max-accuracy", curve
        return min(curve, key=lambda c: (abs(c[1] - knee), c[0]))[0], "accuracy", curve
    knee = find_knee([k for k, _ in mss], [v for _, v in mss], poly_degree)
    if knee is None:
        return max(mss, key=lambda kv: (kv[1], -kv[0]))[0], "fallback-max-mss", curve
    return int(round(knee)), "mss", curve


# --------------------------------------------------------------------------- on a model
def _model_inputs(batch: Mapping[str, Any], device: Any) -> dict[str, Any]:
    """The batch minus labels, on ``device`` (attention maps need no loss)."""
    return {k: (v.to(device) if hasattr(v, "to") else v) for k, v in batch.items() if k != "labels"}


def model_signatures(adapter: HeadAdapter, batches: Sequence[Mapping[str, Any]], n_classes: int | None,
                     grid: int = 32, progress: bool = True, ddof: int = 1) -> Any:
    """One pass of :func:`headbudget.pruning.signatures.collect_signatures` over ``batches`` using
    the adapter's attention probabilities (``n_classes=None``: label-free mode)."""
    from .signatures import collect_signatures

    device = next(adapter.model.parameters()).device
    return collect_signatures(lambda b: adapter.attention_probs(**_model_inputs(b, device)), batches,
                              adapter.head_counts(), n_classes, grid=grid, progress=progress,
                              total=len(batches), ddof=ddof)


def cahp_select(adapter: HeadAdapter, signature_batches: Sequence[Mapping[str, Any]],
                salience_batches: Sequence[Mapping[str, Any]], settings: CahpSettings | None = None, *,
                n_classes: int | None, keep: int | None = None, seed: int = 42,
                loss_fn: Callable[..., Any] | None = None,
                accuracy_fn: Callable[[list[int]], float] | None = None,
                accuracy_ks: Sequence[int] | None = None,
                progress: bool = True) -> tuple[CAHPSelection, dict[str, float]]:
    """CAHP on a model: signatures, salience, selection.  Returns the selection and the wall time of each
    stage (``signatures``, ``salience`` (with the Fisher scores when ``representative="fisher"``),
    ``cluster``).

    Class-conditional mode (``n_classes`` >= 2): JM features of per-class signatures.  Label-free mode
    (``n_classes=None``): JS divergence of pooled attention; ``loss_fn`` should then be the LM loss.
    ``settings`` (:class:`~headbudget.pruning.job.CahpSettings`, the ``prune`` flags of the same names)
    default to the published implementation (docs/pruning.md, "The algorithm"); ``representative="fisher"``
    scores heads by the mean squared per-example gate gradient over ``signature_batches``.  ``representative``,
    ``allocation`` and ``n_clusters`` default to the published selection with classes and to
    :data:`LM_DEFAULTS` label-free.

    Example (``model`` a fine-tuned classifier, batches from ``tasks.make_loader``)::

        adapter = get_adapter(model)
        sel, secs = cahp_select(adapter, train_batches, shuffled_batches, n_classes=5)
        adapter.prune_heads(prune_spec(sel.kept, adapter.head_counts()))
    """
    import time

    from .importance import default_loss, flatten, gate_gradients, salience

    s = settings or CahpSettings()
    representative, allocation = _selection_defaults(n_classes is None, s.representative, s.allocation, s.n_clusters)
    loss_fn = loss_fn or default_loss
    t0 = time.perf_counter()
    sig = model_signatures(adapter, signature_batches, n_classes, s.pool_size, progress, ddof=s.ddof)
    t1 = time.perf_counter()
    sal = salience(adapter, adapter.model, list(salience_batches), loss_fn, fraction=s.salience_fraction,
                   progress=progress)
    t2 = time.perf_counter()
    secs = {"signatures": t1 - t0, "salience": t2 - t1}
    scores = None
    if representative == "fisher":
        scores = flatten(gate_gradients(adapter, adapter.model, list(signature_batches), loss_fn,
                                        reduce="example_square", progress=progress, desc="fisher"))
        secs["salience"] += time.perf_counter() - t2  # the scoring stage: salience plus the representatives' Fisher
    t2 = time.perf_counter()
    opts = dict(keep=keep, poly_degree=s.poly_degree, perplexity=s.perplexity, mss_variant=s.mss, seed=seed,
                accuracy_fn=accuracy_fn, accuracy_ks=accuracy_ks, progress=progress, tsne_dtype=s.tsne_dtype,
                scores=scores, allocation=allocation, n_clusters=s.n_clusters)
    feats, dist = (None, sig.distances()) if sig.label_free else (sig.features(s.var_eps, s.var_floor), None)
    sel = select_heads(feats, sig.heads, sal, distances=dist, **opts)  # type: ignore[arg-type]
    secs["cluster"] = time.perf_counter() - t2
    return sel, secs


def _selection_defaults(label_free: bool, representative: str | None, allocation: str | None,
                        n_clusters: int | None) -> tuple[str, str]:
    """``(representative, allocation)``: the given ones, checked, or the mode's defaults -- the published
    selection (salience, one head per cluster) with classes, :data:`LM_DEFAULTS` label-free."""
    if representative is None:
        representative = LM_DEFAULTS["representative"] if label_free else "salience"
    if allocation is None:
        allocation = LM_DEFAULTS["allocation"] if label_free else "cluster"
    if representative not in REPRESENTATIVES:
        raise ValueError(f"unknown representative {representative!r}; choose from {', '.join(REPRESENTATIVES)}")
    if allocation not in ALLOCATIONS:
        raise ValueError(f"unknown allocation {allocation!r}; choose from {', '.join(ALLOCATIONS)}")
    if n_clusters is not None and n_clusters < 2:
        raise ValueError(f"n_clusters must be >= 2, got {n_clusters}")
    return representative, allocation
