"""CAHP's geometry: a 2-D t-SNE embedding of the heads (:func:`embed_heads`), FasterPAM k-medoids for every
k scored by the Mean Simplified Silhouette (:func:`cluster_sweep`, :func:`mean_simplified_silhouette`), and
the Kneedle knee of a curve (:func:`find_knee`).  :mod:`headbudget.pruning.cahp` turns them into a head
selection.

    >>> import numpy as np
    >>> pts = np.array([[0.0], [1.0], [10.0], [12.0], [20.0]])
    >>> [c.k for c in cluster_sweep(pts, seed=0)]
    [2, 3, 4]
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["MSS_VARIANTS", "Clustering", "cluster_sweep", "embed_heads", "find_knee", "mean_simplified_silhouette"]

MSS_VARIANTS = ("mean", "nearest")


def embed_heads(features: np.ndarray | None = None, *, distances: np.ndarray | None = None,
                perplexity: float = 10.0, seed: int = 42, dtype: str = "float32") -> np.ndarray:
    """t-SNE embedding ``(N, 2)`` of head features (Euclidean) or of a precomputed distance matrix.

    The perplexity is clipped to ``N - 1`` (scikit-learn requires it below the sample count).  ``dtype``:
    the input's precision, ``"float32"`` as the published code (``"float64"``: headbudget's earlier choice).
    """
    if dtype not in ("float32", "float64"):
        raise ValueError(f"embed_heads: dtype must be float32 or float64, got {dtype!r}")
    from sklearn.manifold import TSNE
    from threadpoolctl import threadpool_limits

    if (features is None) == (distances is None):
        raise ValueError("embed_heads: give exactly one of features or distances")
    n = int((features if features is not None else distances).shape[0])  # type: ignore[union-attr]
    if n < 3:
        raise ValueError(f"embed_heads: need at least 3 heads to embed, got {n}")
    perp = float(min(perplexity, n - 1))
    if perp <= 0:
        raise ValueError(f"perplexity must be > 0, got {perplexity}")
    if distances is not None:
        x = np.asarray(distances, dtype=dtype)
        if x.shape != (n, n):
            raise ValueError(f"distance matrix must be square, got {x.shape}")
        x, options = np.clip(x, 0.0, None), {"metric": "precomputed", "init": "random"}
    else:
        x, options = np.asarray(features, dtype=dtype), {"init": "pca"}
        if not np.isfinite(x).all():
            raise ValueError("embed_heads: head features contain NaN or inf")
    with threadpool_limits(1):  # OpenMP threads only oversubscribe at this size (and cost determinism)
        return TSNE(2, perplexity=perp, random_state=seed, **options).fit_transform(x)


def _pairwise(points: np.ndarray) -> np.ndarray:
    diff = points[:, None, :] - points[None, :, :]
    return np.sqrt((diff**2).sum(-1))


def mean_simplified_silhouette(points: np.ndarray | None, labels: Sequence[int], medoids: Sequence[int],
                               variant: str = "mean", distances: np.ndarray | None = None) -> float:
    """Mean Simplified Silhouette of a medoid clustering, over the non-medoid points.

    For each point, ``a`` is the distance to its own medoid and ``b`` the **mean** distance to the
    other medoids (``variant="mean"``, the published CAHP code) or the distance to the **nearest**
    other medoid (``variant="nearest"``, the textbook definition); ``s = (b - a) / max(a, b)``
    (0 when both are 0).  ``labels[i]`` indexes ``medoids``.

    >>> pts = np.array([[0.0], [1.0], [10.0], [12.0], [20.0]])
    >>> round(mean_simplified_silhouette(pts, [0, 0, 1, 1, 2], [0, 2, 4]), 4)
    0.8643
    """
    if variant not in MSS_VARIANTS:
        raise ValueError(f"unknown MSS variant {variant!r}; choose from {', '.join(MSS_VARIANTS)}")
    d = _pairwise(np.asarray(points, dtype=np.float64)) if distances is None else np.asarray(distances)
    labels, medoids = np.asarray(labels), np.asarray(medoids)
    if len(medoids) < 2:
        raise ValueError("the silhouette needs at least two clusters")
    scores = []
    for i in sorted(set(range(len(labels))) - set(medoids.tolist())):
        to_med, own = d[i, medoids], int(labels[i])
        others = np.delete(to_med, own)
        a, b = to_med[own], (others.mean() if variant == "mean" else others.min())
        scores.append(0.0 if max(a, b) == 0 else (b - a) / max(a, b))
    return float(np.mean(scores)) if scores else 0.0


@dataclass
class Clustering:
    k: int
    mss: float
    labels: np.ndarray
    medoids: np.ndarray


def cluster_sweep(points: np.ndarray, ks: Sequence[int] | None = None, seed: int = 42, variant: str = "mean",
                  progress: bool = False) -> list[Clustering]:
    """FasterPAM k-medoids for every ``k`` in ``ks`` (default 2..N-1) on Euclidean distances of
    ``points``, each scored with :func:`mean_simplified_silhouette`."""
    import kmedoids

    from headbudget.progress import ProgressBar

    pts = np.asarray(points, dtype=np.float64)
    n = pts.shape[0]
    ks = list(range(2, n)) if ks is None else list(ks)
    if not ks:
        raise ValueError(f"no k to try with {n} heads (need at least 3 heads)")
    if bad := [k for k in ks if not 2 <= k < n]:
        raise ValueError(f"k must be in 2..{n - 1} for {n} heads, got {bad}")
    diss = _pairwise(pts)
    out = []
    for k in ProgressBar(ks, desc="k-medoids", disable=not progress, leave=False):
        res = kmedoids.fasterpam(diss, k, random_state=seed, n_cpu=1)
        labels, medoids = np.asarray(res.labels), np.asarray(res.medoids)
        out.append(Clustering(k, mean_simplified_silhouette(None, labels, medoids, variant, diss), labels, medoids))
    return out


def find_knee(x: Sequence[float], y: Sequence[float], poly_degree: int = 6) -> float | None:
    """The x of the Kneedle knee of an increasing, concave curve (``kneed.KneeLocator``, polynomial fit), or
    ``None`` when Kneedle finds none."""
    from kneed import KneeLocator

    if len(x) != len(y):
        raise ValueError(f"find_knee: {len(x)} x values but {len(y)} y values")
    if len(x) < 3:
        return None
    if poly_degree < 1:
        raise ValueError(f"--poly-degree must be >= 1, got {poly_degree}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kl = KneeLocator(list(x), list(y), curve="concave", direction="increasing",
                         interp_method="polynomial", polynomial_degree=int(poly_degree))
    return None if kl.knee is None else float(kl.knee)
