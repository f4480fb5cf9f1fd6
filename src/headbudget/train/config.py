"""Run configuration: nested dataclasses loaded from YAML, overridable with ``--set a.b=value``.

A config file has up to five sections (``distill`` optional) plus top-level keys::

    name: quickstart
    seed: 0
    model: {preset: cpu-tiny, schedule: uniform}
    data:  {source: "synthetic:300000", tokenizer: "bpe:512"}
    train: {steps: 200, batch_size: 16, context: 128, lr: 2.0e-3}

Every value is coerced to the field's type (YAML reads ``3e-4`` as a string; it becomes a float here),
and an unknown key is an error naming it and the file.

    >>> cfg = RunConfig.from_dict({"train": {"lr": "3e-4"}})
    >>> cfg = apply_overrides(cfg, ["train.steps=50", "model.schedule=prism"])
    >>> cfg.train.lr, cfg.train.steps, cfg.model.schedule
    (0.0003, 50, 'prism')
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from headbudget.data.text import read_text


class ConfigError(ValueError):
    """An invalid config file or override (message names the file and key)."""


@dataclass
class ModelSection:
    preset: str = "cpu-tiny"
    schedule: str = "uniform"
    #: null = the tokenizer's vocabulary rounded up to a multiple of 64
    vocab_size: int | None = None
    #: null = train.context
    n_positions: int | None = None
    dropout: float = 0.0
    bias: bool = True
    # optional overrides of the preset's shape (null keeps the preset's value)
    n_layers: int | None = None
    d_model: int | None = None
    n_heads: int | None = None
    prism_max_head_dim: int | None = None
    prism_min_head_dim: int | None = None
    #: continue from a saved model (headbudget, GPT-2, Llama... folder, run folder or GGUF): its layout and
    #: weights are used as they are (pruned ones too) and the preset/schedule fields above are ignored
    init: str | None = None


@dataclass
class DataSection:
    source: str = "synthetic:1000000"
    #: byte, bpe:N, gpt2[:DIR], hf:NAME_OR_PATH, or "model": the tokenizer saved with model.init
    tokenizer: str = "byte"
    val_fraction: float = 0.05
    #: null = $HEADBUDGET_DATA_CACHE or ~/.cache/headbudget/data
    cache_dir: str | None = None
    #: bound on characters read (required for streamed ``hf:`` sources)
    max_chars: int | None = None
    #: seed of the synthetic corpus (independent of the training seed, so every run sees the same data)
    seed: int = 0
    split_blank_lines: bool = False


@dataclass
class TrainSection:
    steps: int = 1000
    #: global batch in sequences per optimizer step (split over grad_accum x processes)
    batch_size: int = 16
    grad_accum: int = 1
    context: int = 128
    lr: float = 1e-3
    #: cosine decays to min_lr_ratio x lr
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    #: null = batch_size
    eval_batch_size: int | None = None
    log_every: int = 10
    ckpt_every: int = 0
    keep_last: int = 2
    #: auto = cuda if available else cpu
    device: str = "auto"
    #: auto = bf16 autocast on CUDA, fp32 on CPU; or fp32 / bf16
    precision: str = "auto"
    compile: bool = False
    tensorboard: bool = False
    #: fully-sharded data parallel instead of DDP under torchrun (large presets; untested on CPU)
    fsdp: bool = False
    progress: bool = True
    #: CPU threads for this run; 0 = auto (the cores not already busy, from the load average: on a
    #: shared machine, oversubscribed OpenMP threads can be ~8x slower than one thread)
    threads: int = 0


@dataclass
class DistillSection:
    """Logit distillation from a teacher (``headbudget distill``, ``train --teacher``); off while teacher is null.

    The training loss per token is ``alpha * T^2 * KL(softmax(t/T) || softmax(s/T)) + (1 - alpha) * CE``
    (t, s: teacher and student logits, T: temperature); val_loss stays the plain LM cross-entropy."""

    #: model folder, run folder or GGUF of the teacher (same tokenizer as the student); null = no teacher
    teacher: str | None = None
    temperature: float = 2.0
    #: weight of the KL term; 1 - alpha weighs the LM cross-entropy (0 = plain LM training)
    alpha: float = 1.0


@dataclass
class RunConfig:
    name: str = "run"
    seed: int = 0
    out: str | None = None
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    distill: DistillSection = field(default_factory=DistillSection)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, origin: str = "config") -> RunConfig:
        return _build(cls, d or {}, origin, "")

    @classmethod
    def load(cls, path: str | os.PathLike) -> RunConfig:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file {p} not found")
        try:
            raw = yaml.safe_load(read_text(p))  # not UTF-8: names the file and the byte offset
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{p}:{mark.line + 1}" if mark else str(p)
            raise ConfigError(f"{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
        if raw is not None and not isinstance(raw, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
        return cls.from_dict(raw, str(p))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, **sections: Any) -> RunConfig:
        """Copy with some top-level fields replaced (sections given as dicts of changes)."""
        d = self.to_dict()
        for k, v in sections.items():
            if isinstance(v, dict):
                d[k].update(v)
            else:
                d[k] = v
        return RunConfig.from_dict(d)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none", "~")):
            if type(None) in args:
                return None
        if value == "auto" and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return value.strip().lower() in ("true", "yes", "on", "1")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value.replace("_", ""))
            except ValueError:
                raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
            if f.is_integer():
                return int(f)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise ConfigError(f"{where}: unsupported field type {tp}")


def _build(cls: type, d: dict[str, Any], origin: str, prefix: str) -> Any:
    hints = _hints(cls)
    names = {f.name for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(
                f"{origin}: unknown key {dotted!r}; valid keys here: {', '.join(sorted(names))}"
            )
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if isinstance(value, tp):
                value = dataclasses.asdict(value)
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(f"{origin}: {dotted!r} must be a section (mapping), got {value!r}")
            kwargs[key] = _build(tp, value, origin, dotted + ".")
        else:
            kwargs[key] = _coerce(value, tp, f"{origin}: {dotted}")
    return cls(**kwargs)


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
    d = cfg.to_dict()
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.lr=3e-4")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node: Any = d
        for i, part in enumerate(parts[:-1]):
            if not isinstance(node, dict) or part not in node or not isinstance(node[part], dict):
                raise ConfigError(f"--set {item!r}: unknown section {'.'.join(parts[:i + 1])!r}")
            node = node[part]
        if parts[-1] not in node or isinstance(node[parts[-1]], dict):
            raise ConfigError(f"--set {item!r}: unknown key {key.strip()!r}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node[parts[-1]] = value
    return RunConfig.from_dict(d, "--set")


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
