"""Batches drawn from token memmaps as a pure function of (seed, step).

The global batch of step ``step`` is ``batch_size`` windows of ``context + 1`` tokens whose start offsets
come from ``numpy.random.default_rng([seed, step])``, cut into ``grad_accum x world_size`` equal chunks
(micro-step ``m`` of rank ``r`` takes chunk ``m * world + r``): the data a run sees depends neither on how
it was interrupted (exact resume) nor on how many processes share it (DDP == single process).
Validation uses fixed, evenly spaced windows.

    >>> import numpy as np
    >>> toks = np.arange(1000, dtype=np.uint16)
    >>> x, y = train_batch(toks, seed=0, step=3, batch_size=4, context=8)
    >>> x.shape, bool((y[:, :-1] == x[:, 1:]).all())
    (torch.Size([4, 8]), True)
"""

from __future__ import annotations

import numpy as np
import torch


def _windows(tokens: np.ndarray, offsets: np.ndarray, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = offsets[:, None] + np.arange(context + 1)[None, :]
    block = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return block[:, :-1].contiguous(), block[:, 1:].contiguous()


def check_size(tokens: np.ndarray, context: int, what: str = "train") -> None:
    if len(tokens) < context + 2:
        raise ValueError(f"the {what} split has {len(tokens)} tokens, fewer than context+2={context + 2}; "
                         "use more data or a shorter train.context")


def step_offsets(n_tokens: int, seed: int, step: int, batch_size: int, context: int) -> np.ndarray:
    """Start offsets of the global batch of ``step`` (the same on every rank)."""
    rng = np.random.default_rng([int(seed), int(step)])
    return rng.integers(0, n_tokens - context - 1, size=batch_size, dtype=np.int64)


def train_batch(tokens: np.ndarray, *, seed: int, step: int, batch_size: int, context: int, micro: int = 0,
                n_micro: int = 1, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets for micro-step ``micro`` of ``step`` on ``rank`` (CPU int64 tensors)."""
    parts = n_micro * world_size
    if batch_size % parts:
        raise ValueError(f"train.batch_size={batch_size} is not divisible by grad_accum x world_size = "
                         f"{n_micro} x {world_size}")
    check_size(tokens, context)
    offsets = step_offsets(len(tokens), seed, step, batch_size, context)
    chunk, k = batch_size // parts, micro * world_size + rank
    return _windows(tokens, offsets[k * chunk:(k + 1) * chunk], context)


def val_batches(tokens: np.ndarray, *, n_batches: int, batch_size: int, context: int, rank: int = 0,
                world_size: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of validation batches (evenly spaced windows), this rank's share of each."""
    check_size(tokens, context, "validation")
    if batch_size % world_size:
        raise ValueError(f"eval batch size {batch_size} is not divisible by world_size={world_size}")
    offsets = np.linspace(0, len(tokens) - context - 1, num=n_batches * batch_size, dtype=np.int64)
    chunk = batch_size // world_size
    mine = slice(rank * chunk, (rank + 1) * chunk)
    return [_windows(tokens, offsets[b * batch_size:(b + 1) * batch_size][mine], context)
            for b in range(n_batches)]
