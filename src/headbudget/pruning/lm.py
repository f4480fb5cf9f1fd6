"""Language-model task for head pruning (``headbudget prune MODEL --task lm --data TEXT``).

Causal LMs (converted to headbudget models by :func:`headbudget.loading.load_model`) are pruned label-free:
signatures, salience and the gradient baselines use *calibration* windows of the text (the LM loss), and
the metric is the perplexity of its *held-out* tail.  The text is tokenized once; its last
``heldout_fraction`` of tokens is held out, and up to ``calib_windows`` non-overlapping windows of
``context`` tokens are cut from the rest: the first ones, or seeded ones (:func:`calibration_offsets`).

    >>> from headbudget.loading import load_model_and_tokenizer
    >>> from headbudget.pruning.lm import lm_data, lm_perplexity
    >>> model, tok = load_model_and_tokenizer("runs/prism", as_headbudget=True)          # doctest: +SKIP
    >>> data = lm_data(tok, "../shared/data/text/tinyshakespeare.txt", context=128, calib_windows=32,
    ...                vocab_size=model.config.vocab_size)                                     # doctest: +SKIP
    >>> lm_perplexity(model, data)                            # held-out perplexity   # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from headbudget.pruning.job import FinetuneRecipe

__all__ = ["LMData", "calibration_offsets", "finetune_lm", "lm_batches", "lm_data", "lm_perplexity", "split_lm_ids"]


@dataclass
class LMData:
    """Calibration windows ``(N, context)`` and the held-out token ids."""

    calib: torch.Tensor
    heldout: torch.Tensor
    context: int
    tokens_total: int
    source: str
    calib_offsets: tuple[int, ...] = ()  # token offset of each calibration window in the text
    calib_seed: int | None = None


def calibration_offsets(n_tokens: int, context: int, n_windows: int, seed: int | None = None) -> list[int]:
    """Start offsets of ``n_windows`` non-overlapping ``context``-token windows in the first ``n_tokens``
    tokens: the first windows for ``seed=None``, else slots drawn without replacement with ``seed`` (sorted).

        >>> calibration_offsets(100, 10, 3)
        [0, 10, 20]
        >>> calibration_offsets(100, 10, 3, seed=0) != calibration_offsets(100, 10, 3, seed=1)
        True
    """
    n_slots = n_tokens // context
    n = min(n_windows, n_slots)
    gen = None if seed is None else torch.Generator().manual_seed(int(seed))
    slots = range(n) if gen is None else sorted(torch.randperm(n_slots, generator=gen)[:n].tolist())
    return [s * context for s in slots]


def lm_data(tokenizer: Any, data: str | os.PathLike[str], *, context: int = 128, calib_windows: int = 32,
            heldout_fraction: float = 0.1, vocab_size: int | None = None,
            calib_seed: int | None = None) -> LMData:
    """Tokenize ``data`` (a text file) with a Hugging Face ``tokenizer`` (no special tokens added) and split
    it into calibration windows (the first ones, or seeded ones: ``calib_seed``) and a held-out tail."""
    if context < 2:
        raise ValueError(f"context must be >= 2 tokens, got {context}")
    if calib_windows < 1:
        raise ValueError(f"calib_windows must be >= 1, got {calib_windows}")
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    return split_lm_ids(_token_ids(tokenizer, data, vocab_size), str(data), context=context,
                        calib_windows=calib_windows, heldout_fraction=heldout_fraction, calib_seed=calib_seed)


def _token_ids(tokenizer: Any, path: str | os.PathLike[str], vocab_size: int | None) -> torch.Tensor:
    """Token ids of a whole text file (no special tokens), refused when an id exceeds ``vocab_size``."""
    from headbudget.io import read_text

    text = read_text(str(path))
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    if len(ids) and vocab_size is not None and int(ids.max()) >= vocab_size:
        raise ValueError(f"{path}: token id {int(ids.max())} >= the model's vocab_size {vocab_size} "
                         "(wrong tokenizer for this model?)")
    return ids


def split_lm_ids(ids: torch.Tensor, source: str, *, context: int, calib_windows: int, heldout_fraction: float,
                 calib_seed: int | None = None) -> LMData:
    """:func:`lm_data` on already tokenized ``ids`` (e.g. the same text with another ``calib_seed``)."""
    n = len(ids)
    n_held = int(n * heldout_fraction)
    n_calib_tokens = n - n_held
    n_win = min(calib_windows, n_calib_tokens // context)
    if n_held < 2 or n_win < 1:
        raise ValueError(f"{source}: {n} tokens is too short for one calibration window of {context} tokens "
                         f"plus a held-out tail of {heldout_fraction:.0%} (>= 2 tokens)")
    offsets = calibration_offsets(n_calib_tokens, context, n_win, calib_seed)
    calib = torch.stack([ids[o : o + context] for o in offsets])
    return LMData(calib=calib, heldout=ids[n_calib_tokens:], context=context, tokens_total=n,
                  source=str(source), calib_offsets=tuple(offsets), calib_seed=calib_seed)


def lm_batches(data: LMData, batch_size: int, shuffle: bool = False, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Calibration batches ``{"input_ids", "labels"}`` (labels = inputs: the model shifts them)."""
    n = len(data.calib)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)) if shuffle else torch.arange(n)
    windows = [data.calib[order[i : i + batch_size]] for i in range(0, n, batch_size)]
    return [{"input_ids": ids, "labels": ids} for ids in windows]


def lm_perplexity(model: torch.nn.Module, data: LMData, *, max_windows: int | None = None,
                  progress: bool = False) -> dict[str, Any]:
    """Held-out perplexity (:func:`headbudget.evaluation.perplexity.perplexity`): windows of
    ``data.context`` tokens every ``context - 1`` tokens, so every held-out token after the first is
    scored exactly once (windows share one token)."""
    from headbudget.evaluation.perplexity import perplexity

    return perplexity(model, None, input_ids=data.heldout, context=data.context, stride=max(1, data.context - 1),
                      max_windows=max_windows, progress=progress)


def finetune_lm(model: torch.nn.Module, data: LMData, recipe: FinetuneRecipe) -> list[dict[str, float]]:
    """Recovery fine-tuning on the calibration windows with a classifier's recipe (``lr``, ``warmup_ratio``,
    ``weight_decay``, ``batch_size``, ``seed``, ``max_grad_norm``, ``progress``): AdamW, linear warmup then
    decay, ``recipe.epochs`` passes in a seeded order (:class:`headbudget.train.loop.TrainLoop`).  Returns the
    mean training loss of every epoch."""
    from headbudget.progress import ProgressBar
    from headbudget.train.loop import TrainLoop, build_adamw, warmup_linear

    r, device = recipe, next(model.parameters()).device
    steps_per_epoch = math.ceil(len(data.calib) / r.batch_size)
    total = max(1, r.epochs * steps_per_epoch)
    loop = TrainLoop(model, build_adamw(model, lr=r.lr, weight_decay=r.weight_decay),
                     lambda batch: model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False).loss,
                     grad_clip=r.max_grad_norm, lr_schedule=warmup_linear(r.lr, int(r.warmup_ratio * total), total))
    history = []
    try:
        bar = ProgressBar(total=total, desc="lm fine-tune", disable=not r.progress, leave=False)
        for ep in range(r.epochs):
            batches = lm_batches(data, r.batch_size, shuffle=True, seed=r.seed + ep)
            ran = loop.run(iter(batches), steps=(ep + 1) * steps_per_epoch, start_step=ep * steps_per_epoch,
                           on_step=lambda done, _: bar.update(1))
            history.append({"epoch": ep + 1, "train_loss": sum(ran.losses) / len(ran.losses)})
        bar.close()
    finally:
        model.eval()
    return history
