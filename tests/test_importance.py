"""Importance plug-ins on tiny random models: magnitude by hand (also on a plain transformers ``LlamaForCausalLM``
through two pruning rounds), gate gradients vs autograd, salience."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import names


def _bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=2,
                                                    num_attention_heads=4, intermediate_size=32,
                                                    max_position_embeddings=16, num_labels=3)).eval()


def _batches(n=3):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 30, (4, 7), generator=g), "attention_mask": torch.ones(4, 7, dtype=torch.long),
             "labels": torch.randint(0, 3, (4,), generator=g)} for _ in range(n)]


def test_magnitude_matches_hand_computation_bert_and_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    from headbudget.models.surgery import get_adapter

    model = _bert()
    sa = model.bert.encoder.layer[1].attention.self
    o = model.bert.encoder.layer[1].attention.output.dense.weight.detach()
    h = 2
    want = sum(float((w[h * 4:(h + 1) * 4] ** 2).sum()) for w in (sa.query.weight.detach(), sa.key.weight.detach(), sa.value.weight.detach()))
    want = np.sqrt(want + float((o[:, h * 4:(h + 1) * 4] ** 2).sum()))
    got = get_adapter(model).head_weight_norms()
    assert [len(s) for s in got] == [4, 4]
    assert got[1][h] == pytest.approx(want, rel=1e-5)

    torch.manual_seed(0)
    gpt = GPT2LMHeadModel(GPT2Config(vocab_size=20, n_embd=16, n_layer=1, n_head=4, n_positions=8))
    attn = gpt.transformer.h[0].attn
    w, c = attn.c_attn.weight.detach(), attn.c_proj.weight.detach()  # Conv1D: [in, 3E], [E, out]
    want = sum(float((w[:, k * 16 + h * 4:k * 16 + (h + 1) * 4] ** 2).sum()) for k in range(3))
    want = np.sqrt(want + float((c[h * 4:(h + 1) * 4] ** 2).sum()))
    assert get_adapter(gpt).head_weight_norms()[0][h] == pytest.approx(want, rel=1e-5)


def test_gate_gradients_abs_and_square_and_salience():
    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.importance import default_loss, flatten, gate_gradients, salience

    model = _bert()
    ad = get_adapter(model)
    batches = _batches(4)
    # reference: per-batch gate gradients by hand
    per_batch = []
    for b in batches:
        with ad.gates() as gates:
            default_loss(model, b).backward()
            per_batch.append(torch.cat([g.grad.detach().double() for g in gates]))
    ref = torch.stack(per_batch)
    got_abs = flatten(gate_gradients(ad, model, batches, progress=False))
    got_sq = flatten(gate_gradients(ad, model, batches, reduce="square", progress=False))
    np.testing.assert_allclose(got_abs, ref.abs().mean(0).numpy(), rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(got_sq, (ref**2).sum(0).numpy(), rtol=1e-5, atol=1e-12)
    assert all(p.requires_grad for p in model.parameters())  # parameter flags restored
    sal = salience(ad, model, batches, fraction=0.25, progress=False)  # first batch only
    first = ref[0].abs().numpy()
    np.testing.assert_allclose(sal, (first - first.min()) / (first.max() - first.min()), rtol=1e-5, atol=1e-9)
    assert sal.min() == 0.0 and sal.max() == 1.0


def test_fisher_and_random_through_registry():
    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.importance import ImportanceContext
    from headbudget.pruning.methods import importance_table, select_by_method

    model = _bert()
    ctx = ImportanceContext(get_adapter(model), model, _batches(2), seed=5, progress=False)
    assert set(importance_table()) == {"michel", "fisher", "magnitude", "random"}
    kept, scores = select_by_method("random", ctx, 3)
    assert kept == select_by_method("random", ctx, 3)[0] and len(kept) == 3
    kept_f, scores_f = select_by_method("fisher", ctx, 5)
    assert len(kept_f) == 5 and scores_f.shape == (8,)
    assert {i // 4 for i in kept_f} == {0, 1}
    with pytest.raises(ValueError, match=names("'foo'", "fisher")):
        select_by_method("foo", ctx, 3)


def test_fisher_is_mean_of_per_example_squared_gradients():
    """Fisher = mean over examples of (dL_i/dgate)^2: a batch of 4 vs 4 single-example backward passes by hand."""
    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.importance import ImportanceContext, default_loss, fisher_importance, flatten

    model = _bert()
    ad = get_adapter(model)
    batches = _batches(2)
    batches[1]["attention_mask"][2, 5:] = 0  # a padded example: its slice keeps its own mask
    per_example, per_batch = [], []
    for b in batches:
        for i in range(4):
            one = {"input_ids": b["input_ids"][i : i + 1], "attention_mask": b["attention_mask"][i : i + 1],
                   "labels": b["labels"][i : i + 1]}
            with ad.gates() as gates:
                default_loss(model, one).backward()
                per_example.append(torch.cat([g.grad.detach().double() for g in gates]))
        with ad.gates() as gates:
            default_loss(model, b).backward()
            per_batch.append(torch.cat([g.grad.detach().double() for g in gates]))
    want = (torch.stack(per_example) ** 2).mean(0).numpy()
    got = flatten(fisher_importance(ImportanceContext(ad, model, batches, seed=0, progress=False)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-12)
    # not the squared gradient of the batch-mean loss (what it was before): the two differ
    batch_mean = (torch.stack(per_batch) ** 2).mean(0).numpy()
    assert not np.allclose(got, batch_mean, rtol=1e-2, atol=0)
    # the per-example mean of gradients is the batch gradient (a sanity check of the hand loop)
    np.testing.assert_allclose(torch.stack(per_example).view(2, 4, -1).mean(1).numpy(), torch.stack(per_batch).numpy(),
                               rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_batched_fisher_equals_example_by_example_on_causal_lms(family):
    """One backward pass per batch (per-example gate rows) gives the textbook per-example Fisher of a causal LM,
    also at other gate values (a pruned head's gate at 0) and with -100 labels in one example."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.importance import default_loss, gate_gradients

    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=4, n_positions=16))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))
    ad = get_adapter(model)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 40, (3, 9), generator=g)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    batches[1]["labels"][0, 4:] = -100
    values = [np.ones(4), np.array([1.0, 0.0, 1.0, 1.0])]
    for gate_values in (None, values):
        got = gate_gradients(ad, model, batches, reduce="example_square", gate_values=gate_values, progress=False)
        want = gate_gradients(ad, model, batches, lambda m, b: default_loss(m, b), reduce="example_square",
                              gate_values=gate_values, progress=False)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-12)
        assert float(np.abs(got[0]).sum()) > 0


def test_fisher_goes_example_by_example_when_the_loss_does_not_split():
    """A regression head's loss is not the cross-entropy per_example_losses computes: the batched path must not run."""
    from transformers import BertConfig, BertForSequenceClassification

    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.importance import _losses_split, default_loss, gate_gradients

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=4, intermediate_size=32,
                                                     max_position_embeddings=16, num_labels=1)).eval()
    batches = [{"input_ids": torch.randint(0, 30, (3, 5)), "labels": torch.randn(3)}]
    assert not _losses_split(model, batches)
    ad = get_adapter(model)
    got = gate_gradients(ad, model, batches, reduce="example_square", progress=False)
    want = gate_gradients(ad, model, batches, lambda m, b: default_loss(m, b), reduce="example_square", progress=False)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert _losses_split(_bert(), _batches(1))


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
    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.importance import ImportanceContext, flatten, prune_spec
    from headbudget.pruning.methods import select_by_method

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


def test_gate_gradient_bars_count_the_batches(monkeypatch):
    """The bar's total is the number of batches (``max_batches`` when given), on both Fisher paths."""
    from headbudget import progress
    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.importance import gate_gradients

    totals = []

    class Spy(progress.ProgressBar):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            totals.append(self.total)

    monkeypatch.setattr(progress, "ProgressBar", Spy)
    model = _bert()
    ad = get_adapter(model)
    gate_gradients(ad, model, _batches(3), progress=False)
    gate_gradients(ad, model, _batches(3), reduce="example_square", progress=False)  # the batched Fisher
    gate_gradients(ad, model, _batches(3), max_batches=2, progress=False)
    assert totals == [3, 3, 2]
