"""Converters GPT-2/Llama/Mistral/Qwen2 <-> headbudget: identical logits, both ways, with GQA and padding."""

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

from headbudget.models import ConversionError, HeadBudgetForCausalLM, to_headbudget, to_hf

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
    ("llama", {}),
    ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16}}),
    ("llama", {"head_dim": 32}),  # heads x head_dim != hidden_size
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
    with pytest.raises(ConversionError, match="layer 1 has layout"):
        to_hf(hb)


def test_unsupported_family_is_named():
    from transformers import BertConfig, BertForMaskedLM

    bert = BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64, vocab_size=50))
    with pytest.raises(ConversionError, match="model_type 'bert' cannot be converted"):
        to_headbudget(bert)
