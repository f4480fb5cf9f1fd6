"""The headbudget decoder: parameter counts, SDPA and explicit attention paths, pruning equal to gating, save and
load, padding, the KV cache and generation; boolean 4-D masks (True = attend), left padding with
``output_attentions=True``, and rotary positions at a layer's own (reduced) query/key width."""

import math

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

import headbudget  # noqa: F401  (registers the Auto classes)
from conftest import names
from headbudget.accounting import count_parameters
from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM, to_headbudget
from headbudget.schedules import HeadSchedule, LayerSpec, prism


def tiny(schedule="prism", vocab=97, **kw):
    cfg = HeadBudgetConfig.from_preset("cpu-tiny", schedule, vocab_size=vocab, **kw)
    return HeadBudgetForCausalLM(cfg).eval()


def gqa_model():
    sched = HeadSchedule(64, (LayerSpec(4, 16, 2), LayerSpec(8, 8, 2)), head_dim_multiple=8)
    return HeadBudgetForCausalLM(HeadBudgetConfig(schedule=sched, vocab_size=50, n_positions=32)).eval()


def test_parameter_count_matches_accounting():
    m = tiny()
    expected = count_parameters(m.config.head_schedule, 97, m.config.n_positions).total
    assert m.num_parameters() == expected == sum(p.numel() for p in m.parameters())


def test_uniform_and_prism_models_have_identical_parameter_counts():
    assert tiny("uniform").num_parameters() == tiny("prism").num_parameters()


@pytest.mark.parametrize("make", [tiny, gqa_model])
def test_sdpa_and_explicit_paths_give_same_logits(make):
    m = make()
    x = torch.randint(0, 50, (3, 20))
    fast = m(x).logits
    slow = m(x, output_attentions=True)
    assert (fast - slow.logits).abs().max() <= 1e-5
    for layer, probs in enumerate(slow.attentions):
        assert probs.shape == (3, m.head_counts[layer], 20, 20)
        torch.testing.assert_close(probs.sum(-1), torch.ones(3, m.head_counts[layer], 20))
        assert probs.triu(1).abs().max() == 0  # causal


def test_head_mask_gradients_and_padded_tensor_form():
    m = tiny()
    x = torch.randint(0, 97, (2, 12))
    gates = [torch.ones(h, requires_grad=True) for h in m.head_counts]
    m(x, labels=x, head_mask=gates).loss.backward()
    assert all(g.grad is not None and g.grad.abs().sum() > 0 for g in gates)
    padded = torch.ones(len(m.head_counts), max(m.head_counts))
    padded[2, 1] = 0
    as_list = [torch.ones(h) for h in m.head_counts]
    as_list[2][1] = 0
    torch.testing.assert_close(m(x, head_mask=padded).logits, m(x, head_mask=as_list).logits)


@pytest.mark.parametrize(
    "make, prune",
    [(tiny, {1: [0], 2: [1, 3], 3: [0, 1, 2]}), (gqa_model, {0: [2, 3], 1: [0, 2, 4, 6]})],
)
def test_pruning_equals_gating_to_zero(make, prune):
    m = make()
    x = torch.randint(0, 50, (2, 16))
    gates = [torch.ones(h) for h in m.head_counts]
    for layer, heads in prune.items():
        gates[layer][heads] = 0.0
    gated = m(x, head_mask=gates).logits
    before = m.num_parameters()
    m.prune_heads(prune)
    assert (m(x).logits - gated).abs().max() <= 1e-5
    assert m.num_parameters() < before
    assert m.config.head_schedule.neutral is False
    assert list(m.config.head_schedule.heads) == m.head_counts


def test_gqa_pruning_removes_kv_head_only_with_its_whole_group():
    m = gqa_model()
    m.prune_heads({0: [2, 3]})  # layer 0: 4 query heads over 2 kv heads; heads 2,3 are kv group 1
    assert m.transformer.h[0].attn.n_kv_heads == 1
    assert m.transformer.h[0].attn.projections()["k"][0].shape[0] == 16


def test_unequal_groups_after_pruning_are_an_index_map_not_copies(tmp_path):
    m = gqa_model()  # layer 1: 8 query heads over 2 kv heads (4 + 4)
    x = torch.randint(0, 50, (2, 12))
    gates = [torch.ones(h) for h in m.head_counts]
    gates[1][[0, 1, 5]] = 0.0
    gated = m(x, head_mask=gates).logits
    m.prune_heads({1: [0, 1, 5]})
    attn = m.transformer.h[1].attn
    assert attn.kv_groups == [2, 3] and attn.kv_index == [0, 0, 1, 1, 1]
    assert attn.projections()["k"][0].shape[0] == 2 * 8  # still two kv heads, nothing duplicated
    assert (m(x).logits - gated).abs().max() <= 1e-5
    assert (m(x, output_attentions=True).logits - gated).abs().max() <= 1e-5
    assert m.config.head_schedule[1].kv_groups == (2, 3)
    # A second round indexes the current heads: remove current head 2 (original 3) from kv group 1.
    gates2 = [torch.ones(h) for h in m.head_counts]
    gates2[1][2] = 0.0
    gated2 = m(x, head_mask=gates2).logits
    m.prune_heads({1: [2]})
    assert attn.kv_groups is None and attn.n_kv_heads == 2  # 2 + 2: equal again
    assert (m(x).logits - gated2).abs().max() <= 1e-5
    m.prune_heads({1: [0]})
    m.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.transformer.h[1].attn.kv_groups == [1, 2]
    assert torch.equal(loaded(x).logits, m(x).logits)


def test_refuses_to_remove_last_head_and_changes_nothing():
    m = tiny()
    before = m.head_counts
    with pytest.raises(ValueError, match=names("layer 0", "1 heads")):
        m.prune_heads({2: [0], 0: [0]})
    assert m.head_counts == before
    with pytest.raises(ValueError, match=names("layer 3", "head 9")):
        m.prune_heads({3: [9]})


def test_save_and_load_round_trip_of_pruned_model(tmp_path):
    m = tiny()
    m.prune_heads({2: [0, 1], 3: [3]})
    m.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, HeadBudgetForCausalLM)
    assert loaded.head_counts == m.head_counts == [1, 2, 2, 3]
    x = torch.randint(0, 97, (2, 10))
    assert torch.equal(loaded(x).logits, m(x).logits)
    assert AutoConfig.from_pretrained(tmp_path).head_schedule == m.config.head_schedule


def test_gpt2_weights_give_same_logits():
    cfg = GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=120, n_positions=40, bos_token_id=0, eos_token_id=0)
    hf = GPT2LMHeadModel(cfg).eval()
    ours = to_headbudget(hf)
    x = torch.randint(0, 120, (2, 33))
    assert (hf(x).logits - ours(x).logits).abs().max() <= 1e-4
    mask = torch.ones_like(x)
    mask[0, :5] = 0  # left padding
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    diff = (hf(x, attention_mask=mask, position_ids=pos).logits - ours(x, attention_mask=mask, position_ids=pos).logits)
    assert diff[:, 5:].abs().max() <= 1e-4 and diff[1].abs().max() <= 1e-4


def test_padding_mask_matches_unpadded_run():
    m = tiny()
    x = torch.randint(1, 97, (1, 12))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), x], 1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = m(padded, attention_mask=mask, position_ids=pos).logits[:, 4:]
    assert (out - m(x).logits).abs().max() <= 1e-5


def test_kv_cache_incremental_logits_equal_full_pass():
    m = tiny()
    x = torch.randint(0, 97, (2, 14))
    full = m(x).logits
    out = m(x[:, :9], use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    step = m(x[:, 9:], cache=cache, use_cache=True).logits
    assert (torch.cat([out.logits, step], 1) - full).abs().max() <= 1e-5


def test_generate_uses_cache_and_matches_greedy_loop():
    m = tiny()
    prompt = torch.randint(0, 97, (2, 6))
    lengths = []
    hook = m.transformer.wte.register_forward_hook(lambda mod, inp, out: lengths.append(inp[0].shape[1]))
    gen = m.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    hook.remove()
    assert lengths[0] == 6 and all(n == 1 for n in lengths[1:])  # the prefix is never recomputed
    seq = prompt
    for _ in range(8):
        seq = torch.cat([seq, m(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(gen, seq)


def test_too_long_input_is_a_clear_error():
    m = tiny()
    with pytest.raises(ValueError, match=names("200", "n_positions=128")):
        m(torch.zeros(1, 200, dtype=torch.long))


def test_low_rank_widths_keep_scale_and_shapes():
    base = prism(4, 128, 128, 32)
    layers = [LayerSpec(s.n_heads, s.head_dim, None, s.head_dim // 2, s.head_dim // 4) for s in base]
    sched = base.with_layers(layers, neutral=False)
    m = HeadBudgetForCausalLM(HeadBudgetConfig(schedule=sched, vocab_size=40, n_positions=32))
    attn = m.transformer.h[0].attn
    p = attn.projections()
    assert p["q"][0].shape[0] == 64 and p["v"][0].shape[0] == 32 and attn.o_proj.in_features == 32
    assert attn.scale == pytest.approx(128 ** -0.5)
    x = torch.randint(0, 40, (1, 8))
    assert (m(x).logits - m(x, output_attentions=True).logits).abs().max() <= 1e-5


# ---------------------------------------------------------------------------- a tiny Llama and a GPT-2-like model
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
