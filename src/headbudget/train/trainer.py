"""The training loop: AdamW, warmup + cosine, grad accumulation, clipping, exact resume, DDP/FSDP.

    >>> from headbudget.train import RunConfig, train
    >>> cfg = RunConfig.from_dict({"model": {"preset": "cpu-tiny", "schedule": "prism"},
    ...                            "data": {"source": "synthetic:50000"}, "train": {"steps": 20}})
    >>> # result = train(cfg, "runs/demo")   # -> TrainResult(final_val_loss=..., model_dir=runs/demo/model)

Outputs in the run directory: ``metrics.jsonl`` (one record per logged step: step, tokens, train_loss,
val_loss, lr, grad_norm, tokens_per_s), ``checkpoints/step_*/`` (sharded DCP checkpoints, atomic, last K
kept; see :mod:`headbudget.train.checkpoint`), ``model/``
(Hugging Face format: ``AutoModelForCausalLM.from_pretrained`` loads it), ``tokenizer/``,
``config.yaml`` (the resolved config) and ``summary.json``.

Data order is a pure function of (seed, step) (see :mod:`headbudget.data.loader`), and checkpoints hold
model, optimizer, step and every RNG state, so ``resume=True`` continues bit-for-bit on CPU.
Under ``torchrun`` the trainer joins the process group (gloo on CPU, NCCL on CUDA) and splits each
global batch across ranks; ``train.fsdp: true`` shards parameters, gradients and optimizer state with
FSDP2 (``torch.distributed.fsdp.fully_shard``) instead of replicating them with DDP; both are tested
with 2 CPU processes (gloo).

With ``distill.teacher`` set (``headbudget distill``), each micro-batch's loss is
``alpha * T^2 * KL(teacher || student) + (1 - alpha) * CE`` against a frozen teacher sharing the tokenizer
(:mod:`headbudget.train.distill`); metrics then also record ``distill_kl`` and ``lm_loss``, and ``val_loss``
stays the LM cross-entropy.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from headbudget.data.loader import train_batch, val_batches
from headbudget.data.prepare import PreparedData, prepare_data
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
from headbudget.train.distill import check_distill_section, distill_step_loss, load_teacher
from headbudget.train.launcher import die_with_launcher  # (also imported from here)
from headbudget.train.memory import PeakMemory
from headbudget.train.setup import (
    build_model,
    build_schedule,
    data_tokenizer_spec,
    lr_at,
    param_groups,
    resolve_vocab_size,
)


class TrainingDivergedError(RuntimeError):
    """The loss became NaN/inf; the message names the step and the last good checkpoint."""


@dataclass
class TrainResult:
    out_dir: Path
    model_dir: Path | None
    steps: int
    tokens: int
    final_val_loss: float | None
    final_train_loss: float | None
    params: int
    tokens_per_s: float
    peak_memory_mb: float
    wall_s: float
    schedule: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["out_dir"] = str(self.out_dir)
        d["model_dir"] = str(self.model_dir) if self.model_dir else None
        d.pop("history")
        return d


def _dist_env() -> tuple[int, int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))


# ---------------------------------------------------------------------------- trainer
class Trainer:
    """Train one model from a :class:`RunConfig` into ``out_dir``.

    ``callbacks`` are called as ``cb(trainer, step, record)`` after every optimizer step (``record`` is
    the metrics dict of that step, or None when it was not logged); raising from one stops the run
    (used by tests to simulate a kill); setting ``trainer.stop_requested = True`` from one ends the run
    after that step as a finished one (validated, exported, ``summary.json`` with the steps done; used by
    ``compare --until-flat``).  ``data`` may pass an already prepared dataset.
    """

    def __init__(
        self,
        cfg: RunConfig,
        out_dir: str | os.PathLike,
        *,
        resume: bool = False,
        callbacks: list[Callable[[Trainer, int, dict | None], None]] | None = None,
        data: PreparedData | None = None,
        save_model: bool = True,
    ) -> None:
        self.cfg = cfg
        self.out = Path(out_dir)
        self.resume = resume
        self.callbacks = list(callbacks or [])
        self.data = data
        self.save_model = save_model
        self.rank, self.world, self.local_rank = _dist_env()
        if self.world > 1:  # a worker of torchrun: no orphan training on if the launcher is killed
            die_with_launcher()
        #: set by run() when ``resume`` found the run already finished (nothing was trained or written)
        self.already_finished = False
        #: a callback sets it to end the run after the current step (a stopping rule); see the class doc
        self.stop_requested = False
        self._check()

    def _check(self) -> None:
        t = self.cfg.train
        for name in ("steps", "batch_size", "grad_accum", "context", "eval_batches", "log_every"):
            if getattr(t, name) <= 0:
                raise ValueError(f"train.{name} must be positive, got {getattr(t, name)}")
        if t.batch_size % (t.grad_accum * self.world):
            raise ValueError(
                f"train.batch_size={t.batch_size} must be divisible by train.grad_accum x processes = "
                f"{t.grad_accum} x {self.world}"
            )
        if t.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"train.precision must be auto, fp32 or bf16, got {t.precision!r}")
        check_distill_section(self.cfg.distill)
        if not self.cfg.model.init:
            build_schedule(self.cfg)  # schedule errors before any data work

    # ------------------------------------------------------------------ setup
    def _device(self) -> torch.device:
        d = self.cfg.train.device
        if d == "auto":
            d = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(d)
        if dev.type == "cuda" and self.world > 1:
            dev = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(dev)
        return dev

    def _init_dist(self, device: torch.device) -> bool:
        if self.world <= 1:
            return False
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        return True

    def _prepare(self) -> PreparedData:
        if self.data is not None:
            return self.data
        d = self.cfg.data
        kw = dict(seed=d.seed, val_fraction=d.val_fraction, max_chars=d.max_chars,
                  split_blank_lines=d.split_blank_lines)
        tokenizer = data_tokenizer_spec(self.cfg)
        if self.world > 1:
            import torch.distributed as dist

            if self.rank == 0:
                data = prepare_data(d.source, tokenizer, d.cache_dir, progress=self.cfg.train.progress, **kw)
            dist.barrier()
            if self.rank != 0:
                data = prepare_data(d.source, tokenizer, d.cache_dir, progress=False, **kw)
            return data
        return prepare_data(d.source, tokenizer, d.cache_dir, progress=self.cfg.train.progress, **kw)

    # ------------------------------------------------------------------ main
    def run(self) -> TrainResult:
        device = self._device()
        saved_threads = torch.get_num_threads()
        if device.type == "cpu":
            configure_threads(self.cfg.train.threads, self.world)  # 0: idle cores (headbudget.threads)
        try:
            return self._run(device)
        finally:
            torch.set_num_threads(saved_threads)

    def _run(self, device: torch.device) -> TrainResult:
        cfg, t = self.cfg, self.cfg.train
        if self.resume:
            finished = self._finished_result()
            if finished is not None:  # leave a finished run exactly as it is
                if self.rank == 0:
                    print(f"{self.out} already finished {finished.steps} steps (train.steps={t.steps}); "
                          "nothing to resume, nothing changed", file=sys.stderr, flush=True)
                self.model, self.already_finished = None, True
                return finished
        distributed = self._init_dist(device)
        is_main = self.rank == 0
        self.out.mkdir(parents=True, exist_ok=True)
        ckpt_dir = self.out / "checkpoints"
        metrics_path = self.out / "metrics.jsonl"

        data = self._prepare()
        self.data = data
        train_tokens, val_tokens = data.train, data.val
        vocab = resolve_vocab_size(cfg, data.tokenizer.vocab_size)

        torch.manual_seed(cfg.seed)
        model = build_model(cfg, vocab).to(device)
        raw_model = model
        n_params = sum(p.numel() for p in raw_model.parameters())
        schedule = raw_model.config.schedule

        use_bf16 = (t.precision == "bf16") or (t.precision == "auto" and device.type == "cuda")
        autocast = (torch.autocast(device_type=device.type, dtype=torch.bfloat16) if use_bf16
                    else contextlib.nullcontext())
        teacher = None
        if cfg.distill.teacher:  # every rank its own full, frozen copy (never sharded; headbudget.train.distill)
            student_tok = data.tokenizer.to_hf()
            n_tokens = len(student_tok)  # logits of differently padded vocabularies are compared over these
            teacher = load_teacher(cfg.distill.teacher, student_tok, device,
                                   torch.bfloat16 if use_bf16 else torch.float32)

        fsdp = distributed and t.fsdp  # one process: a plain model whatever train.fsdp says
        if fsdp:
            # FSDP2, as torchtitan: each block is one all-gather unit, the root holds embeddings + head.
            # The module stays the same object (its parameters become DTensor shards).
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (self.world,))
            for block in raw_model.transformer.h:
                fully_shard(block, mesh=mesh)
            fully_shard(raw_model, mesh=mesh)
        elif distributed:
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

        opt_kwargs: dict[str, Any] = dict(lr=t.lr, betas=(t.beta1, t.beta2))
        if device.type == "cuda":
            opt_kwargs["fused"] = True
        decay_names = {n for n, p in raw_model.named_parameters() if p.dim() >= 2}
        optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay, decay_names), **opt_kwargs)

        # ---- resume
        start_step = 0
        rng_restored = False
        if self.resume:
            path = latest_checkpoint(ckpt_dir)
            if path is None and legacy_checkpoints(ckpt_dir):
                raise CheckpointError(
                    f"{ckpt_dir} holds step_*.pt checkpoints of headbudget < 0.2, which are pickled and are "
                    "not loaded; train into a new --out")
            if path is not None:
                saved = read_trainer_state(path)
                self._check_compatible(path, saved.get("config") or {})
                state = load_checkpoint(path, model, optimizer)
                start_step, rng_restored = int(state["step"]), state["rng_restored"]
                if is_main:
                    print(f"resuming from {path} (step {start_step}, written by {state['world_size']} "
                          f"process(es), now {self.world})", flush=True)
            elif is_main:  # documented: --resume on a new run starts it (one command for start and restart)
                print(f"headbudget train: --resume: no checkpoint in {ckpt_dir}; starting from step 0",
                      file=sys.stderr, flush=True)
        if is_main:
            self._trim_metrics(metrics_path, start_step)
            atomic_write_text(self.out / "config.yaml", cfg.to_yaml())
            data.tokenizer.save(self.out / "tokenizer")

        fwd_model = torch.compile(model) if t.compile else model
        ev_bs = t.eval_batch_size or t.batch_size
        val_set = val_batches(val_tokens, n_batches=t.eval_batches, batch_size=ev_bs, context=t.context,
                              rank=self.rank, world_size=self.world)
        if not rng_restored:  # the dropout stream (a resumed run restored its own above)
            torch.manual_seed(cfg.seed + 1 + self.rank)

        writer = None
        if t.tensorboard and is_main:
            try:
                from torch.utils.tensorboard import SummaryWriter

                writer = SummaryWriter(str(self.out / "tensorboard"))
            except ImportError:
                warnings.warn("train.tensorboard: tensorboard is not installed (pip install tensorboard)",
                              stacklevel=2)

        from tqdm.auto import tqdm

        history: list[dict[str, Any]] = []
        tokens_per_step = t.batch_size * t.context
        last_val: float | None = None
        last_train: float | None = None
        tps_values: list[float] = []
        t_start = time.perf_counter()
        bar = tqdm(total=t.steps, initial=start_step, desc=f"train {cfg.model.schedule}", unit="step",
                   disable=not (t.progress and is_main), dynamic_ncols=True, leave=False)
        last_good = latest_checkpoint(ckpt_dir)
        interval_tokens, interval_time = 0, 0.0
        mem = PeakMemory(device)
        steps_done = t.steps
        with mem:
            model.train()
            for step in range(start_step, t.steps):
                t0 = time.perf_counter()
                lr = lr_at(step, cfg)
                for g in optimizer.param_groups:
                    g["lr"] = lr
                loss_sum = torch.zeros((), device=device)
                parts_sum = torch.zeros(2, device=device)  # distillation: [kl, ce]
                for micro in range(t.grad_accum):
                    x, y = train_batch(train_tokens, seed=cfg.seed, step=step, batch_size=t.batch_size,
                                       context=t.context, micro=micro, n_micro=t.grad_accum,
                                       rank=self.rank, world_size=self.world)
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    last_micro = micro == t.grad_accum - 1
                    if fsdp:  # reduce-scatter gradients once per optimizer step
                        model.set_requires_gradient_sync(last_micro)
                    ctx = model.no_sync() if (distributed and not fsdp and not last_micro) else \
                        contextlib.nullcontext()
                    with ctx:
                        with autocast:
                            if teacher is None:
                                loss = self.compute_loss(fwd_model, x, y)
                            else:
                                loss, parts = distill_step_loss(fwd_model, teacher, x, y, cfg.distill.temperature,
                                                                cfg.distill.alpha, n_tokens)
                                parts_sum += parts
                        (loss / t.grad_accum).backward()
                    loss_sum += loss.detach()
                train_loss_t = loss_sum / t.grad_accum
                parts_sum /= t.grad_accum
                if distributed:
                    import torch.distributed as dist

                    dist.all_reduce(train_loss_t)
                    train_loss_t /= self.world
                    if teacher is not None:
                        dist.all_reduce(parts_sum)
                        parts_sum /= self.world
                train_loss = float(train_loss_t)
                if not math.isfinite(train_loss):
                    optimizer.zero_grad(set_to_none=True)
                    bar.close()
                    where = f"; the last good checkpoint is {last_good}" if last_good else \
                        "; no checkpoint was written before it"
                    raise TrainingDivergedError(
                        f"non-finite training loss ({train_loss}) at step {step + 1} (lr {lr:.3g}){where}. "
                        "Lower train.lr, raise train.warmup_steps or use train.precision=fp32."
                    )
                with_grad = [p for p in model.parameters() if p.grad is not None]
                gnorm = torch.nn.utils.get_total_norm([p.grad for p in with_grad])
                if hasattr(gnorm, "full_tensor"):  # FSDP2: a DTensor of per-shard partial norms
                    gnorm = gnorm.full_tensor()
                if t.grad_clip > 0:
                    torch.nn.utils.clip_grads_with_norm_(with_grad, t.grad_clip, gnorm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                done = step + 1
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                interval_time += time.perf_counter() - t0
                interval_tokens += tokens_per_step
                last_train = train_loss

                record = None
                is_eval = (t.eval_every > 0 and done % t.eval_every == 0) or done == t.steps
                if done % t.log_every == 0 or is_eval:
                    tps = interval_tokens / max(interval_time, 1e-9)
                    tps_values.append(tps)
                    interval_tokens, interval_time = 0, 0.0
                    record = {"step": done, "tokens": done * tokens_per_step, "train_loss": train_loss,
                              "val_loss": None, "lr": lr, "grad_norm": float(gnorm), "tokens_per_s": tps}
                    if teacher is not None:  # train_loss is the mixed loss; both of its terms
                        record["distill_kl"], record["lm_loss"] = (float(v) for v in parts_sum)
                    if is_eval:
                        last_val = self.evaluate(model if fsdp else raw_model, val_set, device,
                                                 autocast, distributed)
                        record["val_loss"] = last_val
                    if is_main:
                        with open(metrics_path, "a") as f:
                            f.write(json.dumps(record) + "\n")
                        if writer is not None:
                            for k in ("train_loss", "val_loss", "lr", "grad_norm", "tokens_per_s"):
                                if record[k] is not None:
                                    writer.add_scalar(k, record[k], done)
                    history.append(record)
                    bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tps:,.0f}",
                                    **({"val": f"{last_val:.3f}"} if is_eval else {}))
                bar.update(1)

                if t.ckpt_every > 0 and (done % t.ckpt_every == 0 or done == t.steps):
                    last_good = save_checkpoint(ckpt_dir, done, model, optimizer, meta={"config": cfg.to_dict()},
                                                keep_last=t.keep_last)
                for cb in self.callbacks:
                    cb(self, done, record)
                if self.stop_requested and done < t.steps:  # a callback's stopping rule ends the run here
                    steps_done = done
                    if record is None or record["val_loss"] is None:
                        last_val = self.evaluate(model if fsdp else raw_model, val_set, device, autocast,
                                                 distributed)
                    break
        bar.close()
        if start_step >= t.steps:  # resumed from the final checkpoint (killed while exporting): finish it
            last_val = self.evaluate(model if fsdp else raw_model, val_set, device, autocast, distributed)
            last_train = self._last_train_loss(metrics_path)
        wall = time.perf_counter() - t_start
        if writer is not None:
            writer.close()

        export = self._plain_model(model, cfg, vocab) if fsdp else raw_model  # None on ranks > 0
        model_dir = None
        if self.save_model:
            if is_main:
                def write_model(tmp_dir: Path) -> None:
                    export.save_pretrained(str(tmp_dir))
                    data.tokenizer.save(tmp_dir)  # HF tokenizer files at the model root: AutoTokenizer opens it

                model_dir = atomic_write_dir(self.out / "model", write_model)
        tps_mean = float(np.mean(tps_values)) if tps_values else 0.0
        result = TrainResult(
            out_dir=self.out, model_dir=model_dir, steps=steps_done, tokens=steps_done * tokens_per_step,
            final_val_loss=last_val, final_train_loss=last_train, params=n_params, tokens_per_s=tps_mean,
            peak_memory_mb=mem.peak_mb, wall_s=wall, schedule=schedule, history=history,
        )
        if is_main:
            summary = result.to_dict()
            summary.update(name=cfg.name, seed=cfg.seed, init=cfg.model.init,
                           schedule_spec=f"init:{cfg.model.init}" if cfg.model.init else cfg.model.schedule,
                           world_size=self.world, data=data.meta)
            if teacher is not None:
                summary["distill"] = asdict(cfg.distill)
            atomic_write_text(self.out / "summary.json", json.dumps(summary, indent=2))
        self.model = export
        return result

    # ------------------------------------------------------------------ pieces
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
    def _trim_metrics(path: Path, start_step: int) -> None:
        """Keep only records up to ``start_step`` (a resumed run rewrites what came after)."""
        if not path.exists():
            return
        keep = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= start_step:
                    keep.append(line)
            except (json.JSONDecodeError, KeyError):
                continue
        atomic_write_text(path, "".join(k + "\n" for k in keep))

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

    @staticmethod
    def _last_train_loss(path: Path) -> float | None:
        if not path.exists():
            return None
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return records[-1]["train_loss"] if records else None

    def _finished_result(self) -> TrainResult | None:
        """The recorded result when ``out`` holds a run that finished ``train.steps`` (or more)."""
        path = self.out / "summary.json"
        if not path.is_file():
            return None
        try:
            summary = json.loads(path.read_text())
        except json.JSONDecodeError:
            return None
        if int(summary.get("steps") or 0) < self.cfg.train.steps or summary.get("final_val_loss") is None:
            return None
        path = latest_checkpoint(self.out / "checkpoints")
        if path is not None:  # a finished run resumed with another model or data is still an error
            self._check_compatible(path, read_trainer_state(path).get("config") or {})
        elif (self.out / "config.yaml").is_file():
            import yaml

            self._check_compatible(self.out / "config.yaml",
                                   yaml.safe_load((self.out / "config.yaml").read_text()) or {})
        keys = {f.name for f in TrainResult.__dataclass_fields__.values()} - {"history"}
        result = TrainResult(**{k: summary[k] for k in keys if k in summary})
        result.out_dir = self.out
        result.model_dir = Path(summary["model_dir"]) if summary.get("model_dir") else None
        metrics = self.out / "metrics.jsonl"
        if metrics.exists():
            result.history = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        return result

    #: train keys a resumed run may change (they do not change the model, data or data order)
    RESUMABLE_CHANGES = frozenset({"steps", "eval_every", "eval_batches", "eval_batch_size", "log_every",
                                   "ckpt_every", "keep_last", "progress", "threads", "tensorboard", "compile",
                                   "device", "fsdp"})

    def _check_compatible(self, path: Path, saved: dict[str, Any]) -> None:
        """Refuse to resume a checkpoint written with a different model, data or data order."""
        now = self.cfg.to_dict()
        for section in ("model", "data", "train", "distill"):
            for key, value in now[section].items():
                if section == "train" and key in self.RESUMABLE_CHANGES:
                    continue
                old = saved.get(section, {}).get(key, value)
                if old != value:
                    raise ValueError(f"cannot resume from {path}: it was written with {section}.{key}={old!r}, "
                                     f"the config now says {value!r}")
        if saved.get("seed", self.cfg.seed) != self.cfg.seed:
            raise ValueError(f"cannot resume from {path}: it was written with seed={saved['seed']}, "
                             f"the config now says {self.cfg.seed}")


def train(cfg: RunConfig, out_dir: str | os.PathLike, **kwargs: Any) -> TrainResult:
    """Train one model (see :class:`Trainer`); returns the :class:`TrainResult`."""
    return Trainer(cfg, out_dir, **kwargs).run()
