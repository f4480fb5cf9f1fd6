"""What a run is built from: its prepared data, the model (fresh from the config's schedule, or ``model.init``
converted), its vocabulary, the tokenizer spec and the learning-rate schedule of the config (the optimizer:
train.loop).

    >>> from headbudget.train import RunConfig
    >>> from headbudget.train.setup import build_model, lr_at
    >>> cfg = RunConfig.from_dict({"model": {"preset": "cpu-tiny", "schedule": "prism"}})
    >>> build_model(cfg, 512).head_counts                                   # doctest: +SKIP
    >>> lr_at(0, cfg) < lr_at(cfg.train.warmup_steps, cfg)                  # doctest: +SKIP
"""

from __future__ import annotations

import math

from headbudget.data.prepare import PreparedData, prepare_data
from headbudget.schedule_spec import schedule_from_spec
from headbudget.schedules import HeadSchedule, ModelPreset, get_preset
from headbudget.train.config import RunConfig
from headbudget.train.loop import distributed_env, init_distributed, training_device, warmup_cosine


def model_preset(cfg: RunConfig) -> ModelPreset:
    """The config's preset with its shape overrides (``model.n_layers`` etc.) applied."""
    from dataclasses import replace

    p = get_preset(cfg.model.preset)
    changes = {k: getattr(cfg.model, k) for k in ("n_layers", "d_model", "n_heads", "prism_max_head_dim",
                                                    "prism_min_head_dim") if getattr(cfg.model, k) is not None}
    return replace(p, **changes) if changes else p


def build_schedule(cfg: RunConfig) -> HeadSchedule:
    return schedule_from_spec(cfg.model.schedule, model_preset(cfg))


def prepare_for(cfg: RunConfig, progress: bool = True, force: bool = False) -> PreparedData:
    """The config's ``data:`` section tokenized into its cache, or read back from it (``force``: rebuilt)."""
    d = cfg.data
    return prepare_data(d.source, data_tokenizer_spec(cfg), d.cache_dir, seed=d.seed, val_fraction=d.val_fraction,
                        max_chars=d.max_chars, split_blank_lines=d.split_blank_lines, progress=progress,
                        force=force)


def prepare_shared(cfg: RunConfig) -> PreparedData:
    """:func:`prepare_for` once for all processes: under torchrun the first prepares the cache while the
    others wait, then they read it."""
    rank, world, local_rank = distributed_env()
    if world == 1:
        return prepare_for(cfg, cfg.train.progress)
    import torch.distributed as dist

    init_distributed(training_device(cfg.train.device, world, local_rank), world)
    data = prepare_for(cfg, cfg.train.progress) if rank == 0 else None
    dist.barrier()
    return data or prepare_for(cfg, progress=False)


def data_tokenizer_spec(cfg: RunConfig) -> str:
    """The data tokenizer spec; ``"model"`` means the tokenizer saved at the root of ``model.init``."""
    if cfg.data.tokenizer != "model":
        return cfg.data.tokenizer
    if not cfg.model.init:
        raise ValueError("data.tokenizer=model needs model.init (the model whose tokenizer to use)")
    from headbudget.loading import HF_TOKENIZER_FILES, resolve_model

    src = resolve_model(cfg.model.init)
    if not src.is_local or not any((src.where / f).is_file() for f in HF_TOKENIZER_FILES):
        raise ValueError(f"{cfg.model.init}: no tokenizer saved with the model; set data.tokenizer "
                         "(e.g. --set data.tokenizer=hf:DIR)")
    return f"hf:{src.where}"


def resolve_vocab_size(cfg: RunConfig, tokenizer_vocab: int) -> int:
    if cfg.model.init:  # the model's own vocabulary; build_model checks the tokenizer fits it
        return tokenizer_vocab
    if cfg.model.vocab_size is None:
        return int(math.ceil(tokenizer_vocab / 64) * 64)
    if cfg.model.vocab_size < tokenizer_vocab:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                         f"{tokenizer_vocab} tokens")
    return cfg.model.vocab_size


def build_model(cfg: RunConfig, vocab_size: int):
    """A freshly initialised :class:`HeadBudgetForCausalLM` for the config (seed the RNG first),
    or the model of ``model.init`` converted to headbudget (pruned layouts kept as they are)."""
    from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM

    if cfg.model.init:
        from headbudget.loading import load_model

        model = load_model(cfg.model.init, kind="causal", as_headbudget=True).float().train()
        if model.config.n_positions < cfg.train.context:
            raise ValueError(f"{cfg.model.init}: the model has {model.config.n_positions} positions, "
                             f"shorter than train.context={cfg.train.context}")
        if model.config.vocab_size < vocab_size:
            raise ValueError(f"{cfg.model.init}: the tokenizer has {vocab_size} tokens but the model's "
                             f"vocabulary is {model.config.vocab_size}")
        model.config.dropout = cfg.model.dropout
        return model

    n_pos = cfg.model.n_positions or cfg.train.context
    if n_pos < cfg.train.context:
        raise ValueError(f"model.n_positions={n_pos} is shorter than train.context={cfg.train.context}")
    mcfg = HeadBudgetConfig(schedule=build_schedule(cfg), vocab_size=vocab_size, n_positions=n_pos,
                            dropout=cfg.model.dropout, bias=cfg.model.bias, hidden_act=cfg.model.hidden_act)
    return HeadBudgetForCausalLM(mcfg)


def lr_at(step: int, cfg: RunConfig) -> float:
    """The config's :func:`~headbudget.train.loop.warmup_cosine` at ``step``."""
    t = cfg.train
    return warmup_cosine(t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)(step)
