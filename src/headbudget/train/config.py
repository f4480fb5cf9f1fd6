"""Run configuration: nested dataclasses loaded from YAML, overridable with ``--set a.b=value``.

Every field declares its type, default and help once (:func:`headbudget.typed_config.option`); the config
file (sections ``model``, ``data``, ``train``, ``distill``; top-level ``name``, ``seed``, ``out``), ``--set``
and the commands' ``--section.key`` flags are read through it: values are coerced to the field's type and an
unknown key is one error line naming the nearest valid key.  See docs/training.md ("Configs").

    >>> cfg = RunConfig.from_dict({"train": {"lr": "3e-4"}})
    >>> cfg = apply_overrides(cfg, ["train.steps=50", "model.schedule=prism"])
    >>> cfg.train.lr, cfg.train.steps, cfg.model.schedule
    (0.0003, 50, 'prism')
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from headbudget import typed_config
from headbudget.typed_config import ConfigError, from_dict, load_yaml, option, to_dict, to_yaml

__all__ = ["CompareConfig", "CompareSection", "DataSection", "DistillSection", "ModelSection",
           "RunConfig", "TrainSection", "apply_overrides", "bundled_configs", "load_config", "parse_token_count",
           "resolve_config_path", "steps_for_tokens"]


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
    # two of models.configuration_headbudget.ACTIVATIONS (not imported: that would load transformers)
    hidden_act: str = option("gelu_new", choices=("gelu_new", "gelu"),
                             help="MLP activation: gelu_new (GPT-2's tanh GELU) or gelu (the exact erf GELU of "
                                  "nanoGPT and BERT; 4-5% of a cpu-small training step cheaper on an AVX2 CPU)")
    n_layers: int | None = option(None, help="layers (null: the preset's)")
    d_model: int | None = option(None, help="model width (null: the preset's)")
    n_heads: int | None = option(None, help="heads per layer of the uniform schedule (null: the preset's)")
    prism_max_head_dim: int | None = option(None, help="prism: widest head (null: the preset's)")
    prism_min_head_dim: int | None = option(None, help="prism: narrowest head (null: the preset's)")
    init: str | None = option(
        None, metavar="DIR", help="continue from a saved model (headbudget, GPT-2, Llama... folder, run folder or GGUF; pruned "
                   "and compressed ones too): its layout and weights as they are, preset/schedule ignored, a fresh "
                   "optimizer; given on the command line, data.tokenizer defaults to model (its own tokenizer)")


@dataclass
class DataSection:
    source: str = option("synthetic:1000000",
                         help="text file/glob, jsonl:PATH[:FIELD], hf:NAME[:CONFIG], synthetic[:N_WORDS]")
    tokenizer: str = option("byte", help="byte, bpe:N, gpt2[:DIR], hf:NAME_OR_PATH, or model: the tokenizer "
                                         "saved with model.init")
    val_fraction: float = option(0.05, help="share of the tokens held out for validation")
    cache_dir: str | None = option(None, metavar="DIR", help="cache directory (null: $HEADBUDGET_DATA_CACHE or "
                                              "~/.cache/headbudget/data)")
    max_chars: int | None = option(None, help="bound on characters read (required for streamed hf: sources)")
    seed: int = option(0, help="seed of the synthetic corpus (independent of the training seed, so every run "
                               "sees the same data)")
    split_blank_lines: bool = option(False, help="documents are separated by blank lines")


@dataclass
class TrainSection:
    steps: int = option(1000, help="optimizer steps (set from tokens when tokens is given)")
    tokens: str | None = option(None, metavar="N", help="training tokens, e.g. 1M, 500k or 2e5: steps = tokens / (batch_size x "
                                           "context), rounded up (null: steps as given)")
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
    precision: str = option("auto", help="auto (bf16 autocast on CUDA and on CPUs with AMX/AVX-512 BF16, else fp32), fp32 or bf16")
    compile: bool = option(False, help="torch.compile the model")
    tensorboard: bool = option(False, help="also write TensorBoard logs")
    fsdp: bool = option(False, help="fully-sharded data parallel instead of DDP under torchrun (large presets; "
                                    "untested on CPU)")
    progress: bool = option(True, help="progress bar")
    threads: int = option(0, help="CPU threads for this run; 0 = auto (the cores not already busy, from the load "
                                  "average: on a shared machine, oversubscribed OpenMP threads can be ~8x slower "
                                  "than one thread)")

    def __post_init__(self) -> None:
        if self.tokens is not None:  # the token budget decides the steps, here so Python callers get it too
            self.steps = steps_for_tokens(parse_token_count(self.tokens, "train.tokens (--tokens)"), self.batch_size,
                                          self.context)
            if self.steps > MAX_STEPS:  # tiny batches turn a plausible token count into an impossible run
                raise ConfigError(f"train.tokens (--tokens) {self.tokens!r}: {_e(self.steps)} optimizer steps of "
                                  f"{self.batch_size} x {self.context} tokens, more than any run takes (at most "
                                  f"{_e(MAX_STEPS)}); a typo?")
        elif self.steps > MAX_STEPS:
            raise ConfigError(f"train.steps {self.steps}: more optimizer steps than any run takes (at most "
                              f"{_e(MAX_STEPS)}); a typo?")


@dataclass
class DistillSection:
    """Logit distillation from a teacher (``headbudget distill``, ``train --teacher``); off while teacher is null.
    The loss per token is ``alpha * T^2 * KL(softmax(t/T) || softmax(s/T)) + (1 - alpha) * CE``."""

    teacher: str | None = option(None, help="model folder, run folder or GGUF of the teacher (same tokenizer as "
                                            "the student); null: no teacher")
    temperature: float = option(2.0, help="softmax temperature T of the KL")
    alpha: float = option(1.0, help="weight of the KL term; 1 - alpha weighs the LM cross-entropy (0: plain LM "
                                    "training)")
    teacher_cache: str | None = option(None, help="folder where the teacher's last hidden states are kept per batch "
                                                  "and reused by later students (the loss stays exact); null: none")


@dataclass
class RunConfig:
    name: str = option("run", help="run name (in the default output folder)")
    seed: int = option(0, help="training seed")
    out: str | None = option(None, help="output folder (null: train runs/NAME-SCHEDULE-sSEED, distill "
                                        "runs/NAME-sSEED, compare runs/compare-NAME, quickstart runs/quickstart)")
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    distill: DistillSection = field(default_factory=DistillSection)

    def __post_init__(self) -> None:
        # no float setting of a run means anything at inf or nan (a learning rate of inf diverges at step 1, a nan
        # min_lr_ratio only once the cosine starts, a nan grad_clip turns clipping off): refuse them up front
        for section in fields(self):
            value = getattr(self, section.name)
            for f in fields(value) if is_dataclass(value) else ():
                v = getattr(value, f.name)
                if isinstance(v, float) and not math.isfinite(v):
                    raise ConfigError(f"{section.name}.{f.name} must be a finite number, got {v}")

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, origin: str = "config") -> RunConfig:
        """A run config from a mapping; a ``compare:`` section (``headbudget compare``'s own settings,
        :class:`CompareConfig`) is checked and left out, so ``train`` reads what ``compare --print_config`` wrote."""
        if isinstance(d, dict) and "compare" in d and "compare" not in typed_config.field_types(cls):
            d = dict(d)
            from_dict(CompareSection, d.pop("compare"), origin, "compare.", partial=True)
        return from_dict(cls, d or {}, origin)

    @classmethod
    def load(cls, path: str | os.PathLike) -> RunConfig:
        return cls.from_dict(load_yaml(path), str(path))

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    def to_yaml(self) -> str:
        return to_yaml(self)

    def replace(self, **sections: Any) -> RunConfig:
        """Copy with some top-level fields replaced (sections given as dicts of changes); a new train.steps
        drops train.tokens (which would set the steps back)."""
        d = self.to_dict()
        if "steps" in sections.get("train", {}) and "tokens" not in sections["train"]:
            d["train"]["tokens"] = None
        for k, v in sections.items():
            d[k] = {**d[k], **v} if isinstance(v, dict) else v
        return type(self).from_dict(d)


@dataclass
class CompareSection:
    """What ``headbudget compare`` adds to a run config: the ``compare:`` section of its config file (a plain
    run config reads the file too and leaves it out)."""

    schedules: str = option("uniform,prism", flag="--schedules", metavar="LIST",
                            help="comma list, e.g. uniform,prism,reverse,uniform@128 (use ';' between schedules "
                                 "written as head lists)")
    seeds: int = option(1, flag="--seeds", metavar="N", help="number of seeds (config seed, seed+1, ...)")
    reference: str | None = option(None, flag="--reference", metavar="SCHEDULE",
                                   help="schedule the paired differences (per seed, mean, 95% t-interval) are taken "
                                        "to; trained first at every seed (default: uniform if compared, else the "
                                        "first)")
    until_flat: bool = option(False, flag="--until-flat",
                              help="the reference at the first seed trains until its val loss is flat (spread < 1% "
                                   "of the newest over the last 20% of the steps so far, at eval points after the "
                                   "warmup); every run then trains that many steps, all with the learning-rate "
                                   "schedule of train.steps (train.tokens: the most a run trains)")
    save_models: bool = option(True, flag="--no-save-models", help="do not write each run's model/ folder")
    margin: float | None = option(None, flag="--margin", metavar="NATS",
                                  help="equivalence margin (val loss, nats/token): a schedule whose paired 95% "
                                       "interval lies inside ±NATS is reported equivalent to the reference, a "
                                       "null result stated as firmly as a win")

    def __post_init__(self) -> None:
        if self.seeds < 1:
            raise ConfigError(f"compare.seeds (--seeds) must be at least 1, got {self.seeds}")
        if self.margin is not None and not (math.isfinite(self.margin) and self.margin > 0):  # inf: all equivalent
            raise ConfigError(f"compare.margin (--margin) must be a finite positive loss difference (nats/token), "
                              f"got {self.margin}")


@dataclass
class CompareConfig(RunConfig):
    """``headbudget compare``'s settings: a run config (every run's, schedule and seed aside) and its
    ``compare:`` section, one YAML file (``compare --print_config``) that ``train`` reads too."""

    compare: CompareSection = field(default_factory=CompareSection)

    @classmethod
    def from_run(cls, run: RunConfig, **compare: Any) -> CompareConfig:
        """A comparison whose runs start from ``run``, ``compare`` the fields of its ``compare:`` section (coerced
        and checked as the config file's are; the rest keep ``run``'s section, or the defaults); ``schedules``
        may be a list too (a head-count list among them keeps its commas).

            >>> CompareConfig.from_run(RunConfig(seed=3), schedules=["uniform", "3,3,6,6"], seeds=2).compare.schedules
            'uniform;3,3,6,6'
        """
        if not isinstance(compare.get("schedules", ""), str):
            compare["schedules"] = ";".join(compare["schedules"])
        d = run.to_dict()
        d["compare"] = {**d.get("compare", {}), **compare}
        return cls.from_dict(d, "CompareConfig.from_run")

    def run_config(self) -> RunConfig:
        """The run config every run of the comparison starts from."""
        return RunConfig.from_dict({k: v for k, v in self.to_dict().items() if k != "compare"})


#: the most tokens a run may read: ~30x the largest language-model pretraining runs (~3e13 tokens); more is a typo
MAX_TOKENS = 10**15
#: the most optimizer steps a run may take: ~3 years at 10 steps a second; more is a typo
MAX_STEPS = 10**9


def _e(n: float) -> str:
    """``n`` in two significant digits: ``_e(4.88e26)`` is ``'4.9e26'``."""
    return f"{n:.2g}".replace("e+", "e")


def parse_token_count(value: str, flag: str = "--tokens") -> int:
    """``1M``, ``500k``, ``2e5`` or ``200000`` as a positive number of tokens, at most :data:`MAX_TOKENS`
    (ValueError: one line).

    >>> parse_token_count("1M"), parse_token_count("250k"), parse_token_count("3e4")
    (1000000, 250000, 30000)
    """
    text = str(value).strip().replace("_", "")
    scale = {"k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}.get(text[-1:].lower(), 1)
    try:
        n = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        n = float("nan")
    if not (math.isfinite(n) and n >= 1 and n == int(n)):
        raise ValueError(f"{flag} {value!r}: expected a positive number of tokens, e.g. 1M, 500k or 200000")
    if n > MAX_TOKENS:
        raise ValueError(f"{flag} {value!r}: {_e(n)} tokens, more than any training run reads (at most "
                         f"{_e(MAX_TOKENS)}); a typo in the exponent?")
    return int(n)


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
    cls = type(cfg)
    return cls.from_dict(typed_config.apply_overrides(cls, cfg.to_dict(), overrides), "--set")


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None,
                cls: type[RunConfig] = RunConfig) -> RunConfig:
    """Load a config file (or the defaults when ``path`` is None) and apply overrides; ``cls=CompareConfig``
    also reads the file's ``compare:`` section."""
    return apply_overrides(cls.load(path) if path is not None else cls(), overrides)


def bundled_configs() -> dict[str, Path]:
    """The named configs shipped inside the package (``headbudget/configs/*.yaml``), by name."""
    from importlib.resources import files

    root = Path(str(files("headbudget") / "configs"))
    return {p.stem: p for p in sorted(root.glob("*.yaml"))}


def resolve_config_path(name: str) -> Path:
    """A config file, or the name of a bundled config (``cpu-small``; the README's ``configs/cpu-small.yaml``
    too when there is no such file, so its commands work from a wheel install).

        >>> resolve_config_path("cpu-small").name
        'cpu-small.yaml'
    """
    p = Path(name)
    if p.is_file():
        return p
    bundled = bundled_configs()
    stem = p.name.removesuffix(".yaml")
    if stem in bundled and p.parent in (Path("."), Path("configs")):
        return bundled[stem]
    raise FileNotFoundError(f"config {name!r} not found: not a file, nor a bundled config "
                            f"({', '.join(bundled)})")
