"""Sliding-window perplexity: window plan coverage and values against plain computations."""

from __future__ import annotations

import math

import pytest
import torch
from tests.test_eval_zeroshot import byte_tokenizer, tiny_gpt2

from conftest import names
from headbudget.evaluation.perplexity import loss_by_context_length, perplexity, window_plan
from headbudget.io import read_text


@pytest.mark.parametrize("n, ctx, stride", [(50, 16, 8), (50, 16, 15), (17, 16, 5), (10, 64, 32)])
def test_every_token_after_the_first_is_scored_once(n, ctx, stride):
    scored = []
    for begin, end, trg in window_plan(n, ctx, stride):
        assert end - begin <= ctx and trg <= end - begin - 1
        scored.extend(range(end - trg, end))
    assert scored == list(range(1, n))


def test_single_window_equals_model_loss():
    model, tok = tiny_gpt2(), byte_tokenizer()
    text = "The quick brown fox jumps over the lazy dog. " * 2
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        want = float(model(ids, labels=ids).loss)
    r = perplexity(model, tok, text, context=256, stride=128, progress=False)
    assert r["windows"] == 1 and r["tokens_scored"] == ids.shape[1] - 1
    assert r["loss"] == pytest.approx(want, rel=1e-5) and r["ppl"] == pytest.approx(math.exp(want))


def test_sliding_window_equals_hand_computation():
    model, tok = tiny_gpt2(), byte_tokenizer()
    ids = torch.tensor(tok.encode("abcdefghij" * 4))  # 40 tokens
    nll, n = 0.0, 0
    with torch.no_grad():
        for begin, end, trg in [(0, 16, 15), (8, 24, 8), (16, 32, 8), (24, 40, 8)]:
            lp = torch.log_softmax(model(ids[None, begin:end]).logits[0], -1)
            for t in range(end - trg, end):
                nll -= float(lp[t - begin - 1, ids[t]])
                n += 1
    r = perplexity(model, tok, input_ids=ids, context=16, stride=8, progress=False)
    assert r["tokens_scored"] == n == 39 and r["windows"] == 4
    assert r["loss"] == pytest.approx(nll / n, rel=1e-5)
    assert perplexity(model, tok, input_ids=ids, context=16, stride=8, max_windows=2,
                      progress=False)["tokens_scored"] == 23


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match=names("--stride", "context=8", 9)):
        window_plan(10, 8, 9)
    with pytest.raises(FileNotFoundError, match=names(tmp_path / "missing.txt")):
        read_text(str(tmp_path / "missing.txt"))


def test_window_plan_with_stride_equal_to_context_never_asks_for_more_targets_than_predictions():
    from headbudget.evaluation.perplexity import window_plan

    plan = window_plan(100, 32, 32)
    assert plan[0] == (0, 32, 31)
    assert all(trg <= end - begin - 1 for begin, end, trg in plan)
    assert [b for b, _, _ in plan] == [0, 32, 64, 96]
    assert sum(t for _, _, t in plan) == 100 - 4  # each window's first token has no in-window context


def test_loss_by_context_length_scores_the_same_targets_with_k_tokens_before_them():
    model, tok = tiny_gpt2(), byte_tokenizer()
    ids = torch.tensor(tok.encode("The quick brown fox jumps over the lazy dog. " * 2))  # 90 tokens
    r = loss_by_context_length(model, ids, lengths=(8, 1, 3), every=20, batch_size=2)
    assert r["lengths"] == [1, 3, 8] and r["targets"] == 5  # targets at 8, 28, 48, 68, 88
    with torch.no_grad():
        want = [-float(torch.log_softmax(model(ids[None, t - 3: t]).logits[0, -1], -1)[ids[t]])
                for t in (8, 28, 48, 68, 88)]
        one = [-float(torch.log_softmax(model(ids[None, t - 1: t]).logits[0, -1], -1)[ids[t]])
               for t in (8, 28, 48, 68, 88)]
    assert r["loss"][1] == pytest.approx(sum(want) / 5, rel=1e-5)
    assert r["gain_vs_shortest"][0] == 0.0
    assert r["gain_vs_shortest"][1] == pytest.approx((sum(one) - sum(want)) / 5, rel=1e-5, abs=1e-6)
    assert loss_by_context_length(model, ids, lengths=(1, 8), max_targets=2)["targets"] == 2
    with pytest.raises(ValueError, match=names(145, 128, 90)):  # tokens needed, context, tokens given
        loss_by_context_length(model, ids, lengths=(1, 128))
