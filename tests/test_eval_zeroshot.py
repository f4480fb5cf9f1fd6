"""Zero-shot scoring: hand computations, harness conventions, batching, malformed files; ``is_greedy`` (every
continuation token the argmax) on both strategies, and models whose logits are scaled or soft-capped after the
output projection (the projection is then not split off the decoder)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import assert_names, names
from headbudget.evaluation.encoding import HarnessEncoder
from headbudget.evaluation.scorer import Scorer
from headbudget.evaluation.tasks import DataError, MCExample, get_task, load_examples
from headbudget.evaluation.zeroshot import mc_metrics, mean_stderr

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "zeroshot"
TASKS4 = ["piqa", "hellaswag", "arc_easy", "winogrande"]


def byte_tokenizer():
    """GPT-2-style byte-level BPE with no merges (one token per byte): offline, 257 tokens."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import GPT2TokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = 256
    return GPT2TokenizerFast(vocab=vocab, merges=[])


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=256,
                                      vocab_size=257)).eval()


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def gpt2():
    return tiny_gpt2()


def hand_score(model, tok, context: str, continuation: str) -> float:
    """log P(continuation | context), computed the plain way on the whole sequence."""
    ctx = tok.encode(context)
    whole = tok.encode(context + continuation)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
    return sum(float(logp[t - 1, whole[t]]) for t in range(len(ctx), len(whole)))


def test_scores_match_hand_computation(gpt2, tok):
    exs = load_examples("piqa", FIXTURES) + load_examples("winogrande", FIXTURES)
    for strategy in ("prefix", "full"):
        got = Scorer(gpt2, tok, strategy=strategy, progress=False).score(exs)
        for ex, scores in zip(exs, got, strict=True):
            want = [hand_score(gpt2, tok, c, k) for c, k in zip(ex.contexts, ex.continuations)]
            assert scores == pytest.approx(want, abs=1e-4), strategy


def test_headbudget_model_prefix_cache_matches_full(tok):
    from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    from headbudget.schedules import prism

    torch.manual_seed(1)
    model = HeadBudgetForCausalLM(HeadBudgetConfig(schedule=prism(3, 32, 32, 8), vocab_size=257,
                                                   n_positions=256, dropout=0.0)).eval()
    exs = [e for t in TASKS4 for e in load_examples(t, FIXTURES)]
    fast = Scorer(model, tok, progress=False)
    a = fast.score(exs)
    b = Scorer(model, tok, strategy="full", batch_size=3, progress=False).score(exs)
    assert fast.stats.fallbacks == [] and fast.strategy == "prefix"
    for x, y in zip(a, b, strict=True):
        assert x == pytest.approx(y, abs=1e-4)
    ex = exs[0]
    assert a[0] == pytest.approx([hand_score(model, tok, c, k)
                                  for c, k in zip(ex.contexts, ex.continuations)], abs=1e-4)


def test_batching_equals_one_by_one(gpt2, tok):
    exs = [e for t in TASKS4 for e in load_examples(t, FIXTURES, limit=1)]
    one = [Scorer(gpt2, tok, strategy="full", batch_size=1, progress=False).score([e])[0]
           for e in exs]
    full = Scorer(gpt2, tok, strategy="full", batch_size=5, progress=False)
    batched = full.score(exs)
    prefix = Scorer(gpt2, tok, progress=False)
    cached = prefix.score(exs)
    for a, b, c in zip(one, batched, cached, strict=True):
        assert b == pytest.approx(a, abs=1e-5)
        assert c == pytest.approx(a, abs=1e-4)
    n_rows = sum(len(e.contexts) for e in exs)
    assert full.stats.forward_passes == math.ceil(n_rows / 5)
    # prefix strategy: the 4 trees fit one pass of 16 rows (+1 pass: the self-check's plain scores)
    assert prefix.stats.forward_passes == 2


def tiny_headbudget(seed: int = 1):
    from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    from headbudget.schedules import prism

    torch.manual_seed(seed)
    return HeadBudgetForCausalLM(HeadBudgetConfig(schedule=prism(3, 32, 32, 8), vocab_size=257,
                                                  n_positions=256, dropout=0.0)).eval()


def tiny_llama(seed: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, hidden_size=32,
                                        intermediate_size=64, vocab_size=257,
                                        max_position_embeddings=256)).eval()


def tiny_mistral(seed: int = 3):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, hidden_size=32,
                                            intermediate_size=64, vocab_size=257, sliding_window=8,
                                            max_position_embeddings=256)).eval()


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_headbudget, tiny_llama, tiny_mistral],
                         ids=["gpt2", "headbudget", "llama", "mistral-window8"])
def test_tree_batching_equals_one_by_one(make, tok):
    """Items as token trees packed into rows: same scores as every choice scored alone, no
    fallback, the output projection split off, at most ``batch_size`` rows and far fewer passes
    than items; every tree token counted once."""
    model = make()
    exs = [e for t in TASKS4 for e in load_examples(t, FIXTURES)]
    exs = exs + exs[::-1]  # more items than one batch; prefixes of many lengths
    one = [[hand_score(model, tok, c, k) for c, k in zip(e.contexts, e.continuations)]
           for e in exs]
    passes = {}
    for bs in (6, 2, 1):
        fast = Scorer(model, tok, batch_size=bs, progress=False)
        shapes: list[tuple[int, int]] = []
        inner = fast._tree_forward

        def spy(ids, mask, pos, index, _inner=inner, _seen=shapes):
            _seen.append(tuple(ids.shape))
            return _inner(ids, mask, pos, index)

        fast._tree_forward = spy
        got = fast.score(exs)
        assert fast.stats.fallbacks == [] and fast.strategy == "prefix" and fast._head is not None
        for a, b in zip(got, one, strict=True):
            assert a == pytest.approx(b, abs=1e-4)
        assert max(r for r, _ in shapes) <= bs
        # the rest: the self-check's plain passes over one unit's (at most 4) choices per kind
        # checked (a branched trie; with several items to a row, a row shared by documents)
        n_checked = len(fast.stats.checked)
        assert 1 <= n_checked <= 2
        assert 1 <= fast.stats.forward_passes - len(shapes) <= math.ceil(4 * n_checked / bs)
        items = [fast._sequences(list(zip(e.contexts, e.continuations, strict=True))) for e in exs]
        tree_tokens = [len(fast._layout([s[:-1] for s, _ in it])[0]) for it in items]
        # every item is there twice: a copy in the same row shares all of its tokens (plus the
        # self-check's plain sequences, at most 4 per kind checked)
        assert sum(tree_tokens) / 2 <= fast.stats.tokens <= sum(tree_tokens) + 4 * n_checked * max(tree_tokens)
        passes[bs] = len(shapes)
    assert passes[6] < passes[2] < passes[1]


def test_short_trees_share_a_row(gpt2, tok):
    """Ten short items in one row of one pass (batch size 1): no cross-talk between them."""
    items = [[(f"Q{i}: pick", " a"), (f"Q{i}: pick", " bb"), (f"Q{i}: pick", " c!")] for i in range(10)]
    fast = Scorer(gpt2, tok, batch_size=1, progress=False)
    shapes: list[tuple[int, int]] = []
    inner = fast._tree_forward
    fast._tree_forward = lambda ids, *a: shapes.append(tuple(ids.shape)) or inner(ids, *a)
    got = fast.score_pairs(items)
    # each item's trie: inputs "Qi: pick " (9 bytes), "Qi: pick b", "Qi: pick c" = 11 tokens; a row
    # holds five (55 <= MIN_ROW_TOKENS = 64), whose common "Q" is one token: 1 + 5 * 10
    assert shapes == [(1, 51), (1, 51)]
    for item, scores in zip(items, got, strict=True):
        want = [hand_score(gpt2, tok, c, k) for c, k in item]
        assert [ll for ll, _ in scores] == pytest.approx(want, abs=1e-4)


def test_trie_layout_example():
    """Sequences merged into a trie, depth-first: shared tokens once; a token's subtree
    ``[b, ends[b])`` holds exactly the tokens that may attend to it."""
    ids, pos, ends, where = Scorer._layout([[5, 6, 7, 8], [5, 6, 7], [5, 6, 4], [9]])
    assert ids == [5, 6, 7, 8, 4, 9]
    assert pos == [0, 1, 2, 3, 2, 0]
    assert ends == [5, 5, 4, 4, 5, 6]
    assert where == [[0, 1, 2, 3], [0, 1, 2], [0, 1, 4], [5]]


def test_items_sharing_a_long_prefix_run_it_once(gpt2, tok):
    """Twelve items with one 80-byte few-shot context: one pass, the context's tokens once per
    row instead of once per choice, scores equal to each choice scored alone."""
    shots = "Q: 1+1\nA: 2\n\nQ: 2+3\nA: 5\n\nQ: 4+4\nA: 8\n\nQ: 3+3\nA: 6\n\nQ: 9+0\nA: 9\n\nQ: 1+2\nA: 3\n\n"
    items = [[(f"{shots}Q: {i}+1\nA:", f" {k}") for k in (i + 1, i + 2, 7)] for i in range(12)]
    fast = Scorer(gpt2, tok, batch_size=4, progress=False)
    fast._check = False  # no self-check pass: count the trie passes alone
    shapes: list[tuple[int, int]] = []
    inner = fast._tree_forward
    fast._tree_forward = lambda ids, *a: shapes.append(tuple(ids.shape)) or inner(ids, *a)
    got = fast.score_pairs(items)
    for item, scores in zip(items, got, strict=True):
        want = [hand_score(gpt2, tok, c, k) for c, k in item]
        assert [ll for ll, _ in scores] == pytest.approx(want, abs=1e-4)
    seqs = [fast._sequences(item) for item in items]
    one_trie = len(fast._layout([s[:-1] for item in seqs for s, _ in item])[0])
    per_item = sum(len(fast._layout([s[:-1] for s, _ in item])[0]) for item in seqs)
    # all twelve documents in one row: the shared context once, not once per document
    assert shapes == [(1, one_trie)] and fast.stats.tokens == one_trie
    assert one_trie < per_item / 3


def test_scaled_logits_are_caught_and_the_model_logits_used(gpt2, tok):
    """A model whose logits are not ``lm_head(decoder(x))`` (here: doubled): the self-check sees the
    difference, the scorer keeps trees but takes the model's own logits; scores stay exact."""
    class Doubled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.config = inner.config

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

        def get_decoder(self):
            return self.inner.get_decoder()

        def forward(self, **kw):
            out = self.inner(**kw)
            out.logits = out.logits * 2
            return out

    model = Doubled(gpt2).eval()  # (a new Module is in training mode; the scorer restores it)
    exs = load_examples("piqa", FIXTURES)
    sc = Scorer(model, tok, progress=False)
    got = sc.score(exs)
    assert sc.strategy == "prefix" and sc.stats.fallbacks == [] and sc._head is None
    ref = Scorer(model, tok, strategy="full", progress=False).score(exs)
    for a, b in zip(got, ref, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
    assert ref[0] != pytest.approx(Scorer(gpt2, tok, strategy="full", progress=False).score(exs)[0])


def test_cache_mismatch_falls_back_to_full(gpt2, tok):
    """A model whose cached path is wrong (it ignores the cache) is caught by the self-check."""
    class NoCache(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False,
                    past_key_values=None):
            out = self.inner(input_ids=input_ids, use_cache=use_cache)
            return out

    exs = load_examples("piqa", FIXTURES)
    sc = Scorer(NoCache(gpt2).eval(), tok, progress=False)  # eval: the scorer restores the mode
    with pytest.warns(UserWarning, match="scoring every choice in full"):
        got = sc.score(exs)
    assert sc.strategy == "full" and len(sc.stats.fallbacks) == 1
    ref = Scorer(gpt2, tok, strategy="full", progress=False).score(exs)
    for a, b in zip(got, ref, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_trailing_space_moves_to_continuation(tok):
    enc = HarnessEncoder(tok)
    assert enc.pair("Answer: ", "yes") == enc.pair("Answer:", " yes")
    ctx, cont = enc.pair("Answer:", " yes")
    assert ctx == tok.encode("Answer:") and cont == tok.encode(" yes")
    # empty context: conditioned on the BOS/EOS token
    assert enc.pair("", " yes") == ([256], tok.encode(" yes"))


def test_acc_norm_uses_character_length_of_choice():
    ex = get_task("piqa").example({"goal": "g", "sol1": "abcde", "sol2": "a" * 20, "label": 1})
    assert ex.continuations == [" abcde", " " + "a" * 20]
    assert ex.norm_lengths == [5.0, 20.0]  # the choice, without the joining space
    res, preds = mc_metrics([ex], [[-10.0, -12.0]])
    assert preds == [0] and res["acc"] == 0.0 and res["acc_norm"] == 1.0  # -2.0 < -0.6
    # ties go to the first choice (numpy argmax)
    _, preds = mc_metrics([ex], [[-1.0, -1.0]])
    assert preds == [0]


def test_acc_norm_counts_characters_not_bytes_of_non_ascii_choices():
    """lm-eval's acc_norm divides by ``len(choice)`` of the Python string: characters, not UTF-8 bytes."""
    ex = get_task("piqa").example({"goal": "g", "sol1": "ééééé", "sol2": "abcdefg", "label": 1})
    assert ex.norm_lengths == [5.0, 7.0]  # bytes would be 10 and 7
    arc = get_task("arc_easy").example({"question": "q", "answerKey": "A",
                                        "choices": {"text": ["naïve café", "x"], "label": ["A", "B"]}})
    assert arc.norm_lengths == [10.0, 1.0]
    # -6 / 5 = -1.2 < -7.5 / 7 = -1.07: choice 1 per character (per byte, -6 / 10 = -0.6: choice 0)
    res, preds = mc_metrics([ex], [[-6.0, -7.5]])
    assert preds == [0] and res["acc"] == 0.0 and res["acc_norm"] == 1.0


def test_stderr_is_sample_std_over_sqrt_n():
    xs = [1.0, 0.0, 1.0, 1.0]
    mu = 0.75
    want = math.sqrt(sum((x - mu) ** 2 for x in xs) / 3) / 2
    assert mean_stderr(xs) == pytest.approx(want)
    assert math.isnan(mean_stderr([1.0]))


def test_winogrande_partial_scoring():
    ex = load_examples("winogrande", FIXTURES)[0]
    stem = "Sarah was a much better surgeon than Maria so "
    assert ex.contexts == [stem + "Sarah", stem + "Maria"]
    assert ex.continuations == [" always got the easier cases."] * 2
    assert ex.target == 1
    res, _ = mc_metrics([ex], [[-3.0, -2.0]], get_task("winogrande").metrics)
    assert "acc_norm" not in res and res["acc"] == 1.0


def test_prompts_as_the_harness_builds_them():
    piqa = load_examples("piqa", FIXTURES)[0]
    assert piqa.contexts[0] == "Question: How do I open a jar?\nAnswer:"
    hs = load_examples("hellaswag", FIXTURES)
    assert hs[0].contexts[0] == "Roof shingle removal: A man is sitting on a roof. he"
    assert hs[0].continuations[2] == " is holding a. cube."  # " [title]" -> ". ", "  " -> " "
    assert hs[1].contexts[0] == "Clean and jerk: A lady walks to a barbell. She bends down"
    arc = load_examples("arc_easy", FIXTURES)
    assert arc[0].contexts[0] == "Question: Which is a source of energy?\nAnswer:"
    assert arc[0].continuations == [" Sunlight", " A rock", " Sand"] and arc[1].target == 0


def _write(tmp_path: Path, name: str, lines: list[str]) -> Path:
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    (d / name).write_text("\n".join(lines) + "\n")
    return d


GOOD_PIQA = json.dumps({"goal": "g", "sol1": "a", "sol2": "b", "label": 0})


@pytest.mark.parametrize("line, task, fname, values", [  # the message names FILE:2 and these
    ("{not json", "piqa", "piqa_validation.jsonl", ()),
    (json.dumps({"goal": "g", "sol1": "a", "label": 0}), "piqa", "piqa_validation.jsonl", ("sol2",)),
    (json.dumps({"goal": "g", "sol1": "a", "sol2": "b", "label": 2}), "piqa",
     "piqa_validation.jsonl", ("label", 2)),
    (json.dumps({"sentence": "a _ b", "option1": "x", "option2": "y", "answer": "3"}),
     "winogrande", "winogrande_validation.jsonl", ("answer", 2)),
    (json.dumps({"question": "q", "choices": {"text": ["a"], "label": ["A"]}, "answerKey": "B"}),
     "arc_easy", "arc_easy_test.jsonl", ("answerKey",)),
    (json.dumps({"activity_label": "x", "ctx": "c", "endings": "nope", "label": "0"}),
     "hellaswag", "hellaswag_validation.jsonl", ("endings",)),
])
def test_malformed_rows_name_file_line_field(tmp_path, line, task, fname, values):
    first = {"piqa": GOOD_PIQA, "winogrande": json.dumps(
        {"sentence": "a _ b", "option1": "x", "option2": "y", "answer": "1"}),
        "arc_easy": json.dumps({"question": "q", "choices": {"text": ["a"], "label": ["A"]},
                                "answerKey": "A"}),
        "hellaswag": json.dumps({"activity_label": "x", "ctx": "c", "endings": ["e"],
                                 "label": "0"})}[task]
    d = _write(tmp_path, fname, [first, line])
    with pytest.raises(DataError, match=names(f"{d / fname}:2", *values)):
        load_examples(task, d)


def test_missing_file_and_unknown_task(tmp_path):
    with pytest.raises(FileNotFoundError, match=names(tmp_path / "piqa_validation.jsonl")):
        load_examples("piqa", tmp_path)
    with pytest.raises(ValueError, match=names("nope", "arc_challenge")):
        get_task("nope")


def test_limit_and_registry_extension():
    assert len(load_examples("piqa", FIXTURES, limit=2)) == 2
    assert get_task("arc_challenge").hf_name == "ARC-Challenge"
    ex = get_task("copa").example({"premise": "The man fell.", "choice1": "He slipped.",
                                   "choice2": "He ate.", "question": "cause", "label": 0})
    assert ex.contexts[0] == "The man fell because" and ex.continuations[0] == "  he slipped."
    assert isinstance(ex, MCExample)


def test_predictions_equal_lm_eval_hf_backend(tmp_path, gpt2, tok):
    """The harness's own hf backend gives the same log-likelihoods for the same requests."""
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    gpt2.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    lm = HFLM(pretrained=str(tmp_path / "m"), batch_size=1, device="cpu")

    class Req:  # the only attribute the backend reads
        def __init__(self, args):
            self.args = args

    exs = [e for t in ("piqa", "arc_easy", "winogrande") for e in load_examples(t, FIXTURES, limit=1)]
    reqs = [Req((c, k)) for e in exs for c, k in zip(e.contexts, e.continuations)]
    ref = [ll for ll, _ in lm.loglikelihood(reqs, disable_tqdm=True)]
    ours = [s for row in Scorer(lm.model, lm.tokenizer, progress=False).score(exs) for s in row]
    assert ours == pytest.approx(ref, abs=1e-4)


def test_continuation_longer_than_the_context_names_task_and_row(tmp_path, capsys):
    from headbudget.cli.main import main
    from headbudget.loading import load_tokenizer
    from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM

    m = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", "uniform", vocab_size=260, n_positions=8))
    m.save_pretrained(tmp_path / "m")
    load_tokenizer("byte").save_pretrained(tmp_path / "m")
    fixtures = Path(__file__).parent / "fixtures" / "zeroshot"
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "m"), "--tasks", "piqa", "--data-dir", str(fixtures), "--limit", "2"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("headbudget")]
    assert len(err) == 1 and err[0].startswith("headbudget eval: error: "), err
    from importlib.util import find_spec

    if find_spec("lm_eval") is not None:  # the task runs through lm-eval: its document ids
        assert_names(err[0], "piqa", "document 0", 32)
    else:  # the built-in path: the file's line
        assert_names(err[0], "piqa", f"{fixtures / 'piqa_validation.jsonl'}:1")


def test_attention_window_rules():
    """One window for every layer goes into the tree mask; a disabled window is none; windowed and
    full layers mixed (Gemma 2/3) cannot share one mask: 0, and the scorer falls back to full."""
    from types import SimpleNamespace

    from headbudget.evaluation.scorer import _attention_window

    def model(**cfg):
        return SimpleNamespace(config=SimpleNamespace(**cfg))

    assert _attention_window(model(sliding_window=8)) == 8
    assert _attention_window(model(sliding_window=4096, use_sliding_window=False)) is None  # Qwen2
    assert _attention_window(model(attention_window=16)) == 16  # headbudget's own config field
    assert _attention_window(model(sliding_window=None)) is None
    assert _attention_window(model(sliding_window=8, layer_types=["sliding_attention",
                                                                   "full_attention"])) == 0


def test_mixed_window_layers_fall_back_to_full(tok):
    llama = tiny_llama()
    llama.config.sliding_window = 8
    llama.config.layer_types = ["sliding_attention", "full_attention"]
    exs = load_examples("piqa", FIXTURES)
    sc = Scorer(llama, tok, progress=False)
    with pytest.warns(UserWarning, match="mixes sliding-window and full attention"):
        got = sc.score(exs)
    assert sc.strategy == "full"
    for ex, scores in zip(exs, got, strict=True):
        assert scores == pytest.approx([hand_score(llama, tok, c, k)
                                        for c, k in zip(ex.contexts, ex.continuations)], abs=1e-4)


def test_unbranched_rows_run_without_a_mask(gpt2, tok):
    """Perplexity windows (one unbranched sequence per row, no padding) take the plain causal path:
    no (L, L) mask is built; the scores are the plain ones."""
    rows = [(list(range(40, 80)), 30), (list(range(90, 130)), 39)]
    fast = Scorer(gpt2, tok, batch_size=2, progress=False)
    masks = []
    inner = fast._tree_forward
    fast._tree_forward = lambda ids, mask, *a: masks.append(mask) or inner(ids, mask, *a)
    got = fast.score_rows(rows)
    assert masks == [None]
    with torch.no_grad():
        for (ids, n), (ll, _) in zip(rows, got, strict=True):
            logp = torch.log_softmax(gpt2(torch.tensor([ids[:-1]])).logits[0], -1)
            want = sum(float(logp[t - 1, ids[t]]) for t in range(len(ids) - n, len(ids)))
            assert ll == pytest.approx(want, abs=1e-4)


def test_is_greedy_matches_the_plain_argmax(gpt2, tok):
    """``is_greedy`` (lambada's acc): True exactly when every continuation token is the plain
    model's argmax -- a one-byte continuation chosen as the argmax, one that is not, and a
    two-byte one checked against the plain logits -- through one trie per item."""
    items = []
    with torch.no_grad():
        for ctx in ("Q: abc", "The cat sat on", "x = 1 +", "Hello"):  # no trailing space: it
            ids = tok.encode(ctx)                                      # would join the continuation
            best = int(gpt2(torch.tensor([ids])).logits[0, -1].argmax())
            text = tok.decode([best])
            if tok.encode(ctx + text)[len(ids):] != [best]:
                continue  # a byte that does not round-trip alone
            other = next(c for c in "zq#" if tok.encode(ctx + c)[len(ids):] != [best])
            items.append([(ctx, text), (ctx, other), (ctx, text + other)])
    assert len(items) >= 2
    got = Scorer(gpt2, tok, progress=False).score_pairs(items)
    for item, scores in zip(items, got, strict=True):
        assert [g for _, g in scores][:2] == [True, False]
        ctx, cont = item[2]
        whole, n = tok.encode(ctx + cont), len(tok.encode(ctx))
        with torch.no_grad():
            logits = gpt2(torch.tensor([whole[:-1]])).logits[0]
        assert scores[2][1] == all(int(logits[t - 1].argmax()) == whole[t] for t in range(n, len(whole)))


@pytest.mark.parametrize("branched", [False, True], ids=["unbranched-rows", "branched-and-unbranched"])
def test_padding_is_a_subtree_of_its_own(gpt2, tok, branched):
    """Rows of unequal length in one pass: the padded pass is a masked one, in which every real token sees
    exactly its trie ancestors and every pad position is a subtree of its own (it sees itself only: pads
    never share a subtree end, so no pad is an ancestor of another position); each choice scores as it
    does alone, and the pass is self-checked as the masked kind it is."""
    first = ("Once upon a time there was a small red fox who", " ran")  # 49 + 4 bytes
    items = [[first, (first[0], " hid away")] if branched else [first],
             [("The quick brown dog jumps over it", " again")]]  # 33 + 6 bytes: too long to share a row
    fast = Scorer(gpt2, tok, batch_size=4, progress=False)
    seen = []
    inner = fast._tree_forward
    fast._tree_forward = lambda ids, mask, *a: seen.append((ids, mask)) or inner(ids, mask, *a)
    got = fast.score_pairs(items)
    for item, scores in zip(items, got, strict=True):
        want = [hand_score(gpt2, tok, c, k) for c, k in item]
        assert [ll for ll, _ in scores] == pytest.approx(want, abs=1e-4)
    ((ids, mask),) = seen
    assert ids.shape[0] == 2 and mask is not None
    allowed = mask[:, 0] == 0
    T = ids.shape[1]
    layouts = [fast._layout([s[:-1] for s, _ in fast._sequences(item)]) for item in items]  # rows: longest first
    assert len(layouts[0][0]) == T > len(layouts[1][0])  # the second row is padded
    for r, (t_ids, _, t_ends, _) in enumerate(layouts):
        n = len(t_ids)
        key = torch.arange(n)
        trie = (key[None, :] <= key[:, None]) & (key[:, None] < torch.tensor(t_ends)[None, :])
        assert torch.equal(allowed[r, :n, :n], trie) and not allowed[r, :n, n:].any()
        assert torch.equal(allowed[r, n:], torch.eye(T, dtype=torch.bool)[n:]), f"row {r}: pads see other positions"
    kind = "branched trie" if branched else "unbranched row"
    assert f"{kind} (loglikelihood) (float32, cpu)" in fast.stats.checked


# ---------------------------------------------------------------------------- is_greedy, row by row
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
    from transformers import GraniteConfig, GraniteForCausalLM

    return GraniteForCausalLM(GraniteConfig(logits_scaling=0.05, **_SHAPE))  # logits x 20


def _cohere():
    from transformers import CohereConfig, CohereForCausalLM

    return CohereForCausalLM(CohereConfig(logit_scale=8.0, **_SHAPE))


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(final_logit_softcapping=0.3, head_dim=8, sliding_window=64,
                                          layer_types=["full_attention"] * 2, **_SHAPE))


@pytest.mark.parametrize("make", [_granite, _cohere, _gemma2], ids=["granite", "cohere", "gemma2"])
@pytest.mark.parametrize("strategy", ["full", "prefix"])
def test_scaled_or_soft_capped_logits_are_scored_as_the_model_returns_them(tok, make, strategy):
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
