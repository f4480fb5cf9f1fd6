"""Parameter and FLOP accounting of models with biases (Qwen2 q/k/v bias, Llama o_proj and gated-MLP
bias, GPT-2 LayerNorm bias, LayerNorm without bias) against a count of the real module, so a bias
counted zero times or twice shows."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from headbudget.accounting import config_cost, count_parameters, flops_per_token
from headbudget.evaluation.cost import model_cost, module_flops_per_token
from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM, to_headbudget
from headbudget.schedules import HeadSchedule, LayerSpec

D, V, P, T = 32, 53, 40, 40
LLAMA = dict(hidden_size=D, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=V, max_position_embeddings=P)


def _bias_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if n.endswith(".bias"))


CASES = {
    # Qwen2: q/k/v biases, no o_proj bias, no MLP bias
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**LLAMA)),
    # Llama with attention_bias (q/k/v and o_proj) and mlp_bias (gate/up/down), untied head
    "llama-biases": lambda: LlamaForCausalLM(LlamaConfig(attention_bias=True, mlp_bias=True,
                                                          tie_word_embeddings=False, **LLAMA)),
    "llama-mlp-bias-tied": lambda: LlamaForCausalLM(LlamaConfig(mlp_bias=True, tie_word_embeddings=True, **LLAMA)),
    "mistral-no-bias": lambda: MistralForCausalLM(MistralConfig(**LLAMA)),
    # GPT-2: LayerNorm weight + bias, biases on every projection, learned positions
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=D, n_head=4, vocab_size=V, n_positions=P)),
}
# the bias parameters each real module holds, by hand
EXPECTED_BIASES = {
    "qwen2": 2 * (4 * 8 + 2 * 8 + 2 * 8),
    "llama-biases": 2 * ((4 * 8 + 2 * 8 + 2 * 8) + D + (48 + 48 + D)),
    "llama-mlp-bias-tied": 2 * (48 + 48 + D),
    "mistral-no-bias": 0,
    "gpt2": 2 * (3 * D + D + 4 * D + D + 2 * D) + D,  # c_attn, c_proj, c_fc, mlp.c_proj, ln_1/ln_2; ln_f
}


@pytest.mark.parametrize("name", list(CASES))
def test_parameters_and_flops_with_biases_match_the_real_module(name):
    torch.manual_seed(0)
    hf = CASES[name]().eval()
    real = sum(p.numel() for p in hf.parameters())  # a tied weight once
    assert _bias_count(hf) == EXPECTED_BIASES[name]
    hb = to_headbudget(hf)
    cost = config_cost(hb.config, T)
    assert cost.params == real == sum(p.numel() for p in hb.parameters())
    assert _bias_count(hb) == EXPECTED_BIASES[name]
    # FLOPs: 2 x every linear weight of the real module (biases are not counted) + the attention products
    assert cost.flops_per_token == module_flops_per_token(hf, T)
    assert model_cost(hb, T) == model_cost(hf, T) == {"params": real, "flops_per_token": cost.flops_per_token,
                                                      "context": T}


def test_qwen2_cost_by_hand():
    hf = CASES["qwen2"]()
    q, kv = 4 * 8, 2 * 8
    per_layer = D * (q + 2 * kv) + (q + 2 * kv) + q * D + 3 * D * 48 + 2 * D  # qkv(+bias), o, MLP, 2 RMSNorms
    assert not hf.config.tie_word_embeddings  # Qwen2's default: the head has its own V x D weights
    assert config_cost(to_headbudget(hf).config, T).params == 2 * V * D + 2 * per_layer + D
    flops_layer = 2 * D * (q + 2 * kv) + 2 * q * D + 2 * 3 * D * 48 + 2 * T * (q + q)
    assert config_cost(to_headbudget(hf).config, T).flops_per_token == 2 * flops_layer + 2 * D * V


@pytest.mark.parametrize("bias", [True, False], ids=["layernorm-with-bias", "layernorm-without-bias"])
def test_schedule_count_of_a_layernorm_model_with_and_without_bias(bias):
    sched = HeadSchedule(D, (LayerSpec(4, 8), LayerSpec(2, 8, 1), LayerSpec(1, 16, None, 8, 4)), head_dim_multiple=4,
                         neutral=False)
    model = HeadBudgetForCausalLM(HeadBudgetConfig(schedule=sched, vocab_size=V, n_positions=P, bias=bias))
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 7 and all((m.bias is not None) == bias for m in norms)
    real = sum(p.numel() for p in model.parameters())
    counted = count_parameters(sched, V, P, bias=bias)
    assert counted.total == real == config_cost(model.config).params
    assert counted.embedding == V * D + P * D
    for layer, block in zip(counted.per_layer, model.transformer.h):
        assert layer.attention == sum(p.numel() for p in block.attn.parameters())
        assert layer.mlp == sum(p.numel() for p in block.mlp.parameters())
        assert layer.norms == sum(p.numel() for p in (*block.ln_1.parameters(), *block.ln_2.parameters()))
    assert counted.total - counted.embedding - sum(lay.total for lay in counted.per_layer) == \
        sum(p.numel() for p in model.transformer.ln_f.parameters())
    flops = flops_per_token(sched, V, T)
    assert flops["total"] == config_cost(model.config, T).flops_per_token == module_flops_per_token(model, T)
