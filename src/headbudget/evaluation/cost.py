"""What a model costs: real parameter count and forward FLOPs per token, for any supported family.

    >>> model_cost(model)                    # doctest: +SKIP
    {'params': 6887040, 'flops_per_token': 20447232, 'context': 256}

Conventions are :mod:`headbudget.accounting`'s (tied embeddings once; FLOPs 2 x every linear layer's
multiply-adds plus the attention products at the full context); other models than headbudget's are counted
from their modules (BERT, GPT-2, Llama-style).
"""

from __future__ import annotations

from typing import Any

from torch import nn


def _context(config: Any) -> int:
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        v = getattr(config, name, None)
        if v:
            return int(v)
    raise ValueError(f"{type(config).__name__}: no context length in the config; give context=")


def _attention_widths(model: nn.Module) -> list[tuple[int, int]]:
    """(query width, value width) = (heads x qk dim, heads x v dim) of every attention layer."""
    widths = []
    for mod in model.modules():
        q, o = getattr(mod, "q_proj", None), getattr(mod, "o_proj", None)
        sa, dense = getattr(mod, "self", None), getattr(getattr(mod, "output", None), "dense", None)
        c_attn, c_proj = getattr(mod, "c_attn", None), getattr(mod, "c_proj", None)
        if isinstance(q, nn.Linear) and isinstance(o, nn.Linear):  # Llama/Mistral/Qwen2
            widths.append((q.out_features, o.in_features))
        elif isinstance(getattr(mod, "qkv_proj", None), nn.Linear) and isinstance(o, nn.Linear) \
                and hasattr(mod, "qk_head_dim"):  # headbudget: one fused q|k|v projection
            widths.append((mod.n_heads * mod.qk_head_dim, o.in_features))
        elif isinstance(getattr(sa, "query", None), nn.Linear) and isinstance(dense, nn.Linear):  # BERT
            widths.append((sa.query.out_features, dense.in_features))
        elif c_attn is not None and c_proj is not None and hasattr(c_attn, "nf"):  # GPT-2 (Conv1D: in x out)
            widths.append((int(c_attn.weight.shape[1]) // 3, int(c_proj.weight.shape[0])))
    return widths


def module_flops_per_token(model: nn.Module, context: int) -> int:
    """Forward FLOPs per token of every ``nn.Linear`` / GPT-2 ``Conv1D`` and attention layer."""
    linear = sum(2 * mod.weight.numel() for mod in model.modules()
                 if isinstance(mod, nn.Linear) or type(mod).__name__ == "Conv1D")
    return linear + sum(2 * context * (q + v) for q, v in _attention_widths(model))


def model_cost(model: nn.Module, context: int | None = None) -> dict[str, int]:
    """``{"params", "flops_per_token", "context"}``; ``context`` defaults to the model's positions."""
    config = model.config
    T = int(context) if context else _context(config)
    params = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    if getattr(config, "model_type", None) == "headbudget":
        from headbudget.accounting import config_cost

        flops = config_cost(config, T).flops_per_token
    else:
        flops = module_flops_per_token(model, T)
    return {"params": int(params), "flops_per_token": int(flops), "context": T}


def model_kv_cache_bytes(model: nn.Module) -> int | None:
    """Bytes one token adds to the model's KV cache at its parameters' dtype, or None for an encoder:
    headbudget decoders by :mod:`headbudget.accounting`, Llama-style and GPT-2 from their k/v projections.

        >>> model_kv_cache_bytes(model)          # doctest: +SKIP
        92160
    """
    config = model.config
    if getattr(config, "model_type", None) == "headbudget":
        from headbudget.accounting import kv_cache_bytes_per_token

        return kv_cache_bytes_per_token(config, next(model.parameters()).dtype)
    size = next(model.parameters()).element_size()
    if not (getattr(config, "is_decoder", False) or type(model).__name__.endswith("ForCausalLM")):
        return None
    elements = 0
    for mod in model.modules():
        k, v = getattr(mod, "k_proj", None), getattr(mod, "v_proj", None)
        if isinstance(k, nn.Linear) and isinstance(v, nn.Linear):
            elements += k.out_features + v.out_features
        c_attn = getattr(mod, "c_attn", None)
        if c_attn is not None and hasattr(c_attn, "nf"):  # GPT-2: q | k | v columns of one Conv1D
            elements += 2 * (int(c_attn.weight.shape[1]) // 3)
    return int(elements * size) if elements else None


__all__ = ["model_cost", "model_kv_cache_bytes", "module_flops_per_token"]
