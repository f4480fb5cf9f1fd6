"""Training: run configs, the one training loop (:mod:`headbudget.train.loop`), the trainer (exact resume,
DDP/FSDP2) and schedule comparisons.

    >>> from headbudget.train import load_config, train
    >>> # result = train(load_config("configs/quickstart.yaml", ["train.steps=50"]), "runs/qs")
"""

from typing import Any

from headbudget.train.config import RunConfig, apply_overrides, load_config, resolve_config_path
from headbudget.typed_config import ConfigError

__all__ = ["ConfigError", "RunConfig", "apply_overrides", "load_config", "resolve_config_path", "Trainer",
           "TrainingDivergedError", "TrainResult", "build_model", "train"]

_TRAINER = {"Trainer", "TrainResult", "build_model", "train"}


def __getattr__(name: str) -> Any:
    # the trainer (torch) loads on first use, so reading configs (``headbudget.train.config``) stays light
    if name in _TRAINER or name == "TrainingDivergedError":  # the error: the loop alone, not transformers
        from importlib import import_module

        return getattr(import_module(f"headbudget.train.{'trainer' if name in _TRAINER else 'loop'}"), name)
    raise AttributeError(f"module 'headbudget.train' has no attribute {name!r}")
