"""Load Hugging Face GPT-2 weights into a headbudget model (uniform schedule), and back.

GPT-2 stores q/k/v fused in one ``Conv1D`` (``c_attn``, weight ``[in, 3*out]``); headbudget keeps
separate ``nn.Linear`` projections (weight ``[out, in]``), so loading splits and transposes.

    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32))
    >>> model = from_gpt2(hf)
"""

from __future__ import annotations

import torch

from headbudget.models.config import HeadBudgetConfig
from headbudget.models.modeling import HeadBudgetForCausalLM
from headbudget.schedules import uniform


def config_from_gpt2(gpt2_config) -> HeadBudgetConfig:
    """A headbudget config with GPT-2's shape and a uniform schedule."""
    act = getattr(gpt2_config, "activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"GPT-2 activation {act!r} is not supported (headbudget uses tanh-approximated GELU)")
    inner = getattr(gpt2_config, "n_inner", None)
    if inner not in (None, 4 * gpt2_config.n_embd):
        raise ValueError(f"GPT-2 n_inner={inner} is not 4 x n_embd; headbudget uses a 4x MLP")
    return HeadBudgetConfig(
        schedule=uniform(gpt2_config.n_layer, gpt2_config.n_embd, gpt2_config.n_head),
        vocab_size=gpt2_config.vocab_size,
        n_positions=gpt2_config.n_positions,
        dropout=0.0,
        bias=True,
        layer_norm_epsilon=gpt2_config.layer_norm_epsilon,
        bos_token_id=gpt2_config.bos_token_id,
        eos_token_id=gpt2_config.eos_token_id,
    )


def gpt2_state_dict_to_headbudget(sd: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """Map a ``GPT2LMHeadModel`` state dict to headbudget parameter names."""
    out: dict[str, torch.Tensor] = {
        "transformer.wte.weight": sd["transformer.wte.weight"],
        "transformer.wpe.weight": sd["transformer.wpe.weight"],
        "transformer.ln_f.weight": sd["transformer.ln_f.weight"],
        "transformer.ln_f.bias": sd["transformer.ln_f.bias"],
        "lm_head.weight": sd.get("lm_head.weight", sd["transformer.wte.weight"]),
    }
    for i in range(n_layer):
        src, dst = f"transformer.h.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[dst + f"{ln}.weight"] = sd[src + f"{ln}.weight"]
            out[dst + f"{ln}.bias"] = sd[src + f"{ln}.bias"]
        w, b = sd[src + "attn.c_attn.weight"], sd[src + "attn.c_attn.bias"]  # Conv1D: [in, 3*d]
        for name, wi, bi in zip(("q_proj", "k_proj", "v_proj"), w.chunk(3, dim=1), b.chunk(3)):
            out[dst + f"attn.{name}.weight"] = wi.t().contiguous()
            out[dst + f"attn.{name}.bias"] = bi
        out[dst + "attn.o_proj.weight"] = sd[src + "attn.c_proj.weight"].t().contiguous()
        out[dst + "attn.o_proj.bias"] = sd[src + "attn.c_proj.bias"]
        out[dst + "mlp.c_fc.weight"] = sd[src + "mlp.c_fc.weight"].t().contiguous()
        out[dst + "mlp.c_fc.bias"] = sd[src + "mlp.c_fc.bias"]
        out[dst + "mlp.c_proj.weight"] = sd[src + "mlp.c_proj.weight"].t().contiguous()
        out[dst + "mlp.c_proj.bias"] = sd[src + "mlp.c_proj.bias"]
    return out


@torch.no_grad()
def from_gpt2(gpt2_model) -> HeadBudgetForCausalLM:
    """Convert a ``transformers.GPT2LMHeadModel`` (object, or name/path) into a headbudget model."""
    if isinstance(gpt2_model, str):
        from transformers import GPT2LMHeadModel

        gpt2_model = GPT2LMHeadModel.from_pretrained(gpt2_model)
    config = config_from_gpt2(gpt2_model.config)
    model = HeadBudgetForCausalLM(config)
    sd = gpt2_state_dict_to_headbudget(gpt2_model.state_dict(), config.n_layer)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"GPT-2 conversion mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.to(next(gpt2_model.parameters()).dtype).eval()
