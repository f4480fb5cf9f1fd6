"""The published baselines (pipelined / joint DSP, PASS, AttAttr) and the proximity-bias numbers, on tiny
random BERTs and the fixture SST-5 files; gate training runs on the one training loop (TrainLoop) and gives
the reference results bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import names

FIX = Path(__file__).resolve().parent / "fixtures" / "cahp"
DATA = FIX / "sst5"
COUNTS = [4, 4, 4]


def _tiny_bert(num_layers: int = 3, heads: int = 4, seed: int = 0, eager: bool = False):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    kw = {"attn_implementation": "eager"} if eager else {}
    cfg = BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=num_layers, num_attention_heads=heads,
                     intermediate_size=32, max_position_embeddings=32, num_labels=3, **kw)
    return BertForSequenceClassification(cfg).eval()


def _batches(n: int = 4, bsz: int = 4, seq: int = 6, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 60, (bsz, seq), generator=g),
             "attention_mask": torch.ones(bsz, seq, dtype=torch.long),
             "labels": torch.randint(0, 3, (bsz,), generator=g)} for _ in range(n)]


def _head_loss(layer: int, heads: list[int], dim: int = 4):
    """A toy loss that only wants the gated output of ``heads`` in ``layer`` to be large: its gradient
    raises those heads' gates and leaves every other gate alone."""

    def loss_fn(model, batch):
        seen = {}
        dense = model.bert.encoder.layer[layer].attention.output.dense
        handle = dense.register_forward_hook(lambda m, args, out: seen.setdefault("x", args[0]))
        try:
            model(**{k: v for k, v in batch.items() if k != "labels"})
        finally:
            handle.remove()
        x = seen["x"]
        return -sum(x[..., h * dim:(h + 1) * dim].pow(2).mean() for h in heads)

    return loss_fn


def _initial_logits(method: str, seed: int) -> np.ndarray:
    from headbudget.pruning.gated import _xavier_logits

    logits = _xavier_logits(COUNTS, method, torch.Generator().manual_seed(seed))
    return logits.float().double().numpy() if method.startswith("pass") else logits.numpy()


# --------------------------------------------------------------------------- DSP / PASS math
def test_gumbel_soft_top_k_is_k_hot_at_low_temperature_and_sums_to_k():
    from headbudget.pruning.gated import gumbel_soft_top_k

    w = torch.tensor([0.3, -1.0, 2.0, 0.1, 1.5], dtype=torch.float64)
    zero = torch.zeros_like(w)
    assert gumbel_soft_top_k(w, 2, 1e-8, noise=zero).tolist() == [0.0, 0.0, 1.0, 0.0, 1.0]
    soft = gumbel_soft_top_k(w, 3, 1000.0, noise=zero)
    assert float(soft.sum()) == pytest.approx(3.0, abs=1e-9)
    assert soft.max() - soft.min() < 0.01  # hot start: nearly uniform, every head gets gradient


def test_dsp_temperature_anneals_exponentially_then_stays():
    from headbudget.pruning.gated import dsp_temperature

    assert dsp_temperature(0, 90) == pytest.approx(1000.0)
    assert dsp_temperature(45, 90) == pytest.approx((1000.0 * 1e-8) ** 0.5, rel=1e-9)  # geometric midpoint
    assert dsp_temperature(90, 90) == 1e-8 and dsp_temperature(500, 90) == 1e-8


def test_pass_penalty_matches_hand_computed_probabilities():
    from headbudget.pruning.gated import hard_concrete_probs, pass_sparsity_penalty

    log_a = torch.tensor([3.0, -3.0])
    a = 0.33 * np.log(0.1 / 1.1)
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    p0, p1, pnb = hard_concrete_probs(log_a)
    assert p0.tolist() == pytest.approx([sig(a - 3), sig(a + 3)], rel=1e-5)
    assert p1.tolist() == pytest.approx([sig(3 + a), sig(-3 + a)], rel=1e-5)  # log(1.1/0.1) = -log(0.1/1.1)
    want = abs(0.5 * 2 - float(p0.sum())) + abs(0.5 * 2 - float(p1.sum())) + float(pnb.sum())
    assert float(pass_sparsity_penalty(log_a, 0.5)) == pytest.approx(want, rel=1e-6)


def test_pass_clip_and_reopen_follow_the_published_schedule():
    """At a reopen step the logits are clipped to [-5, 5] and a closed gate whose head has the top attention
    confidence (reopen probability 1) is reopened at +5; one with confidence 0 stays closed."""
    import random

    from headbudget.pruning.gated import PASS_COEFF_INIT, _pass_schedule

    logits = torch.nn.Parameter(torch.tensor([-7.0, -6.0, 9.0, 0.5]))
    conf = torch.tensor([2.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    # 100 steps: warm-up 10, climb 45, reopen every 15; step 30 reopens; 1 open gate, not the 2 wanted -> climb
    coeff, counter, reopened = _pass_schedule(logits, 30, PASS_COEFF_INIT, 9, 10, 45, 15, 100, 2, conf,
                                              random.Random(0), True)
    assert logits.detach().tolist() == [5.0, -5.0, 5.0, 0.5] and reopened == 1
    assert conf.tolist() == [0.0] * 4  # confidence restarts after a reopen
    assert counter == 10 and coeff == pytest.approx(1e-5 * 1000 ** (9 / 45))


def test_pass_confidence_is_the_mean_max_pre_softmax_score():
    """PASS's reopen probabilities come from each head's max (over keys) scaled q.k score, averaged over the
    batch and the queries and summed over forwards -- checked against q and k computed by hand."""
    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.gated import _confidence_patch

    model = _tiny_bert()
    adapter = get_adapter(model)
    conf = torch.zeros(12, dtype=torch.float64)
    patch = _confidence_patch(adapter, conf, [0, 4, 8, 12])
    batch = {k: v for k, v in _batches(n=1)[0].items() if k != "labels"}
    with torch.no_grad():
        with patch():
            model(**batch)
        with patch():
            model(**batch)
        hidden = model(**batch, output_hidden_states=True).hidden_states
    want = []
    for layer in range(3):
        sa = model.bert.encoder.layer[layer].attention.self
        q = sa.query(hidden[layer]).view(4, 6, 4, 4).transpose(1, 2)
        k = sa.key(hidden[layer]).view(4, 6, 4, 4).transpose(1, 2)
        want += (2 * (q @ k.transpose(-1, -2) / 2.0).max(-1).values.mean((0, 2))).tolist()
    np.testing.assert_allclose(conf.numpy(), want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- gate training
@pytest.mark.parametrize("method", ["pipelined-dsp", "pass-frozen"])
def test_frozen_gate_training_keeps_weights_and_trains_only_the_logits(method):
    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.gated import GateSettings, train_gates
    from headbudget.pruning.importance import prune_spec

    model = _tiny_bert()
    adapter = get_adapter(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = train_gates(method, adapter, model, _batches(), 5, GateSettings(cooldown=3, seed=3), progress=False)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # bit for bit
    assert all(p.grad is None for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())  # restored for the fine-tune
    assert res.steps == 4 and len(res.kept) == 5
    assert not np.allclose(res.logits, _initial_logits(method, 3))  # the logits did train
    layers = {i // 4 for i in res.kept}
    assert layers == {0, 1, 2}  # at least one head per layer
    adapter.prune_heads(prune_spec(res.kept, COUNTS))
    assert sum(adapter.head_counts()) == 5
    assert sum(m.attention.self.query.out_features for m in model.bert.encoder.layer) == 5 * 4  # physically gone


@pytest.mark.parametrize("method", ["joint-dsp", "joint-dsp-finetuned", "pass"])
def test_joint_gate_training_trains_the_weights_too(method):
    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.gated import GateSettings, train_gates

    model = _tiny_bert()
    before = {k: v.clone() for k, v in model.named_parameters()}
    res = train_gates(method, get_adapter(model), model, _batches(), 6,
                      GateSettings(cooldown=3, seed=3, weight_lr=1e-2), progress=False)
    changed = [k for k, v in model.named_parameters() if not torch.equal(before[k], v)]
    assert "bert.encoder.layer.0.attention.self.query.weight" in changed
    assert "classifier.weight" in changed
    assert len(res.kept) == 6 and res.info["weight_lr"] == 1e-2


@pytest.mark.parametrize("method", ["pipelined-dsp", "joint-dsp", "pass", "pass-frozen"])
def test_gate_logits_move_the_way_the_loss_says(method):
    """Only head (1, 2)'s output lowers the task loss: its logit gains on every other one (DSP's soft top-k
    and PASS's sparsity target push the others down), ends the largest, and is kept."""
    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.gated import GateSettings, train_gates

    model = _tiny_bert()
    wanted = 1 * 4 + 2
    res = train_gates(method, get_adapter(model), model, _batches(n=8), 3,
                      GateSettings(cooldown=2, seed=5, lr=0.5, weight_lr=0.0), loss_fn=_head_loss(1, [2]),
                      progress=False)
    delta = res.logits - _initial_logits(method, 5)
    others = np.delete(delta, wanted)
    assert delta[wanted] > others.max() + 0.5
    if not method.startswith("pass"):  # without a sparsity penalty the wanted logit itself rises
        assert delta[wanted] > 1.0 and (others < 0).all()
    assert int(np.argmax(res.logits)) == wanted
    assert wanted in res.kept


def test_at_least_one_head_per_layer_even_when_the_loss_wants_one_layer():
    """The toy loss only rewards layer 0's heads; keeping 3 heads still keeps one in every layer."""
    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.gated import GateSettings, train_gates

    model = _tiny_bert()
    res = train_gates("pipelined-dsp", get_adapter(model), model, _batches(n=8), 3,
                      GateSettings(cooldown=2, seed=5), loss_fn=_head_loss(0, [0, 1, 2, 3]),
                      progress=False)
    top3 = set(np.argsort(-res.logits)[:3].tolist())
    assert top3 <= {0, 1, 2, 3}  # by rank alone all three would come from layer 0
    assert sorted(i // 4 for i in res.kept) == [0, 1, 2]


# --------------------------------------------------------------------------- AttAttr
def test_attattr_equals_a_brute_force_integrated_gradients_loop(monkeypatch):
    import transformers.models.bert.modeling_bert as mb
    from transformers import BertTokenizerFast

    from headbudget.data.classification import ClassificationCollator, load_task
    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.attattr import attattr_scores

    tok = BertTokenizerFast(vocab_file=str(FIX / "vocab.txt"))
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
        max_position_embeddings=64, num_labels=5, attn_implementation="eager")).eval()
    examples = load_task("sst5", DATA).splits["dev"][:3]
    steps = 5
    got = attattr_scores(get_adapter(model), model, tok, examples, steps=steps, progress=False)

    # Brute force: one forward per example, layer and step, batch of one; layer l's attention replaced by
    # alpha * A through a plain substitute of BERT's eager attention.
    original = mb.eager_attention_forward
    state = {}

    def substitute(module, query, key, value, attention_mask, **kwargs):
        out, w = original(module, query, key, value, attention_mask, **kwargs)
        if module is state.get("module"):
            w = state["map"]
            out = torch.matmul(w, value).transpose(1, 2).contiguous()
        return out, w

    monkeypatch.setattr(mb, "eager_attention_forward", substitute)
    want = [np.zeros(4), np.zeros(4)]
    collate = ClassificationCollator(tok, 128)
    for ex in examples:
        batch = collate([ex])
        label = int(batch.pop("labels")[0])
        with torch.no_grad():
            maps = model(**batch, output_attentions=True).attentions
        for layer in range(2):
            a = maps[layer][0]
            total = torch.zeros_like(a)
            for i in range(steps):
                m = (a * (i / steps)).unsqueeze(0).requires_grad_(True)
                state.update(module=model.bert.encoder.layer[layer].attention.self, map=m)
                prob = torch.softmax(model(**batch).logits, -1)[0, label]
                (g,) = torch.autograd.grad(prob, m)
                total += g[0]
                state.clear()
            attr = a * total / steps
            for h in range(4):
                want[layer][h] += float(attr[h].max())
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-12)
    assert all(p.grad is None for p in model.parameters())


def test_attattr_refuses_lm_and_bad_settings():
    from headbudget.pruning.job import PruneJob
    from headbudget.pruning.pipeline import check_job

    with pytest.raises(ValueError, match=names("attattr", "lm")):
        check_job(PruneJob("m", "lm", None, "o", method="attattr", keep=3, data="t.txt"))
    with pytest.raises(ValueError, match=names("gate_cooldown", 1, 0)):
        check_job(PruneJob("m", "sst5", "d", "o", method="joint-dsp-finetuned", keep=3, gate_cooldown=0))


# --------------------------------------------------------------------------- report: proximity bias
def test_report_depth_numbers_on_a_hand_checked_layout():
    from headbudget.pruning.report import REPORT_KEYS, build_report

    kept = {layer: [] for layer in range(12)}
    kept.update({0: [0, 5], 4: [1], 7: [2], 8: [0], 11: [3]})
    rep = build_report("pass", 144, kept, None, None, {"dense": 0.5, "pruned": 0.4, "finetuned": None},
                       {"total": 1.0}, n_layers=12)
    assert tuple(rep) == REPORT_KEYS
    # depths 0, 0, 4/11, 7/11, 8/11, 1 -> mean 30/66; middle third (depth in [1/3, 2/3]) = layers 4..7: 2 of 6
    assert rep["mean_depth"] == pytest.approx(30 / 66, abs=1e-15)
    assert rep["middle_third_share"] == pytest.approx(2 / 6, abs=1e-15)


# --------------------------------------------------------------------------- CLI end to end
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    tok = BertTokenizerFast(vocab_file=str(FIX / "vocab.txt"))
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=3,
                                                     num_attention_heads=4, intermediate_size=32,
                                                     max_position_embeddings=64, num_labels=5))
    out = tmp_path_factory.mktemp("baselines") / "tiny"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize(("method", "extra"), [
    ("joint-dsp", ["--gate-cooldown", "2", "--pretrained", "TINY", "--joint-epochs", "1"]),
    ("joint-dsp-finetuned", ["--gate-cooldown", "2"]),
    ("pipelined-dsp", ["--gate-cooldown", "2"]),
    ("pass", ["--pretrained", "TINY", "--joint-epochs", "1"]),
    ("pass-frozen", []),
    ("attattr", ["--attattr-examples", "3", "--attattr-steps", "4"]),
])
def test_prune_cli_baseline_writes_a_loadable_model(tiny, tmp_path, method, extra):
    from headbudget.cli.main import main
    from headbudget.loading import load_model
    from headbudget.models.surgery import get_adapter

    out = tmp_path / method
    rc = main(["prune", str(tiny), "--task", "sst5", "--data-dir", str(DATA), "--method", method, "--keep", "5",
               "--finetune-epochs", "0", "--batch-size", "16", "--no-progress", "--out", str(out),
               *[str(tiny) if a == "TINY" else a for a in extra]])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["method"] == method and rep["heads_kept"] == 5
    assert all(len(v) >= 1 for v in rep["kept"].values())
    layers = [int(k) for k, v in rep["kept"].items() for _ in v]
    assert rep["mean_depth"] == pytest.approx(sum(layer / 2 for layer in layers) / 5)
    assert rep["middle_third_share"] == pytest.approx(sum(layer == 1 for layer in layers) / 5)
    model = load_model(out / "model", "classifier", num_labels=5)
    assert get_adapter(model).head_counts() == [len(rep["kept"][str(i)]) for i in range(3)]
    details = json.loads((out / "details.json").read_text())
    assert len(details["scores"]) == 12
    if method != "attattr":
        assert details["gate_training"]["steps"] == 4  # 60 training examples / 16 per batch
    assert "warning" not in rep  # DSP here cools down within its 4 steps (cooldown 2)


def test_dsp_that_never_cools_down_says_so(tiny, tmp_path, capsys):
    """4 gate-training steps against the published SST-5 cooldown of 90: the temperature stays high, and the
    report (and stderr) say so with the way out."""
    from headbudget.cli.main import main

    out = tmp_path / "dsp"
    rc = main(["prune", str(tiny), "--task", "sst5", "--data-dir", str(DATA), "--method", "pipelined-dsp",
               "--keep", "5", "--finetune-epochs", "0", "--batch-size", "16", "--no-progress", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    want = ("pipelined-dsp: the temperature never reached 1e-08: 4 gate-training steps < cooldown 90 "
            "(last temperature 430); raise gate_epochs (--gate-epochs) or lower gate_cooldown (--gate-cooldown)")
    assert rep["warning"] == want
    assert want in capsys.readouterr().err


@pytest.mark.parametrize("method", ["pipelined-dsp", "pass", "pass-frozen"])
def test_gated_baselines_prune_a_causal_lm_label_free(tmp_path, method):
    """task lm: the gates train on the calibration windows' LM loss of a headbudget model with unequal
    layers (2, 4, 8 heads); PASS runs without reopening there (no eager attention to read confidence from)."""
    from headbudget.cli.main import main
    from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    from headbudget.schedules import prism

    torch.manual_seed(0)
    HeadBudgetForCausalLM(HeadBudgetConfig(schedule=prism(3, 64, 32, 8), vocab_size=257, n_positions=64,
                                           dropout=0.0)).save_pretrained(tmp_path / "run" / "model")
    from headbudget.models.tokenizers import ByteTokenizer

    ByteTokenizer().save(tmp_path / "run" / "tokenizer")
    out = tmp_path / method
    rc = main(["prune", str(tmp_path / "run"), "--task", "lm", "--data", str(FIX.parent / "lm" / "tiny_corpus.txt"),
               "--method", method, "--keep", "6", "--gate-cooldown", "2", "--context", "32", "--calib-windows", "8",
               "--batch-size", "4", "--no-progress", "--device", "cpu", "--out", str(out),
               *(["--joint-epochs", "1"] if method == "pass" else [])])  # an LM is its own pre-trained start
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["heads_kept"] == 6 and all(len(rep["kept"][str(i)]) >= 1 for i in range(3))
    details = json.loads((out / "details.json").read_text())
    assert details["gate_training"]["steps"] == 2  # 8 windows / 4 per batch
    if method.startswith("pass"):
        assert details["gate_training"]["reopen"] is False
    assert details["gate_training"]["start"] == "model"
    from headbudget.models.surgery import get_adapter

    model = HeadBudgetForCausalLM.from_pretrained(out / "model")
    assert get_adapter(model).head_counts() == [len(rep["kept"][str(i)]) for i in range(3)]


def test_prune_compare_gives_the_baselines_the_preceding_cahp_knee(tiny, tmp_path):
    from headbudget.pruning.compare import run_prune_compare
    from headbudget.pruning.job import PruneCompareJob

    job = PruneCompareJob(model=str(tiny), task="sst5", data_dir=str(DATA), out=str(tmp_path / "cmp"), pool_size=8,
                          batch_size=16, finetune_epochs=0, progress=False, save_model=False, gate_cooldown=2,
                          attattr_examples=2, attattr_steps=3, pretrained=str(tiny), joint_epochs=1,
                          methods="cahp@6,pipelined-dsp,joint-dsp,pass,attattr")
    summary = run_prune_compare(job)
    rows = summary["rows"]
    knee = rows[0]["heads_kept"]
    assert [(r["label"], r["heads_kept"], r["count_from"]) for r in rows[1:]] == [
        (m, knee, "cahp-d6 knee") for m in ("pipelined-dsp", "joint-dsp", "pass", "attattr")]
    for r in rows:
        layers = [int(k) for k, v in r["kept"].items() for _ in v]
        assert r["mean_depth"] == pytest.approx(sum(layer / 2 for layer in layers) / len(layers))
        assert r["middle_third_share"] == pytest.approx(layers.count(1) / len(layers))
    assert "mean depth" in (tmp_path / "cmp" / "compare.md").read_text()


@pytest.mark.parametrize("method", ["pipelined-dsp", "pass-frozen", "joint-dsp"])
def test_gate_training_depends_on_its_seed_alone_not_on_the_callers_random_state(method):
    """Dropout inside gate training draws from torch's global generator: two runs with one seed must agree whatever
    the process drew before (a worker's earlier cells), and the caller's random state is left as it was."""
    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.gated import GateSettings, train_gates

    results = []
    for before in (0, 1):
        model = _tiny_bert()  # BERT's dropout 0.1 is on while gates train
        torch.rand(before + 1)  # a different global random state at the start of gate training
        state = torch.get_rng_state()
        res = train_gates(method, get_adapter(model), model, _batches(n=6), 5, GateSettings(cooldown=3, seed=7),
                          progress=False)
        assert torch.equal(torch.get_rng_state(), state)
        results.append(res.logits)
    np.testing.assert_array_equal(results[0], results[1])


# --------------------------------------------------------------------------- gate training on the one loop
#: Reference results of train_gates on the tiny BERT of _train_gates (kept heads, heads PASS reopened, final gate
#: logits; 20 steps with PASS reopening), computed by a gate-training loop written without TrainLoop: gate training
#: on TrainLoop must give them bit for bit
_REFERENCE_GATES = {
    ("pass-frozen", True): ([0, 1, 6, 10, 11], 5, [4.9387526512146, 4.938931941986084, 2.26098895072937, 0.7539010643959045,
                                            2.549811363220215, 2.1413540840148926, 4.93870735168457,
                                            -0.8531513214111328, 1.6700572967529297, 1.6442286968231201,
                                            4.264365196228027, 4.264598846435547]),
    ("joint-dsp-finetuned", False): ([1, 2, 6, 7, 9], None, [-1.963037989096056, 1.1726358628779683, 2.207736550940807,
                                                   -1.0696549889708502, -1.0635291077462852, -0.9199879961804793,
                                                   1.1370334255837407, 2.1640592786040407, -0.5871153784841945,
                                                   2.337302589111245, 1.0336867476636153, -2.3297264565108575]),
}


def _train_gates(method: str, toy_loss: bool):
    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.gated import GateSettings, train_gates

    model = _tiny_bert(eager=True, seed=2)
    return train_gates(method, get_adapter(model), model, _batches(n=10, seed=4), 5,
                       GateSettings(cooldown=5, seed=7, epochs=2, weight_lr=1e-2), progress=False,
                       **({"loss_fn": _head_loss(1, [2])} if toy_loss else {}))


def test_gate_training_runs_on_the_one_train_loop(monkeypatch):
    from headbudget.train.loop import TrainLoop

    runs = []
    original = TrainLoop.run

    def counting(self, *args, **kwargs):
        runs.append(kwargs.get("steps"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TrainLoop, "run", counting)
    res = _train_gates("pipelined-dsp", toy_loss=False)
    assert runs == [20] and res.steps == 20 and len(res.history) == 20


@pytest.mark.parametrize(("method", "toy_loss"), list(_REFERENCE_GATES))
def test_gate_training_gives_the_reference_gates(method, toy_loss, monkeypatch):
    import contextlib

    import headbudget.pruning.gated as gated

    # the reference loop draws dropout from the caller's generator, gate training seeds it (seeded_dropout, see
    # test_gate_training_depends_on_its_seed_alone_not_on_the_callers_random_state): with that seeding off,
    # gate training gives the reference numbers bit for bit
    monkeypatch.setattr(gated, "seeded_dropout", lambda seed, device: contextlib.nullcontext())
    kept, reopened, logits = _REFERENCE_GATES[(method, toy_loss)]
    res = _train_gates(method, toy_loss)
    assert res.kept == kept and res.info.get("reopened") == reopened
    np.testing.assert_allclose(res.logits, logits, rtol=1e-5, atol=1e-6)
