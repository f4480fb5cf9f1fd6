"""CAHP selection options for label-free (task lm) pruning: Fisher representatives, importance allocation
over clusters (hand-computed on balanced examples: equal shares, ties to the lowest label, the cluster count),
their label-free defaults, and the CLI flags that set them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import names
from headbudget.pruning.cahp import LM_DEFAULTS, allocate_by_importance, select_heads
from headbudget.pruning.job import CahpSettings


def _groups(n_groups: int, per: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.normal(10.0 * c, 0.01, (per, 4)) for c in range(n_groups)])


def test_allocate_by_importance_spreads_the_count_by_summed_importance():
    # cluster 0 holds 90% of the importance, cluster 1 and 2 5% each: 6 slots -> 4, 1, 1
    labels = [0, 0, 0, 0, 0, 1, 1, 1, 2, 2]
    imp = [0.30, 0.25, 0.20, 0.10, 0.05, 0.03, 0.01, 0.01, 0.04, 0.01]
    assert allocate_by_importance(labels, imp, 6) == [0, 1, 2, 3, 5, 8]
    # every cluster keeps at least one head, even with no importance; a full cluster passes slots on
    assert allocate_by_importance([0, 0, 1, 2], [1.0, 1.0, 0.0, 0.0], 3) == [0, 2, 3]
    assert allocate_by_importance([0, 1, 1, 1], [9.0, 0.1, 0.3, 0.2], 3) == [0, 2, 3]
    with pytest.raises(ValueError, match=names(2, 3)):  # 2 heads, 3 clusters
        allocate_by_importance([0, 1, 2], [1.0, 1.0, 1.0], 2)


def test_representative_is_the_max_score_head_of_each_cluster():
    """One head per cluster: the max of ``scores`` (e.g. Fisher), not of salience."""
    feats = _groups(4, 6)                                    # 4 tight groups of 6 heads
    heads = [(i // 12, i % 12) for i in range(24)]          # 2 layers
    salience = np.linspace(1.0, 0.0, 24)                     # salience prefers each group's first head
    fisher = np.zeros(24)
    best = [3, 10, 14, 23]                                   # one planted max per group
    fisher[best] = 1.0
    # perplexity 3 < the group size, so that t-SNE keeps each group of 6 together
    by_sal = select_heads(feats, heads, salience, keep=4, seed=0, perplexity=3)
    assert by_sal.kept == [0, 6, 12, 18]
    by_fisher = select_heads(feats, heads, salience, keep=4, seed=0, perplexity=3, scores=fisher)
    assert by_fisher.kept == best


def test_importance_allocation_forced_count_one_per_layer():
    feats = _groups(3, 8, seed=1)                            # 24 heads in 3 groups
    heads = [(i // 6, i % 6) for i in range(24)]            # 4 layers of 6; group 0 = layer 0 + layer 1[:2]
    fisher = np.full(24, 0.01)
    fisher[:8] = np.linspace(2.0, 1.0, 8)                    # group 0 carries nearly all the importance
    sel = select_heads(feats, heads, np.zeros(24), keep=10, seed=0, perplexity=5, scores=fisher,
                       allocation="importance", n_clusters=3)
    assert len(sel.kept) == 10 and sel.knee_source == "keep" and sel.knee_k == 3
    assert {heads[i][0] for i in sel.kept} == {0, 1, 2, 3}    # at least one head per layer
    # group 0 gets the most slots (its top heads by Fisher), the others only what the rules force
    assert set(range(6)) <= set(sel.kept)
    assert sum(1 for i in sel.kept if i < 8) >= 7
    # one head per cluster with the same count keeps far fewer of group 0's heads
    one_each = select_heads(feats, heads, np.zeros(24), keep=10, seed=0, perplexity=5, scores=fisher)
    assert sum(1 for i in one_each.kept if i < 8) < sum(1 for i in sel.kept if i < 8)


def test_importance_allocation_on_the_knee_path_keeps_the_knee_count():
    feats = _groups(4, 6, seed=2)
    heads = [(i // 12, i % 12) for i in range(24)]
    fisher = np.random.default_rng(0).random(24)
    knee = select_heads(feats, heads, np.zeros(24), seed=0, perplexity=5, scores=fisher)
    alloc = select_heads(feats, heads, np.zeros(24), seed=0, perplexity=5, scores=fisher,
                         allocation="importance", n_clusters=2)
    assert knee.knee_source == alloc.knee_source == "mss" and len(alloc.mss) == len(knee.mss)
    assert len(alloc.kept) == len(knee.kept)
    with pytest.raises(ValueError, match=names("'greedy'", "cluster", "importance")):
        select_heads(feats, heads, np.zeros(24), keep=4, allocation="greedy")


def _tiny_lm():
    from transformers import GPT2Config, GPT2LMHeadModel

    from headbudget.models.surgery import get_adapter

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=32)).eval()
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 50, (3, 12), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    return get_adapter(model), batches


def test_cahp_select_defaults_by_mode_and_fisher_scores(monkeypatch):
    """Label-free: Fisher scores (mean squared per-example gate gradient) + importance allocation;
    class-conditional keeps the published salience / one head per cluster."""
    import headbudget.pruning.cahp as cahp
    from headbudget.pruning.importance import flatten, gate_gradients

    ad, batches = _tiny_lm()
    seen = {}
    real = cahp.select_heads

    def spy(features, heads, salience, **kw):
        seen.update(kw)
        return real(features, heads, salience, **kw)

    monkeypatch.setattr(cahp, "select_heads", spy)
    sel, secs = cahp.cahp_select(ad, batches, batches, CahpSettings(pool_size=6), n_classes=None, keep=5, seed=0,
                                 progress=False)
    assert seen["allocation"] == LM_DEFAULTS["allocation"] == "importance"
    assert seen["n_clusters"] is None and len(sel.kept) == 5 and set(secs) == {"signatures", "salience", "cluster"}
    want = flatten(gate_gradients(ad, ad.model, batches, reduce="example_square", progress=False))
    np.testing.assert_allclose(seen["scores"], want, rtol=1e-6)
    assert np.argmax(want) in sel.kept
    cahp.cahp_select(ad, batches, batches, CahpSettings(pool_size=6, representative="salience", allocation="cluster"),
                     n_classes=None, keep=5, seed=0, progress=False)
    assert seen["scores"] is None and seen["allocation"] == "cluster"  # the original label-free CAHP
    with pytest.raises(ValueError, match=names("'medoid'", "salience")):
        cahp.cahp_select(ad, batches, batches, CahpSettings(representative="medoid"), n_classes=None, keep=5,
                         progress=False)


def test_classification_default_stays_published(monkeypatch):
    import headbudget.pruning.cahp as cahp

    seen = {}

    def spy(features, heads, salience, **kw):
        seen.update(kw)
        raise RuntimeError("stop")

    class Sig:
        label_free = False
        heads = [(0, 0)]

        def features(self, *a):
            return np.zeros((1, 1))

    monkeypatch.setattr(cahp, "select_heads", spy)
    monkeypatch.setattr(cahp, "model_signatures", lambda *a, **k: Sig())
    monkeypatch.setattr("headbudget.pruning.importance.salience", lambda *a, **k: np.zeros(1))
    with pytest.raises(RuntimeError, match="stop"):
        cahp.cahp_select(type("A", (), {"model": None})(), [], [], n_classes=5, progress=False)
    assert seen["scores"] is None and seen["allocation"] == "cluster" and seen["n_clusters"] is None


def test_cli_flags_reach_the_job_and_unset_ones_stay_out_of_the_fingerprint():
    import argparse

    from headbudget.cli.prune_cmd import _add_common, _job
    from headbudget.pruning.job import PruneJob
    from headbudget.pruning.pipeline import _job_fingerprint

    p = argparse.ArgumentParser()
    _add_common(p, PruneJob)
    base = ["m", "--task", "lm", "--data", "t.txt", "--out", "o"]
    job = _job(p.parse_args([*base, "--representative", "salience", "--allocation", "cluster", "--clusters", "7"]))
    assert (job.representative, job.allocation, job.n_clusters) == ("salience", "cluster", 7)
    fp = _job_fingerprint(job)
    assert (fp["representative"], fp["allocation"], fp["n_clusters"]) == ("salience", "cluster", 7)
    default = _job(p.parse_args(base))
    assert default.representative is default.allocation is default.n_clusters is None
    assert not {"representative", "allocation", "n_clusters"} & set(_job_fingerprint(default))


def test_allocation_shares_are_of_all_slots():
    """A cluster's share is ``keep * mass_c / mass`` over all ``keep`` slots, its first slot included."""
    # two clusters of 10, cluster 0 holding 90% of the importance: shares 9 and 1 of the 10 slots (shares of
    # the 8 slots left after one each, 7.2 and 0.8, would give 1 + 7 and 1 + 1)
    labels = [0] * 10 + [1] * 10
    assert allocate_by_importance(labels, [0.9] * 10 + [0.1] * 10, 10) == [*range(9), 10]


def test_allocation_cluster_mass_is_the_summed_importance():
    """``mass_c`` sums the cluster's importance: a big cluster of less important heads can outweigh a
    small one of more important heads."""
    # 8 heads of importance 1.0 (sum 8, 40%) and 24 of 0.5 (sum 12, 60%): 4 and 6 of 10 slots; by the mean
    # importance (1.0 vs 0.5: two thirds to cluster 0) it would be 7 and 3
    labels = [0] * 8 + [1] * 24
    assert allocate_by_importance(labels, [1.0] * 8 + [0.5] * 24, 10) == [0, 1, 2, 3, *range(8, 14)]


def test_importance_allocation_on_the_knee_path_clusters_into_n_clusters():
    """Without ``keep``, the knee sets the head count only: the heads are allocated over the
    ``n_clusters`` clustering of the same embedding, not over the knee's clusters."""
    from headbudget.pruning.cahp import ensure_one_per_layer
    from headbudget.pruning.clustering import cluster_sweep

    feats = _groups(4, 6, seed=2)
    heads = [(i // 12, i % 12) for i in range(24)]
    fisher = np.random.default_rng(0).random(24)
    sel = select_heads(feats, heads, np.zeros(24), seed=0, perplexity=5, scores=fisher,
                       allocation="importance", n_clusters=2)
    assert sel.knee_source == "mss" and sel.knee_k > 2  # the knee differs from n_clusters here
    (two,) = cluster_sweep(sel.embedding, ks=[2], seed=0)
    assert len(np.unique(sel.labels)) == 2 and sel.labels.tolist() == two.labels.tolist()
    want, _ = ensure_one_per_layer(allocate_by_importance(two.labels, fisher, len(sel.kept)), heads, fisher)
    assert sel.kept == want


# ---------------------------------------------------------------------------- allocation, balanced
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
