"""Pruned checkpoints: ``save_pretrained`` plus ``kept_heads.json``, re-applied on load."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headbudget.io import atomic_write_text, regular_file
from headbudget.model_files import MODEL_FILES, check_folder_files, json_problem
from headbudget.models.surgery.base import _STATE_ATTR, KEPT_HEADS_FILE
from headbudget.models.surgery.families import LlamaAdapter, get_adapter


def save_pruned(model: nn.Module, out_dir: str | os.PathLike[str], tokenizer: Any = None) -> Path:
    """``save_pretrained`` plus ``kept_heads.json`` (original kept heads per layer, re-applied by :func:`load_pruned`).

    >>> import tempfile
    >>> from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    >>> model = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", "uniform", vocab_size=64))
    >>> out = save_pruned(model, tempfile.mkdtemp())            # then: model = load_pruned(out)
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    adapter = get_adapter(model)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    record: dict[str, Any] = {"family": adapter.family, "architecture": type(model).__name__,
                              "head_counts": adapter.head_counts(),
                              "kept": {str(li): hs for li, hs in adapter.pruned_heads_record().items()}}
    if isinstance(adapter, LlamaAdapter):
        record["query_to_kv"] = {str(li): v for li, v in adapter.query_to_kv().items()}
        record["kv_head_counts"] = adapter.kv_head_counts()
    atomic_write_text(out / KEPT_HEADS_FILE, json.dumps(record, indent=1) + "\n")
    return out


def _load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single = path / "model.safetensors"
    if single.exists():
        return load_file(str(single))
    index = path / "model.safetensors.index.json"
    if index.exists():
        sd: dict[str, torch.Tensor] = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            sd.update(load_file(str(regular_file(path / shard))))  # the index may name any path
        return sd
    raise FileNotFoundError(f"{path}: no model.safetensors (or sharded index) to load")


def load_pruned(model_dir: str | os.PathLike[str], dtype: torch.dtype | None = None) -> nn.Module:
    """Load a model written by :func:`save_pruned`: build it from its config, re-apply the kept heads,
    then load the (already pruned) weights.  A directory without ``kept_heads.json`` loads unpruned."""
    import transformers

    path = Path(model_dir)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json (not a saved model directory)")
    check_folder_files(path, MODEL_FILES)  # a FIFO among them would block the reading forever
    record_path = path / KEPT_HEADS_FILE
    if record_path.exists() and (problem := json_problem(record_path)):
        raise ValueError(problem)
    record = json.loads(record_path.read_text()) if record_path.exists() else None
    config = transformers.AutoConfig.from_pretrained(path)
    arch = (record or {}).get("architecture") or (config.architectures or [None])[0]
    if getattr(config, "model_type", None) == "headbudget" or (record or {}).get("family") == "headbudget":
        from headbudget.models import HeadBudgetForCausalLM

        model = HeadBudgetForCausalLM.from_pretrained(path, dtype=dtype)
        if record is not None:
            model.__dict__[_STATE_ATTR] = {"kept": {int(li): list(v) for li, v in record["kept"].items()}}
        return model
    cls = getattr(transformers, arch or "", None)
    if cls is None:
        raise ValueError(f"{path}: unknown architecture {arch!r} in config/kept_heads.json")
    if record is None:
        return cls.from_pretrained(path, dtype=dtype)
    model = cls._from_config(config)
    adapter = get_adapter(model)
    try:
        adapter.prune_to({int(li): v for li, v in record["kept"].items()})
    except ValueError as exc:
        raise ValueError(f"{record_path}: {exc}") from None
    result = model.load_state_dict(_load_state_dict(path), strict=False)
    tied_keys = getattr(model, "_tied_weights_keys", None) or {}
    tied = set(tied_keys) if isinstance(tied_keys, (dict, list, set, tuple)) else set()
    missing = [k for k in result.missing_keys if k not in tied and not k.endswith("position_ids")]
    if missing or result.unexpected_keys:
        raise ValueError(f"{path}: weights do not match the pruned {arch}: missing {missing[:5]}, "
                         f"unexpected {list(result.unexpected_keys)[:5]}")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    if dtype is not None:
        model.to(dtype)
    return model.eval()
