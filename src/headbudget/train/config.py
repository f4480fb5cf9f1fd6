"""Run configuration: nested dataclasses loaded from YAML, overridable with ``--set a.b=value``.

A config file has up to five sections (``distill`` optional) plus top-level keys::

    name: quickstart
    seed: 0
    model: {preset: cpu-tiny, schedule: uniform}
    data:  {source: "synthetic:300000", tokenizer: "bpe:512"}
    train: {steps: 200, batch_size: 16, context: 128, lr: 2.0e-3}

Every field declares its type, default and help once (:func:`headbudget.typed_config.option`); the config
file, ``--set`` and the commands' ``--section.key`` flags are read through it: every value is coerced to the
field's type (YAML reads ``3e-4`` as a string; it becomes a float here), and an unknown key is one error line
naming it, the file and the nearest valid key.

    >>> cfg = RunConfig.from_dict({"train": {"lr": "3e-4"}})
    >>> cfg = apply_overrides(cfg, ["train.steps=50", "model.schedule=prism"])
    >>> cfg.train.lr, cfg.train.steps, cfg.model.schedule
    (0.0003, 50, 'prism')
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headbudget import typed_config
from headbudget.typed_config import ConfigError, from_dict, load_yaml, option, to_dict, to_yaml

__all__ = ["ConfigError", "DataSection", "DistillSection", "ModelSection", "RunConfig", "TrainSection",
           "apply_overrides", "bundled_configs", "load_config", "resolve_config_path", "steps_for_tokens"]


@dataclass
class ModelSection:
    preset: str = option("cpu-tiny", help="model size preset (headbudget.models presets: cpu-tiny, cpu-small, "
                                          "gpt2-124m, ...)")
    schedule: str = option("uniform", help="head schedule: uniform, prism, reverse, linear, uniform@128, "
                                           "3,3,6,6 ...")
    vocab_size: int | None = option(None, help="null: the tokenizer's vocabulary rounded up to a multiple of 64")
    n_positions: int | None = option(None, help="longest sequence (null: train.context)")
    dropout: float = option(0.0, help="dropout probability")
    bias: bool = option(True, help="biases in linear layers and layer norms")
    # optional overrides of the preset's shape (null keeps the preset's value)
    n_layers: int | None = option(None, help="layers (null: the preset's)")
    d_model: int | None = option(None, help="model width (null: the preset's)")
    n_heads: int | None = option(None, help="heads per layer of the uniform schedule (null: the preset's)")
    prism_max_head_dim: int | None = option(None, help="prism: widest head (null: the preset's)")
    prism_min_head_dim: int | None = option(None, help="prism: narrowest head (null: the preset's)")
    init: str | None = option(
        None, help="continue from a saved model (headbudget, GPT-2, Llama... folder, run folder or GGUF): its "
                   "layout and weights are used as they are (pruned ones too) and preset/schedule are ignored")


@dataclass
class DataSection:
    source: str = option("synthetic:1000000",
                         help="text file/glob, jsonl:PATH[:FIELD], hf:NAME[:CONFIG], synthetic[:N_WORDS]")
    tokenizer: str = option("byte", help="byte, bpe:N, gpt2[:DIR], hf:NAME_OR_PATH, or model: the tokenizer "
                                         "saved with model.init")
    val_fraction: float = option(0.05, help="share of the tokens held out for validation")
    cache_dir: str | None = option(None, help="cache directory (null: $HEADBUDGET_DATA_CACHE or "
                                              "~/.cache/headbudget/data)")
    max_chars: int | None = option(None, help="bound on characters read (required for streamed hf: sources)")
    seed: int = option(0, help="seed of the synthetic corpus (independent of the training seed, so every run "
                               "sees the same data)")
    split_blank_lines: bool = option(False, help="documents are separated by blank lines")


@dataclass
class TrainSection:
    steps: int = option(1000, help="optimizer steps")
    batch_size: int = option(16, help="global batch in sequences per optimizer step (split over grad_accum x "
                                      "processes)")
    grad_accum: int = option(1, help="micro-batches per optimizer step")
    context: int = option(128, help="sequence length in tokens")
    lr: float = option(1e-3, help="peak learning rate")
    min_lr_ratio: float = option(0.1, help="cosine decays to min_lr_ratio x lr")
    warmup_steps: int = option(50, help="linear warmup steps")
    weight_decay: float = option(0.1, help="AdamW weight decay")
    beta1: float = option(0.9, help="AdamW beta1")
    beta2: float = option(0.95, help="AdamW beta2")
    grad_clip: float = option(1.0, help="gradient norm clip (0: none)")
    eval_every: int = option(100, help="steps between validation losses")
    eval_batches: int = option(8, help="batches per validation loss")
    eval_batch_size: int | None = option(None, help="validation batch size (null: batch_size)")
    log_every: int = option(10, help="steps between log lines")
    ckpt_every: int = option(0, help="steps between checkpoints (0: only at the end)")
    keep_last: int = option(2, help="checkpoints kept")
    device: str = option("auto", help="auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    precision: str = option("auto", help="auto (bf16 autocast on CUDA, fp32 on CPU), fp32 or bf16")
    compile: bool = option(False, help="torch.compile the model")
    tensorboard: bool = option(False, help="also write TensorBoard logs")
    fsdp: bool = option(False, help="fully-sharded data parallel instead of DDP under torchrun (large presets; "
                                    "untested on CPU)")
    progress: bool = option(True, help="progress bar")
    threads: int = option(0, help="CPU threads for this run; 0 = auto (the cores not already busy, from the load "
                                  "average: on a shared machine, oversubscribed OpenMP threads can be ~8x slower "
                                  "than one thread)")


@dataclass
class DistillSection:
    """Logit distillation from a teacher (``headbudget distill``, ``train --teacher``); off while teacher is null.

    The training loss per token is ``alpha * T^2 * KL(softmax(t/T) || softmax(s/T)) + (1 - alpha) * CE``
    (t, s: teacher and student logits, T: temperature); val_loss stays the plain LM cross-entropy."""

    teacher: str | None = option(None, help="model folder, run folder or GGUF of the teacher (same tokenizer as "
                                            "the student); null: no teacher")
    temperature: float = option(2.0, help="softmax temperature T of the KL")
    alpha: float = option(1.0, help="weight of the KL term; 1 - alpha weighs the LM cross-entropy (0: plain LM "
                                    "training)")


@dataclass
class RunConfig:
    name: str = option("run", help="run name (default folder runs/NAME-SCHEDULE-sSEED)")
    seed: int = option(0, help="training seed")
    out: str | None = option(None, help="run directory")
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    distill: DistillSection = field(default_factory=DistillSection)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, origin: str = "config") -> RunConfig:
        return from_dict(cls, d or {}, origin)

    @classmethod
    def load(cls, path: str | os.PathLike) -> RunConfig:
        return cls.from_dict(load_yaml(path), str(path))

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    def to_yaml(self) -> str:
        return to_yaml(self)

    def replace(self, **sections: Any) -> RunConfig:
        """Copy with some top-level fields replaced (sections given as dicts of changes)."""
        d = self.to_dict()
        for k, v in sections.items():
            if isinstance(v, dict):
                d[k].update(v)
            else:
                d[k] = v
        return RunConfig.from_dict(d)


def steps_for_tokens(tokens: int, batch_size: int, context: int) -> int:
    """Optimizer steps (``train.steps``) that train at least ``tokens`` tokens at ``batch_size`` x ``context`` per step.

    >>> steps_for_tokens(1_000_000, 16, 128)   # 2,048 tokens a step: 488.28 -> 489
    489
    """
    if tokens < 1 or batch_size < 1 or context < 1:
        raise ValueError(f"tokens, batch_size and context must be positive, got {tokens}, {batch_size}, {context}")
    return -(-tokens // (batch_size * context))


def apply_overrides(cfg: RunConfig, overrides: list[str] | None) -> RunConfig:
    """Apply ``section.key=value`` strings (values parsed as YAML, then coerced to the field type)."""
    return RunConfig.from_dict(typed_config.apply_overrides(RunConfig, cfg.to_dict(), overrides), "--set")


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a config file (or the defaults when ``path`` is None) and apply overrides."""
    cfg = RunConfig.load(path) if path is not None else RunConfig()
    return apply_overrides(cfg, overrides)


def bundled_configs() -> dict[str, Path]:
    """The named configs shipped inside the package (``headbudget/configs/*.yaml``), by name."""
    from importlib.resources import files

    root = Path(str(files("headbudget") / "configs"))
    return {p.stem: p for p in sorted(root.glob("*.yaml"))}


def resolve_config_path(name: str) -> Path:
    """A config file, or the name of a bundled config: ``quickstart``, ``cpu-small``, ``gpt2-124m``, ...

    ``configs/cpu-small.yaml`` (the README's spelling) also finds the bundled file when there is no
    such file, so the README's commands work from a wheel install too.

        >>> resolve_config_path("cpu-small").name
        'cpu-small.yaml'
    """
    p = Path(name)
    if p.is_file():
        return p
    bundled = bundled_configs()
    stem = p.name[:-len(".yaml")] if p.name.endswith(".yaml") else p.name
    if stem in bundled and (p.parent == Path(".") or p.parent == Path("configs")):
        return bundled[stem]
    raise FileNotFoundError(f"config {name!r} not found: not a file, nor a bundled config "
                            f"({', '.join(bundled)})")
