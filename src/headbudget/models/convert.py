"""Lossless conversion between Hugging Face decoders and the headbudget model, both ways.

``to_headbudget`` turns GPT-2, Llama, Mistral and Qwen2 models into :class:`HeadBudgetForCausalLM` with
identical logits; ``to_hf`` exports a uniform headbudget model back to its family's transformers class.

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> hf = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=100))
    >>> hb = to_headbudget(hf)                 # HeadBudgetForCausalLM, family "llama"
    >>> hb.prune_heads({0: [1]})               # leaves kv groups of 1 and 2 query heads
    >>> back = to_hf(to_headbudget(hf))        # LlamaForCausalLM again
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from headbudget.models.config import HeadBudgetConfig
from headbudget.models.configuration_headbudget import ACTIVATIONS
from headbudget.models.modeling import HeadBudgetForCausalLM
from headbudget.models.rotary_headbudget import rope_problem

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
FAMILIES = ("gpt2", *LLAMA_FAMILY)


class ConversionError(ValueError):
    """A model the converter cannot represent exactly; the message names the field and its value."""


# ----------------------------------------------------------------------------- into headbudget
def config_from_hf(hf_config: Any) -> HeadBudgetConfig:
    """The headbudget config that reproduces a GPT-2 / Llama / Mistral / Qwen2 config exactly."""
    family = getattr(hf_config, "model_type", None)
    if family == "gpt2":
        return _config_from_gpt2(hf_config)
    if family in LLAMA_FAMILY:
        return _config_from_llama(hf_config, family)
    raise ConversionError(f"model_type {family!r} cannot be converted to headbudget (supported: {', '.join(FAMILIES)})")


def _config_from_gpt2(c: Any) -> HeadBudgetConfig:
    act = getattr(c, "activation_function", "gelu_new")
    if act not in ACTIVATIONS["gelu"]:
        raise ConversionError(f"GPT-2 activation_function={act!r} is not supported (one of "
                              f"{', '.join(ACTIVATIONS['gelu'])})")
    if getattr(c, "n_inner", None) not in (None, 4 * c.n_embd):
        raise ConversionError(f"GPT-2 n_inner={c.n_inner} is not 4 x n_embd")
    if getattr(c, "scale_attn_by_inverse_layer_idx", False) or not getattr(c, "scale_attn_weights", True):
        raise ConversionError("GPT-2 attention scaling other than 1/sqrt(head_dim) is not supported")
    if getattr(c, "add_cross_attention", False):
        raise ConversionError("GPT-2 add_cross_attention=True is not supported (a decoder-only model has none)")
    layer = {"n_heads": c.n_head, "head_dim": c.n_embd // c.n_head}
    return HeadBudgetConfig(
        schedule={"d_model": c.n_embd, "layers": [layer] * c.n_layer, "name": "gpt2", "head_dim_multiple": 1},
        vocab_size=c.vocab_size, n_positions=c.n_positions, dropout=0.0, bias=True,
        hidden_act=act, layer_norm_epsilon=c.layer_norm_epsilon, family="gpt2",
        tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=getattr(c, "pad_token_id", None),
    )


def _config_from_llama(c: Any, family: str) -> HeadBudgetConfig:
    if getattr(c, "hidden_act", "silu") != "silu":
        raise ConversionError(f"{family} hidden_act={c.hidden_act!r} is not supported (gated SiLU only)")
    window = None
    if family == "mistral":
        window = getattr(c, "sliding_window", None)
    elif family == "qwen2" and getattr(c, "use_sliding_window", False):
        raise ConversionError("qwen2 use_sliding_window=True (per-layer windows) is not supported")
    rope = dict(getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    if getattr(c, "partial_rotary_factor", None) not in (None, 1.0):  # a config that keeps it outside rope
        rope.setdefault("partial_rotary_factor", c.partial_rotary_factor)
    if problem := rope_problem(rope):
        raise ConversionError(f"{family} {problem}")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    n_kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    layer = {"n_heads": c.num_attention_heads, "head_dim": head_dim, "n_kv_heads": n_kv}
    attn_bias = bool(getattr(c, "attention_bias", False))
    qkv_bias, o_bias = (True, False) if family == "qwen2" else (attn_bias, attn_bias)
    return HeadBudgetConfig(
        schedule={"d_model": c.hidden_size, "layers": [layer] * c.num_hidden_layers, "name": family,
                  "neutral": c.num_attention_heads * head_dim == c.hidden_size, "head_dim_multiple": 1},
        vocab_size=c.vocab_size, n_positions=c.max_position_embeddings, dropout=float(c.attention_dropout or 0.0),
        bias=False, qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=bool(getattr(c, "mlp_bias", False)),
        norm="rmsnorm", mlp="gated_silu", intermediate_size=c.intermediate_size, position="rotary",
        rope_parameters=rope, attention_window=window, layer_norm_epsilon=c.rms_norm_eps,
        initializer_range=c.initializer_range, family=family, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=getattr(c, "pad_token_id", None),
    )


def _gpt2_to_headbudget_state(sd: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    out = {f"transformer.{k}": sd[f"transformer.{k}"] for k in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")}
    if "lm_head.weight" in sd:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[p + f"{ln}.weight"], out[p + f"{ln}.bias"] = sd[p + f"{ln}.weight"], sd[p + f"{ln}.bias"]
        # GPT-2's Conv1D stores [in, out]; its fused c_attn already orders the rows q | k | v.
        for ours, theirs in (("attn.qkv_proj", "attn.c_attn"), ("attn.o_proj", "attn.c_proj"),
                             ("mlp.c_fc", "mlp.c_fc"), ("mlp.c_proj", "mlp.c_proj")):
            out[p + ours + ".weight"] = sd[p + theirs + ".weight"].t().contiguous()
            out[p + ours + ".bias"] = sd[p + theirs + ".bias"]
    return out


def _llama_to_headbudget_state(sd: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    out = {"transformer.wte.weight": sd["model.embed_tokens.weight"], "transformer.ln_f.weight": sd["model.norm.weight"]}
    if "lm_head.weight" in sd:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(n_layer):
        src, dst = f"model.layers.{i}.", f"transformer.h.{i}."
        out[dst + "ln_1.weight"] = sd[src + "input_layernorm.weight"]
        out[dst + "ln_2.weight"] = sd[src + "post_attention_layernorm.weight"]
        for t in ("weight", "bias"):
            parts = [src + f"self_attn.{p}_proj.{t}" for p in "qkv"]
            if parts[0] in sd:
                out[dst + f"attn.qkv_proj.{t}"] = torch.cat([sd[n] for n in parts])
            for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
                if f"{src}{name}.{t}" in sd:
                    out[f"{dst}{name.replace('self_attn', 'attn')}.{t}"] = sd[f"{src}{name}.{t}"]
    return out


def _assemble(config: HeadBudgetConfig, sd: dict[str, torch.Tensor]) -> HeadBudgetForCausalLM:
    """A headbudget model built on the meta device whose tensors are ``sd``'s (no random init, no copy)."""
    with torch.device("meta"):
        hb = HeadBudgetForCausalLM(config)
    missing, unexpected = hb.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ConversionError(f"{config.family} conversion mismatch: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        hb.lm_head.weight = hb.transformer.wte.weight
    left = [n for n, t in (*hb.named_parameters(), *hb.named_buffers()) if t.is_meta]
    if left and not any(t.is_meta for t in sd.values()):  # (a model on the meta device converts to one)
        raise ConversionError(f"{config.family} conversion left {left} without weights")
    return hb.eval()


@torch.no_grad()
def to_headbudget(model: nn.Module) -> HeadBudgetForCausalLM:
    """Convert a transformers decoder (GPT-2, Llama, Mistral, Qwen2) into a headbudget model; identity on one.

    The result keeps the input's dtype and device and shares its tensors where the layout is the same
    (~1.1x the model's bytes, ``benchmarks/convert_memory.py``): an in-place update of one shows in both.
    """
    if isinstance(model, HeadBudgetForCausalLM):
        return model
    if getattr(model.config, "model_type", None) == "headbudget":  # opened through trust_remote_code
        return _assemble(HeadBudgetConfig.from_dict(model.config.to_dict()), model.state_dict())
    config = config_from_hf(model.config)
    convert = _gpt2_to_headbudget_state if config.family == "gpt2" else _llama_to_headbudget_state
    return _assemble(config, convert(model.state_dict(), config.n_layer))


# ----------------------------------------------------------------------------- back to transformers
def _uniform_layout(config: HeadBudgetConfig) -> dict[str, Any]:
    layers = config.layer_specs()
    first = layers[0]
    for i, spec in enumerate(layers):
        if spec != first:
            raise ConversionError(
                f"layer {i} has layout {spec}, layer 0 has {first}: only a uniform schedule exports to the "
                f"plain {config.family} class (keep the headbudget checkpoint; it opens with trust_remote_code)"
            )
    if first["kv_groups"] is not None or first["qk_head_dim"] != first["head_dim"] or \
            first["v_head_dim"] != first["head_dim"]:
        raise ConversionError(f"layer 0 layout {first} (unequal groups or reduced widths) has no {config.family} form")
    return first


def _require(config: HeadBudgetConfig, **expected: Any) -> None:
    for key, value in expected.items():
        if getattr(config, key) != value:
            raise ConversionError(f"{key}={getattr(config, key)!r}, but the {config.family} class needs {value!r}")


def hf_config_from(config: HeadBudgetConfig) -> Any:
    """The transformers config of the plain class for a uniform headbudget config."""
    layer = _uniform_layout(config)
    common = {"vocab_size": config.vocab_size, "tie_word_embeddings": config.tie_word_embeddings,
              "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
              "pad_token_id": config.pad_token_id}
    if config.family == "gpt2":
        from transformers import GPT2Config

        _require(config, norm="layernorm", mlp="gelu", position="learned", qkv_bias=True, o_bias=True,
                 mlp_bias=True, bias=True)
        if layer["n_heads"] * layer["head_dim"] != config.n_embd or layer["n_kv_heads"] != layer["n_heads"]:
            raise ConversionError(f"layer layout {layer} has no GPT-2 form (needs n_heads x head_dim == d_model, MHA)")
        if config.intermediate_sizes() != [4 * config.n_embd] * config.n_layer:
            raise ConversionError("GPT-2 needs a 4 x d_model MLP in every layer")
        return GPT2Config(n_layer=config.n_layer, n_embd=config.n_embd, n_head=layer["n_heads"],
                          n_positions=config.n_positions, layer_norm_epsilon=config.layer_norm_epsilon,
                          resid_pdrop=config.dropout, embd_pdrop=config.dropout, attn_pdrop=config.dropout,
                          activation_function=config.hidden_act, **common)
    if config.family not in LLAMA_FAMILY:
        raise ConversionError(f"family {config.family!r} has no transformers class (supported: {', '.join(FAMILIES)})")
    _require(config, norm="rmsnorm", mlp="gated_silu", position="rotary")
    sizes = set(config.intermediate_sizes())
    if len(sizes) != 1:
        raise ConversionError(f"per-layer MLP widths {config.intermediate_sizes()} have no {config.family} form")
    fields = dict(hidden_size=config.n_embd, intermediate_size=sizes.pop(), num_hidden_layers=config.n_layer,
                  num_attention_heads=layer["n_heads"], num_key_value_heads=layer["n_kv_heads"],
                  head_dim=layer["head_dim"], max_position_embeddings=config.n_positions,
                  rms_norm_eps=config.layer_norm_epsilon, rope_parameters=dict(config.rope_parameters),
                  attention_dropout=config.dropout, initializer_range=config.initializer_range, **common)
    if config.family == "llama":
        from transformers import LlamaConfig

        if config.qkv_bias != config.o_bias:
            raise ConversionError(f"Llama has one attention_bias; qkv_bias={config.qkv_bias}, o_bias={config.o_bias}")
        return LlamaConfig(attention_bias=config.qkv_bias, mlp_bias=config.mlp_bias, **fields)
    _require(config, mlp_bias=False)
    if config.family == "mistral":
        from transformers import MistralConfig

        _require(config, qkv_bias=False, o_bias=False)
        return MistralConfig(sliding_window=config.attention_window, **fields)
    from transformers import Qwen2Config

    _require(config, qkv_bias=True, o_bias=False, attention_window=None)
    return Qwen2Config(use_sliding_window=False, **fields)


@torch.no_grad()
def to_hf(model: HeadBudgetForCausalLM) -> nn.Module:
    """Export a uniform headbudget model to ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` / ... (same logits)."""
    from transformers import AutoModelForCausalLM

    config, sd = model.config, model.state_dict()
    hf = AutoModelForCausalLM.from_config(hf_config_from(config))
    out: dict[str, torch.Tensor] = {}
    if config.family == "gpt2":
        for key, value in sd.items():
            name = key.replace("attn.qkv_proj", "attn.c_attn").replace("attn.o_proj", "attn.c_proj")
            is_conv = any(f"{m}.weight" in name for m in ("c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"))
            out[name] = value.t().contiguous() if is_conv else value
    else:
        out = {"model.embed_tokens.weight": sd["transformer.wte.weight"], "model.norm.weight": sd["transformer.ln_f.weight"]}
        if "lm_head.weight" in sd:
            out["lm_head.weight"] = sd["lm_head.weight"]
        for i, block in enumerate(model.transformer.h):
            src, dst = f"transformer.h.{i}.", f"model.layers.{i}."
            out[dst + "input_layernorm.weight"] = sd[src + "ln_1.weight"]
            out[dst + "post_attention_layernorm.weight"] = sd[src + "ln_2.weight"]
            for name, (w, b) in block.attn.projections().items():
                out[dst + f"self_attn.{name}_proj.weight"] = w
                if b is not None:
                    out[dst + f"self_attn.{name}_proj.bias"] = b
            out.update({dst + key[len(src):]: value for key, value in sd.items()
                        if key.startswith(src + "mlp.")})
    missing, unexpected = hf.load_state_dict(out, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)
               and ".attn.bias" not in k and "masked_bias" not in k]
    if missing or unexpected:
        raise ConversionError(f"export to {config.family} mismatch: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        hf.tie_weights()
    return hf.to(next(model.parameters()).dtype).eval()
