"""CAHP's signature pass regrouped by length (the default) against the per-batch reference (``legacy=True``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import names
from headbudget.pruning.signatures import MIN_WIDTH, _split_right_padded, collect_signatures

FIX = Path(__file__).resolve().parent / "fixtures" / "cahp"

# On the CPU this was written on, reference and fast path give bit-equal float32 maps and resize them
# with the same interpolate call; only the Chan merges of the float64 means/variances group the
# examples differently, a few float64 ulps (largest gap measured: 7e-16 here, 1.6e-15 on MiniLM's JM
# features over all SST-5 train).  A CPU whose kernels round another key width differently moves the
# float32 maps by a few float32 ulps (1.2e-7 relative each, maps <= 1; 1.5e-8 on the means measured
# with 9-token inputs cut to 9 columns).  1e-6 absolute on means and variances of values in [0, 1]
# and on JM distances in [0, 2] allows both and still catches a wrong crop, a lost or doubled example
# or a mixed-up label, which move them by 1e-3 or more.
ATOL = 1e-6


def _tokenizer():
    from transformers import BertTokenizerFast

    return BertTokenizerFast(vocab_file=str(FIX / "vocab.txt"), do_lower_case=True)


def _tiny(family: str):
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2ForSequenceClassification,
    )

    tok = _tokenizer()
    torch.manual_seed(0)
    if family == "bert":
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64, num_labels=5)
        return BertForSequenceClassification(cfg).eval()
    cfg = GPT2Config(vocab_size=tok.vocab_size, n_embd=32, n_layer=3, n_head=4, n_positions=64, num_labels=5,
                     pad_token_id=tok.pad_token_id)
    return GPT2ForSequenceClassification(cfg).eval()


def _batches(batch_size: int = 8):
    """The 60 fixture sentences (6-13 tokens), every fourth one followed by the next two, so that
    lengths fall on both sides of MIN_WIDTH, within batches and across them."""
    import dataclasses

    from headbudget.data.classification import load_task, make_loader

    train = load_task("sst5", FIX / "sst5", splits=["train"]).train
    train = [dataclasses.replace(ex, text=" ".join(e.text for e in train[i : i + 3])) if i % 4 == 0 else ex
             for i, ex in enumerate(train)]
    return list(make_loader(train, _tokenizer(), batch_size, False, 0, 64))


def _signatures(adapter, batches, n_classes, legacy, calls=None):
    def attention(b):
        inputs = {k: v for k, v in b.items() if k != "labels"}
        if calls is not None:
            calls.append(tuple(inputs["attention_mask"].shape))
        return adapter.attention_probs(**inputs)

    return collect_signatures(attention, batches, adapter.head_counts(), n_classes, grid=8, progress=False,
                              legacy=legacy)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_regrouped_signatures_and_kept_heads_equal_the_per_batch_reference(family):
    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.cahp import select_heads

    adapter = get_adapter(_tiny(family))
    batches = _batches()
    lengths = torch.cat([b["attention_mask"].sum(1) for b in batches])
    assert int(lengths.min()) < MIN_WIDTH < int(lengths.max())  # both widths rules are exercised
    calls: list[tuple[int, int]] = []
    ref = _signatures(adapter, batches, 5, legacy=True)
    new = _signatures(adapter, batches, 5, legacy=False, calls=calls)
    assert torch.equal(new.count, ref.count) and int(new.count.sum()) == 60
    torch.testing.assert_close(new.mean, ref.mean, atol=ATOL, rtol=0)
    torch.testing.assert_close(new.var, ref.var, atol=ATOL, rtol=0)
    np.testing.assert_allclose(new.features(), ref.features(), atol=ATOL, rtol=0)
    # the point of the path: fewer tokens through the model, never more per forward than a given batch
    budget = max(b["attention_mask"].numel() for b in batches)
    assert all(n * w <= budget for n, w in calls)
    assert sum(n * w for n, w in calls) < sum(b["attention_mask"].numel() for b in batches)
    # same selection: knee, clusters and kept heads
    salience = np.linspace(1.0, 2.0, len(ref.heads))
    a = select_heads(ref.features(), ref.heads, salience, perplexity=3.0, seed=42)
    b = select_heads(new.features(), new.heads, salience, perplexity=3.0, seed=42)
    assert (b.knee_k, b.kept) == (a.knee_k, a.kept)


def test_label_free_regrouped_equals_reference():
    from headbudget.models.surgery import get_adapter

    adapter = get_adapter(_tiny("bert"))
    batches = _batches(batch_size=16)
    ref = _signatures(adapter, batches, None, legacy=True)
    new = _signatures(adapter, batches, None, legacy=False)
    torch.testing.assert_close(new.mean, ref.mean, atol=ATOL, rtol=0)
    np.testing.assert_allclose(new.distances(), ref.distances(), atol=ATOL, rtol=0)


def _fake_attention(b):
    """Row-independent maps that depend on every real token and ignore padded keys: a batch layout
    cannot change them beyond float32 rounding, a wrong crop or row order changes them a lot."""
    ids, mask = b["input_ids"].double(), b["attention_mask"].double()
    scores = torch.sin(ids[:, None, :, None] * ids[:, None, None, :] / 7.0 + torch.arange(2.0)[None, :, None, None])
    scores = scores.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
    probs = torch.softmax(scores, -1).float()
    return [probs[:, :1], probs[:, 1:]]


def test_mixed_batches_fall_back_per_batch_and_still_match():
    """Left-padded and mask-less batches take the per-batch path; right-padded ones are regrouped."""
    g = torch.Generator().manual_seed(0)

    def batch(lengths, t, left=False, mask=True):
        ids = torch.randint(1, 50, (len(lengths), t), generator=g)
        m = torch.zeros(len(lengths), t, dtype=torch.long)
        for i, n in enumerate(lengths):
            m[i, t - n:] = 1 if left else 0
            m[i, :n] = 0 if left else 1
        out = {"input_ids": ids * m if mask else ids, "labels": torch.arange(len(lengths)) % 3}
        if mask:
            out["attention_mask"] = m
        return out

    batches = [batch([3, 20, 7], 20), batch([5, 9], 12), batch([4, 6, 6], 8, left=True), batch([5, 5], 5, mask=False),
               batch([18, 2], 18)]
    calls = []

    def attention(b):
        calls.append(tuple(b["input_ids"].shape))
        if "attention_mask" not in b:
            b = dict(b, attention_mask=torch.ones_like(b["input_ids"]))
        return _fake_attention(b)

    ref = collect_signatures(attention, batches, [1, 1], 3, grid=4, progress=False, legacy=True)
    calls.clear()
    new = collect_signatures(attention, batches, [1, 1], 3, grid=4, progress=False)
    torch.testing.assert_close(new.mean, ref.mean, atol=ATOL, rtol=0)
    torch.testing.assert_close(new.var, ref.var, atol=ATOL, rtol=0)
    assert new.count.tolist() == ref.count.tolist() == [5.0, 5.0, 2.0]
    # the two fall-backs first, as given; then lengths 2/3 (16 columns of a T>=16 batch), 5 and 9
    # (12 columns: their batch has only 12), 7 (16), 18 and 20, each one forward (budget 3 x 20 = 60)
    assert calls[:2] == [(3, 8), (2, 5)]
    assert calls[2:] == [(1, 16), (1, 16), (1, 12), (1, 16), (1, 12), (1, 18), (1, 20)]


def test_split_right_padded_rules():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    batch = {"input_ids": torch.arange(12).view(3, 4), "attention_mask": mask, "labels": torch.tensor([0, 1, 2])}
    parts = _split_right_padded(batch)
    assert [k[:2] for k, _ in parts] == [(2, 4), (4, 4)]  # T = 4 < MIN_WIDTH: the batch's own width
    assert parts[0][1]["labels"].tolist() == [0, 2] and parts[0][1]["input_ids"].tolist() == [[0, 1, 2, 3],
                                                                                            [8, 9, 10, 11]]
    wide = {k: torch.nn.functional.pad(v, (0, 30)) if v.dim() == 2 else v for k, v in batch.items()}
    assert [k[:2] for k, _ in _split_right_padded(wide)] == [(2, MIN_WIDTH), (4, MIN_WIDTH)]
    long_row = {k: v[1:2] for k, v in wide.items()}
    long_row["attention_mask"] = torch.ones(1, 34, dtype=torch.long)
    assert [k[:2] for k, _ in _split_right_padded(long_row)] == [(34, 34)]
    assert _split_right_padded({**batch, "attention_mask": mask.flip(1)}) is None  # left padding
    assert _split_right_padded({**batch, "attention_mask": torch.tensor([[1, 0, 1, 0]] * 3)}) is None  # a hole
    assert _split_right_padded({**batch, "attention_mask": mask * torch.tensor([[0], [1], [1]])}) is None  # empty row
    assert _split_right_padded({k: v for k, v in batch.items() if k != "attention_mask"}) is None
    assert _split_right_padded({**batch, "pixel_values": torch.zeros(3, 4, 4)}) is None
    assert _split_right_padded({**batch, "task": "sst5"}) is None


def test_missing_labels_fail_before_any_forward():
    calls = []
    batch = {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match=names("'labels'")):
        collect_signatures(lambda b: calls.append(1) or _fake_attention(b), [batch], [1, 1], 2, grid=4,
                           progress=False)
    assert calls == []
