"""Scorer results that a one-line slip would corrupt without an error: ``is_greedy`` (every token of the
continuation the argmax, on both strategies) and models whose logits are scaled or soft-capped after
the output projection (the projection must then not be split off the decoder)."""

from __future__ import annotations

import pytest
import torch
from tests.test_eval_zeroshot import byte_tokenizer, tiny_gpt2
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
)

from headbudget.evaluation.scorer import Scorer


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@torch.no_grad()
def _hand(model, ids: list[int], n: int) -> tuple[float, bool]:
    """(log P(last n tokens | the ones before), every one of them the argmax): the plain computation."""
    logits = model(torch.tensor([ids[:-1]])).logits[0, -n:].float()
    target = torch.tensor(ids[-n:])
    lp = torch.log_softmax(logits, -1).gather(-1, target[:, None])[:, 0]
    return float(lp.sum()), bool((logits.argmax(-1) == target).all())


@torch.no_grad()
def _greedy_after(model, ids: list[int]) -> int:
    return int(model(torch.tensor([ids])).logits[0, -1].argmax())


@torch.no_grad()
def _not_greedy_after(model, ids: list[int]) -> int:
    return int(model(torch.tensor([ids])).logits[0, -1].argmin())


def _greedy_rows(model) -> tuple[list[tuple[list[int], int]], list[bool]]:
    """Rows (ids, 3 scored tokens) whose continuations are: all greedy; greedy but the last; greedy but
    the first; greedy only the last; and none greedy."""
    ctx = [72, 101, 108, 108, 111, 32]
    rows = []
    for pattern in ("ggg", "ggx", "xgg", "xxg", "xxx"):
        ids = list(ctx)
        for p in pattern:
            ids.append(_greedy_after(model, ids) if p == "g" else _not_greedy_after(model, ids))
        rows.append((ids, 3))
    return rows, [True, False, False, False, False]


@pytest.mark.parametrize("strategy", ["full", "prefix"])
def test_is_greedy_means_every_continuation_token_is_the_argmax(tok, strategy):
    model = tiny_gpt2()
    rows, greedy = _greedy_rows(model)
    scorer = Scorer(model, tok, batch_size=2, strategy=strategy, progress=False)
    got = scorer.score_rows(rows)
    assert [g for _, g in got] == greedy
    for (ids, n), (ll, _) in zip(rows, got):
        assert ll == pytest.approx(_hand(model, ids, n)[0], abs=1e-5)
    assert [_hand(model, ids, n)[1] for ids, n in rows] == greedy  # the rows are what they claim
    assert scorer.stats.strategy == strategy and scorer.stats.fallbacks == []


@pytest.mark.parametrize("strategy", ["full", "prefix"])
def test_is_greedy_of_several_choices_per_item(tok, strategy):
    # the choices of one item share the context: one branched trie (prefix), or one sequence each,
    # sorted by length and regrouped into items (full)
    model = tiny_gpt2()
    rows, _ = _greedy_rows(model)
    items = [[rows[0], rows[4], rows[1]], [rows[3][:1] + (1,)], [rows[2], rows[0]]]
    scorer = Scorer(model, tok, batch_size=2, strategy=strategy, progress=False)
    with torch.inference_mode():
        got = scorer._score_items([[(list(ids), n) for ids, n in item] for item in items], "choices")
    want = [[_hand(model, ids, n) for ids, n in item] for item in items]
    assert [[g for _, g in item] for item in got] == [[True, False, False], [True], [False, True]]
    assert [[g for _, g in item] for item in want] == [[True, False, False], [True], [False, True]]
    for item_got, item_want in zip(got, want):
        for (ll, _), (ref, _) in zip(item_got, item_want):
            assert ll == pytest.approx(ref, abs=1e-5)


# ---------------------------------------------------------------------------- logits after the head
_SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=257, max_position_embeddings=128)


def _granite():
    return GraniteForCausalLM(GraniteConfig(logits_scaling=0.05, **_SHAPE))  # logits x 20


def _cohere():
    return CohereForCausalLM(CohereConfig(logit_scale=8.0, **_SHAPE))


def _gemma2():
    return Gemma2ForCausalLM(Gemma2Config(final_logit_softcapping=0.3, head_dim=8, sliding_window=64,
                                          layer_types=["full_attention"] * 2, **_SHAPE))


@pytest.mark.parametrize("make", [_granite, _cohere, _gemma2], ids=["granite", "cohere", "gemma2"])
@pytest.mark.parametrize("strategy", ["full", "prefix"])
def test_scaled_or_soft_capped_logits_are_scored_as_the_model_returns_them(tok, make, strategy):
    torch.manual_seed(0)
    model = make().eval()
    with torch.no_grad():  # scaled or capped logits differ from head(decoder(x)) by far more than 1e-5
        ids = torch.tensor([[72, 101, 108, 108, 111]])
        plain = model.get_output_embeddings()(model.get_decoder()(ids).last_hidden_state)
        assert (torch.log_softmax(plain, -1) - torch.log_softmax(model(ids).logits, -1)).abs().max() > 1e-3
    scorer = Scorer(model, tok, batch_size=4, strategy=strategy, progress=False)
    assert scorer._head is None  # the logits are not head(decoder(x)): never split the projection off
    rows, greedy = _greedy_rows(model)
    got = scorer.score_rows(rows)
    assert [g for _, g in got] == greedy
    for (ids, n), (ll, _) in zip(rows, got):
        assert ll == pytest.approx(_hand(model, ids, n)[0], abs=1e-5)
    # the choices of one item through a branched trie (prefix) or one by one (full)
    pairs = [("The cat sat on", " the mat"), ("The cat sat on", " a hat"), ("The cat sat on", " it")]
    got = scorer.score_pairs([pairs])[0]
    for (ctx, cont), (ll, g) in zip(pairs, got):
        whole = tok.encode(ctx + cont)
        ref, ref_greedy = _hand(model, whole, len(whole) - len(tok.encode(ctx)))
        assert (ll, g) == (pytest.approx(ref, abs=1e-5), ref_greedy)
    assert scorer.stats.fallbacks == [] and scorer.stats.strategy == strategy
