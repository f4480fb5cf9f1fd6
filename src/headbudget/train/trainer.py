"""``headbudget train``: one run from a :class:`RunConfig` into a folder (data, model, exact resume, DDP/FSDP2, export);
its steps run through :class:`headbudget.train.loop.TrainLoop` (AdamW, warmup + cosine, accumulation, clipping).

    >>> from headbudget.train import RunConfig, train
    >>> cfg = RunConfig.from_dict({"model": {"preset": "cpu-tiny", "schedule": "prism"},
    ...                            "data": {"source": "synthetic:50000"}, "train": {"steps": 20}})
    >>> # result = train(cfg, "runs/demo")   # -> TrainResult(final_val_loss=..., model_dir=runs/demo/model)

Writes ``metrics.jsonl``, ``checkpoints/``, ``model/`` (Hugging Face format), ``tokenizer/``, ``config.yaml``
and ``summary.json``.  Data order is a pure function of (seed, step) and checkpoints hold every RNG state, so
``resume=True`` continues bit-for-bit on CPU.  See docs/training.md ("The trainer").
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from headbudget.data.loader import train_batch, val_batches
from headbudget.data.prepare import PreparedData
from headbudget.devices import use_bf16_autocast
from headbudget.io import atomic_write_dir, atomic_write_text
from headbudget.threads import configure_threads
from headbudget.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    legacy_checkpoints,
    load_checkpoint,
    read_trainer_state,
    save_checkpoint,
)
from headbudget.train.config import RunConfig
from headbudget.train.distill import TeacherCache, check_distill_section, distill_step_loss, load_teacher
from headbudget.train.launcher import die_with_launcher
from headbudget.train.loop import (
    TrainLoop,
    build_adamw,
    distributed_env,
    init_distributed,
    shard_or_replicate,
    training_device,
)
from headbudget.train.memory import PeakMemory
from headbudget.train.records import (  # TrainResult is also imported from here
    RESUMABLE_CHANGES,
    MetricsLogger,
    TrainResult,
    check_compatible,
    finished_result,
    last_train_loss,
    trim_metrics,
)
from headbudget.train.setup import build_model, build_schedule, lr_at, prepare_shared, resolve_vocab_size

__all__ = ["Trainer", "TrainResult", "build_model", "build_schedule", "lr_at", "train"]


@dataclass
class _Run:
    """What one run trains with (built by ``Trainer._setup``)."""

    device: torch.device
    distributed: bool
    fsdp: bool
    is_main: bool
    data: PreparedData
    vocab: int
    model: torch.nn.Module  # what steps: DDP-wrapped, FSDP2-sharded or the model itself
    raw_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    autocast: Any
    teacher: torch.nn.Module | None
    n_tokens: int
    teacher_cache: TeacherCache | None
    val_set: list
    n_params: int
    ckpt_dir: Path
    metrics_path: Path
    rng_restored: bool = False


# ---------------------------------------------------------------------------- trainer
class Trainer:
    """Train one model from a :class:`RunConfig` into ``out_dir``.

    ``callbacks`` are called as ``cb(trainer, step, record)`` after every optimizer step (``record``: the
    metrics dict of that step, or None when it was not logged); raising from one stops the run, setting
    ``trainer.stop_requested = True`` ends it after that step as a finished one (validated, exported).
    ``stop_at_step`` ends it so after that many steps (then an eval and checkpoint step), keeping the
    learning-rate schedule of ``train.steps``.  ``data`` may pass an already prepared dataset.
    """

    def __init__(self, cfg: RunConfig, out_dir: str | os.PathLike, *, resume: bool = False,
                 callbacks: list[Callable[[Trainer, int, dict | None], None]] | None = None,
                 data: PreparedData | None = None, save_model: bool = True,
                 stop_at_step: int | None = None) -> None:
        self.cfg = cfg
        if stop_at_step is not None and not 0 < stop_at_step <= cfg.train.steps:
            raise ValueError(f"stop_at_step={stop_at_step} must be in 1..train.steps ({cfg.train.steps})")
        #: the last step this run trains (``train.steps`` unless ``stop_at_step`` ends it earlier)
        self.end_step = stop_at_step or cfg.train.steps
        self.out, self.resume, self.callbacks = Path(out_dir), resume, list(callbacks or [])
        self.data, self.save_model = data, save_model
        self.rank, self.world, self.local_rank = distributed_env()
        if self.world > 1:  # a worker of torchrun: no orphan training on if the launcher is killed
            die_with_launcher()
        #: set by run() when ``resume`` found the run already finished (nothing was trained or written)
        self.already_finished = False
        self.summary: dict[str, Any] | None = None  # what summary.json records, once a run has finished
        #: a callback sets it to end the run after the current step (a stopping rule); see the class doc
        self.stop_requested = False
        #: the step run() started training from: 0, or that of the checkpoint it resumed
        self.start_step = 0
        self._check()

    def _check(self) -> None:
        t = self.cfg.train
        for name in ("steps", "batch_size", "grad_accum", "context", "eval_batches", "log_every"):
            if getattr(t, name) <= 0:
                raise ValueError(f"train.{name} must be positive, got {getattr(t, name)}")
        if t.batch_size % (t.grad_accum * self.world):
            raise ValueError(f"train.batch_size={t.batch_size} must be divisible by train.grad_accum x "
                             f"processes = {t.grad_accum} x {self.world}")
        if t.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"train.precision must be auto, fp32 or bf16, got {t.precision!r}")
        check_distill_section(self.cfg.distill)
        if not self.cfg.model.init:
            build_schedule(self.cfg)  # schedule errors before any data work

    # ------------------------------------------------------------------ main
    def run(self) -> TrainResult:
        device = training_device(self.cfg.train.device, self.world, self.local_rank)
        saved_threads = torch.get_num_threads()
        if device.type == "cpu":
            configure_threads(self.cfg.train.threads, self.world)  # 0: idle cores (headbudget.threads)
        try:
            return self._run(device)
        finally:
            torch.set_num_threads(saved_threads)

    def _run(self, device: torch.device) -> TrainResult:
        if self.resume:
            finished = finished_result(self.out, self.cfg, steps=self.end_step)
            if finished is not None:  # leave a finished run exactly as it is
                if self.rank == 0:
                    print(f"{self.out} already finished {finished.steps} steps (train.steps={self.cfg.train.steps}); "
                          "nothing to resume, nothing changed", file=sys.stderr, flush=True)
                self.model, self.already_finished = None, True
                return finished
        run = self._setup(device)
        start_step = self.start_step = self._resume_step(run)
        if start_step > self.end_step:
            raise ValueError(f"{self.out}: its checkpoint is at step {start_step}, past the {self.end_step} steps this "
                             "run is to train; resume it with the settings it was made with, or train into a new --out")
        if run.is_main:
            trim_metrics(run.metrics_path, start_step)
            atomic_write_text(self.out / "config.yaml", self.cfg.to_yaml())
            run.data.tokenizer.save(self.out / "tokenizer")
        if not run.rng_restored:  # the dropout stream (a resumed run restored its own)
            torch.manual_seed(self.cfg.seed + 1 + self.rank)
        t_start = time.perf_counter()
        with PeakMemory(device) as mem:
            steps_done, last_val, last_train = self._train_steps(run, start_step)
        if start_step >= self.end_step:  # resumed from the final checkpoint (killed while exporting)
            last_val = self.validation_loss(run)
            last_train = last_train_loss(run.metrics_path)
        return self._finish(run, steps_done, last_val, last_train, mem.peak_mb, time.perf_counter() - t_start)

    def _setup(self, device: torch.device) -> _Run:
        """Process group, data, model (DDP/FSDP2-wrapped), optimizer, teacher and validation batches."""
        cfg, t = self.cfg, self.cfg.train
        distributed = init_distributed(device, self.world)
        self.out.mkdir(parents=True, exist_ok=True)
        data = self.data = self.data if self.data is not None else prepare_shared(self.cfg)
        vocab = resolve_vocab_size(cfg, data.tokenizer.vocab_size)
        torch.manual_seed(cfg.seed)
        raw_model = build_model(cfg, vocab).to(device)
        use_bf16 = use_bf16_autocast(t.precision, device)
        autocast = (torch.autocast(device_type=device.type, dtype=torch.bfloat16) if use_bf16
                    else contextlib.nullcontext())
        teacher, n_tokens, cache = None, 0, None
        if cfg.distill.teacher:  # every rank its own full, frozen copy (never sharded; headbudget.train.distill)
            student_tok = data.tokenizer.to_hf()
            n_tokens = len(student_tok)  # logits of differently padded vocabularies are compared over these
            teacher = load_teacher(cfg.distill.teacher, student_tok, device,
                                   torch.bfloat16 if use_bf16 else torch.float32)
            if cfg.distill.teacher_cache:
                cache = TeacherCache(cfg.distill.teacher_cache, teacher)
        fsdp = distributed and t.fsdp  # one process: a plain model whatever train.fsdp says
        n_params = sum(p.numel() for p in raw_model.parameters())  # before FSDP2 shards them
        decay_names = {n for n, p in raw_model.named_parameters() if p.dim() >= 2}
        model = shard_or_replicate(raw_model, device, self.world if distributed else 1, fsdp)
        optimizer = build_adamw(model, lr=t.lr, weight_decay=t.weight_decay, betas=(t.beta1, t.beta2),
                                decay_names=decay_names)  # fused kernel where torch has one (CPU too)
        val_set = val_batches(data.val, n_batches=t.eval_batches, batch_size=t.eval_batch_size or t.batch_size,
                              context=t.context, rank=self.rank, world_size=self.world)
        return _Run(device=device, distributed=distributed, fsdp=fsdp, is_main=self.rank == 0, data=data,
                    vocab=vocab, model=model, raw_model=raw_model, optimizer=optimizer, autocast=autocast,
                    teacher=teacher, n_tokens=n_tokens, teacher_cache=cache, val_set=val_set, n_params=n_params,
                    ckpt_dir=self.out / "checkpoints", metrics_path=self.out / "metrics.jsonl")

    def _resume_step(self, run: _Run) -> int:
        """With ``resume``, the step of the latest checkpoint (model, optimizer and RNG restored), else 0."""
        if not self.resume:
            return 0
        path = latest_checkpoint(run.ckpt_dir)
        if path is None and legacy_checkpoints(run.ckpt_dir):
            raise CheckpointError(
                f"{run.ckpt_dir} holds step_*.pt checkpoints of headbudget < 0.2, which are pickled and are "
                "not loaded; train into a new --out")
        if path is None:
            if run.is_main:  # documented: --resume on a new run starts it (one command for start and restart)
                print(f"headbudget train: --resume: no checkpoint in {run.ckpt_dir}; starting from step 0",
                      file=sys.stderr, flush=True)
            return 0
        check_compatible(self.cfg, path, read_trainer_state(path).get("config") or {})
        state = load_checkpoint(path, run.model, run.optimizer)
        run.rng_restored = state["rng_restored"]
        if run.is_main:
            print(f"resuming from {path} (step {int(state['step'])}, written by {state['world_size']} "
                  f"process(es), now {self.world})", flush=True)
        return int(state["step"])

    def _train_steps(self, run: _Run, start_step: int) -> tuple[int, float | None, float | None]:
        """The optimizer steps (headbudget.train.loop); returns (steps done, last val loss, last train loss)."""
        cfg, t = self.cfg, self.cfg.train
        fwd_model = torch.compile(run.model) if t.compile else run.model
        last_good = [latest_checkpoint(run.ckpt_dir)]

        def loss_fn(batch: tuple[torch.Tensor, torch.Tensor]):
            x, y = batch
            if run.teacher is None:
                return self.compute_loss(fwd_model, x, y)
            return distill_step_loss(fwd_model, run.teacher, x, y, cfg.distill.temperature, cfg.distill.alpha,
                                     run.n_tokens, run.teacher_cache)

        def hint() -> str:
            where = f"; the last good checkpoint is {last_good[0]}" if last_good[0] else \
                "; no checkpoint was written before it"
            return f"{where}. Lower train.lr, raise train.warmup_steps or use train.precision=fp32."

        def save(done: int) -> None:
            last_good[0] = save_checkpoint(run.ckpt_dir, done, run.model, run.optimizer,
                                           meta={"config": cfg.to_dict()}, keep_last=t.keep_last)

        loop = TrainLoop(run.model, run.optimizer, loss_fn, grad_accum=t.grad_accum, grad_clip=t.grad_clip,
                         lr_schedule=lambda step: lr_at(step, cfg), autocast=run.autocast, divergence_hint=hint)
        logger = MetricsLogger(self, run, start_step)
        self.history = logger.history
        try:
            result = loop.run(
                self._micro_batches(run, start_step), steps=self.end_step, start_step=start_step,
                log_at=lambda done: done % t.log_every == 0 or self.is_eval_step(done),
                checkpoint_at=lambda done: t.ckpt_every > 0 and (done % t.ckpt_every == 0 or done == self.end_step),
                on_log=logger.log, on_checkpoint=save, on_step=logger.after_step)
        finally:
            logger.close()
        last_val = logger.last_val
        if result.steps < t.steps and (logger.last_record is None or logger.last_record["val_loss"] is None):
            last_val = self.validation_loss(run)  # a callback's stopping rule ended the run between evaluations
        last_train = result.losses[-1] if result.losses else None
        return min(result.steps, t.steps), last_val, last_train

    def _micro_batches(self, run: _Run, start_step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The micro-batches of steps ``start_step..``: a pure function of (seed, step, micro, rank)."""
        t, device = self.cfg.train, run.device
        pin = device.type == "cuda"  # a copy from pageable memory waits for the GPU queue: a sync per micro-batch
        for step in range(start_step, t.steps):
            for micro in range(t.grad_accum):
                x, y = train_batch(run.data.train, seed=self.cfg.seed, step=step, batch_size=t.batch_size,
                                   context=t.context, micro=micro, n_micro=t.grad_accum, rank=self.rank,
                                   world_size=self.world)
                if pin:
                    x, y = x.pin_memory(), y.pin_memory()
                yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    # ------------------------------------------------------------------ what the metrics logger asks
    def is_eval_step(self, done: int) -> bool:
        """Is the validation loss measured after optimizer step ``done`` (every ``train.eval_every``, and the last)?"""
        t = self.cfg.train
        return (t.eval_every > 0 and done % t.eval_every == 0) or done == self.end_step

    def validation_loss(self, run: _Run) -> float:
        """The validation loss of ``run``'s model now (a collective under DDP/FSDP: every rank calls it)."""
        return self.evaluate(run.model if run.fsdp else run.raw_model, run.val_set, run.device, run.autocast,
                             run.distributed)

    def _finish(self, run: _Run, steps_done: int, last_val: float | None, last_train: float | None,
                peak_mb: float, wall: float) -> TrainResult:
        """Export the model (HF format), write ``summary.json``; the :class:`TrainResult`."""
        cfg, data = self.cfg, run.data
        export = self._plain_model(run.model, cfg, run.vocab) if run.fsdp else run.raw_model  # None on ranks > 0
        model_dir = None
        if self.save_model and run.is_main:
            def write_model(tmp_dir: Path) -> None:
                export.save_pretrained(str(tmp_dir))
                data.tokenizer.save(tmp_dir)  # HF tokenizer files at the model root: AutoTokenizer opens it

            model_dir = atomic_write_dir(self.out / "model", write_model)
        tokens_per_step = cfg.train.batch_size * cfg.train.context
        tps_values = [r["tokens_per_s"] for r in self.history]
        result = TrainResult(
            out_dir=self.out, model_dir=model_dir, steps=steps_done, tokens=steps_done * tokens_per_step,
            final_val_loss=last_val, final_train_loss=last_train, params=run.n_params,
            tokens_per_s=float(np.mean(tps_values)) if tps_values else 0.0, peak_memory_mb=peak_mb, wall_s=wall,
            schedule=run.raw_model.config.schedule, history=self.history,
        )
        if run.is_main:
            summary = result.to_dict()
            summary.update(name=cfg.name, seed=cfg.seed, init=cfg.model.init,
                           schedule_spec=f"init:{cfg.model.init}" if cfg.model.init else cfg.model.schedule,
                           world_size=self.world, data=data.meta)
            if run.teacher is not None:
                summary["distill"] = asdict(cfg.distill)
                if run.teacher_cache is not None:  # batches read back vs computed by the teacher in this run
                    summary["distill"]["cache"] = {"hits": run.teacher_cache.hits, "misses": run.teacher_cache.misses,
                                                   "folder": str(run.teacher_cache.dir)}
            atomic_write_text(self.out / "summary.json", json.dumps(summary, indent=2))
            self.summary = summary
        self.model = export
        return result

    # ------------------------------------------------------------------ pieces
    #: train keys a resumed run may change (:data:`headbudget.train.records.RESUMABLE_CHANGES`)
    RESUMABLE_CHANGES = RESUMABLE_CHANGES

    @staticmethod
    def compute_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``model`` on inputs ``x`` and (already shifted) targets ``y``."""
        logits = model(input_ids=x, use_cache=False).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model, val_set, device, autocast, distributed) -> float:
        was_training = model.training
        model.eval()
        total = torch.zeros((), device=device, dtype=torch.float64)
        for x, y in val_set:
            with autocast:
                total += self.compute_loss(model, x.to(device), y.to(device)).double()
        mean = total / len(val_set)
        if distributed:
            import torch.distributed as dist

            dist.all_reduce(mean)
            mean /= self.world
        model.train(was_training)
        return float(mean)

    @staticmethod
    def _plain_model(model, cfg: RunConfig, vocab: int):
        """The FSDP2 model gathered into an ordinary model on rank 0 (None elsewhere; a collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not full:  # ranks > 0 receive nothing with cpu_offload
            return None
        with torch.random.fork_rng(devices=[]):  # initial values are overwritten; keep the RNG untouched
            plain = build_model(cfg, vocab)
        plain.load_state_dict(full)
        return plain


def train(cfg: RunConfig, out_dir: str | os.PathLike, **kwargs: Any) -> TrainResult:
    """Train one model (see :class:`Trainer`); returns the :class:`TrainResult`."""
    return Trainer(cfg, out_dir, **kwargs).run()
