"""Do a model folder's saved weights fit its ``config.json``?  Read from the safetensors headers alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class WeightsMismatchError(ValueError):
    """Saved weights whose shapes do not fit the model their config describes (names file and tensor)."""


def check_weight_shapes(folder: Path, config: Any) -> None:
    """Compare each tensor's shape in ``folder``'s ``*.safetensors`` headers with the model ``config`` builds
    on the meta device: a corrupt file, or a config edited to another layout, is one ValueError naming the
    file and the first tensor (instead of transformers' multi-line load report and a RuntimeError).

    >>> import tempfile
    >>> from transformers import AutoConfig
    >>> from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    >>> model = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", "uniform", vocab_size=64))
    >>> model.save_pretrained(folder := Path(tempfile.mkdtemp()))
    >>> check_weight_shapes(folder, AutoConfig.from_pretrained(folder))     # they fit: nothing to say
    """
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return
    from safetensors import SafetensorError, safe_open

    expected: dict[str, tuple[int, ...]] | None = None
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                shapes = {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}  # noqa: SIM118
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{f}: not a readable safetensors file ({exc})") from None
        if expected is None:
            from transformers import AutoModelForCausalLM

            try:
                with torch.device("meta"):
                    model = AutoModelForCausalLM.from_config(config)
            except Exception:  # an architecture from_config cannot build: from_pretrained says why
                return
            expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        for key, shape in shapes.items():
            if key in expected and expected[key] != shape:
                raise WeightsMismatchError(
                    f"{f}: tensor {key} has shape {list(shape)}, but {folder / 'config.json'} describes a model "
                    f"whose {key} is {list(expected[key])}; the config does not belong to these weights")


__all__ = ["WeightsMismatchError", "check_weight_shapes"]
