"""What a training run leaves in its folder and reads back: ``metrics.jsonl`` (and TensorBoard), its
:class:`TrainResult` (``summary.json``), and whether a checkpoint fits the config a resume asks for.

    >>> from headbudget.train.records import finished_result
    >>> finished_result("runs/demo", cfg)  # the recorded result when runs/demo finished cfg's steps  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from headbudget.io import atomic_write_text
from headbudget.train.checkpoint import latest_checkpoint, read_trainer_state
from headbudget.train.config import RunConfig
from headbudget.train.loop import LogRecord

__all__ = ["RESUMABLE_CHANGES", "MetricsLogger", "TrainResult", "check_compatible", "finished_result",
           "last_train_loss", "read_metrics", "trim_metrics"]


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
    #: read back from a finished run's folder (``finished_result``), not trained by this process
    read_back: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("history", "read_back")}
        return dict(d, out_dir=str(self.out_dir), model_dir=str(self.model_dir) if self.model_dir else None)


# ---------------------------------------------------------------------------- metrics
class MetricsLogger:
    """The trainer's side of the loop's log steps (evaluation, ``metrics.jsonl``, TensorBoard, the progress bar)
    and of every step (the callbacks); ``trainer`` is a :class:`~headbudget.train.trainer.Trainer`, ``run``
    what it trains with."""

    def __init__(self, trainer: Any, run: Any, start_step: int) -> None:
        from headbudget.progress import ProgressBar

        t = trainer.cfg.train
        self.trainer, self.run = trainer, run
        # a resumed run's history is the whole run's, read by every rank (a stopping rule decides alike on
        # all); the step filter makes a rank that reads before the main rank's trim_metrics see the same ones
        self.history: list[dict[str, Any]] = \
            [r for r in read_metrics(run.metrics_path) if r["step"] <= start_step] if start_step else []
        self.last_val: float | None = None
        self.last_record: dict[str, Any] | None = None  # of the last step (None when it was not logged)
        self.tokens_per_step = t.batch_size * t.context
        self.writer = self._tensorboard() if t.tensorboard and run.is_main else None
        self.bar = ProgressBar(total=t.steps, initial=start_step, desc=f"train {trainer.cfg.model.schedule}", unit="step",
                        disable=not (t.progress and run.is_main), dynamic_ncols=True, leave=False)

    def _tensorboard(self) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            warnings.warn("train.tensorboard: tensorboard is not installed (pip install tensorboard)", stacklevel=3)
            return None
        return SummaryWriter(str(self.trainer.out / "tensorboard"))

    def log(self, rec: LogRecord) -> dict[str, Any]:
        """One ``metrics.jsonl`` record (evaluated at eval steps); the callbacks receive it."""
        done, run = rec.step, self.run
        record = {"step": done, "tokens": done * self.tokens_per_step, "train_loss": rec.loss, "val_loss": None,
                  "lr": rec.lr, "grad_norm": rec.grad_norm,
                  "tokens_per_s": rec.steps * self.tokens_per_step / max(rec.seconds, 1e-9)}
        if run.teacher is not None:  # train_loss is the mixed loss; both of its terms
            record["distill_kl"], record["lm_loss"] = rec.parts
        is_eval = self.trainer.is_eval_step(done)
        if is_eval:
            self.last_val = record["val_loss"] = self.trainer.validation_loss(run)
        if run.is_main:
            with open(run.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if self.writer is not None:
                for k in ("train_loss", "val_loss", "lr", "grad_norm", "tokens_per_s"):
                    if record[k] is not None:
                        self.writer.add_scalar(k, record[k], done)
        self.history.append(record)
        self.bar.set_postfix(loss=f"{rec.loss:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                             **({"val": f"{self.last_val:.3f}"} if is_eval else {}))
        return record

    def after_step(self, done: int, record: dict[str, Any] | None) -> bool:
        """Callbacks; True when one asked to stop (``trainer.stop_requested``) before the last step."""
        self.last_record = record
        self.bar.update(1)
        for cb in self.trainer.callbacks:
            cb(self.trainer, done, record)
        return self.trainer.stop_requested and done < self.trainer.cfg.train.steps

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()


def trim_metrics(path: Path, start_step: int) -> None:
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


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` (none when it does not exist; a last line cut short by a crash, or
    being written right now, is left out)."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines[:-1]]
    with contextlib.suppress(json.JSONDecodeError):
        records += [json.loads(line) for line in lines[-1:]]
    return records


def last_train_loss(path: Path) -> float | None:
    records = read_metrics(path)
    return records[-1]["train_loss"] if records else None


# ---------------------------------------------------------------------------- resume
#: train keys a resumed run may change (they do not change the model, data or data order)
RESUMABLE_CHANGES = frozenset({"steps", "tokens", "eval_every", "eval_batches", "eval_batch_size", "log_every",
                               "ckpt_every", "keep_last", "progress", "threads", "tensorboard", "compile",
                               "device", "fsdp"})


def check_compatible(cfg: RunConfig, path: Path, saved: dict[str, Any]) -> None:
    """Refuse to resume a checkpoint written with a different model, data or data order."""
    now = cfg.to_dict()
    for section in ("model", "data", "train", "distill"):
        for key, value in now[section].items():
            if section == "train" and key in RESUMABLE_CHANGES:
                continue
            old = saved.get(section, {}).get(key, value)
            if old != value:
                raise ValueError(f"cannot resume from {path}: it was written with {section}.{key}={old!r}, "
                                 f"the config now says {value!r}")
    if saved.get("seed", cfg.seed) != cfg.seed:
        raise ValueError(f"cannot resume from {path}: it was written with seed={saved['seed']}, "
                         f"the config now says {cfg.seed}")


def finished_result(out: str | os.PathLike, cfg: RunConfig, steps: int | None = None) -> TrainResult | None:
    """The recorded result when ``out`` holds a run that finished ``train.steps`` (or more); ``steps``
    replaces ``train.steps`` for a run stopped early on purpose (0 accepts any finished run)."""
    out = Path(out)
    path = out / "summary.json"
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    need = cfg.train.steps if steps is None else steps
    if int(summary.get("steps") or 0) < need or summary.get("final_val_loss") is None:
        return None
    path = latest_checkpoint(out / "checkpoints")
    if path is not None:  # a finished run resumed with another model or data is still an error
        check_compatible(cfg, path, read_trainer_state(path).get("config") or {})
    elif (out / "config.yaml").is_file():
        import yaml

        check_compatible(cfg, out / "config.yaml", yaml.safe_load((out / "config.yaml").read_text()) or {})
    keys = set(TrainResult.__dataclass_fields__) - {"history", "read_back"}
    result = TrainResult(**{k: summary[k] for k in keys if k in summary}, read_back=True)
    result.out_dir, result.history = out, read_metrics(out / "metrics.jsonl")
    result.model_dir = Path(summary["model_dir"]) if summary.get("model_dir") else None
    return result
