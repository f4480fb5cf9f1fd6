"""CAHP math on synthetic arrays: distances, streaming stats, padding, MSS, knee, selection rules."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import names
from headbudget.pruning.cahp import ensure_one_per_layer, kept_by_layer, representatives, select_heads
from headbudget.pruning.clustering import cluster_sweep, find_knee, mean_simplified_silhouette
from headbudget.pruning.importance import head_list, michel_iterative, prune_spec, select_top
from headbudget.pruning.signatures import (
    ClassSignatureAccumulator,
    bhattacharyya_gaussian,
    collect_signatures,
    jeffries_matusita,
    jm_features,
    js_distance_matrix,
    real_token_maps,
    resize_maps,
)


# ----------------------------------------------------------------------------- distances
def test_bhattacharyya_and_jm_hand_values():
    # equal variances, means 1 apart: 1/4 * 1/2 = 0.125
    assert float(bhattacharyya_gaussian(0.0, 1.0, 1.0, 1.0, eps=0)) == pytest.approx(0.125, abs=1e-12)
    # equal means, variances 1 and 4: 1/2 ln(5 / (2*1*2)) = 1/2 ln 1.25
    assert float(bhattacharyya_gaussian(0.0, 1.0, 0.0, 4.0, eps=0)) == pytest.approx(0.5 * math.log(1.25), abs=1e-12)
    # both terms: mu 0 vs 2, var 1 vs 3: 1/4 * 4/4 + 1/2 ln(4 / (2 sqrt 3))
    want = 0.25 + 0.5 * math.log(4 / (2 * math.sqrt(3)))
    assert float(bhattacharyya_gaussian(0.0, 1.0, 2.0, 3.0, eps=0)) == pytest.approx(want, abs=1e-12)
    assert float(jeffries_matusita(0.0, 1.0, 1.0, 1.0, eps=0)) == pytest.approx(2 * (1 - math.exp(-0.125)), abs=1e-12)
    # identical Gaussians -> 0; far apart -> saturates at 2
    assert float(jeffries_matusita(0.3, 0.1, 0.3, 0.1)) == pytest.approx(0.0, abs=1e-12)
    assert float(jeffries_matusita(0.0, 0.0, 1.0, 0.0, eps=1e-10)) == pytest.approx(2.0, abs=1e-12)


def test_variance_floor_default_is_published_max_var_1e6():
    # var 0 and 4e-6, means 0 and 1e-3: the default floors to max(var, 1e-6) -> v1 = 1e-6, v2 = 4e-6:
    # D_B = 1/4 * 1e-6 / 5e-6 + 1/2 ln(5e-6 / (2 * sqrt(1e-6 * 4e-6))) = 0.05 + 1/2 ln(5/4)
    want = 0.05 + 0.5 * math.log(1.25)
    assert float(bhattacharyya_gaussian(0.0, 0.0, 1e-3, 4e-6)) == pytest.approx(want, rel=1e-9)
    assert float(jeffries_matusita(0.0, 0.0, 1e-3, 4e-6)) == pytest.approx(2 * (1 - math.exp(-want)), rel=1e-9)
    # variances above the floor are untouched (the hand values above hold with the default floor too)
    assert float(bhattacharyya_gaussian(0.0, 1.0, 2.0, 3.0)) == pytest.approx(
        0.25 + 0.5 * math.log(4 / (2 * math.sqrt(3))), abs=1e-12)
    # the earlier choice, var + 1e-10 with no floor: v1 = 1e-10, v2 = 4.0001e-6
    v1, v2 = 1e-10, 4e-6 + 1e-10
    old = 0.25 * 1e-6 / (v1 + v2) + 0.5 * math.log((v1 + v2) / (2 * math.sqrt(v1 * v2)))
    got = float(bhattacharyya_gaussian(0.0, 0.0, 1e-3, 4e-6, eps=1e-10, var_floor=None))
    assert got == pytest.approx(old, rel=1e-9) and got > 1.0 > want  # the floor matters here


def test_jm_features_layout_and_pairs():
    mean = torch.zeros(3, 2, 2, 2, dtype=torch.float64)
    var = torch.ones(3, 2, 2, 2, dtype=torch.float64)
    mean[1, 0] = 1.0  # class 1 differs from 0 and 2 on head 0 only
    feats = jm_features(mean, var, eps=0)
    assert feats.shape == (2, 3 * 4)  # pairs (0,1), (0,2), (1,2) x 4 cells
    jm1 = 2 * (1 - math.exp(-0.125))
    np.testing.assert_allclose(feats[0], [jm1] * 4 + [0.0] * 4 + [jm1] * 4, atol=1e-12)
    np.testing.assert_allclose(feats[1], 0.0, atol=1e-12)
    with pytest.raises(ValueError, match="at least two classes"):
        jm_features(mean[:1], var[:1])


def test_streaming_stats_match_numpy_and_do_not_depend_on_batching():
    rng = np.random.default_rng(0)
    x = rng.random((40, 3, 4, 4))
    y = rng.integers(0, 3, 40)
    a = ClassSignatureAccumulator(3, 3, 4)
    a.update(torch.tensor(x), torch.tensor(y))
    b = ClassSignatureAccumulator(3, 3, 4)
    for s in range(0, 40, 7):
        b.update(torch.tensor(x[s : s + 7]), torch.tensor(y[s : s + 7]))
    pop = ClassSignatureAccumulator(3, 3, 4, ddof=0)
    pop.update(torch.tensor(x), torch.tensor(y))
    for c in range(3):
        np.testing.assert_allclose(a.mean[c].numpy(), x[y == c].mean(0), atol=1e-12)
        # default: sample variance (ddof 1), as the published code's torch.var
        np.testing.assert_allclose(a.var[c].numpy(), x[y == c].var(0, ddof=1), atol=1e-12)
        np.testing.assert_allclose(pop.var[c].numpy(), x[y == c].var(0, ddof=0), atol=1e-12)
        np.testing.assert_allclose(b.mean[c].numpy(), a.mean[c].numpy(), atol=1e-12)
        np.testing.assert_allclose(b.var[c].numpy(), a.var[c].numpy(), atol=1e-12)
    assert a.count.tolist() == [float((y == c).sum()) for c in range(3)]


def test_js_distance_matrix_hand_value():
    p = torch.tensor([[[1.0, 0.0], [0.5, 0.5]], [[0.0, 1.0], [0.5, 0.5]], [[1.0, 0.0], [0.5, 0.5]]])
    d = js_distance_matrix(p)
    # row 0 disjoint -> ln 2, row 1 identical -> 0: mean ln2 / 2
    assert d[0, 1] == pytest.approx(math.log(2) / 2, abs=1e-12)
    assert d[0, 2] == pytest.approx(0.0, abs=1e-12)
    np.testing.assert_allclose(d, d.T)


# ----------------------------------------------------------------------------- padding
def test_padding_never_enters_the_grid():
    torch.manual_seed(0)
    lengths = [5, 3, 4]
    t = 6
    real = [torch.softmax(torch.randn(2, n, n), -1) for n in lengths]
    # right-padded batch whose padding cells hold garbage; one left-padded copy of input 1
    attn = torch.full((3, 2, t, t), 7.0)
    mask = torch.zeros(3, t, dtype=torch.long)
    for i, (m, n) in enumerate(zip(real, lengths)):
        if i == 1:  # left padding
            attn[i, :, t - n :, t - n :] = m
            mask[i, t - n :] = 1
        else:
            attn[i, :, :n, :n] = m
            mask[i, :n] = 1
    layers = [attn[:, :1], attn[:, 1:]]  # two layers of one head each
    maps = real_token_maps(layers, mask)
    for m, r in zip(maps, real):
        torch.testing.assert_close(m, r)
    batch = {"attention_mask": mask, "labels": torch.tensor([0, 1, 1])}
    sig = collect_signatures(lambda b: layers, [batch], [1, 1], n_classes=2, grid=4, progress=False)
    want = resize_maps(real, 4).double()
    torch.testing.assert_close(sig.mean[0], want[0])
    torch.testing.assert_close(sig.mean[1], want[1:].mean(0))
    assert float(sig.mean.max()) <= 1.0  # the 7.0 padding never leaked


def test_resize_identity_at_same_size():
    m = torch.softmax(torch.randn(2, 4, 4), -1)
    torch.testing.assert_close(resize_maps([m], 4)[0], m)


# ----------------------------------------------------------------------------- MSS and knee
PTS = np.array([[0.0], [1.0], [10.0], [12.0], [20.0]])


def test_mss_mean_and_nearest_variants_hand_values():
    labels, medoids = [0, 0, 1, 1, 2], [0, 2, 4]
    # point 1: a=1, others 9 and 19; point 3: a=2, others 12 and 8
    mean_v = ((14 - 1) / 14 + (10 - 2) / 10) / 2
    nearest_v = ((9 - 1) / 9 + (8 - 2) / 8) / 2
    assert mean_simplified_silhouette(PTS, labels, medoids) == pytest.approx(mean_v, abs=1e-12)
    assert mean_simplified_silhouette(PTS, labels, medoids, "nearest") == pytest.approx(nearest_v, abs=1e-12)
    with pytest.raises(ValueError, match=names("'max'", "mean", "nearest")):
        mean_simplified_silhouette(PTS, labels, medoids, "max")


def test_cluster_sweep_finds_obvious_groups():
    rng = np.random.default_rng(1)
    pts = np.concatenate([rng.normal(c * 10, 0.1, (5, 2)) for c in range(3)])
    sweep = cluster_sweep(pts, seed=0)
    assert [c.k for c in sweep] == list(range(2, 15))
    three = sweep[1]
    assert [three.labels[i * 5] for i in range(3)] == [three.labels[i * 5 + 4] for i in range(3)]
    assert len(set(three.labels.tolist())) == 3
    # the published "mean" variant keeps rising after the true k (hence the knee) ...
    assert sweep[0].mss < 0.7 < 0.99 < three.mss <= sweep[-1].mss
    # ... the textbook nearest-medoid variant peaks at the true k
    nearest = cluster_sweep(pts, seed=0, variant="nearest")
    assert max(nearest, key=lambda c: c.mss).k == 3


def test_knee_on_synthetic_curve_and_degree_effect():
    x = list(range(2, 31))
    y = [min(k, 10) / 10 for k in x]
    assert find_knee(x, y, 6) == 11.0
    assert find_knee(x, y, 3) == 11.0
    assert find_knee(x, y, 2) == 14.0  # a lower degree keeps more heads
    assert find_knee([1, 2], [0, 1]) is None


# ----------------------------------------------------------------------------- selection rules
def test_representatives_are_most_salient_not_medoid():
    assert representatives([0, 0, 1, 1, 1], [0.1, 0.2, 0.9, 0.3, 0.95]) == [1, 4]


def test_at_least_one_head_per_layer_rescue():
    heads = head_list([3, 2, 2])
    kept, rescued = ensure_one_per_layer([0, 1], heads, [0.5, 0.1, 0.2, 0.3, 0.8, 0.6, 0.6])
    assert rescued == [4, 5]  # layer 1: head 1 (0.8); layer 2: tie -> lower index
    assert kept_by_layer(kept, heads) == {0: [0, 1], 1: [1], 2: [0]}


def test_select_top_exact_count_and_one_per_layer():
    scores = [np.array([0.9, 0.8, 0.7]), np.array([0.1, 0.05]), np.array([0.6, 0.95])]
    kept = select_top(scores, 4)
    assert kept == [0, 1, 3, 6]
    assert prune_spec(kept, [3, 2, 2]) == {0: [2], 1: [1], 2: [0]}
    with pytest.raises(ValueError, match=names(2, 3, 7)):  # 2 heads asked: between 3 (one per layer) and 7
        select_top(scores, 2)


def test_select_heads_seeded_and_forced_keep():
    rng = np.random.default_rng(0)
    feats = np.concatenate([rng.normal(c, 0.05, (6, 8)) for c in range(4)])
    heads = head_list([6, 6, 6, 6])
    sal = rng.random(24)
    a = select_heads(feats, heads, sal, seed=3)
    b = select_heads(feats, heads, sal, seed=3)
    assert a.kept == b.kept and a.knee_k == b.knee_k
    np.testing.assert_allclose(a.embedding, b.embedding)
    forced = select_heads(feats, heads, sal, keep=7, seed=0)
    assert forced.knee_source == "keep" and len(forced.kept) == 7
    assert forced.knee_k == 7 - len(forced.rescued)
    assert all(forced.kept_by_layer[layer] for layer in range(4))
    for c in range(forced.knee_k):  # each kept head is its cluster's most salient
        members = np.flatnonzero(forced.labels == c)
        assert int(members[np.argmax(sal[members])]) in forced.kept
    with pytest.raises(ValueError, match=names("--keep", 4, 23, 24)):
        select_heads(feats, heads, sal, keep=24)


class _FakeGateAdapter:
    """Loss = sum_h w_h * gate_h^2 per layer: gradient 2 w_h g_h, zero once a gate is 0."""

    def __init__(self, weights):
        self.w = [torch.tensor(w, dtype=torch.float64) for w in weights]
        self.model = torch.nn.Linear(1, 1)

    def head_counts(self):
        return [len(w) for w in self.w]

    def gates(self):
        import contextlib

        @contextlib.contextmanager
        def cm():
            self.g = [torch.ones(len(w), dtype=torch.float64, requires_grad=True) for w in self.w]
            yield self.g

        return cm()


def test_michel_iterative_recomputes_with_gates_zeroed():
    from headbudget.pruning.importance import ImportanceContext

    ad = _FakeGateAdapter([[1.0, 2.0, 3.0, 4.0], [5.0, 0.5]])
    loss = lambda model, batch: sum((w * g**2).sum() for w, g in zip(ad.w, ad.g))  # noqa: E731
    ctx = ImportanceContext(ad, ad.model, [{}], loss, progress=False)
    kept = michel_iterative(ctx, 3, step_fraction=0.2)
    # layer-normalised: layer 0 -> [1,2,3,4]/sqrt(30); layer 1 -> [5, .5]/sqrt(25.25)
    # round 1 removes (1,1) (0.0995) then head (0,0) (0.18) ; round 2 removes (0,1)
    assert kept == [2, 3, 4]


def test_parity_defaults_seed_and_tsne_float32(monkeypatch):
    import inspect

    import sklearn.manifold

    from headbudget.pruning.cahp import cahp_select, select_heads
    from headbudget.pruning.clustering import cluster_sweep, embed_heads
    from headbudget.pruning.job import PruneJob

    for fn in (cahp_select, select_heads, embed_heads, cluster_sweep):
        assert inspect.signature(fn).parameters["seed"].default == 42, fn.__name__
    assert PruneJob(model="m", task="sst5", data_dir="d", out="o").seed == 42
    from headbudget.cli.main import build_parser

    args = build_parser().parse_args(["prune", "m", "--task", "sst5", "--data-dir", "d", "--out", "o"])
    assert args.seed == 42 and args.salience_order == "file" and not args.legacy_signatures
    seen = []
    real = sklearn.manifold.TSNE.fit_transform

    def spy(self, x, *a, **k):
        seen.append((np.asarray(x).dtype, self.random_state))
        return real(self, x, *a, **k)

    monkeypatch.setattr(sklearn.manifold.TSNE, "fit_transform", spy)
    feats = np.random.default_rng(0).random((8, 5))
    embed_heads(feats, perplexity=3)
    embed_heads(feats, perplexity=3, dtype="float64")
    embed_heads(distances=np.abs(feats[:, :1] - feats[:, :1].T), perplexity=3)
    assert seen == [(np.float32, 42), (np.float64, 42), (np.float32, 42)]


def test_select_heads_knee_path_end_to_end_matches_independent_pipeline():
    """No forced count: t-SNE -> FasterPAM sweep -> MSS (mean variant) -> Kneedle knee -> most salient head per
    cluster -> one head per layer, recomputed here with sklearn / kmedoids / kneed directly."""
    import kmedoids
    from kneed import KneeLocator
    from sklearn.manifold import TSNE

    from headbudget.pruning.cahp import select_heads

    rng = np.random.default_rng(7)
    centres = rng.normal(0, 10, (6, 12))
    feats = np.concatenate([c + rng.normal(0, 0.3, (5, 12)) for c in centres])  # 30 heads in 6 blobs
    heads = [(i // 6, i % 6) for i in range(30)]  # 5 layers x 6 heads
    sal = rng.random(30)
    sel = select_heads(feats, heads, sal)
    assert sel.knee_source == "mss"

    emb = TSNE(2, perplexity=10.0, init="pca", random_state=42).fit_transform(feats.astype(np.float32))
    np.testing.assert_allclose(sel.embedding, emb, atol=1e-4)
    e64 = emb.astype(np.float64)
    diss = np.sqrt(((e64[:, None, :] - e64[None, :, :]) ** 2).sum(-1))
    curve, by_k = [], {}
    for k in range(2, 30):
        res = kmedoids.fasterpam(diss, k, random_state=42, n_cpu=1)
        lab, med = np.asarray(res.labels), np.asarray(res.medoids)
        s = []
        for i in range(30):
            if i in set(med.tolist()):
                continue
            a = diss[i, med[lab[i]]]
            b = np.mean([diss[i, m] for j, m in enumerate(med) if j != lab[i]])
            s.append((b - a) / max(a, b))
        curve.append((k, float(np.mean(s))))
        by_k[k] = lab
    np.testing.assert_allclose([v for _, v in sel.mss], [v for _, v in curve], atol=1e-9)
    knee = KneeLocator([k for k, _ in curve], [v for _, v in curve], curve="concave", direction="increasing",
                       interp_method="polynomial", polynomial_degree=6).knee
    assert knee is not None and sel.knee_k == int(round(knee))
    lab = by_k[sel.knee_k]
    want = {max(np.flatnonzero(lab == c), key=lambda i: (sal[i], -i)) for c in np.unique(lab)}
    for layer in range(5):
        members = [i for i in range(30) if heads[i][0] == layer]
        if not want.intersection(members):
            want.add(max(members, key=lambda i: (sal[i], -i)))
    assert sel.kept == sorted(int(i) for i in want)
    assert 5 <= len(sel.kept) < 30
