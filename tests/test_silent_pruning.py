"""Pruning results a one-line slip would change without an error: label-free CAHP's importance
allocation and cluster count on a balanced example (hand-computed), magnitude importance and two
pruning rounds on a plain transformers ``LlamaForCausalLM``."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from headbudget.models.surgery import get_adapter
from headbudget.pruning.cahp import allocate_by_importance, select_heads
from headbudget.pruning.importance import ImportanceContext, flatten, prune_spec
from headbudget.pruning.methods import select_by_method


# ---------------------------------------------------------------------------- CAHP allocation, balanced
def test_balanced_clusters_share_the_count_equally_and_ties_go_to_the_lowest_label():
    labels = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    imp = [3.0, 2.0, 1.0] * 4  # every cluster holds a quarter of the importance
    # keep 8: shares 8 x 1/4 = 2 each -> the two most important heads of every cluster
    assert allocate_by_importance(labels, imp, 8) == [0, 1, 3, 4, 6, 7, 9, 10]
    # keep 6: shares 1.5 each; after one slot each, the two slots left go to the tied clusters 0 and 1
    assert allocate_by_importance(labels, imp, 6) == [0, 1, 3, 4, 6, 9]
    # keep 7 in 3 clusters of 4: shares 7/3 -> slots 1,1,1 then clusters 0, 1, 2, then 0 again: 3, 2, 2
    assert allocate_by_importance([0] * 4 + [1] * 4 + [2] * 4, [4.0, 3.0, 2.0, 1.0] * 3, 7) == \
        [0, 1, 2, 4, 5, 8, 9]
    # every slot handed out, each cluster within its size
    assert allocate_by_importance(labels, imp, 12) == list(range(12))
    assert allocate_by_importance(labels, imp, 4) == [0, 3, 6, 9]


def test_equal_importance_not_equal_size_shares_by_importance():
    # cluster 0 has 2 heads, cluster 1 has 4, each half the importance: keep 4 -> 2 and 2, not 1 and 3
    labels = [0, 0, 1, 1, 1, 1]
    imp = [2.0, 2.0, 1.0, 1.0, 1.0, 1.0]
    assert allocate_by_importance(labels, imp, 4) == [0, 1, 2, 3]
    # a lone head holding half the importance fills its cluster; the slot it cannot take passes on
    assert allocate_by_importance([0, 1, 1, 1], [3.0, 1.0, 1.0, 1.0], 4) == [0, 1, 2, 3]
    # with no importance at all the shares follow the sizes: 4 x 2/6 -> 1 (+ rounding), 4 x 4/6 -> 3
    assert allocate_by_importance(labels, [0.0] * 6, 4) == [0, 2, 3, 4]


def _balanced_distances(groups: list[int], spread: float = 0.01) -> np.ndarray:
    """A label-free (JS-divergence-like) distance matrix: heads of one group near 0, others 1 apart."""
    g = np.asarray(groups)
    rng = np.random.default_rng(0)
    d = np.where(g[:, None] == g[None, :], spread, 1.0) + rng.uniform(0, spread, (len(g), len(g)))
    d = (d + d.T) / 2
    np.fill_diagonal(d, 0.0)
    return d


def _balanced_heads():
    """12 heads in 3 layers of 4; group g = heads (0, g), (1, g), (2, g): every group spans every layer.
    Importance per group sums to 6 (balanced); even groups rank layer 0 first, odd ones layer 2."""
    heads = [(i // 4, i % 4) for i in range(12)]
    groups = [h for _, h in heads]
    imp = np.array([{0: 3.0, 1: 2.0, 2: 1.0}[lay] if h % 2 == 0 else {0: 1.0, 1: 2.0, 2: 3.0}[lay]
                    for lay, h in heads])
    return heads, groups, imp


@pytest.mark.parametrize("n_clusters", [4, None], ids=["n_clusters=4", "default-n_clusters"])
def test_label_free_importance_allocation_on_a_balanced_example(n_clusters):
    heads, groups, imp = _balanced_heads()
    sel = select_heads(None, heads, np.zeros(12), distances=_balanced_distances(groups), keep=8, seed=0,
                       perplexity=3, scores=imp, allocation="importance", n_clusters=n_clusters)
    # the cluster count: n_clusters, capped by keep (8) and n - 1 (11); the default (30) -> 8
    assert sel.knee_k == (4 if n_clusters else 8) and len(np.unique(sel.labels)) == sel.knee_k
    assert sel.knee_source == "keep" and len(sel.kept) == 8 and sel.rescued == []
    if n_clusters == 4:
        # the clustering found the 4 groups, and each gets 8 x 6/24 = 2 slots: its two best heads
        assert all(len({sel.labels[i] for i in range(12) if groups[i] == g}) == 1 for g in range(4))
        assert sel.kept == [0, 2, 4, 5, 6, 7, 9, 11]


def test_label_free_importance_allocation_balanced_with_an_odd_count():
    heads, groups, imp = _balanced_heads()
    sel = select_heads(None, heads, np.zeros(12), distances=_balanced_distances(groups), keep=6, seed=0,
                       perplexity=3, scores=imp, allocation="importance", n_clusters=4)
    assert sel.knee_k == 4 and len(sel.kept) == 6
    label_of = {g: int(sel.labels[groups.index(g)]) for g in range(4)}
    # shares 1.5 each: one slot per group, the two extra ones to the groups with the two lowest labels
    extra = sorted(range(4), key=label_of.__getitem__)[:2]
    per_group = {g: sum(1 for i in sel.kept if groups[i] == g) for g in range(4)}
    assert per_group == {g: 2 if g in extra else 1 for g in range(4)}
    best_first = {g: sorted((i for i in range(12) if groups[i] == g), key=lambda i: (-imp[i], i)) for g in range(4)}
    assert sel.kept == sorted(i for g in range(4) for i in best_first[g][:per_group[g]])


# ---------------------------------------------------------------------------- a plain LlamaForCausalLM
def _plain_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=8, num_key_value_heads=4, head_dim=4,
                                         vocab_size=61, max_position_embeddings=32)).eval()
    with torch.no_grad():  # heads of clearly different sizes: query head h of every layer x (h + 1)
        for layer in model.model.layers:
            q = layer.self_attn.q_proj.weight.view(8, 4, 32)
            q.mul_(torch.arange(1.0, 9.0).view(8, 1, 1))
    return model


def _hand_magnitude(model) -> list[np.ndarray]:
    """Per head: sqrt(|q rows|^2 + |k rows|^2 + |v rows|^2 of its key/value head + |o columns|^2)."""
    out = []
    for layer in model.model.layers:
        a = layer.self_attn
        d = int(a.head_dim)
        n, n_kv = a.q_proj.out_features // d, a.k_proj.out_features // d
        scores = []
        for h in range(n):
            kv = h // (n // n_kv)
            sq = sum(float((w.detach()[r * d:(r + 1) * d] ** 2).sum()) for w, r in
                     ((a.q_proj.weight, h), (a.k_proj.weight, kv), (a.v_proj.weight, kv)))
            sq += float((a.o_proj.weight.detach()[:, h * d:(h + 1) * d] ** 2).sum())
            scores.append(np.sqrt(sq))
        out.append(np.array(scores))
    return out


def test_magnitude_importance_and_two_pruning_rounds_on_a_plain_llama():
    model = _plain_llama()
    dense = copy.deepcopy(model)
    adapter = get_adapter(model)
    assert adapter.family == "llama" and adapter.head_counts() == [8, 8] and adapter.kv_head_counts() == [4, 4]
    ctx = ImportanceContext(adapter, model, batches=[], progress=False)
    kept, scores = select_by_method("magnitude", ctx, 12)
    original = _hand_magnitude(model)
    np.testing.assert_allclose(scores, flatten(original), rtol=1e-6)
    # the scaled query rows make the last heads of each layer the largest: keep heads 2..7 of both
    assert kept == [2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15]

    # round 1 on the transformers model itself: heads 0, 1 (all of KV group 0) and half of group 1
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    adapter.prune_heads({0: [0, 1, 2], 1: [0, 1]})
    assert adapter.head_counts() == [5, 6] and adapter.kv_head_counts() == [5, 3]
    assert adapter.original_heads() == {0: [3, 4, 5, 6, 7], 1: [2, 3, 4, 5, 6, 7]}
    # magnitude on the pruned model: the survivors keep exactly their scores (their rows did not change)
    after = select_by_method("magnitude", ImportanceContext(adapter, model, [], progress=False), 6)
    np.testing.assert_allclose(after[1], flatten(_hand_magnitude(model)), rtol=1e-6)
    np.testing.assert_allclose(after[1], np.concatenate([original[0][3:], original[1][2:]]), rtol=1e-6)

    # round 2 on the already pruned model, by current indices: keep the best 6 by magnitude
    spec = prune_spec(after[0], adapter.head_counts())
    assert after[0] == [2, 3, 4, 8, 9, 10] and spec == {0: [0, 1], 1: [0, 1, 2]}
    adapter.prune_heads(spec)
    assert adapter.head_counts() == [3, 3] and adapter.kv_head_counts() == [3, 3]  # groups of 1 and 2: duplicated
    assert adapter.original_heads() == {0: [5, 6, 7], 1: [5, 6, 7]}
    with torch.no_grad():
        pruned = model(ids).logits
        gated_adapter = get_adapter(dense)
        gate = {li: torch.tensor([1.0 if h in keep else 0.0 for h in range(8)])
                for li, keep in adapter.original_heads().items()}
        with gated_adapter.set_gate_values(gate):
            gated = dense(ids).logits
        assert (gated - dense(ids).logits).abs().max() > 1e-3  # the removed heads mattered
    assert (pruned - gated).abs().max() <= 1e-5
    model.set_attn_implementation("eager")  # repeats key/value heads by num_key_value_groups itself
    with torch.no_grad():
        assert (model(ids).logits - gated).abs().max() <= 1e-5
