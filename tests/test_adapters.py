"""Head adapters: gating == removal for every family, refusals, save/load, attention probabilities."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    RobertaConfig,
    RobertaForSequenceClassification,
)

from conftest import names
from headbudget.models.surgery import get_adapter, load_pruned, save_pruned

VOCAB = 64


def _bert():
    cfg = BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        num_labels=3,
    )
    return BertForSequenceClassification(cfg)


def _roberta():
    cfg = RobertaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        vocab_size=VOCAB,
        max_position_embeddings=40,
        num_labels=3,
        pad_token_id=1,
    )
    return RobertaForSequenceClassification(cfg)


def _gpt2():
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32))


def _gpt2_cls():
    cfg = GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32, num_labels=2, pad_token_id=0
    )
    return GPT2ForSequenceClassification(cfg)


def _llama(heads: int = 8, kv: int = 2):
    cfg = LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=4,
        intermediate_size=48,
        vocab_size=VOCAB,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(cfg)


def _qwen2():  # Llama-style with q/k/v biases
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=4,
        intermediate_size=48,
        vocab_size=VOCAB,
        max_position_embeddings=32,
    )
    return Qwen2ForCausalLM(cfg)


def _headbudget():
    from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    from headbudget.schedules import HeadSchedule, LayerSpec

    sched = HeadSchedule(32, (LayerSpec(4, 8), LayerSpec(4, 8, n_kv_heads=2)))
    return HeadBudgetForCausalLM(
        HeadBudgetConfig(schedule=sched, vocab_size=VOCAB, n_positions=32, dropout=0.0, bias=True)
    )


def _inputs(family: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # a padded row
    mask[2, 4:] = 0
    if family in ("bert", "roberta"):
        return {"input_ids": ids, "attention_mask": mask}
    return {"input_ids": ids}


# (builder, family key for inputs, removal spec with current indices, expected head counts after)
CASES = {
    "bert": (_bert, "bert", {0: [1, 3], 1: [0]}, [2, 3]),
    "roberta": (_roberta, "roberta", {0: [0, 1, 2], 1: [2]}, [1, 3]),
    "gpt2": (_gpt2, "gpt2", {0: [1, 3], 1: [0]}, [2, 3]),
    "gpt2-cls": (_gpt2_cls, "gpt2", {0: [2], 1: [0, 3]}, [3, 2]),
    # layer 0 drops a whole KV group (queries 0-3); layer 1 leaves groups of 3 and 2 (partial)
    "llama-gqa": (_llama, "llama", {0: [0, 1, 2, 3], 1: [1, 5, 6]}, [4, 5]),
    "qwen2-bias": (_qwen2, "llama", {0: [0, 5], 1: [1, 2, 3]}, [6, 5]),
    "headbudget": (_headbudget, "headbudget", {0: [1, 3], 1: [0, 1]}, [2, 2]),
}


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return CASES[name][0]().eval()


def _logits(model: nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("name", list(CASES))
def test_removed_equals_gated_to_zero(name: str) -> None:
    model = _build(name)
    _, fam, spec, expected = CASES[name]
    inputs = _inputs(fam)
    adapter = get_adapter(model)
    counts = adapter.head_counts()
    values = [torch.ones(n) for n in counts]
    for layer, heads in spec.items():
        values[layer][heads] = 0.0
    dense = _logits(model, inputs)
    with adapter.set_gate_values(values):
        gated = _logits(model, inputs)
    assert (gated - dense).abs().max() > 1e-4  # the gates really act
    adapter.prune_heads(spec)
    assert adapter.head_counts() == expected
    pruned = _logits(model, inputs)
    assert (pruned - gated).abs().max().item() <= 1e-5
    for layer, heads in spec.items():
        assert adapter.original_heads()[layer] == [h for h in range(counts[layer]) if h not in heads]
    record = adapter.pruned_heads_record()
    assert json.loads(json.dumps(record)) == {str(k): v for k, v in record.items()}


def test_family_detection_and_unsupported() -> None:
    assert get_adapter(_bert()).family == "bert"
    assert get_adapter(_roberta()).family == "bert"
    assert get_adapter(_gpt2()).family == "gpt2"
    assert get_adapter(_llama()).family == "llama"
    assert get_adapter(_headbudget()).family == "headbudget"

    class Wrapped(nn.Module):  # sentence-transformers style: BertModel + a custom head
        def __init__(self) -> None:
            super().__init__()
            self.encoder_model = BertModel(_bert().config, add_pooling_layer=False)
            self.head = nn.Linear(32, 2)

    assert get_adapter(Wrapped()).family == "bert"
    with pytest.raises(ValueError, match=names("Sequential")):
        get_adapter(nn.Sequential(nn.Linear(2, 2)))


def test_gates_give_gradients_and_hooks_are_removed() -> None:
    model = _build("bert")
    inputs = _inputs("bert")
    adapter = get_adapter(model)
    dense = _logits(model, inputs)
    with adapter.gates() as gates:
        assert [g.shape[0] for g in gates] == [4, 4]
        assert all(g.requires_grad and torch.equal(g, torch.ones(4)) for g in gates)
        out = model(**inputs, labels=torch.tensor([0, 1, 2]))
        out.loss.backward()
        grads = [g.grad.clone() for g in gates]
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    # d loss / d gate_h is the first-order change of the loss when head h is scaled
    eps = 1e-3
    vals = [torch.ones(4), torch.ones(4)]
    vals[1][2] += eps
    with adapter.set_gate_values(vals):
        up = model(**inputs, labels=torch.tensor([0, 1, 2])).loss.item()
    assert abs((up - out.loss.item()) / eps - grads[1][2].item()) < 2e-3
    assert torch.equal(_logits(model, inputs), dense)  # no hooks left behind
    for layer in model.bert.encoder.layer:
        assert not layer.attention.output.dense._forward_pre_hooks


def test_refuses_last_head_and_leaves_model_untouched() -> None:
    model = _build("gpt2")
    adapter = get_adapter(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=names("layer 1", "4 heads")):
        adapter.prune_heads({0: [0], 1: [0, 1, 2, 3]})
    with pytest.raises(ValueError, match=names("layer 0", "head 4")):
        adapter.prune_heads({0: [4]})
    with pytest.raises(ValueError, match=names("layer 5")):
        adapter.prune_heads({5: [0]})
    assert adapter.head_counts() == [4, 4]
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # pruning in two steps: indices are current ones, the record keeps original ones
    adapter.prune_heads({1: [0]})
    adapter.prune_heads({1: [0, 1]})
    assert adapter.original_heads()[1] == [3]
    with pytest.raises(ValueError, match=names("layer 1", "1 heads")):
        adapter.prune_heads({1: [0]})


def test_llama_gqa_groups() -> None:
    model = _build("llama-gqa")
    adapter = get_adapter(model)
    assert adapter.head_counts() == [8, 8] and adapter.kv_head_counts() == [2, 2]
    with pytest.raises(ValueError, match=names("layer 1", "KV group 0")):
        adapter.prune_heads({1: [1]}, partial_groups="refuse")
    adapter.prune_heads({0: [4, 5, 6, 7]}, partial_groups="refuse")  # a whole group: allowed
    assert adapter.kv_head_counts()[0] == 1
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (4, 32)
    # equal partial groups keep the KV heads without duplication
    adapter.prune_heads({1: [0, 4]})
    assert adapter.head_counts()[1] == 6 and adapter.kv_head_counts()[1] == 2
    assert model.model.layers[1].self_attn.num_key_value_groups == 3
    # uneven groups (3 and 1 queries): the KV head of the 3-group is stored 3 times
    adapter.prune_heads({1: [4, 5]})
    assert adapter.query_to_kv()[1] == [0, 0, 0, 1]
    assert adapter.kv_head_counts()[1] == 4
    # a cached greedy decode still matches the uncached one
    ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
        seq = ids
        for _ in range(4):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(gen, seq)


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama-gqa", "headbudget"])
def test_save_load_pruned_reproduces_outputs(name: str, tmp_path) -> None:
    model = _build(name)
    _, fam, spec, expected = CASES[name]
    inputs = _inputs(fam)
    adapter = get_adapter(model)
    adapter.prune_heads(spec)
    want = _logits(model, inputs)
    save_pruned(model, tmp_path / "m")
    record = json.loads((tmp_path / "m" / "kept_heads.json").read_text())
    assert record["family"] == adapter.family and record["head_counts"] == expected
    loaded = load_pruned(tmp_path / "m")
    assert type(loaded) is type(model)
    again = get_adapter(loaded)
    assert again.head_counts() == expected and again.kv_head_counts() == adapter.kv_head_counts()
    assert again.original_heads() == adapter.original_heads()
    assert (_logits(loaded, inputs) - want).abs().max().item() <= 1e-6


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama-gqa", "headbudget"])
def test_attention_probs_shapes_and_rows(name: str) -> None:
    model = _build(name)
    _, fam, spec, _expected = CASES[name]
    inputs = _inputs(fam)
    adapter = get_adapter(model)
    adapter.prune_heads(spec)
    model.train()
    probs = adapter.attention_probs(**inputs)
    assert model.training  # restored
    assert [tuple(p.shape) for p in probs] == [(3, n, 9, 9) for n in adapter.head_counts()]
    for p in probs:
        assert torch.allclose(p.sum(-1), torch.ones(p.shape[:-1]), atol=1e-5)
        if fam != "bert":  # decoders: causal
            assert p.triu(1).abs().max() == 0


def test_bert_padding_is_respected() -> None:
    model = _build("bert")
    inputs = _inputs("bert")
    adapter = get_adapter(model)
    probs = adapter.attention_probs(**inputs)
    for p in probs:
        assert p[1, :, :, 6:].abs().max() == 0  # padded keys get no attention
        assert p[2, :, :, 4:].abs().max() == 0
    # a padded row gives the same logits as the same sentence alone, unpadded
    batch = _logits(model, inputs)
    alone = _logits(model, {"input_ids": inputs["input_ids"][1:2, :6]})
    assert (batch[1] - alone[0]).abs().max().item() <= 1e-5
    # and the same holds for a pruned model under gates
    adapter.prune_heads({0: [0], 1: [3]})
    batch = _logits(model, inputs)
    alone = _logits(model, {"input_ids": inputs["input_ids"][2:3, :4]})
    assert (batch[2] - alone[0]).abs().max().item() <= 1e-5


def test_the_loader_keeps_its_own_copy_of_the_kept_heads_file_name() -> None:
    import headbudget.loading as loading
    import headbudget.models.surgery as surgery

    # importing surgery in the loader would import transformers
    assert loading.KEPT_HEADS_FILE == surgery.KEPT_HEADS_FILE == "kept_heads.json"


@pytest.mark.parametrize("name", list(CASES))
def test_every_family_is_a_head_adapter(name: str) -> None:
    from headbudget.models.surgery import HeadAdapter

    adapter = get_adapter(_build(name))
    assert isinstance(adapter, HeadAdapter)
    q, k, v = adapter.qkv_weights(0)
    n, n_kv = adapter.head_counts()[0], adapter.kv_head_counts()[0]
    assert q.shape[0] % n == 0 and k.shape[0] % n_kv == 0 and v.shape == k.shape  # rows head by head
    assert len(adapter.kv_group(0)) == n and max(adapter.kv_group(0)) < n_kv


def test_outside_surgery_an_adapter_is_used_only_through_its_interface() -> None:
    """Every ``<...>adapter.<name>`` read in the package outside models/surgery names a member of the Protocol."""
    import ast
    from pathlib import Path

    from headbudget.models.surgery import HeadAdapter

    members = {n for n in dir(HeadAdapter) if not n.startswith("__")} | set(HeadAdapter.__annotations__)
    src = Path(__file__).resolve().parents[1] / "src" / "headbudget"
    used = {}
    for path in src.rglob("*.py"):
        if "surgery" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            base = node.value if isinstance(node, ast.Attribute) else None
            name = (base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else "")
            if name.endswith("adapter") and not node.attr.startswith("__"):
                used.setdefault(node.attr, str(path.relative_to(src)))
    assert {a: p for a, p in used.items() if a not in members} == {}
    assert {"head_counts", "prune_heads", "attention_module"} <= set(used)
