"""Attention distance / entropy / locality on hand-made matrices and real models; plots."""

from __future__ import annotations

import math

import pytest
import torch

from headbudget.analysis.attention import (
    attention_stats,
    attention_summary,
    plot_distance,
    plot_distance_comparison,
    write_json,
)


def test_hand_made_matrix():
    # head 0: every query attends to key 0; head 1: uniform over the causal prefix
    t = 4
    h0 = torch.zeros(t, t)
    h0[:, 0] = 1.0
    h1 = torch.tril(torch.ones(t, t))
    h1 = h1 / h1.sum(-1, keepdim=True)
    s = attention_stats(torch.stack([h0, h1])[None], local_window=2)
    # head 0: distances i = 0,1,2,3 -> mean 1.5; head 1: E|i-j| = i/2 -> mean 0.75
    assert s["distance"] == pytest.approx([1.5, 0.75])
    # entropies: 0 for head 0; log(i+1) averaged for head 1
    assert s["entropy"] == pytest.approx([0.0, sum(math.log(i + 1) for i in range(t)) / t])
    # local window 2 = keys i and i-1: head 0 -> rows 0,1 have all mass there (1,1,0,0)
    # head 1 -> 1, 1, 2/3, 2/4
    assert s["local_share"] == pytest.approx([0.5, (1 + 1 + 2 / 3 + 0.5) / 4])


def test_query_mask_drops_padded_rows():
    h = torch.zeros(1, 1, 3, 3)
    h[0, 0, :, 0] = 1.0
    s = attention_stats(h, local_window=1, query_mask=torch.tensor([[1, 1, 0]]))
    assert s["distance"] == pytest.approx([0.5])  # rows 0 and 1 only


def _prism_model():
    from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    from headbudget.schedules import prism

    torch.manual_seed(0)
    return HeadBudgetForCausalLM(HeadBudgetConfig(schedule=prism(4, 32, 32, 8), vocab_size=64,
                                                  n_positions=64, dropout=0.0)).eval()


def test_summary_handles_different_head_counts_and_matches_stats(tmp_path):
    model = _prism_model()
    heads = [spec.n_heads for spec in model.config.head_schedule.layers]
    assert len(set(heads)) > 1
    ids = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(0))
    s = attention_summary(model, ids, local_window=4, batch_size=2)
    assert [r["n_heads"] for r in s["layers"]] == heads
    with torch.no_grad():
        att = model(ids, output_attentions=True).attentions
    for layer, probs in enumerate(att):
        want = attention_stats(probs, local_window=4)
        assert s["layers"][layer]["distance"] == pytest.approx(want["distance"], abs=1e-5)
        assert s["layers"][layer]["local_share"] == pytest.approx(want["local_share"], abs=1e-5)
        assert s["mean_distance"][layer] == pytest.approx(sum(want["distance"]) / heads[layer])
    assert s["plain_average_distance"] == pytest.approx(19 / 4)  # mean of i / 2 over query positions 0..19
    even = torch.tril(torch.ones(20, 20)) / torch.arange(1, 21)[:, None]  # every query averages its prefix
    assert attention_stats(even[None])["distance"][0] == pytest.approx(s["plain_average_distance"])
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[:, 15:] = 0  # right padding: 15 real tokens per row
    assert attention_summary(model, ids, attention_mask=mask)["plain_average_distance"] == pytest.approx(14 / 4)
    path = write_json(s, tmp_path / "a.json")
    assert path.read_text().startswith("{")
    p1 = plot_distance(s, tmp_path / "one.png")
    p2 = plot_distance_comparison({"prism": s, "again": s}, tmp_path / "cmp.png")
    for p in (p1, p2):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hf_gpt2_attentions():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=32,
                                       vocab_size=50)).eval()
    s = attention_summary(model, torch.randint(0, 50, (1, 12)), local_window=3)
    assert [r["n_heads"] for r in s["layers"]] == [2, 2]
    assert all(0.0 <= v <= 11.0 for r in s["layers"] for v in r["distance"])


def test_summary_from_a_long_text_encodes_only_a_prefix_with_the_whole_texts_ids():
    """`headbudget attention` on a many-MB file used to tokenize all of it for a few hundred tokens."""
    from headbudget.analysis.attention import _leading_ids, attention_summary_from_text
    from headbudget.data.synthetic import generate_text
    from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    from headbudget.models.tokenizers import BPETokenizer
    from headbudget.schedules import uniform

    text = generate_text(20000, seed=3)
    bpe = BPETokenizer.train([text[:20000]], 300)
    seen: list[int] = []

    class Spy:
        def encode(self, t, add_special_tokens=False):
            seen.append(len(t))
            return bpe.encode(t)

    full = bpe.encode(text)
    ids = _leading_ids(Spy(), text, 200)
    assert len(ids) >= 216 and ids == full[:len(ids)]           # the whole text's ids, as far as they go
    assert max(seen) < len(text) // 4                           # not the whole text
    assert _leading_ids(Spy(), text, len(full) + 1) == full     # more than the text holds: all of it
    torch.manual_seed(0)
    model = HeadBudgetForCausalLM(HeadBudgetConfig(schedule=uniform(2, 32, 2), vocab_size=bpe.vocab_size,
                                                   n_positions=64)).eval()
    got = attention_summary_from_text(model, Spy(), text, seq_len=32, n_seqs=3)
    ref = attention_summary(model, torch.tensor(full[:96]).view(3, 32))
    assert got["n_tokens"] == 32 and got["mean_distance"] == ref["mean_distance"]
