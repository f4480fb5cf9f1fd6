"""Converters GPT-2/Llama/Mistral/Qwen2 <-> headbudget: identical logits, both ways, with GQA and padding; a
non-default norm epsilon survives conversion both ways."""

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

from conftest import assert_names, names
from headbudget.models import ConversionError, HeadBudgetForCausalLM, to_headbudget, to_hf
from test_model import _llama  # tests/ is on sys.path under pytest

LLAMA_SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)


def make(family: str, **over):
    torch.manual_seed(0)
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=101, n_positions=64,
                                          **over)).eval()
    cls, cfg = {
        "llama": (LlamaForCausalLM, LlamaConfig),
        "mistral": (MistralForCausalLM, MistralConfig),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config),
    }[family]
    kw = dict(LLAMA_SHAPE, **over)
    model = cls(cfg(**kw)).eval()
    with torch.no_grad():  # random biases and norm weights, so a dropped or misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def padded_batch(vocab: int = 101):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    mask[2, :11] = 0
    return ids, mask


CASES = [
    ("gpt2", {}),
    ("gpt2", {"activation_function": "gelu"}),  # the exact GELU, honoured rather than read as GPT-2's tanh one
    ("llama", {}),
    ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16}}),
    ("llama", {"head_dim": 32}),  # heads x head_dim != hidden_size
    ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 16}}),
    ("mistral", {"sliding_window": 6}),
    ("qwen2", {}),
]


@pytest.mark.parametrize("family, over", CASES)
def test_converted_logits_equal_within_1e4_with_padding(family, over):
    hf = make(family, **over)
    hb = to_headbudget(hf)
    assert isinstance(hb, HeadBudgetForCausalLM) and hb.config.family == family
    ids, mask = padded_batch()
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).logits
        ours = hb(ids, attention_mask=mask).logits
        plain = (hf(ids).logits - hb(ids).logits).abs().max()
    real = mask.bool()
    assert (ref[real] - ours[real]).abs().max() <= 1e-4
    assert plain <= 1e-4
    assert hb.num_parameters() == hf.num_parameters()


@pytest.mark.parametrize("family, over", CASES)
def test_uniform_headbudget_exports_back_to_the_plain_class(family, over):
    hf = make(family, **over)
    back = to_hf(to_headbudget(hf))
    assert type(back) is type(hf)
    ids, _ = padded_batch()
    with torch.no_grad():
        assert (back(ids).logits - hf(ids).logits).abs().max() <= 1e-5


def test_kv_cache_generation_matches_the_original_llama():
    hf = make("llama")
    hb = to_headbudget(hf)
    prompt = torch.randint(0, 101, (1, 6))
    a = hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    b = hb.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)


def test_pruned_model_does_not_export_and_says_why():
    hb = to_headbudget(make("llama"))
    hb.prune_heads({1: [0]})
    with pytest.raises(ConversionError, match=names("layer 1", "layer 0")):
        to_hf(hb)


def test_unsupported_family_is_named():
    from transformers import BertConfig, BertForMaskedLM

    bert = BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64, vocab_size=50))
    with pytest.raises(ConversionError, match=names("model_type", "'bert'")):
        to_headbudget(bert)


# ----------------------------------------------------------------------------- built on meta, no copy
def _old_conversion(hf):
    """What to_headbudget did before it built on the meta device: a random fp32 model, weights copied."""
    from headbudget.models.convert import (
        _gpt2_to_headbudget_state,
        _llama_to_headbudget_state,
        config_from_hf,
    )

    config = config_from_hf(hf.config)
    hb = HeadBudgetForCausalLM(config)
    convert = _gpt2_to_headbudget_state if config.family == "gpt2" else _llama_to_headbudget_state
    hb.load_state_dict(convert(hf.state_dict(), config.n_layer), strict=False)
    if config.tie_word_embeddings:
        hb.tie_weights()
    return hb.to(next(hf.parameters()).dtype).eval()


@pytest.mark.parametrize("family, over, dtype", [
    ("gpt2", {}, torch.float32), ("llama", {}, torch.float32), ("llama", {"tie_word_embeddings": True}, torch.float32),
    ("llama", {}, torch.bfloat16), ("gpt2", {}, torch.bfloat16),
])
def test_conversion_keeps_dtype_and_device_and_gives_the_old_logits_exactly(family, over, dtype):
    hf = make(family, **over).to(dtype)
    hb = to_headbudget(hf)
    tensors = [*hb.parameters(), *hb.buffers()]
    assert {t.dtype for t in tensors} == {dtype} and {t.device for t in tensors} == {torch.device("cpu")}
    ids, mask = padded_batch()
    with torch.no_grad():
        assert torch.equal(hb(ids, attention_mask=mask).logits, _old_conversion(hf)(ids, attention_mask=mask).logits)
    tied = hb.config.tie_word_embeddings
    assert tied == (family == "gpt2" or "tie_word_embeddings" in over)
    assert (hb.lm_head.weight is hb.transformer.wte.weight) == tied
    assert hb.num_parameters() == hf.num_parameters()


def test_conversion_keeps_a_non_cpu_device():
    """Without a GPU: a model on the meta device converts to one on the meta device (same code path as cuda)."""
    with torch.device("meta"):
        hf = LlamaForCausalLM(LlamaConfig(**LLAMA_SHAPE)).to(torch.float16)
    hb = to_headbudget(hf)
    assert {(t.device.type, t.dtype) for t in hb.parameters()} == {("meta", torch.float16)}
    assert hb.num_parameters() == hf.num_parameters()


def test_conversion_shares_the_inputs_tensors_instead_of_copying_them():
    hf = make("llama")
    hb = to_headbudget(hf)
    pairs = [(hb.transformer.wte.weight, hf.model.embed_tokens.weight), (hb.lm_head.weight, hf.lm_head.weight),
             (hb.transformer.h[1].mlp.up_proj.weight, hf.model.layers[1].mlp.up_proj.weight),
             (hb.transformer.h[2].attn.o_proj.weight, hf.model.layers[2].self_attn.o_proj.weight)]
    assert all(a.data_ptr() == b.data_ptr() for a, b in pairs)
    assert hb.transformer.h[0].attn.qkv_proj.weight.data_ptr() != hf.model.layers[0].self_attn.q_proj.weight.data_ptr()
    assert not hb.training


# ----------------------------------------------------------------------------- options refused at conversion
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # the supported ones, listed when refusing another


@pytest.mark.parametrize("over, parts", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
     ["llama", "partial_rotary_factor=0.5"]),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
     ["llama", "rope_type='dynamic'", *ROPE_TYPES]),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 2.0,
                          "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                          "original_max_position_embeddings": 16}},
     ["llama", "rope_type='longrope'", *ROPE_TYPES]),
])
def test_rope_options_that_cannot_work_are_refused_at_conversion_in_one_line(over, parts):
    hf = make("llama", **over)
    with pytest.raises(ConversionError) as err:
        to_headbudget(hf)
    assert "\n" not in str(err.value)
    assert_names(str(err.value), *parts)


def test_gpt2_cross_attention_is_refused_at_conversion():
    with pytest.raises(ConversionError, match=names("GPT-2", "add_cross_attention=True")):
        to_headbudget(make("gpt2", add_cross_attention=True))


def test_headbudget_config_with_dynamic_rope_is_refused_at_load_not_at_forward(tmp_path):
    import json

    from headbudget.loading import load_model

    hb = to_headbudget(make("llama"))
    hb.save_pretrained(tmp_path / "m")
    cfg_file = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:
        load_model(tmp_path / "m")
    assert_names(str(err.value), tmp_path / "m", "rope_type='dynamic'", *ROPE_TYPES)


def test_hidden_act_is_honoured_and_a_wrong_one_is_refused_in_one_line(tmp_path):
    from headbudget.models import HeadBudgetConfig

    torch.manual_seed(0)
    tanh = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", vocab_size=101)).eval()
    exact = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", vocab_size=101, hidden_act="gelu")).eval()
    exact.load_state_dict(tanh.state_dict())
    ids, _ = padded_batch()
    with torch.no_grad():
        assert (tanh(ids).logits - exact(ids).logits).abs().max() > 1e-5  # measured 5.4e-5 at this init
    exact.save_pretrained(tmp_path)
    reloaded = HeadBudgetForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.hidden_act == "gelu"
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, exact(ids).logits)
    with pytest.raises(ValueError, match=names("hidden_act='relu'", "mlp='gelu'")):
        HeadBudgetConfig.from_preset("cpu-tiny", hidden_act="relu")
    with pytest.raises(ValueError, match=names("hidden_act='gelu'", "silu")):
        HeadBudgetConfig.from_preset("cpu-tiny", mlp="gated_silu", hidden_act="gelu")
    with pytest.raises(ConversionError, match=names("activation_function='relu'")):
        to_headbudget(make("gpt2", activation_function="relu"))


# ---------------------------------------------------------------------------- norm epsilon both ways
def test_non_default_rms_norm_eps_survives_conversion_both_ways():
    hf = _llama(rms_norm_eps=0.1)  # large, so the value visibly changes every norm's output
    hb = to_headbudget(hf)
    assert hb.config.layer_norm_epsilon == 0.1
    norms = [mod for mod in hb.modules() if type(mod).__name__ == "HeadBudgetRMSNorm"]
    assert len(norms) == 2 * 2 + 1 and {n.eps for n in norms} == {0.1}
    ids = torch.randint(0, 101, (2, 12))
    with torch.no_grad():
        ref = hf(ids).logits
        assert (hb(ids).logits - ref).abs().max() <= 1e-5
        back = to_hf(hb)
        assert back.config.rms_norm_eps == 0.1
        assert (back(ids).logits - ref).abs().max() <= 1e-5
        # the value matters here: the same weights with the default epsilon give other logits
        hf.config.rms_norm_eps = 1e-6
        assert (to_headbudget(hf)(ids).logits - ref).abs().max() > 1e-2


def test_non_default_layer_norm_epsilon_survives_gpt2_conversion_both_ways():
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=101, n_positions=32,
                                    layer_norm_epsilon=0.1)).eval()
    hb = to_headbudget(hf)
    assert hb.config.layer_norm_epsilon == 0.1
    assert {mod.eps for mod in hb.modules() if isinstance(mod, torch.nn.LayerNorm)} == {0.1}
    back = to_hf(hb)
    assert back.config.layer_norm_epsilon == 0.1
    ids = torch.randint(0, 101, (2, 12))
    with torch.no_grad():
        ref = hf(ids).logits
        assert (hb(ids).logits - ref).abs().max() <= 1e-5
        assert (back(ids).logits - ref).abs().max() <= 1e-5
