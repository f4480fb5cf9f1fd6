"""Checks against independent references: each compares with a computation that
shares no code with the thing tested, so a bug planted in the layout-specific paths shows."""

import itertools
import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from headbudget.accounting import config_cost
from headbudget.budget import fit_integer_total
from headbudget.compression.svd import svd_compress
from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM, to_headbudget
from headbudget.models.surgery import get_adapter
from headbudget.schedules import HeadSchedule, LayerSpec


def _llama_gqa(tie=False, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return to_headbudget(LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=61, max_position_embeddings=64, tie_word_embeddings=tie))).eval()


def _gpt2_mixed():
    sched = HeadSchedule(64, (LayerSpec(2, 32), LayerSpec(4, 16, 2, 8, 24), LayerSpec(8, 8, 4)), neutral=False)
    return HeadBudgetForCausalLM(HeadBudgetConfig(schedule=sched, vocab_size=53, n_positions=32)).eval()


def _pruned_llama():
    m = _llama_gqa()
    m.prune_heads({0: [0, 5, 6], 1: [3]})  # unequal groups in both layers
    return m


@pytest.mark.parametrize("make", [_gpt2_mixed, _llama_gqa, _pruned_llama, lambda: _llama_gqa(tie=True)])
def test_cost_matches_parameter_count_and_torch_flop_counter(make):
    """Accounting vs ``sum(numel)`` and vs torch's own FLOP counter on the explicit attention path."""
    m = make()
    T = 24
    cost = config_cost(m.config, context=T)
    assert cost.params == sum(p.numel() for p in m.parameters())
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        m(torch.randint(0, m.config.vocab_size, (1, T)), output_attentions=True)
    assert counter.get_total_flops() == cost.flops_per_token * T


def test_lm_loss_equals_an_independent_cross_entropy_with_ignored_labels():
    m = _llama_gqa()
    x = torch.randint(0, 61, (3, 12))
    labels = x.clone()
    labels[0, 3] = labels[1, :7] = labels[2, -1] = -100
    out = m(x, labels=labels)
    logp = torch.log_softmax(out.logits.double(), -1)
    terms = [-logp[b, t, labels[b, t + 1]] for b in range(3) for t in range(11) if labels[b, t + 1] != -100]
    assert out.loss.item() == pytest.approx(torch.stack(terms).mean().item(), rel=1e-6)


def test_pruning_a_layer_whose_value_width_differs_from_its_query_width():
    sched = HeadSchedule(64, (LayerSpec(2, 32), LayerSpec(4, 16), LayerSpec(8, 8)), neutral=False)
    m = HeadBudgetForCausalLM(HeadBudgetConfig(schedule=sched, vocab_size=53, n_positions=32)).eval()
    svd_compress(m, qk_ranks=[16, 8, 4], v_ranks=[8, 16, 6])  # every layer now has qk_head_dim != v_head_dim
    x = torch.randint(0, 53, (2, 10))
    gates = [torch.ones(h) for h in m.head_counts]
    gates[0][1] = gates[1][0] = gates[2][[2, 5]] = 0.0
    gated = m(x, head_mask=gates).logits
    m.prune_heads({0: [1], 1: [0], 2: [2, 5]})
    assert (m(x).logits - gated).abs().max() <= 1e-5
    assert config_cost(m.config).params == sum(p.numel() for p in m.parameters())


def test_second_pruning_round_on_llama_gqa_indexes_current_heads():
    """Two rounds == one round with the union (mapped to original indices), compared on logits."""
    x = torch.randint(0, 61, (2, 10))
    two = _llama_gqa()
    two.prune_heads({0: [1, 2]})            # originals 1, 2 -> current heads are originals 0,3,4,5,6,7
    two.prune_heads({0: [1, 4]})            # current 1, 4 == originals 3, 6
    one = _llama_gqa()
    one.prune_heads({0: [1, 2, 3, 6]})
    assert torch.equal(two(x).logits, one(x).logits)
    assert two.transformer.h[0].attn.kv_groups == one.transformer.h[0].attn.kv_groups == [1, 3]


def test_magnitude_importance_on_grouped_query_model_counts_each_heads_own_kv_head():
    m = _pruned_llama()
    norms = get_adapter(m).head_weight_norms()
    for layer, block in enumerate(m.transformer.h):
        a = block.attn
        p = a.projections()
        for h in range(a.n_heads):  # reference: slice the fused weights by hand via the index map
            g = a.kv_index[h]
            dq, dv = a.qk_head_dim, a.v_head_dim
            sq = (p["q"][0][h * dq:(h + 1) * dq].pow(2).sum() + p["k"][0][g * dq:(g + 1) * dq].pow(2).sum()
                  + p["v"][0][g * dv:(g + 1) * dv].pow(2).sum() + a.o_proj.weight[:, h * dv:(h + 1) * dv].pow(2).sum())
            assert norms[layer][h] == pytest.approx(sq.sqrt().item(), rel=1e-5)


def _brute_force(targets, lower, upper, weights, total):
    best = None
    for v in itertools.product(*[range(lo, hi + 1) for lo, hi in zip(lower, upper)]):
        err = abs(total - sum(a * w for a, w in zip(v, weights)))
        dev = max(abs(a - t) for a, t in zip(v, targets))
        key = (round(err, 9), dev)
        if best is None or key < best[0]:
            best = (key, v)
    return best[0]


def test_budget_rounding_hits_the_total_without_straying_from_layer_targets():
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(2, 4)
        targets = [rng.uniform(1, 6) for _ in range(n)]
        weights = [rng.choice([1, 2, 3, 4]) for _ in range(n)]
        lower, upper = [1] * n, [7] * n
        total = sum(t * w for t, w in zip(targets, weights))
        v = fit_integer_total(targets, lower, upper, weights, total)
        err = abs(total - sum(a * w for a, w in zip(v, weights)))
        (best_err, best_dev) = _brute_force(targets, lower, upper, weights, total)
        assert err <= best_err + min(weights) / 2 + 1e-9, (targets, weights, v)
        # no layer strays more than one unit further from its target than the best exact-total solution
        assert max(abs(a - t) for a, t in zip(v, targets)) <= best_dev + 1 + 1e-9, (targets, weights, v)
