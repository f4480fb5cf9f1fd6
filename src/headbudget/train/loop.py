"""The one training loop of headbudget (every trainer of the package runs through :class:`TrainLoop`):
parameter groups, learning-rate schedule, gradient accumulation, clipping, a NaN guard, checkpoint hooks,
DDP/FSDP2.

    >>> import torch
    >>> from headbudget.train.loop import TrainLoop, build_adamw, warmup_cosine
    >>> model = torch.nn.Linear(4, 1)
    >>> batches = iter([torch.randn(8, 4) for _ in range(6)])
    >>> loop = TrainLoop(model, build_adamw(model, lr=1e-2, weight_decay=0.1),
    ...                  lambda x: model(x).pow(2).mean(), grad_accum=2, grad_clip=1.0,
    ...                  lr_schedule=warmup_cosine(1e-2, warmup_steps=1, total_steps=3))
    >>> result = loop.run(batches, steps=3, log_every=3)
    >>> result.steps, len(result.losses)
    (3, 3)

The host reads the losses only at log steps, checkpoint steps and the end (as nanoGPT does), so a GPU queue
is never drained by a ``.item()``; a NaN stops the run at the next of those points, before any checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["LogRecord", "LoopResult", "TrainLoop", "TrainingDivergedError", "build_adamw", "distributed_env",
           "fused_adamw_available", "init_distributed", "param_groups", "shard_or_replicate", "training_device",
           "warmup_cosine", "warmup_linear"]


class TrainingDivergedError(RuntimeError, FloatingPointError):
    """The loss became NaN/inf; the message names the first such step (and, from the trainer, the last good
    checkpoint).  A ``FloatingPointError`` too, which classifier fine-tuning raised before."""


# ---------------------------------------------------------------------------- optimizer and schedule
def _clean_name(name: str) -> str:
    """Parameter name without DDP/FSDP/compile wrapper prefixes."""
    for prefix in ("_orig_mod.", "module.", "_fsdp_wrapped_module."):
        name = name.replace(prefix, "")
    return name


def param_groups(model: torch.nn.Module, weight_decay: float,
                 decay_names: set[str] | None = None) -> list[dict[str, Any]]:
    """Weight decay on matrices (linear and embedding weights), none on biases and norms; frozen parameters
    left out.  ``decay_names`` (of the unwrapped model) is needed under FSDP, whose shards lose shapes."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # shared (tied) tensors are listed once
        if not p.requires_grad:
            continue
        wd = (_clean_name(name) in decay_names if decay_names is not None
              else p.dim() >= 2 and "LayerNorm" not in name and "layer_norm" not in name)
        (decay if wd else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(model: torch.nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.999),
                decay_names: set[str] | None = None, fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups`; ``fused=None`` takes torch's fused kernel wherever torch has it for
    every parameter (CUDA, and CPU since torch 2.4), ``True`` insists on it, ``False`` refuses it.  The two
    round differently (~1e-7 per step); a resumed run keeps its checkpoint's kind (bit-identical)."""
    groups = param_groups(model, weight_decay, decay_names)
    available = fused_adamw_available(p for g in groups for p in g["params"])
    if fused and not available:
        raise ValueError("fused AdamW asked for, but torch has no fused kernel for some parameter's device or dtype")
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **({"fused": True} if available and fused is not False else {}))


def fused_adamw_available(params: Iterable[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW kernel takes every one of ``params`` (its own check: floating point, on a
    device with the kernel; CUDA only before torch 2.4, whose optimizer module lacks that check)."""
    import importlib

    check = getattr(importlib.import_module("torch.optim.optimizer"), "_device_dtype_check_for_fused", None)
    try:
        for p in params:
            if check is not None:
                check(p)
            elif not (p.is_cuda and p.is_floating_point()):
                return False
    except RuntimeError:
        return False
    return True


def warmup_cosine(lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> Callable[[int], float]:
    """Linear warmup over ``warmup_steps`` (step 0 already at ``lr / warmup_steps``), then cosine decay to
    ``min_lr_ratio * lr`` at ``total_steps``.

        >>> f = warmup_cosine(1.0, 10, 110, 0.1)
        >>> f(0), f(9), round(f(60), 6), round(f(110), 6)
        (0.1, 1.0, 0.55, 0.1)
    """
    floor = lr * min_lr_ratio
    span = max(1, total_steps - warmup_steps)

    def lr_at(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return lr * (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / span)
        return floor + 0.5 * (lr - floor) * (1 + math.cos(math.pi * progress))

    return lr_at


def warmup_linear(lr: float, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Linear warmup from 0 over ``warmup_steps``, then linear decay to 0 at ``total_steps``: the same floats as
    ``transformers.get_linear_schedule_with_warmup`` (BERT fine-tuning's schedule).

        >>> f = warmup_linear(1.0, 2, 10)
        >>> f(0), f(1), f(2), f(6), f(10)
        (0.0, 0.5, 1.0, 0.5, 0.0)
    """

    def lr_at(step: int) -> float:
        if step < warmup_steps:
            return lr * (float(step) / float(max(1, warmup_steps)))
        return lr * max(0.0, float(total_steps - step) / float(max(1, total_steps - warmup_steps)))

    return lr_at


# ---------------------------------------------------------------------------- processes
def distributed_env() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from torchrun's environment (``(0, 1, 0)`` without it)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))


def training_device(spec: str, world: int = 1, local_rank: int = 0) -> torch.device:
    """The device of ``train.device`` (``auto``: CUDA when there is one); under torchrun on CUDA, this
    process's GPU (``LOCAL_RANK``), made the current one."""
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if spec == "auto" else spec)
    if dev.type == "cuda" and world > 1:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    return dev


def init_distributed(device: torch.device, world: int) -> bool:
    """Join the process group (NCCL on CUDA, gloo on CPU) when ``world > 1``; True when distributed."""
    if world <= 1:
        return False
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return True


def shard_or_replicate(model: torch.nn.Module, device: torch.device, world: int, fsdp: bool) -> torch.nn.Module:
    """FSDP2 (``fsdp``; as torchtitan, each block of ``model.transformer.h`` one all-gather unit, the module
    the same object) or DDP for a multi-process run; the model itself on one process."""
    if world <= 1:
        return model
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# ---------------------------------------------------------------------------- the loop
@dataclass
class LogRecord:
    """What a log step reads from the device: the step's loss (mean over micro-batches and processes), the
    gradient norm before clipping, the lr, the loss function's extra terms and the seconds of the ``steps``
    steps since the previous record."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    parts: tuple[float, ...]
    seconds: float
    steps: int


@dataclass
class LoopResult:
    steps: int  # optimizer steps done in all (``start_step`` + the steps of this call)
    losses: list[float] = field(default_factory=list)  # the loss of every step of this call


@dataclass
class _Pending:  # one optimizer step whose loss is still on the device
    step: int
    lr: float
    loss: torch.Tensor
    parts: torch.Tensor | None


class TrainLoop:
    """Optimizer steps over micro-batches: ``loss_fn(batch)`` (a scalar, or ``(scalar, extra_terms)``) under
    ``autocast``, backward of ``loss / grad_accum``, gradient sync only on the last micro-batch (DDP
    ``no_sync``, FSDP2 ``set_requires_gradient_sync``), clipping to ``grad_clip`` (0/None: none), the
    learning rate from ``lr_schedule`` (a function of the step, or a torch ``LRScheduler`` stepped after each
    optimizer step), then ``optimizer.step()``.  ``nonfinite="raise"`` stops a run whose loss went NaN/inf
    (:class:`TrainingDivergedError`; ``divergence_hint()`` is appended to its message); ``"ignore"`` runs on
    (the experiments compare learning rates and keep the best).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[[Any], Any], *,
                 grad_accum: int = 1, grad_clip: float | None = None, lr_schedule: Any = None,
                 autocast: contextlib.AbstractContextManager | None = None, nonfinite: str = "raise",
                 divergence_hint: Callable[[], str] | None = None) -> None:
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
        if nonfinite not in ("raise", "ignore"):
            raise ValueError(f"nonfinite must be 'raise' or 'ignore', got {nonfinite!r}")
        from torch.nn.parallel import DistributedDataParallel

        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.grad_accum, self.grad_clip = grad_accum, grad_clip or 0.0
        self.lr_schedule, self.nonfinite, self.divergence_hint = lr_schedule, nonfinite, divergence_hint
        self.autocast = autocast if autocast is not None else contextlib.nullcontext()
        self._ddp = isinstance(model, DistributedDataParallel)
        self._fsdp = hasattr(model, "set_requires_gradient_sync")  # an FSDP2 module
        self._pending: list[_Pending] = []
        self._losses: list[float] = []

    def run(self, micro_batches: Iterator[Any], *, steps: int, start_step: int = 0, log_every: int = 0,
            log_at: Callable[[int], bool] | None = None, checkpoint_at: Callable[[int], bool] | None = None,
            on_log: Callable[[LogRecord], Any] | None = None, on_checkpoint: Callable[[int], Any] | None = None,
            on_step: Callable[[int, Any], bool | None] | None = None) -> LoopResult:
        """Optimizer steps ``start_step + 1 .. steps`` (numbered by steps done), each on ``grad_accum`` batches of
        ``micro_batches``; ends early, at a step boundary, when the iterator does.

        ``log_at(done)`` (default: every ``log_every`` steps and the last) marks the log steps: there the loss is
        read and checked and ``on_log(LogRecord)`` runs (what it returns is passed on to ``on_step``).
        ``on_checkpoint(done)`` runs where ``checkpoint_at(done)``, after every loss up to it was checked.
        ``on_step(done, logged)`` runs after every step; returning True ends the run there.
        """
        if log_at is None:
            def log_at(done: int) -> bool:
                return done == steps or (log_every > 0 and done % log_every == 0)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)  # nothing left over from an earlier backward
        self._pending, self._losses = [], []
        batches, done, seconds, n_steps = iter(micro_batches), start_step, 0.0, 0
        for step in range(start_step, steps):
            t0 = time.perf_counter()
            logged = log_at(step + 1)
            grad_norm = self.step(batches, step, need_norm=logged)
            if grad_norm is None:  # the iterator ended
                break
            done, n_steps = step + 1, n_steps + 1
            record, last = None, self.check() if logged else None
            seconds += time.perf_counter() - t0
            if logged:
                rec = LogRecord(step=done, loss=last[0], grad_norm=float(grad_norm), lr=last[1], parts=last[2],
                                seconds=seconds, steps=n_steps)
                seconds, n_steps = 0.0, 0
                record = on_log(rec) if on_log is not None else rec
            if checkpoint_at is not None and checkpoint_at(done):
                self.check()  # no checkpoint holds weights a NaN has reached
                if on_checkpoint is not None:
                    on_checkpoint(done)
            if on_step is not None and on_step(done, record):
                break
        self.check()
        return LoopResult(steps=done, losses=self._losses)

    def step(self, batches: Iterator[Any], step: int, need_norm: bool) -> torch.Tensor | None:
        """One optimizer step (the ``step``-th, from 0) on the next ``grad_accum`` batches; its gradient norm (a
        device tensor; 0 when neither clipping nor ``need_norm`` asks for it), or None when ``batches`` had nothing
        left.  Its loss stays on the device until :meth:`check` (benchmarks/throughput.py calls both)."""
        if callable(self.lr_schedule) and not hasattr(self.lr_schedule, "step"):
            lr = self.lr_schedule(step)
            for g in self.optimizer.param_groups:
                g["lr"] = lr
        else:
            lr = self.optimizer.param_groups[0]["lr"]
        accumulated = self._accumulate(batches, step)
        if accumulated is None:
            return None
        loss, parts = accumulated
        grad_norm = torch.zeros(())
        if need_norm or self.grad_clip > 0:
            with_grad = [p for p in self.model.parameters() if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in with_grad])
            if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor of per-shard partial norms
                grad_norm = grad_norm.full_tensor()
            if self.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(with_grad, self.grad_clip, grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if hasattr(self.lr_schedule, "step"):  # a torch LRScheduler
            self.lr_schedule.step()
        self._pending.append(_Pending(step + 1, float(lr), loss, parts))
        return grad_norm

    def _accumulate(self, batches: Iterator[Any], step: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Forward and backward of ``grad_accum`` micro-batches: (mean loss, mean extra terms), on the device."""
        loss_sum: torch.Tensor | None = None
        parts_sum: torch.Tensor | None = None
        for micro in range(self.grad_accum):
            try:
                batch = next(batches)
            except StopIteration:
                if micro == 0:
                    return None
                raise ValueError(f"the batches ended inside step {step + 1} ({micro} of {self.grad_accum} "
                                 "micro-batches)") from None
            last_micro = micro == self.grad_accum - 1
            if self._fsdp:  # reduce-scatter gradients once per optimizer step
                self.model.set_requires_gradient_sync(last_micro)
            sync = self.model.no_sync() if self._ddp and not last_micro else contextlib.nullcontext()
            with sync:
                with self.autocast:
                    out = self.loss_fn(batch)
                    loss, parts = out if isinstance(out, tuple) else (out, None)
                    if parts is not None:
                        parts_sum = (torch.zeros_like(parts) if parts_sum is None else parts_sum) + parts.detach()
                (loss / self.grad_accum).backward()
            if loss_sum is None:
                loss_sum = torch.zeros((), device=loss.device)
            loss_sum += loss.detach()
        assert loss_sum is not None
        if parts_sum is not None:
            parts_sum /= self.grad_accum
        return loss_sum / self.grad_accum, parts_sum

    def check(self) -> tuple[float, float, tuple[float, ...]] | None:
        """Read the pending losses (one host sync; averaged over processes) and stop on a non-finite one.
        Returns (loss, lr, parts) of the last pending step."""
        if not self._pending:
            return None
        losses = torch.stack([p.loss for p in self._pending])
        parts = torch.stack([p.parts for p in self._pending]) if self._pending[-1].parts is not None else None
        world = _world_size()
        if world > 1:
            import torch.distributed as dist

            dist.all_reduce(losses)
            losses /= world
            if parts is not None:
                dist.all_reduce(parts)
                parts /= world
        values = losses.tolist()
        pending, self._pending = self._pending, []
        if self.nonfinite == "raise":
            for p, v in zip(pending, values):
                if not math.isfinite(v):
                    hint = self.divergence_hint() if self.divergence_hint is not None else ""
                    raise TrainingDivergedError(f"non-finite training loss ({v}) at step {p.step} "
                                                f"(lr {p.lr:.3g}){hint}")
        self._losses.extend(values)
        last_parts = tuple(parts[-1].tolist()) if parts is not None else ()
        return values[-1], pending[-1].lr, last_parts
