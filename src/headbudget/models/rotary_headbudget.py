"""Rotary position frequencies of the headbudget model, computed as transformers computes them.

Copied next to every saved checkpoint with ``modeling_headbudget.py`` (which imports it).  Imports torch
only (transformers for the scaled rope types).

    >>> from headbudget.models.rotary_headbudget import default_inv_freq
    >>> default_inv_freq(1e4, 4)
    tensor([1.0000, 0.0100])
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .configuration_headbudget import HeadBudgetConfig


# Rope types whose frequencies are fixed (computed once, as transformers does); "dynamic" and "longrope"
# change with the sequence length, and the rest are not tested against transformers.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_problem(params: dict | None) -> str | None:
    """Why the rotary ``rope_parameters`` cannot work here (one line), or None when they can.

    >>> rope_problem({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    "rope_type='dynamic' is not supported (supported: default, linear, llama3, yarn)"
    """
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        return f"rope_type={rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
    factor = params.get("partial_rotary_factor", 1.0)
    if factor != 1.0:  # every head dimension is rotated here
        return f"partial_rotary_factor={factor!r} is not supported (rotary over the whole head only)"
    return None


def default_inv_freq(base: float, head_dim: int) -> torch.Tensor:
    """Transformers' "default" rotary inverse frequencies: ``default_inv_freq(1e4, 4)`` is ``[1.0, 0.01]``."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rotary_inv_freq(config: HeadBudgetConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for one head width, computed as transformers does."""
    params = dict(config.rope_parameters)
    if problem := rope_problem(params):
        raise ValueError(problem)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return default_inv_freq(float(params["rope_theta"]), head_dim), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    shim = LlamaConfig(hidden_size=config.n_embd, num_attention_heads=1, head_dim=head_dim,
                       max_position_embeddings=config.n_positions, rope_parameters=params)
    return ROPE_INIT_FUNCTIONS[rope_type](shim, None)
