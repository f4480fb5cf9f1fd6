"""The head adapter as the rest of headbudget sees it: the one interface pruning, compression and analysis use
to read, gate and remove a model's attention heads, whatever its family.

    >>> from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    >>> from headbudget.models.surgery import get_adapter
    >>> model = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", "uniform", vocab_size=64))
    >>> adapter: HeadAdapter = get_adapter(model)           # BERT, GPT-2, Llama/Mistral/Qwen2 or headbudget
    >>> ids = torch.arange(8)[None]                          # one sequence of 8 tokens
    >>> with adapter.set_gate_values({0: [1, 1, 1, 0]}):    # one gate per head, 1.0 = unchanged
    ...     gated = model(ids).logits                        # head 3 of layer 0 off, exactly like removal
    >>> adapter.prune_heads({0: [3]})                         # then really removed
    >>> torch.allclose(model(ids).logits, gated, atol=1e-6), adapter.head_counts()
    (True, [3, 4, 4, 4])
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn


@runtime_checkable
class HeadAdapter(Protocol):
    """Every family's adapter (:func:`headbudget.models.surgery.get_adapter`) provides these and nothing else is
    used outside :mod:`headbudget.models.surgery`."""

    family: str  #: "bert", "gpt2", "llama" or "headbudget"
    empty_layers: bool  #: whether a layer may lose every head (encoders yes, decoders no)
    model: nn.Module

    @property
    def num_layers(self) -> int: ...

    # bookkeeping
    def head_counts(self) -> list[int]: ...
    def kv_head_counts(self) -> list[int]: ...
    def kv_group(self, layer: int) -> list[int]: ...
    def original_heads(self) -> dict[int, list[int]]: ...
    def pruned_heads_record(self) -> dict[int, list[int]]: ...

    # where the heads live
    def attention_module(self, layer: int) -> nn.Module: ...
    def out_proj(self, layer: int) -> nn.Module: ...
    def out_head_dim(self, layer: int) -> int: ...
    def qkv_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
    def head_weight_norms(self) -> list[np.ndarray]: ...

    # gating and attention probabilities
    def gate_hooks(self, gates: list[torch.Tensor]) -> contextlib.AbstractContextManager[list[torch.Tensor]]: ...
    def gates(self) -> contextlib.AbstractContextManager[list[torch.Tensor]]: ...
    def set_gate_values(self, values: Sequence[Any]) -> contextlib.AbstractContextManager[list[torch.Tensor]]: ...
    def eager_attention(self) -> contextlib.AbstractContextManager[None]: ...
    def attention_probs(self, **inputs: Any) -> list[torch.Tensor]: ...

    # removal
    def prune_heads(self, heads: Mapping[int | str, Sequence[int]], **opts: Any) -> None: ...
    def prune_to(self, kept: Mapping[int | str, Sequence[int]], **opts: Any) -> None: ...


__all__ = ["HeadAdapter"]
