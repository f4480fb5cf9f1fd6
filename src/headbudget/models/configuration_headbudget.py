"""Configuration of a headbudget decoder: imports ``transformers`` only.

Copied verbatim next to every saved checkpoint (with ``modeling_headbudget.py``) so it opens where
headbudget is not installed; ``headbudget.models.HeadBudgetConfig`` subclasses it (presets, schedule view).
The attention layout is ``schedule``: ``{"d_model": 768, "layers": [{"n_heads": 12, "head_dim": 64,
"n_kv_heads": 4, "qk_head_dim": 64, "v_head_dim": 64, "kv_groups": [3, 3, 4, 2]}, ...]}``; ``kv_groups``
(query heads per key/value head) only appears when the groups are unequal.  Block options (README.md)
make it GPT-2 (the default) or Llama/Mistral/Qwen2 (``norm="rmsnorm"``, ``mlp="gated_silu"``,
``position="rotary"``).

    >>> cfg = HeadBudgetConfig(schedule={"d_model": 64, "layers": [{"n_heads": 4, "head_dim": 16}] * 2},
    ...                        vocab_size=100, norm="rmsnorm", mlp="gated_silu", position="rotary")
    >>> cfg.layer_specs()[0]["n_kv_heads"], cfg.intermediate_sizes()
    (4, [256, 256])
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

_LAYER_KEYS = ("n_heads", "head_dim", "n_kv_heads", "qk_head_dim", "v_head_dim", "kv_groups")
_CHOICES = {"norm": ("layernorm", "rmsnorm"), "mlp": ("gelu", "gated_silu"), "position": ("learned", "rotary")}
# The MLP activations each ``mlp`` kind runs (HF names): the tanh GELU of GPT-2 under its three HF names, the
# exact (erf) GELU of BERT and nanoGPT, SiLU for the gated MLP.
ACTIVATIONS = {"gelu": ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu"), "gated_silu": ("silu",)}
_DEFAULT_SCHEDULE = {"d_model": 768, "layers": [{"n_heads": 12, "head_dim": 64}] * 12}


def normalize_layer(spec: dict[str, Any], index: int = 0) -> dict[str, Any]:
    """Fill a layer's defaults and check its shape; errors name the layer and the value."""
    if unknown := set(spec) - set(_LAYER_KEYS):
        raise ValueError(f"layer {index}: unknown schedule field(s) {sorted(unknown)}")
    s = {"n_heads": spec.get("n_heads"), "head_dim": spec.get("head_dim")}
    for key, default in (("n_kv_heads", "n_heads"), ("qk_head_dim", "head_dim"), ("v_head_dim", "head_dim")):
        s[key] = spec.get(key) or s[default]
    for key, value in s.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"layer {index}: {key} must be a positive integer, got {value!r}")
    groups = spec.get("kv_groups")
    if groups is not None:
        groups = [int(g) for g in groups]
        if len(groups) != s["n_kv_heads"] or sum(groups) != s["n_heads"] or min(groups) < 1:
            raise ValueError(f"layer {index}: kv_groups {groups} must list {s['n_kv_heads']} positive sizes "
                             f"summing to n_heads={s['n_heads']}")
        if len(set(groups)) == 1:  # equal groups are plain grouped-query attention
            groups = None
    elif s["n_heads"] % s["n_kv_heads"]:
        raise ValueError(f"layer {index}: n_heads={s['n_heads']} is not divisible by "
                         f"n_kv_heads={s['n_kv_heads']} (give kv_groups for unequal groups)")
    s["kv_groups"] = groups
    return s


class HeadBudgetConfig(PretrainedConfig):
    model_type = "headbudget"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    attribute_map = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer",
                     "max_position_embeddings": "n_positions"}

    def __init__(
        self, schedule: dict[str, Any] | Any = None, vocab_size: int = 50257, n_positions: int = 1024,
        dropout: float = 0.0, bias: bool = True, qkv_bias: bool | None = None, o_bias: bool | None = None,
        mlp_bias: bool | None = None, norm: str = "layernorm", mlp: str = "gelu", mlp_ratio: float = 4,
        intermediate_size: int | list[int] | None = None, hidden_act: str | None = None,
        position: str = "learned", rope_parameters: dict[str, Any] | None = None,
        attention_window: int | None = None, layer_norm_epsilon: float = 1e-5,
        initializer_range: float = 0.02, family: str = "gpt2",
        tie_word_embeddings: bool = True, use_cache: bool = True, bos_token_id: int | None = None,
        eos_token_id: int | None = None, pad_token_id: int | None = None, **kwargs: Any,
    ) -> None:
        schedule = _DEFAULT_SCHEDULE if schedule is None else schedule
        if hasattr(schedule, "to_dict"):  # a headbudget HeadSchedule
            schedule = schedule.to_dict()
        layers = [normalize_layer(dict(s), i) for i, s in enumerate(schedule["layers"])]
        if not layers:
            raise ValueError("a schedule needs at least one layer")
        self.schedule = dict(schedule, layers=[_compact(s) for s in layers])
        self.n_embd = int(schedule["d_model"])
        self.n_layer = len(layers)
        for option, value in (("norm", norm), ("mlp", mlp), ("position", position)):
            if value not in _CHOICES[option]:
                raise ValueError(f"{option}={value!r} is not one of {', '.join(_CHOICES[option])}")
        self.vocab_size, self.n_positions, self.dropout, self.bias = vocab_size, n_positions, dropout, bias
        self.qkv_bias = bias if qkv_bias is None else qkv_bias
        self.o_bias = bias if o_bias is None else o_bias
        self.mlp_bias = bias if mlp_bias is None else mlp_bias
        self.norm, self.mlp, self.position = norm, mlp, position
        self.mlp_ratio, self.intermediate_size = mlp_ratio, intermediate_size
        self.hidden_act = hidden_act or ACTIVATIONS[mlp][0]
        if self.hidden_act not in ACTIVATIONS[mlp]:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not one of {', '.join(ACTIVATIONS[mlp])} "
                             f"(mlp={mlp!r})")
        if position == "rotary" and rope_parameters is None:
            rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        self.rope_parameters = rope_parameters if position == "rotary" else None
        self.attention_window, self.layer_norm_epsilon = attention_window, layer_norm_epsilon
        self.initializer_range, self.family, self.use_cache = initializer_range, family, use_cache
        # HF tooling reads one head count; report the largest layer's (the schedule is the truth).
        self.num_attention_heads = max(s["n_heads"] for s in layers)
        self.num_key_value_heads = max(s["n_kv_heads"] for s in layers)
        for derived in ("n_embd", "n_layer", "num_attention_heads", "num_key_value_heads", "hidden_size",
                        "num_hidden_layers"):
            kwargs.pop(derived, None)
        kwargs.setdefault("auto_map", {"AutoConfig": "configuration_headbudget.HeadBudgetConfig",
                                       "AutoModelForCausalLM": "modeling_headbudget.HeadBudgetForCausalLM"})
        super().__init__(tie_word_embeddings=tie_word_embeddings, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs)

    def layer_specs(self) -> list[dict[str, Any]]:
        """Every layer's attention layout with defaults filled in (``kv_groups`` None when equal)."""
        return [normalize_layer(s, i) for i, s in enumerate(self.schedule["layers"])]

    def intermediate_sizes(self) -> list[int]:
        """MLP hidden width of every layer."""
        size = self.intermediate_size
        if size is None:
            return [int(self.mlp_ratio * self.n_embd)] * self.n_layer
        if isinstance(size, int):
            return [size] * self.n_layer
        if len(size) != self.n_layer:
            raise ValueError(f"intermediate_size lists {len(size)} layers, the model has {self.n_layer}")
        return [int(s) for s in size]


def _compact(spec: dict[str, Any]) -> dict[str, Any]:
    """A layer dict without fields equal to their defaults (short, stable config.json)."""
    out = {"n_heads": spec["n_heads"], "head_dim": spec["head_dim"], "n_kv_heads": spec["n_kv_heads"]}
    for key in ("qk_head_dim", "v_head_dim"):
        if spec[key] != spec["head_dim"]:
            out[key] = spec[key]
    if spec["kv_groups"] is not None:
        out["kv_groups"] = list(spec["kv_groups"])
    return out
