"""Training: run configs, the trainer (AdamW, cosine, exact resume, DDP/FSDP) and schedule comparisons.

    >>> from headbudget.train import load_config, train
    >>> # result = train(load_config("configs/quickstart.yaml", ["train.steps=50"]), "runs/qs")
"""

from headbudget.train.config import ConfigError, RunConfig, apply_overrides, load_config, resolve_config_path
from headbudget.train.trainer import Trainer, TrainingDivergedError, TrainResult, build_model, train

__all__ = ["ConfigError", "RunConfig", "apply_overrides", "load_config", "resolve_config_path", "Trainer",
           "TrainingDivergedError", "TrainResult", "build_model", "train"]
