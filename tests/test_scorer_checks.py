"""The scorer's fast path is checked, not trusted: every kind of unit it builds (branched
tries, unbranched rows, rows shared across documents, rolling windows) is compared with the plain
computation when first met, whatever the order of requests; a model that ignores 4-D masks, or whose
fast path raises, falls back with exactly one warning; bf16/fp16 stay on the fast path when they agree
with the plain path at their own precision; ``--dtype`` / ``dtype=`` on every command."""

from __future__ import annotations

import itertools
import warnings
from types import SimpleNamespace

import pytest
import torch
from tests.test_eval_zeroshot import FIXTURES, byte_tokenizer

from conftest import assert_names, error_line, names
from headbudget.cli.main import main
from headbudget.evaluation.scorer import Scorer
from headbudget.evaluation.scorer_check import logprob_tolerance
from headbudget.evaluation.tasks import load_examples

pytest.importorskip("lm_eval")
from headbudget.evaluation.harness import HeadBudgetLM  # noqa: E402  (needs lm_eval)

MAX_LEN = 48  # the rolling windows' length: 95 bytes + the prefix token = two full windows


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=MAX_LEN, vocab_size=257,
                                       bos_token_id=256, eos_token_id=256, tie_word_embeddings=False))
    with torch.no_grad():  # logits a few nats apart, as a trained model's (a random one's are flat)
        model.lm_head.weight.mul_(40)
    return model.eval()


class IgnoresTreeMask(torch.nn.Module):
    """A model that drops 4-D attention masks (as some custom models do): right on plain, causal
    sequences, wrong wherever a token must not see an earlier token of its row."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, input_ids=None, attention_mask=None, **kw):
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = None
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, **kw)


def _request(task: str, doc: int, idx: int, *args: str) -> SimpleNamespace:
    return SimpleNamespace(task_name=task, doc_id=doc, idx=idx, args=args)


SHOTS = "Q: one plus one\nA: two\n\nQ: two plus two\nA: four\n\n"  # > SHARE_MIN_TOKENS bytes
REQUESTS = {
    # multiple choice: each document's choices one branched trie
    "mc": ("loglikelihood", [_request("mc", d, i, f"Is {d} odd?", c)
                             for d in range(3) for i, c in enumerate((" yes", " no", " not sure"))]),
    # rolling: every window full (2 x 48 tokens), so no mask, no padding, no shared row
    "rolling": ("loglikelihood_rolling", [_request("ppl", d, 0, ("abcdefghijklm"[d:] * 10)[:95])
                                          for d in range(3)]),
    # one continuation per document, documents sharing a long few-shot context: one shared row
    "shared": ("loglikelihood", [_request("shared", d, 0, f"{SHOTS}Q: {d} plus 1\nA:", f" {d + 1}")
                                 for d in range(4)]),
}
ORDERS = [("rolling", "mc"), ("mc", "rolling"), ("rolling", "shared"), ("shared", "rolling", "mc")]


def _answer(lm: HeadBudgetLM, order: tuple[str, ...]) -> dict[str, list]:
    return {name: getattr(lm, REQUESTS[name][0])(REQUESTS[name][1]) for name in order}


def _fallback_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "scoring every choice in full" in str(w.message)]


def _lls(results: list) -> list[float]:
    return [r[0] if isinstance(r, tuple) else r for r in results]


def _plain_and_fast(model, tok, order: tuple[str, ...]) -> tuple[dict, dict, list[str], HeadBudgetLM]:
    """The plain path's answers, the (checked) fast path's answers, its fallback warnings, its model."""
    plain = _answer(HeadBudgetLM(pretrained=model, tokenizer=tok, strategy="full", max_length=MAX_LEN,
                                 progress=False), order)
    lm = HeadBudgetLM(pretrained=model, tokenizer=tok, max_length=MAX_LEN, progress=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = _answer(lm, order)
    return plain, got, _fallback_warnings(record), lm


@pytest.mark.parametrize("order", ORDERS, ids=["-".join(o) for o in ORDERS])
def test_mask_ignoring_model_is_caught_in_every_order(gpt2, tok, order):
    """Whatever comes first -- rolling windows, which such a model gets right, or documents sharing a
    row -- the first branched trie or shared row is checked: one warning, the plain scores."""
    model = IgnoresTreeMask(gpt2).eval()
    plain, got, msgs, lm = _plain_and_fast(model, tok, order)
    assert len(msgs) == 1 and msgs[0].startswith("IgnoresTreeMask (float32, cpu): the tree scores of a ")
    assert lm.scorer.strategy == "full" and len(lm.scorer.stats.fallbacks) == 1
    for name in order:
        assert _lls(got[name]) == pytest.approx(_lls(plain[name]), abs=1e-5)


def test_the_mask_ignoring_model_is_wrong_on_the_fast_path(gpt2, tok):
    """(The test above has teeth: unchecked, the fast path gives this model wrong branched tries and
    shared rows, and right rolling windows -- the order that used to slip through.)"""
    model = IgnoresTreeMask(gpt2).eval()
    plain = _answer(HeadBudgetLM(pretrained=model, tokenizer=tok, strategy="full", max_length=MAX_LEN,
                                 progress=False), ("mc", "shared", "rolling"))
    lm = HeadBudgetLM(pretrained=model, tokenizer=tok, max_length=MAX_LEN, progress=False)
    lm.scorer._check = False
    fast = _answer(lm, ("mc", "shared", "rolling"))
    for name in ("mc", "shared"):
        worst = max(abs(a - b) for a, b in zip(_lls(fast[name]), _lls(plain[name]), strict=True))
        assert worst > 0.1
    assert _lls(fast["rolling"]) == pytest.approx(_lls(plain["rolling"]), abs=1e-4)


def test_a_right_model_keeps_the_fast_path_and_checks_each_kind_once(gpt2, tok):
    """The same requests on a model that honours the mask: no warning, every kind checked exactly
    once (however many calls), scores equal to the plain ones."""
    lm = HeadBudgetLM(pretrained=gpt2, tokenizer=tok, max_length=MAX_LEN, progress=False)
    plain = HeadBudgetLM(pretrained=gpt2, tokenizer=tok, strategy="full", max_length=MAX_LEN, progress=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for order in ORDERS:
            got, want = _answer(lm, order), _answer(plain, order)
            for name in order:
                assert _lls(got[name]) == pytest.approx(_lls(want[name]), abs=1e-4)
    assert _fallback_warnings(record) == [] and lm.scorer.strategy == "prefix"
    assert sorted(lm.scorer.stats.checked) == [
        "branched trie (loglikelihood) (float32, cpu)",
        "row shared with another document (loglikelihood) (float32, cpu)",
        "unbranched row (loglikelihood) (float32, cpu)",
        "unbranched row without mask (rolling window) (float32, cpu)",
    ]


def test_a_model_whose_fast_path_raises_falls_back_once(tok):
    """BLOOM (ALiBi: its position bias is built from a 2-D mask) cannot take a tree mask.  Rolling
    windows first (no mask: the fast path runs) then multiple choice (a 4-D mask: it raises): one
    warning naming the model and the error, no traceback, the plain scores."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    bloom = BloomForCausalLM(BloomConfig(n_layer=2, n_head=2, hidden_size=16, vocab_size=257)).eval()
    order = ("rolling", "mc")
    plain, got, msgs, lm = _plain_and_fast(bloom, tok, order)
    assert len(msgs) == 1 and msgs[0].startswith("BloomForCausalLM (float32, cpu): tree scoring failed (")
    for name in order:
        assert _lls(got[name]) == pytest.approx(_lls(plain[name]), abs=1e-5)


def tiny_llama(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         hidden_size=64, intermediate_size=128, vocab_size=257,
                                         max_position_embeddings=256))
    with torch.no_grad():  # logits of a trained model's size (a few nats apart), not near-uniform
        model.lm_head.weight.mul_(40)
    return model.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_keeps_the_fast_path(tok, dtype):
    """bf16/fp16: the fast path's per-token log-probabilities agree with the plain path's at the same
    precision within the dtype's tolerance, so the scorer keeps the fast path (a fp32 tolerance on
    summed scores sent bf16 to the slow path every time)."""
    model = tiny_llama(dtype)
    exs = [e for t in ("piqa", "arc_easy", "winogrande") for e in load_examples(t, FIXTURES)]
    fast = Scorer(model, tok, progress=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = fast.score(exs)
    assert _fallback_warnings(record) == [] and fast.strategy == "prefix"
    name = str(dtype).removeprefix("torch.")
    assert fast.stats.checked and all(f"({name}, cpu)" in k for k in fast.stats.checked)
    # per token, on every item (not only the first of each kind): fast vs plain at this dtype
    items = [fast._sequences(list(zip(e.contexts, e.continuations, strict=True))) for e in exs]
    tol = logprob_tolerance(dtype)
    worst = 0.0
    with torch.inference_mode():
        units = [(i, part) for i, item in enumerate(items) for part in fast._units(item)]
        for rows in fast._passes(items, units):
            _, token_lls, _ = fast._tree_pass([[(items[i], part) for i, part in row] for row in rows])
            flat = [u for row in rows for u in row]
            for (i, part), lls in zip(flat, token_lls, strict=True):
                for k, plain, _ in fast._plain_token_logprobs([items[i][j] for j in part]):
                    worst = max(worst, float((lls[k] - plain).abs().max()))
    assert 0 < worst <= tol
    # the summed scores: the plain ones at this dtype up to rounding, which the old fp32 check refused
    plain = Scorer(model, tok, strategy="full", progress=False).score(exs)
    diffs = [abs(a - b) for g, p in zip(got, plain, strict=True) for a, b in zip(g, p, strict=True)]
    assert max(diffs) > 1e-3 + 1e-4 * 5 and max(diffs) < 5 * tol


def test_the_check_follows_a_cast_model(tok):
    """A model cast after the scorer was made is checked again at its new dtype."""
    model = tiny_llama(torch.float32)
    items = [[(f"Q{i}: pick", " a"), (f"Q{i}: pick", " bb")] for i in range(3)]
    sc = Scorer(model, tok, progress=False)
    sc.score_pairs(items)
    model.to(torch.bfloat16)
    sc.score_pairs(items)
    assert sc.stats.checked == ["branched trie (loglikelihood) (float32, cpu)",
                                "row shared with another document (loglikelihood) (float32, cpu)",
                                "branched trie (loglikelihood) (bfloat16, cpu)",
                                "row shared with another document (loglikelihood) (bfloat16, cpu)"]


# --------------------------------------------------------------------------- --dtype / dtype=
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, gpt2, tok):
    d = tmp_path_factory.mktemp("tiny")
    gpt2.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dtype_in_lm_eval_model_args(model_dir, dtype):
    """``dtype=`` as lm-eval's hf backend takes it: the parameters are of that type, the device is
    the default one (cpu here), and the model info says so."""
    import lm_eval.api.registry

    import headbudget  # noqa: F401  (registers the model)

    cls = lm_eval.api.registry.get_model("headbudget")
    lm = cls.create_from_arg_string(f"pretrained={model_dir},dtype={dtype}", {"batch_size": 4, "device": None})
    assert {p.dtype for p in lm.scorer.model.parameters()} == {getattr(torch, dtype)}
    assert lm.get_model_info()["dtype"] == dtype and lm.get_model_info()["device"] == "cpu"


def test_dtype_auto_keeps_the_checkpoint_type_and_bad_values_are_one_line(model_dir):
    lm = HeadBudgetLM(pretrained=str(model_dir), dtype="auto")
    assert {p.dtype for p in lm.scorer.model.parameters()} == {torch.float32}
    with pytest.raises(ValueError, match=names("dtype", "fp8", "auto", "float32", "bfloat16", "float16")) as exc:
        HeadBudgetLM(pretrained=str(model_dir), dtype="fp8")
    assert "\n" not in str(exc.value)


COMMANDS = {
    "eval": ["--tasks", "piqa", "--data-dir", str(FIXTURES)],
    "perplexity": ["--data", str(FIXTURES / "piqa_validation.jsonl")],
    "attention": ["--data", str(FIXTURES / "piqa_validation.jsonl"), "--out", "OUT"],
    "prune": ["--task", "lm", "--data", str(FIXTURES / "piqa_validation.jsonl"), "--out", "OUT"],
    "prune-compare": ["--task", "lm", "--data", str(FIXTURES / "piqa_validation.jsonl"), "--out", "OUT"],
    "compress": ["--out", "OUT"],
}


@pytest.mark.parametrize(("command", "flag"), [*itertools.product(COMMANDS, ["--dtype", "--device"]),
                                               ("finetune", "--device")])
def test_bad_dtype_or_device_is_one_line_exit_2(model_dir, tmp_path, capsys, command, flag):
    finetune = ["--task", "sst5", "--data-dir", str(tmp_path), "--out", "OUT"]
    args = [a.replace("OUT", str(tmp_path / "out")) for a in COMMANDS.get(command, finetune)]
    value = "fp8" if flag == "--dtype" else "tpu"
    assert main([command, str(model_dir), *args, flag, value]) == 2
    choices = ("auto", "float32", "bfloat16", "float16") if flag == "--dtype" else ("cpu", "cuda", "cuda:N")
    assert_names(error_line(capsys.readouterr().err, command), value, *choices)
    assert not (tmp_path / "out").exists()


def test_perplexity_runs_in_the_requested_dtype(model_dir, tmp_path, capsys):
    """``perplexity --dtype bfloat16``: the model runs in bf16 (its loss is the bf16 one, not fp32's)."""
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat. " * 20)
    losses = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / f"{dtype}.json"
        assert main(["perplexity", str(model_dir), "--data", str(text), "--context", "32", "--dtype", dtype,
                     "--json", str(out), "--quiet"]) == 0
        import json

        losses[dtype] = json.loads(out.read_text())["loss"]
    assert losses["float32"] != losses["bfloat16"]
    assert losses["bfloat16"] == pytest.approx(losses["float32"], abs=0.05)


def test_prune_and_compress_write_the_requested_dtype(tmp_path):
    """``prune --dtype bfloat16`` prunes (and saves) the bf16 model; ``compress --dtype bfloat16``
    compresses in float32, measures perplexity and saves in bf16."""
    from tests.test_prune_lm import COMMON, TEXT, _tiny_headbudget

    from headbudget.loading import load_model

    run = _tiny_headbudget(tmp_path / "run", with_tokenizer=True)
    assert main(["prune", str(run), "--task", "lm", "--data", str(TEXT), "--out", str(tmp_path / "p"),
                 "--keep", "6", "--dtype", "bfloat16", *COMMON]) == 0
    assert {p.dtype for p in load_model(tmp_path / "p" / "model").parameters()} == {torch.bfloat16}
    assert main(["compress", str(run / "model"), "--tokenizer", str(run / "tokenizer"), "--keep-ratio", "0.5",
                 "--data", str(TEXT), "--context", "32", "--max-windows", "20", "--out", str(tmp_path / "c"),
                 "--dtype", "bfloat16", "--no-progress"]) == 0
    assert {p.dtype for p in load_model(tmp_path / "c" / "model").parameters()} == {torch.bfloat16}


def test_verify_units_flags_a_nan_difference():
    """A NaN on the fast path is a mismatch, never a pass: NaN compares false with everything, so it must
    survive the running maximum (max(0.0, nan) is 0.0) and fail the tolerance test (nan > tol is False)."""
    from headbudget.evaluation.scorer_check import _TreeMismatch, verify_units

    def plain(rows):
        return [(i, torch.tensor([-0.5, -1.0]), True) for i in range(len(rows))]

    nan = float("nan")
    for tree in ([torch.tensor([-0.5, nan]), torch.tensor([-0.5, -1.0])],   # NaN row, then a right one
                 [torch.tensor([-0.5, -1.0]), torch.tensor([nan, -1.0])],   # a right row, then NaN
                 [torch.tensor([nan, nan])]):
        rows = [([1, 2, 3, 4], 2)] * len(tree)
        with pytest.raises(_TreeMismatch, match=r"differ from the plain scores by up to nan nats"):
            verify_units({"branched trie (loglikelihood)": (rows, tree)}, plain, torch.float32)
    # the same rows without a NaN pass
    verify_units({"branched trie (loglikelihood)": ([([1, 2, 3, 4], 2)], [torch.tensor([-0.5, -1.0])])},
                 plain, torch.float32)


class NaNOnTreeMask(torch.nn.Module):
    """A model whose fast path (a 4-D tree mask) returns NaN logits -- as a kernel overflowing on a
    masked row can -- and whose plain path is right."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, input_ids=None, attention_mask=None, **kw):
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, **kw)
        if attention_mask is not None and attention_mask.dim() == 4:
            out.logits = torch.full_like(out.logits, float("nan"))
        return out


def test_nan_on_the_fast_path_falls_back_to_the_plain_scores(gpt2, tok):
    """The self-check meets NaN tree scores: one warning saying so, strategy full, finite plain scores."""
    model = NaNOnTreeMask(gpt2).eval()
    plain, got, msgs, lm = _plain_and_fast(model, tok, ("mc",))
    assert len(msgs) == 1 and "by up to nan nats per token" in msgs[0], msgs
    assert lm.scorer.strategy == "full" and len(lm.scorer.stats.fallbacks) == 1
    lls = _lls(got["mc"])
    assert len(lls) == 9 and all(ll == ll for ll in lls)
    assert lls == pytest.approx(_lls(plain["mc"]), abs=1e-5)
