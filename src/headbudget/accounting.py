"""Exact parameter and FLOP accounting from a schedule.

Conventions (stated because papers differ):
- parameters count every weight and bias of the headbudget/GPT-2 decoder: token and position
  embeddings, per layer two LayerNorms, q/k/v/o projections sized from the layer's schedule entry,
  the 4x GELU MLP, the final LayerNorm; the output head is tied to the token embedding.
  ``non_embedding`` = total - token embedding - position embedding.
- forward FLOPs per token count 2 per multiply-add of every linear layer (including the tied
  output head), plus the attention-score (QK^T) and attention-value products at the full context
  length T (no causal discount, as in PaLM/nanoGPT's MFU estimate): ``2*T*H*qk_dim + 2*T*H*v_dim``.
  LayerNorms, softmax, GELU and biases are not counted.

    >>> from headbudget.schedules import prism, uniform
    >>> count_parameters(prism(12, 768), 50257, 1024).total == count_parameters(uniform(12, 768, 12), 50257, 1024).total
    True
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from headbudget.schedules import HeadSchedule, LayerSpec


@dataclass(frozen=True)
class LayerParams:
    attention: int
    mlp: int
    norms: int

    @property
    def total(self) -> int:
        return self.attention + self.mlp + self.norms


@dataclass(frozen=True)
class ParameterCount:
    total: int
    embedding: int
    non_embedding: int
    attention: int
    mlp: int
    per_layer: tuple[LayerParams, ...]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["per_layer"] = [dict(asdict(p), total=p.total) for p in self.per_layer]
        return d


def _qkv_rows(spec: LayerSpec) -> int:
    """Output features of a layer's q, k and v projections together."""
    return spec.n_heads * spec.qk_head_dim + spec.n_kv_heads * (spec.qk_head_dim + spec.v_head_dim)


def attention_parameters(spec: LayerSpec, d_model: int, bias: bool = True) -> int:
    rows = _qkv_rows(spec)
    return d_model * rows + spec.n_heads * spec.v_head_dim * d_model + ((rows + d_model) if bias else 0)


def mlp_parameters(d_model: int, mlp_ratio: int = 4, bias: bool = True) -> int:
    hidden = mlp_ratio * d_model
    return 2 * d_model * hidden + ((hidden + d_model) if bias else 0)


def count_parameters(schedule: HeadSchedule, vocab_size: int, n_positions: int, *, bias: bool = True,
                     mlp_ratio: int = 4) -> ParameterCount:
    """Count parameters of a headbudget decoder with this schedule (matches ``model.num_parameters()``)."""
    d = schedule.d_model
    norm = 2 * d if bias else d  # LayerNorm weight (+ bias)
    mlp = mlp_parameters(d, mlp_ratio, bias)
    per_layer = tuple(LayerParams(attention_parameters(s, d, bias), mlp, 2 * norm) for s in schedule.layers)
    embedding = vocab_size * d + n_positions * d
    total = embedding + sum(p.total for p in per_layer) + norm
    return ParameterCount(total=total, embedding=embedding, non_embedding=total - embedding,
                          attention=sum(p.attention for p in per_layer), mlp=sum(p.mlp for p in per_layer),
                          per_layer=per_layer)


def attention_flops_per_token(spec: LayerSpec, d_model: int, context: int) -> int:
    """Forward FLOPs per token of one attention layer: projections plus score and value products."""
    proj = 2 * d_model * (_qkv_rows(spec) + spec.n_heads * spec.v_head_dim)
    return proj + 2 * context * spec.n_heads * (spec.qk_head_dim + spec.v_head_dim)  # scores and values


def flops_per_token(schedule: HeadSchedule, vocab_size: int, context: int, *,
                    mlp_ratio: int = 4) -> dict[str, int | list[int]]:
    """Forward FLOPs per token at context length ``context``: total, per layer, and the output head."""
    d = schedule.d_model
    per_layer = [attention_flops_per_token(s, d, context) + 4 * d * mlp_ratio * d for s in schedule.layers]
    head = 2 * d * vocab_size
    return {"total": sum(per_layer) + head, "per_layer": per_layer, "lm_head": head}


@dataclass(frozen=True)
class ModelCost:
    """Parameters (tied weights once) and forward FLOPs per token at ``context`` of a decoder config."""

    params: int
    flops_per_token: int
    context: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def config_cost(config, context: int | None = None) -> ModelCost:
    """Cost of any headbudget decoder config (GPT-2 or Llama-family blocks, pruned or compressed layouts).

    Same conventions as :func:`count_parameters`/:func:`flops_per_token`, plus the block options:
    gated MLPs have three matrices, RMSNorm has no bias, rotary models have no position table and an
    untied output head counts its own parameters.

        >>> from headbudget.models import HeadBudgetConfig
        >>> config_cost(HeadBudgetConfig.from_preset("gpt2-124m", "prism")).params
        124439808
    """
    d, vocab = config.n_embd, config.vocab_size
    context = config.n_positions if context is None else context
    specs = [LayerSpec(**s) for s in config.layer_specs()]
    gated = config.mlp == "gated_silu"
    n_mat = 3 if gated else 2
    norm = d * (2 if (config.norm == "layernorm" and config.bias) else 1)
    params = vocab * d + norm + (0 if config.tie_word_embeddings else vocab * d)
    params += config.n_positions * d if config.position == "learned" else 0
    flops = 2 * d * vocab
    for spec, hidden in zip(specs, config.intermediate_sizes()):
        rows = _qkv_rows(spec)
        params += attention_parameters(spec, d, bias=False) + 2 * norm
        params += rows * config.qkv_bias + d * config.o_bias
        params += n_mat * d * hidden + config.mlp_bias * ((2 if gated else 1) * hidden + d)
        flops += attention_flops_per_token(spec, d, context) + 2 * n_mat * d * hidden
    return ModelCost(params=int(params), flops_per_token=int(flops), context=int(context))


def kv_cache_bytes_per_token(config, dtype="float32") -> int:
    """Bytes one token adds to the KV cache of a headbudget decoder: every layer stores its key heads
    (``n_kv_heads x qk_head_dim``) and value heads (``n_kv_heads x v_head_dim``) at the element size of
    ``dtype`` (a torch dtype or its name).

        >>> from headbudget.models import HeadBudgetConfig
        >>> cfg = HeadBudgetConfig(schedule={"d_model": 64, "layers": [{"n_heads": 4, "head_dim": 16,
        ...                                                             "n_kv_heads": 2}] * 3})
        >>> kv_cache_bytes_per_token(cfg, "bfloat16")   # 3 layers x 2 (k, v) x 2 heads x 16 x 2 bytes
        384
    """
    import torch

    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype name (e.g. float32, bfloat16)")
        dtype = resolved
    size = torch.empty((), dtype=dtype).element_size()
    per_token = sum(s["n_kv_heads"] * (s["qk_head_dim"] + s["v_head_dim"]) for s in config.layer_specs())
    return int(per_token * size)
