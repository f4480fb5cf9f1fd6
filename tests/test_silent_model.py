"""Model behaviours a wrong sign or a dropped argument would break without any error: boolean 4-D masks
(True = attend), left padding with ``output_attentions=True``, a non-default norm epsilon through
conversion both ways, and rotary positions at a layer's own (reduced) query/key width."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM, to_headbudget, to_hf


def _llama(head_dim: int = 16, layers: int = 2, seed: int = 0, **over) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
               num_key_value_heads=2, head_dim=head_dim, vocab_size=101, max_position_embeddings=64,
               tie_word_embeddings=True)
    cfg.update(over)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    with torch.no_grad():  # non-trivial norm weights, so a misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _gpt2_like() -> HeadBudgetForCausalLM:
    torch.manual_seed(0)
    return HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", "prism", vocab_size=101)).eval()


MODELS = {"gpt2-like": _gpt2_like, "llama-rotary": lambda: to_headbudget(_llama())}


# ---------------------------------------------------------------------------- 4-D masks: a token tree
def _tree_masks() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens [a, b, c, d] where c and d are two alternative continuations of [a, b] (d does not see c)."""
    allowed = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    bool_mask = allowed.view(1, 1, 4, 4)
    additive = torch.zeros(1, 1, 4, 4).masked_fill(~bool_mask, torch.finfo(torch.float32).min)
    return bool_mask, additive, torch.tensor([[0, 1, 2, 2]])


@pytest.mark.parametrize("explicit", [False, True], ids=["sdpa", "output_attentions"])
@pytest.mark.parametrize("name", list(MODELS))
def test_boolean_4d_mask_true_means_attend(name, explicit):
    m = MODELS[name]()
    ids = torch.tensor([[5, 17, 42, 77]])
    bool_mask, additive, pos = _tree_masks()
    with torch.no_grad():
        tree = m(ids, attention_mask=bool_mask, position_ids=pos, output_attentions=explicit)
        as_floats = m(ids, attention_mask=additive, position_ids=pos, output_attentions=explicit).logits
        branch_c = m(ids[:, [0, 1, 2]]).logits  # each branch run alone, as a plain causal sequence
        branch_d = m(ids[:, [0, 1, 3]]).logits
    assert (tree.logits[0, :3] - branch_c[0]).abs().max() <= 1e-5
    assert (tree.logits[0, 3] - branch_d[0, 2]).abs().max() <= 1e-5
    assert (tree.logits - as_floats).abs().max() <= 1e-5
    if explicit:  # d's attention to c is exactly zero; c's to d too (causal)
        for probs in tree.attentions:
            assert probs[0, :, 3, 2].abs().max() == 0 and probs[0, :, 2, 3].abs().max() == 0
            assert probs[0, :, 3, [0, 1, 3]].sum(-1).sub(1).abs().max() <= 1e-5


@pytest.mark.parametrize("name", list(MODELS))
def test_left_padded_batch_with_output_attentions_matches_each_sequence_alone(name):
    m = MODELS[name]()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 101, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # row 0: 4 pad tokens on the left, then 6 real ones
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = m(ids, attention_mask=mask, position_ids=pos, output_attentions=True)
        fast = m(ids, attention_mask=mask, position_ids=pos).logits
        alone0 = m(ids[:1, 4:], output_attentions=True)
        alone1 = m(ids[1:], output_attentions=True)
    assert torch.isfinite(out.logits).all()
    assert (out.logits[0, 4:] - alone0.logits[0]).abs().max() <= 1e-5
    assert (out.logits[1] - alone1.logits[0]).abs().max() <= 1e-5
    assert (out.logits[:, 4:] - fast[:, 4:]).abs().max() <= 1e-5 and (out.logits[1] - fast[1]).abs().max() <= 1e-5
    for layer, probs in enumerate(out.attentions):
        assert probs[0, :, 4:, :4].abs().max() == 0  # real tokens never attend to padding
        assert (probs[0, :, 4:, 4:] - alone0.attentions[layer][0]).abs().max() <= 1e-5
        assert (probs[1] - alone1.attentions[layer][0]).abs().max() <= 1e-5


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
    torch.manual_seed(0)
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


# ---------------------------------------------------------------------------- rotary at reduced q/k width
def _mixed_width_model() -> tuple[HeadBudgetForCausalLM, LlamaForCausalLM, LlamaForCausalLM]:
    """Layer 0: 4 heads of width 16; layer 1: q/k/v reduced to width 8 (``head_dim`` 16 keeps the scale).

    Returned with two 1-layer transformers Llamas, one per width, that share its embeddings and norms."""
    wide, narrow = _llama(16, layers=1, seed=1), _llama(8, layers=1, seed=2)
    with torch.no_grad():
        narrow.model.embed_tokens.weight.copy_(wide.model.embed_tokens.weight)
        narrow.model.norm.weight.copy_(wide.model.norm.weight)
    full = {"n_heads": 4, "head_dim": 16, "n_kv_heads": 2}
    cfg = HeadBudgetConfig(
        schedule={"d_model": 64, "layers": [full, dict(full, qk_head_dim=8, v_head_dim=8)], "neutral": True,
                  "head_dim_multiple": 1},
        vocab_size=101, n_positions=64, bias=False, norm="rmsnorm", mlp="gated_silu", intermediate_size=96,
        position="rotary", layer_norm_epsilon=wide.config.rms_norm_eps, family="llama", tie_word_embeddings=True)
    model = HeadBudgetForCausalLM(cfg).eval()
    sd_wide, sd_narrow = to_headbudget(wide).state_dict(), to_headbudget(narrow).state_dict()
    state = {k: v for k, v in sd_wide.items() if not k.startswith("transformer.h.")}
    state.update({k: v for k, v in sd_wide.items() if k.startswith("transformer.h.0.")})
    for k, v in sd_narrow.items():
        if k.startswith("transformer.h.0."):
            state[k.replace("h.0.", "h.1.")] = v.clone()
    # transformers scales narrow scores by 1/sqrt(8), layer 1 by 1/sqrt(head_dim=16): fold the ratio into q
    state["transformer.h.1.attn.qkv_proj.weight"][:4 * 8] *= math.sqrt(16 / 8)
    model.load_state_dict(state)
    return model, wide, narrow


@torch.no_grad()
def _silence(block) -> None:
    """Zero a block's two output projections: it then adds nothing to the residual stream."""
    block.attn.o_proj.weight.zero_()
    block.mlp.down_proj.weight.zero_()


@pytest.mark.parametrize("kept", [0, 1], ids=["full-width-layer", "reduced-width-layer"])
@pytest.mark.parametrize("explicit", [False, True], ids=["sdpa", "output_attentions"])
def test_rotary_uses_each_layers_own_query_key_width(kept, explicit):
    model, wide, narrow = _mixed_width_model()
    assert [b.attn.qk_head_dim for b in model.transformer.h] == [16, 8]
    _silence(model.transformer.h[1 - kept])
    ref_model = (wide, narrow)[kept]
    ids = torch.randint(0, 101, (2, 20))
    with torch.no_grad():
        ref = ref_model(ids).logits
        ours = model(ids, output_attentions=explicit).logits
        # positions matter in this layer (rotary is applied, not skipped)
        shuffled = model(ids, position_ids=torch.arange(20).flip(0).unsqueeze(0), output_attentions=explicit).logits
    assert (ours - ref).abs().max() <= 1e-5
    assert (shuffled - ours).abs().max() > 1e-3
