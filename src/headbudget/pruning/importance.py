"""Head importance scores (plug-ins) and importance-based head selection.

Scoring and pruning are separate (Torch-Pruning style): an *importance* maps a model and data to one
score per head (per-layer arrays, higher = more important); :func:`select_top` turns scores into a kept set
of an exact size under the at-least-one-head-per-layer rule; the adapter removes the rest.  Michel et al.'s
method is iterative, so it is a *selector* (:func:`michel_iterative`).  The scorers here (``michel``,
``fisher``, ``magnitude``, ``random``; see docs/pruning.md, "Baselines") are registered as plug-ins by
:mod:`headbudget.pruning.methods`, the one table of methods.

    >>> scores = [np.array([0.1, 0.9, 0.5]), np.array([0.2, 0.3])]
    >>> heads = head_list([3, 2])
    >>> [heads[i] for i in select_top(scores, 3, heads)]
    [(0, 1), (0, 2), (1, 1)]
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from headbudget.models.surgery import HeadAdapter

__all__ = ["ImportanceContext", "default_loss", "flatten", "gate_gradients", "head_list", "michel_iterative",
           "salience", "select_top"]

Batch = Mapping[str, torch.Tensor]
LossFn = Callable[[torch.nn.Module, Batch], torch.Tensor]


def default_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """``model(**batch).loss`` (classification: ``labels`` in the batch; LM: ``labels=input_ids``)."""
    loss = getattr(model(**batch), "loss", None)
    if loss is None:
        raise ValueError("the model returned no loss: the batches must carry 'labels'")
    return loss


def head_list(head_counts: Sequence[int]) -> list[tuple[int, int]]:
    """``[(layer, head), ...]`` in layer order -- the flat order every score array uses."""
    return [(layer, h) for layer, n in enumerate(head_counts) for h in range(n)]


def flatten(per_layer: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(s, dtype=np.float64).reshape(-1) for s in per_layer])


def unflatten(flat: np.ndarray, head_counts: Sequence[int]) -> list[np.ndarray]:
    return [np.asarray(flat[end - n : end]) for n, end in zip(head_counts, itertools.accumulate(head_counts))]


@contextlib.contextmanager
def frozen_params(model: torch.nn.Module) -> Iterator[None]:
    """Disable parameter gradients (gate gradients only need activations) and restore them."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        yield
    finally:
        for p, f in flags:
            p.requires_grad_(f)


@contextlib.contextmanager
def _model_mode(model: torch.nn.Module, train: bool) -> Iterator[None]:
    """``model`` in train (``True``) or eval mode inside the block, its own mode restored after."""
    was_training = model.training
    model.train(train)
    try:
        yield
    finally:
        model.train(was_training)


def batch_to_device(batch: Batch, device: torch.device) -> dict[str, Any]:
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}


def gate_gradients(adapter: HeadAdapter, model: torch.nn.Module, batches: Iterable[Batch],
                   loss_fn: LossFn = default_loss, *,
                   gate_values: Sequence[torch.Tensor | Sequence[float]] | None = None, reduce: str = "abs",
                   max_batches: int | None = None, progress: bool = True,
                   desc: str = "gate gradients") -> list[np.ndarray]:
    """Mean over batches of ``|dL/dgate|`` (``reduce="abs"``), the sum over batches of ``(dL/dgate)^2``
    (``"square"``), or the mean over *examples* of ``(dL_i/dgate)^2`` (``"example_square"``, the textbook
    empirical Fisher); one array per layer.  Taken in eval mode (no dropout) with parameter gradients off;
    ``gate_values`` evaluates the gradient at other gate values (Michel et al. set pruned heads' gates to 0).
    """
    from headbudget.progress import ProgressBar

    if reduce not in ("abs", "square", "example_square"):
        raise ValueError(f"reduce must be 'abs', 'square' or 'example_square', got {reduce!r}")
    if reduce == "example_square" and loss_fn is default_loss and _losses_split(model, batches):
        return _example_fisher(adapter, model, batches, gate_values=gate_values, max_batches=max_batches,
                               progress=progress, desc=desc)
    device = next(model.parameters()).device
    n = n_examples = 0
    with _model_mode(model, False), frozen_params(model), adapter.gates() as gates:
        if gate_values is not None:
            for g, v in zip(gates, gate_values):
                g.data.copy_(torch.as_tensor(v, dtype=g.dtype, device=g.device))
        totals = [torch.zeros(g.shape, dtype=torch.float64) for g in gates]
        for batch in ProgressBar(batches, desc=desc, total=max_batches, disable=not progress, leave=False):
            if max_batches is not None and n >= max_batches:  # the bar's total: len(batches) when not given
                break
            parts = _examples(batch) if reduce == "example_square" else [batch]
            for part in parts:
                for g in gates:
                    g.grad = None
                loss_fn(model, batch_to_device(part, device)).backward()
                for t, g in zip(totals, gates):
                    grad = torch.zeros_like(t) if g.grad is None else g.grad.detach().to("cpu", torch.float64)
                    t += grad.abs() if reduce == "abs" else grad**2
            n_examples += len(parts)
            n += 1
    if n == 0:
        raise ValueError("no batches for the gate gradients (empty training data?)")
    denominator = {"abs": n, "square": 1, "example_square": n_examples}[reduce]
    return [(t / denominator).numpy() for t in totals]


def per_example_losses(model: torch.nn.Module, batch: Batch) -> torch.Tensor | None:
    """Each example's own loss, as ``model(**one_example).loss`` computes it, from one forward pass of the
    batch: cross-entropy for single-label classification, mean next-token cross-entropy (labels -100
    ignored) for a causal LM; None for any other loss (the caller then goes example by example)."""
    labels = batch.get("labels")
    problem = getattr(getattr(model, "config", None), "problem_type", None)
    if labels is None or labels.is_floating_point() or problem not in (None, "single_label_classification"):
        return None
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    if logits.dim() == 2 and labels.dim() == 1 and logits.shape[-1] > 1:
        return torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")
    if logits.dim() == 3 and labels.shape == logits.shape[:2]:
        target = labels[:, 1:]
        tokens = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), target,
                                                   reduction="none", ignore_index=-100)
        return tokens.sum(1) / (target != -100).sum(1)
    return None


def _losses_split(model: torch.nn.Module, batches: Iterable[Batch]) -> bool:
    """Whether :func:`per_example_losses` reproduces ``default_loss`` on the first batch (their mean is the
    batch's loss), so that the batched Fisher computes the textbook one; otherwise it goes example by example."""
    if not isinstance(batches, Sequence) or not batches:
        return False
    with _model_mode(model, False), torch.no_grad():
        batch = batch_to_device(batches[0], next(model.parameters()).device)
        losses = per_example_losses(model, batch)
        return losses is not None and bool(torch.allclose(losses.mean(), default_loss(model, batch).float(),
                                                          rtol=1e-4, atol=1e-6))


def _example_fisher(adapter: HeadAdapter, model: torch.nn.Module, batches: Iterable[Batch], *,
                    gate_values: Sequence[torch.Tensor | Sequence[float]] | None, max_batches: int | None,
                    progress: bool, desc: str) -> list[np.ndarray]:
    """``gate_gradients(..., reduce="example_square")`` with one backward pass per batch: every example gets
    its own row of gates, so the gradient of the summed per-example losses at row b is ``dL_b/dgate``."""
    from headbudget.progress import ProgressBar

    device = next(model.parameters()).device
    base = [torch.ones(n, dtype=torch.float32, device=device) for n in adapter.head_counts()]
    if gate_values is not None:
        base = [torch.as_tensor(v, dtype=torch.float32, device=device).reshape(b.shape)
                for b, v in zip(base, gate_values)]
    totals = [torch.zeros(b.shape, dtype=torch.float64) for b in base]
    n = n_examples = 0
    with _model_mode(model, False), frozen_params(model):
        for batch in ProgressBar(batches, desc=desc, total=max_batches, disable=not progress, leave=False):
            if max_batches is not None and n >= max_batches:
                break
            part = batch_to_device(batch, device)
            bsz = int(part["labels"].shape[0]) if torch.is_tensor(part.get("labels")) else 0
            gates = [b.expand(bsz, -1).clone().requires_grad_(True) for b in base]
            with adapter.gate_hooks(gates):
                losses = per_example_losses(model, part)
                assert losses is not None  # _losses_split checked that this loss splits
                losses.sum().backward()
            for t, g in zip(totals, gates):
                t += (g.grad.detach().to("cpu", torch.float64) ** 2).sum(0)
            n_examples += bsz
            n += 1
    if n == 0:
        raise ValueError("no batches for the gate gradients (empty training data?)")
    return [(t / n_examples).numpy() for t in totals]


def _examples(batch: Batch) -> list[dict[str, Any]]:
    """Split a batch into single-example batches (every tensor sliced along its first dimension)."""
    sizes = {int(v.shape[0]) for v in batch.values() if torch.is_tensor(v) and v.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(f"cannot split a batch into examples: its tensors have first dimensions {sorted(sizes)}")
    (bsz,) = sizes
    return [{k: (v[i : i + 1] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in batch.items()}
            for i in range(bsz)]


def salience(adapter: HeadAdapter, model: torch.nn.Module, batches: Sequence[Batch],
             loss_fn: LossFn = default_loss, fraction: float = 0.25, progress: bool = True) -> np.ndarray:
    """CAHP's head salience: mean ``|dL/dgate|`` over the first ``fraction`` of ``batches``,
    min-max normalised to [0, 1] over all heads (flat, layer order)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"salience fraction must be in (0, 1], got {fraction}")
    n = max(1, math.ceil(len(batches) * fraction))
    flat = flatten(gate_gradients(adapter, model, batches[:n], loss_fn, progress=progress, desc="salience"))
    lo, hi = flat.min(), flat.max()
    return np.zeros_like(flat) if hi == lo else (flat - lo) / (hi - lo)


# --------------------------------------------------------------------------- plug-ins
@dataclass
class ImportanceContext:
    """What an importance may use: the adapter (and its model), batches, the loss, a seed, and ``job``: the
    run's settings, where a method registered with ``settings=`` finds its own (``ctx.job.<field>``)."""

    adapter: HeadAdapter
    model: torch.nn.Module
    batches: Sequence[Batch]
    loss_fn: LossFn = default_loss
    seed: int = 0
    progress: bool = True
    job: Any = None

    @property
    def head_counts(self) -> list[int]:
        return list(self.adapter.head_counts())


class Importance(Protocol):
    def __call__(self, ctx: ImportanceContext) -> list[np.ndarray]: ...


def l2_normalise_per_layer(scores: Sequence[np.ndarray], eps: float = 1e-20) -> list[np.ndarray]:
    """Divide every layer's scores by their L2 norm (Michel et al.)."""
    return [np.asarray(s, dtype=np.float64) / max(float(np.linalg.norm(s)), eps) for s in scores]


def michel_importance(ctx: ImportanceContext, gate_values: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
    """Mean ``|dL/dgate|`` over the batches, L2-normalised within each layer."""
    grads = gate_gradients(ctx.adapter, ctx.model, ctx.batches, ctx.loss_fn, gate_values=gate_values,
                           progress=ctx.progress, desc="michel importance")
    return l2_normalise_per_layer(grads)


def fisher_importance(ctx: ImportanceContext) -> list[np.ndarray]:
    """Empirical Fisher: mean over examples of the squared per-example gate gradient ``(dL_i/dgate)^2``
    (one backward pass per example; ``L_i`` is example i's own loss)."""
    return gate_gradients(ctx.adapter, ctx.model, ctx.batches, ctx.loss_fn, reduce="example_square",
                          progress=ctx.progress, desc="fisher importance")


def magnitude_importance(ctx: ImportanceContext) -> list[np.ndarray]:
    """L2 norm of each head's weights: its q/k/v projection rows and o projection columns."""
    return [np.asarray(n, dtype=np.float64) for n in ctx.adapter.head_weight_norms()]


def random_importance(ctx: ImportanceContext) -> list[np.ndarray]:
    """Seeded uniform scores."""
    rng = np.random.default_rng(ctx.seed)
    return [rng.random(n) for n in ctx.head_counts]


# --------------------------------------------------------------------------- selection
def select_top(scores: Sequence[np.ndarray], n_keep: int, heads: Sequence[tuple[int, int]] | None = None,
               layer_floor: bool = True) -> list[int]:
    """Keep exactly ``n_keep`` heads: each layer's best head first (at-least-one rule), then the
    best of the rest by global score (ties: lower index).  Returns sorted flat indices.

    ``layer_floor=False``: the ``n_keep`` best heads globally, as the baselines' papers rank them, so a
    layer whose heads all score low can lose every head:

        >>> scores = [np.array([0.1, 0.2]), np.array([0.9, 0.8])]
        >>> select_top(scores, 2), select_top(scores, 2, layer_floor=False)
        ([1, 2], [2, 3])
    """
    counts = [len(s) for s in scores]
    flat = flatten(scores)
    low = len(counts) if layer_floor else 1
    if not low <= n_keep <= len(flat):
        raise ValueError(f"cannot keep {n_keep} heads: need between {low}"
                         f"{' (one per layer)' if layer_floor else ''} and {len(flat)}")
    if not np.isfinite(flat).all():
        raise ValueError("importance scores contain NaN or inf")
    starts = itertools.accumulate([0, *counts])
    kept = {a + int(np.argmax(flat[a : a + n])) for a, n in zip(starts, counts)} if layer_floor else set()
    rest = [i for i in sorted(range(len(flat)), key=lambda i: (-flat[i], i)) if i not in kept]
    return sorted(kept | set(rest[: n_keep - len(kept)]))


def michel_iterative(ctx: ImportanceContext, n_keep: int, step_fraction: float = 0.1,
                     layer_floor: bool = True) -> list[int]:
    """Michel et al.'s iterative pruning: recompute importance with the pruned heads' gates at 0
    and remove the least important ``step_fraction`` of the original heads per round, never a
    layer's last head (``layer_floor=False``: any head, as in the paper), until ``n_keep`` remain."""
    counts = ctx.head_counts
    total = sum(counts)
    low = len(counts) if layer_floor else 1
    if not low <= n_keep <= total:
        raise ValueError(f"cannot keep {n_keep} heads: need between {low} and {total}")
    step = max(1, int(round(step_fraction * total)))
    alive = np.ones(total, dtype=bool)
    layer_of = np.array([layer for layer, n in enumerate(counts) for _ in range(n)])
    while alive.sum() > n_keep:
        imp = flatten(michel_importance(ctx, gate_values=unflatten(alive.astype(np.float64), counts)))
        n_remove = min(step, int(alive.sum()) - n_keep)
        for i in sorted(np.flatnonzero(alive), key=lambda i: (imp[i], -i)):
            if n_remove == 0:
                break
            if layer_floor and alive[layer_of == layer_of[i]].sum() <= 1:
                continue
            alive[i] = False
            n_remove -= 1
    return sorted(int(i) for i in np.flatnonzero(alive))


def gate_mask(kept: Iterable[int], head_counts: Sequence[int]) -> list[torch.Tensor]:
    """Per-layer 0/1 gate values that keep exactly ``kept`` (flat indices)."""
    flat = torch.zeros(sum(head_counts))
    flat[list(kept)] = 1.0
    return list(torch.split(flat, list(head_counts)))


def prune_spec(kept: Iterable[int], head_counts: Sequence[int]) -> dict[int, list[int]]:
    """``{layer: [heads to remove]}`` (current indices) for ``adapter.prune_heads``."""
    keep = {int(i) for i in kept}
    out: dict[int, list[int]] = {}
    for i, (layer, h) in enumerate(head_list(head_counts)):
        if i not in keep:
            out.setdefault(layer, []).append(h)
    return out
