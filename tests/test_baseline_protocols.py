"""The baselines as their authors run them: joint DSP and PASS trained jointly from the pre-trained model (their
earlier forms kept as ``joint-dsp-finetuned`` / ``pass-frozen``), every baseline without the one-head-per-layer
floor, and BERT layers that lose every head -- on tiny random BERTs and the fixture SST-5 files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import names

FIX = Path(__file__).resolve().parent / "fixtures" / "cahp"
DATA = FIX / "sst5"
# 3 layers x 4 heads; flat index = layer * 4 + head.  Layer 1's heads score lowest of all, so a global top-k
# empties it while the floor keeps its best head (index 6).
LOW_MIDDLE = [np.array([0.9, 0.8, 0.7, 0.6]), np.array([0.01, 0.02, 0.04, 0.03]), np.array([0.5, 0.4, 0.3, 0.2])]


def _bert(layers: int = 3, seed: int = 0, labels: int = 5, vocab: int = 60, eager: bool = False):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    kw = {"attn_implementation": "eager"} if eager else {}
    return BertForSequenceClassification(BertConfig(
        vocab_size=vocab, hidden_size=16, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=32,
        max_position_embeddings=64, num_labels=labels, **kw)).eval()


def _save(path: Path, seed: int) -> Path:
    from transformers import BertTokenizerFast

    tok = BertTokenizerFast(vocab_file=str(FIX / "vocab.txt"))
    _bert(seed=seed, vocab=tok.vocab_size).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("ft") / "ft", seed=0)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("pre") / "pre", seed=1)  # same shapes, other weights


def _job(model, out, **kw):
    from headbudget.pruning.job import PruneJob

    base = dict(model=str(model), task="sst5", data_dir=str(DATA), out=str(out), batch_size=16, finetune_epochs=0,
                progress=False, save_model=False, gate_cooldown=2)
    base.update(kw)
    return PruneJob(**base)


# --------------------------------------------------------------------------- zero-head layers (surgery)
def test_bert_layer_without_heads_equals_the_gated_dense_model_and_reloads(tmp_path):
    """All of layer 1's heads removed: the logits are the dense model's with that layer's gates at 0, and the
    layer's attention block outputs LayerNorm(output-projection bias + its input) -- nothing else."""
    from headbudget.models.surgery import get_adapter, load_pruned, save_pruned

    model = _bert()
    ids = torch.randint(1, 60, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    adapter = get_adapter(model)
    with torch.no_grad(), adapter.set_gate_values({0: [1, 0, 1, 1], 1: [0, 0, 0, 0]}):
        want = model(input_ids=ids, attention_mask=mask).logits
    adapter.prune_heads({0: [1], 1: [0, 1, 2, 3]})
    assert adapter.head_counts() == [3, 0, 4] and adapter.original_heads()[1] == []
    block = model.bert.encoder.layer[1].attention
    assert type(block.self).__name__ == "NoHeadSelfAttention" and block.output.dense.weight.shape == (16, 0)
    seen = {}
    block.register_forward_hook(lambda m, args, out: seen.update(x=args[0], y=out[0]))
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    out = block.output
    torch.testing.assert_close(seen["y"], out.LayerNorm(out.dense.bias + seen["x"]), rtol=0, atol=0)
    assert [p.shape[1] for p in adapter.attention_probs(input_ids=ids, attention_mask=mask)] == [3, 0, 4]
    save_pruned(model, tmp_path / "m")
    back = load_pruned(tmp_path / "m")
    assert get_adapter(back).head_counts() == [3, 0, 4]
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids, attention_mask=mask).logits, got)
    # the family is still recognised when the first layer (the one it looks at) has no heads either
    with torch.no_grad(), get_adapter(back).set_gate_values({0: [0, 0, 0], 1: []}):
        want = back(input_ids=ids, attention_mask=mask).logits
    get_adapter(back).prune_heads({0: [0, 1, 2]})
    assert get_adapter(back).head_counts() == [0, 0, 4]
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids, attention_mask=mask).logits, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_decoders_refuse_to_empty_a_layer_in_one_line(family):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from headbudget.models.surgery import get_adapter

    model = (GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=2, n_head=4, vocab_size=50)) if family == "gpt2" else
             LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=50)))
    with pytest.raises(ValueError, match=names("layer 1", "4 heads", family, "BERT-family")):
        get_adapter(model).prune_heads({1: [0, 1, 2, 3]})
    assert get_adapter(model).head_counts() == [4, 4]


# --------------------------------------------------------------------------- no floor: the selection rules
def test_select_top_with_and_without_the_floor():
    from headbudget.pruning.importance import select_top

    floored, free = select_top(LOW_MIDDLE, 5), select_top(LOW_MIDDLE, 5, layer_floor=False)
    assert floored == [0, 1, 2, 6, 8] and free == [0, 1, 2, 3, 8]  # exactly 5 each; layer 1 keeps 1 vs 0
    assert select_top(LOW_MIDDLE, 2, layer_floor=False) == [0, 1]  # fewer heads than layers is allowed now
    with pytest.raises(ValueError, match=names("3", "12")):
        select_top(LOW_MIDDLE, 2)


def test_michel_without_the_floor_removes_a_whole_layer(monkeypatch):
    from headbudget.pruning import importance

    monkeypatch.setattr(importance, "michel_importance", lambda ctx, gate_values=None: LOW_MIDDLE)

    class Ctx:
        head_counts = [4, 4, 4]

    assert importance.michel_iterative(Ctx(), 5) == [0, 1, 2, 6, 8]
    assert importance.michel_iterative(Ctx(), 5, layer_floor=False) == [0, 1, 2, 3, 8]


def test_gate_training_without_the_floor_keeps_the_best_logits_globally():
    """The toy loss rewards only layer 0's heads: with the floor layers 1 and 2 keep one head each, without it
    all 3 kept heads are layer 0's."""
    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.gated import GateSettings, train_gates
    from test_baselines import _batches, _head_loss

    kept = {}
    for floor in (True, False):
        model = _bert(vocab=60)
        kept[floor] = train_gates("pipelined-dsp", get_adapter(model), model, _batches(n=8), 3,
                                  GateSettings(cooldown=2, seed=5), loss_fn=_head_loss(0, [0, 1, 2, 3]),
                                  progress=False, layer_floor=floor).kept
    assert sorted(i // 4 for i in kept[True]) == [0, 1, 2]
    assert len(kept[False]) == 3 and {i // 4 for i in kept[False]} == {0}


@pytest.fixture
def low_middle():
    from headbudget.pruning import methods

    methods.register_importance("low-middle", lambda ctx: LOW_MIDDLE)
    yield "low-middle"
    methods.unregister("low-middle")


def test_run_prune_without_the_floor_empties_the_weakest_layer_physically(finetuned, tmp_path, low_middle):
    from headbudget.loading import load_model
    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.pipeline import run_prune

    floored = run_prune(_job(finetuned, tmp_path / "a", method=low_middle, keep=5))["report"]
    free = run_prune(_job(finetuned, tmp_path / "b", method=low_middle, keep=5, layer_floor=False,
                          save_model=True))["report"]
    assert floored["kept"] == {"0": [0, 1, 2], "1": [2], "2": [0]}
    assert free["kept"] == {"0": [0, 1, 2, 3], "1": [], "2": [0]} and free["heads_kept"] == 5
    model = load_model(tmp_path / "b" / "model", "classifier", num_labels=5)
    assert get_adapter(model).head_counts() == [4, 0, 1]
    two = run_prune(_job(finetuned, tmp_path / "c", method=low_middle, keep=2, layer_floor=False))["report"]
    assert two["kept"] == {"0": [0, 1], "1": [], "2": []}  # below one head per layer
    details = json.loads((tmp_path / "b" / "details.json").read_text())
    assert details["job"]["layer_floor"] is False
    assert "layer_floor" not in json.loads((tmp_path / "a" / "details.json").read_text())["job"]  # old runs resume


def test_attattr_without_the_floor(finetuned, tmp_path, monkeypatch):
    from headbudget.pruning import methods
    from headbudget.pruning.pipeline import run_prune

    monkeypatch.setattr(methods.attattr, "attattr_scores", lambda *a, **k: LOW_MIDDLE)
    kept = {floor: run_prune(_job(finetuned, tmp_path / str(floor), method="attattr", keep=5, layer_floor=floor,
                                  limit_eval=4))["report"]["kept"]["1"] for floor in (True, False)}
    assert kept == {True: [2], False: []}


def test_cahp_keeps_its_floor(finetuned, tmp_path, low_middle):
    from headbudget.pruning.compare import _as_method
    from headbudget.pruning.pipeline import check_job

    with pytest.raises(ValueError, match=names("cahp", "layer_floor", "--no-layer-floor")):
        check_job(_job(finetuned, tmp_path, layer_floor=False))
    job = _job(finetuned, tmp_path, layer_floor=False)
    assert _as_method(job, "cahp").layer_floor is True and _as_method(job, "fisher").layer_floor is False
    check_job(_as_method(job, "cahp"))  # what prune-compare checks: no refusal for a comparison with baselines


# --------------------------------------------------------------------------- joint from the pre-trained model
def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("method", "start", "moves", "epochs"), [
    ("joint-dsp", "pretrained", True, 2),
    ("joint-dsp-finetuned", "finetuned", True, 1),
    ("pass", "pretrained", True, 2),
    ("pass-frozen", "finetuned", False, 1),
])
def test_where_gate_training_starts_and_whether_the_encoder_moves(finetuned, pretrained, tmp_path, monkeypatch,
                                                                  method, start, moves, epochs):
    from headbudget.loading import load_model
    from headbudget.pruning import gated
    from headbudget.pruning.pipeline import run_prune

    spy = {}
    original = gated.train_gates

    def recording(method_, adapter, model, *args, **kwargs):
        spy["before"] = _state(model)
        res = original(method_, adapter, model, *args, **kwargs)
        spy["after"] = _state(model)
        return res

    monkeypatch.setattr(gated, "train_gates", recording)
    res = run_prune(_job(finetuned, tmp_path / method, method=method, keep=5, pretrained=str(pretrained),
                         joint_epochs=2, gate_epochs=1))
    want = _state(load_model(pretrained if start == "pretrained" else finetuned, "classifier", num_labels=5))
    assert all(torch.equal(spy["before"][k], want[k]) for k in want)  # the weights it started from
    key = "bert.encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(spy["before"][key], _state(load_model(
        finetuned if start == "pretrained" else pretrained, "classifier", num_labels=5))[key])
    moved = [k for k in spy["before"] if not torch.equal(spy["before"][k], spy["after"][k])]
    assert (key in moved) is moves and bool(moved) is moves
    info = res["details"]["gate_training"]
    assert res["report"]["heads_kept"] == 5 and info["epochs"] == epochs and info["steps"] == 4 * epochs
    assert info["start"] == ("pretrained" if start == "pretrained" else "model")
    assert ("weight_lr" in info) is moves


def test_joint_protocols_need_the_pretrained_model_and_a_fitting_one(finetuned, tmp_path):
    from headbudget.pruning.pipeline import check_job, run_prune

    for method, other in (("joint-dsp", "joint-dsp-finetuned"), ("pass", "pass-frozen")):
        with pytest.raises(ValueError, match=names(method, "--pretrained", other)):
            check_job(_job(finetuned, tmp_path, method=method, keep=5))
    with pytest.raises(ValueError, match=names("joint_epochs", "1", "0")):
        check_job(_job(finetuned, tmp_path, method="pass", keep=5, pretrained="p", joint_epochs=0))
    other = tmp_path / "two-layers"
    from transformers import BertTokenizerFast

    _bert(layers=2, vocab=BertTokenizerFast(vocab_file=str(FIX / "vocab.txt")).vocab_size).save_pretrained(other)
    with pytest.raises(ValueError, match=names("pretrained", other, "bert.encoder.layer.2.")):
        run_prune(_job(finetuned, tmp_path / "x", method="joint-dsp", keep=5, pretrained=str(other),
                       limit_eval=4))


def test_only_layer_floor_true_itself_is_left_out_of_the_fingerprint():
    """Older runs resume because the default ``True`` is left out; any other value is recorded as given."""
    import dataclasses

    from headbudget.pruning.job import PruneJob
    from headbudget.pruning.pipeline import _job_fingerprint

    job = PruneJob("m", "lm", None, "o", method="fisher")
    assert "layer_floor" not in _job_fingerprint(job)
    assert _job_fingerprint(dataclasses.replace(job, layer_floor=False))["layer_floor"] is False
    assert _job_fingerprint(dataclasses.replace(job, layer_floor=1))["layer_floor"] == 1
