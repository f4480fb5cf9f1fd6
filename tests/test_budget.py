"""Budgeted schedules: targets, granularity, validation, spec parsing and registration; parameter and FLOP
accounting of models with biases (Qwen2 q/k/v bias, Llama o_proj and gated-MLP bias, GPT-2 LayerNorm bias,
LayerNorm without bias) against a count of the real module, so a bias counted zero times or twice shows."""

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

from conftest import names
from headbudget import schedule_spec, schedules
from headbudget.accounting import config_cost, count_parameters, flops_per_token
from headbudget.budget import (
    BudgetError,
    budgeted_schedule,
    fit_integer_total,
    parse_budget_spec,
    reference_schedule,
)
from headbudget.budget_report import budget_report, budget_step
from headbudget.evaluation.cost import model_cost, module_flops_per_token
from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM, to_headbudget
from headbudget.schedules import HeadSchedule, LayerSpec, ScheduleError

PRESETS = ["cpu-tiny", "cpu-small", "gpt2-124m"]
FRACTIONS = [0.25, 0.5, 0.6, 0.75, 0.9, 1.0]


@pytest.mark.parametrize("strategy", ["uniform_shrink", "late_dim_decay", "front_loaded_heads"])
@pytest.mark.parametrize("preset", PRESETS)
def test_strategies_hit_target_within_one_step(strategy, preset):
    ref = reference_schedule(preset)
    for f in FRACTIONS:
        s = budgeted_schedule(preset, f, strategy)
        assert isinstance(s, HeadSchedule) and s.neutral is False
        assert s.n_layers == ref.n_layers and s.d_model == ref.d_model
        assert abs(s.budget - f * ref.budget) <= budget_step(ref, strategy), (strategy, preset, f, s)
        assert all(d % 8 == 0 and d >= 8 for d in s.head_dims)
        # re-validates through the dict round trip
        assert HeadSchedule.from_dict(s.to_dict()) == s


def test_exact_values_cpu_small():
    assert budgeted_schedule("cpu-small", 0.75, "uniform_shrink").head_dims == (48,) * 6
    s = budgeted_schedule("cpu-small", 0.75, "late_dim_decay")
    assert s.head_dims == (64, 64, 56, 48, 32, 24) and s.budget == 1152 == 0.75 * 1536
    assert s.heads == (4,) * 6
    f = budgeted_schedule("cpu-small", 0.75, "front_loaded_heads")
    assert f.heads == (4, 4, 3, 3, 2, 2) and f.head_dims == (64,) * 6 and f.budget == 1152


def test_late_dim_decay_keeps_early_layers_and_is_monotone():
    for decay in ("linear", "geometric"):
        s = budgeted_schedule("gpt2-124m", 0.6, "late_dim_decay", decay=decay, keep_layers=3)
        assert s.head_dims[:3] == (64, 64, 64)
        assert list(s.head_dims) == sorted(s.head_dims, reverse=True)
        assert abs(s.budget - 0.6 * 12 * 768) <= 12 * 8
    lin = budgeted_schedule("gpt2-124m", 0.6, "late_dim_decay", decay="linear", keep_layers=3)
    geo = budgeted_schedule("gpt2-124m", 0.6, "late_dim_decay", decay="geometric", keep_layers=3)
    assert lin.head_dims != geo.head_dims


def test_front_loaded_heads_non_increasing():
    s = budgeted_schedule("gpt2-124m", 0.5, "front_loaded_heads")
    assert list(s.heads) == sorted(s.heads, reverse=True) and s.heads[0] == 12
    assert s.budget == 0.5 * 12 * 768


def test_custom_layers_and_profile():
    s = budgeted_schedule("cpu-tiny", None, "custom", layers="4x32/4x32/2x32/2x16")
    assert s.heads == (4, 4, 2, 2) and s.head_dims == (32, 32, 32, 16) and s.budget == 352
    with pytest.raises(BudgetError, match=names("3", "4")):
        budgeted_schedule("cpu-tiny", None, "custom", layers="4x32/4x32/2x32")
    with pytest.raises(BudgetError, match=names("0.5")):
        budgeted_schedule("cpu-tiny", 0.5, "custom", layers="4x32/4x32/4x32/4x32")
    p = budgeted_schedule("cpu-small", 0.5, "custom", profile="1/1/1/0.5/0.5/0.5")
    assert p.budget == 768
    assert p.head_dims[0] > p.head_dims[-1]
    with pytest.raises(ScheduleError, match=names("layer 3", "head_dim=12", 8)):
        budgeted_schedule("cpu-tiny", None, "custom", layers="4x32/4x32/2x32/2x12")


def test_errors_are_specific():
    with pytest.raises(BudgetError, match=names("(0, 1]", 1.5)):
        budgeted_schedule("cpu-small", 1.5, "uniform_shrink")
    with pytest.raises(BudgetError, match=names("0.050")):
        budgeted_schedule("cpu-small", 0.05, "uniform_shrink")
    with pytest.raises(BudgetError, match=names("'nope'")):
        budgeted_schedule("cpu-small", 0.5, "nope")
    with pytest.raises(BudgetError, match=names("uniform_shrink", "decay")):
        budgeted_schedule("cpu-small", 0.5, "uniform_shrink", decay="linear")
    with pytest.raises(BudgetError, match=names("late_dim_decay", 0.3, "0.854", "keep_layers=5")):
        budgeted_schedule("cpu-small", 0.3, "late_dim_decay", keep_layers=5)


def test_fit_integer_total():
    assert fit_integer_total([1.5, 1.5, 1.5], [1] * 3, [4] * 3, [1] * 3, 5) == [1, 2, 2]
    v = fit_integer_total([2.4, 2.4, 2.4, 2.4], [1] * 4, [8] * 4, [3, 3, 3, 3], 30)
    assert sum(x * 3 for x in v) == 30 and max(v) - min(v) <= 1


def test_spec_parsing_and_registration():
    assert parse_budget_spec("late_dim_decay:0.5:decay=geometric:keep=2") == (
        "late_dim_decay", 0.5, {"decay": "geometric", "keep_layers": 2})
    assert parse_budget_spec("late_dim_decay:0.5:geometric")[2] == {"decay": "geometric"}
    with pytest.raises(BudgetError, match=names("'uniform_shrink'")):
        parse_budget_spec("uniform_shrink")
    s = schedule_spec.schedule_from_spec("late_dim_decay:0.75", "cpu-small")
    assert s == budgeted_schedule("cpu-small", 0.75, "late_dim_decay")
    assert schedule_spec.schedule_from_spec("custom:4x32/4x32/2x32/2x32", "cpu-tiny").heads == (4, 4, 2, 2)
    assert schedule_spec.schedule_from_spec("prism", "cpu-small") == schedules.prism(6, 256, 256, 64)
    with pytest.raises(BudgetError, match=names("'spiral'", "'spiral:0.5'")):
        schedule_spec.schedule_from_spec("spiral:0.5", "cpu-small")
    # the strategies are kinds from the start (no import of headbudget.budget needed to register them)
    for kind in ("uniform_shrink", "late_dim_decay", "front_loaded_heads", "custom"):
        assert kind in schedule_spec.SCHEDULE_KINDS
    s2 = schedule_spec.schedule_from_spec("uniform_shrink", "cpu-small", budget=0.5)
    assert s2.head_dims == (32,) * 6
    s3 = schedule_spec.SCHEDULE_KINDS["late_dim_decay"](schedules.get_preset("cpu-small"), spec_arg="0.75")
    assert s3 == s


def test_budget_report_counts():
    ref = reference_schedule("cpu-tiny")
    s = budgeted_schedule("cpu-tiny", 0.5, "uniform_shrink")
    r = budget_report(s, ref, vocab_size=512, n_positions=128)
    assert r.fraction == 0.5 and r.budget == 256 and r.reference_budget == 512
    # per layer: q,k,v out 64 each (+bias 64), o in 64 -> 128 (+bias 128)
    per_layer = 3 * (128 * 64 + 64) + 64 * 128 + 128
    assert r.attention_params == 4 * per_layer
    assert r.flops_per_token < r.reference_flops_per_token
    assert "D=256 (0.500 of 512)" in r.format()


def test_budgeted_schedule_builds_a_model_with_exact_parameter_count():
    for strategy in ("late_dim_decay", "front_loaded_heads"):
        s = budgeted_schedule("cpu-tiny", 0.5, strategy)
        m = HeadBudgetForCausalLM(HeadBudgetConfig(schedule=s, vocab_size=64, n_positions=32))
        assert m.transformer.h[-1].attn.projections()["q"][0].shape[0] == s[-1].width
        assert m.num_parameters() == count_parameters(s, 64, 32).total
        out = m(torch.randint(0, 64, (1, 8)), labels=torch.randint(0, 64, (1, 8)))
        assert out.logits.shape == (1, 8, 64) and torch.isfinite(out.loss)


# ---------------------------------------------------------------------------- accounting of biases
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
