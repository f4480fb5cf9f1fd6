"""Granularity of head pruning on grouped-query models: head / group / balanced selections,
exact removal, KV-cache accounting, and unequal groups that attend without copying the cache."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import names
from headbudget.accounting import config_cost, kv_cache_bytes_per_token
from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
from headbudget.models.surgery import get_adapter
from headbudget.pruning.granularity import apply_granularity, kv_groups_of
from headbudget.pruning.importance import gate_mask, prune_spec

LAYERS, HEADS, KV, HEAD_DIM, VOCAB = 4, 8, 4, 8, 97
TEXT = Path(__file__).resolve().parent / "fixtures" / "lm" / "tiny_corpus.txt"


def _llama_like(seed: int = 0, vocab: int = VOCAB) -> HeadBudgetForCausalLM:
    """4 layers, 8 query heads on 4 kv heads (2 per group), RMSNorm, gated SiLU MLP, rotary positions."""
    torch.manual_seed(seed)
    cfg = HeadBudgetConfig(
        schedule={"d_model": 32, "layers": [{"n_heads": HEADS, "head_dim": HEAD_DIM, "n_kv_heads": KV}] * LAYERS},
        vocab_size=vocab, n_positions=64, norm="rmsnorm", mlp="gated_silu", position="rotary", bias=False,
        intermediate_size=48, tie_word_embeddings=False)
    return HeadBudgetForCausalLM(cfg).eval()


def _scores(seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.random(HEADS) for _ in range(LAYERS)]


def _cached_logits(model: HeadBudgetForCausalLM, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """Logits of every position after the prefix, one cached decode step at a time."""
    out = model(ids[:, :prefix], use_cache=True)
    cache, steps = out.past_key_values if hasattr(out, "past_key_values") else out.cache, [out.logits[:, -1:]]
    for t in range(prefix, ids.shape[1]):
        out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
        steps.append(out.logits)
    return torch.cat(steps, dim=1)


def _cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@pytest.mark.parametrize("granularity", ["head", "group", "balanced"])
def test_removal_equals_gating_and_cached_decode_equals_recomputation(granularity):
    dense = _llama_like()
    adapter = get_adapter(dense)
    counts, groups, scores = adapter.head_counts(), kv_groups_of(adapter), _scores()
    budget = 18  # of 32: 9 whole groups of 2 for `group`
    from headbudget.pruning.importance import select_top

    kept = apply_granularity(granularity, scores, groups, budget, kept=select_top(scores, budget))
    assert len(kept) == budget
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), adapter.set_gate_values(gate_mask(kept, counts)):
        gated = dense(ids).logits
    pruned = _llama_like()
    get_adapter(pruned).prune_heads(prune_spec(kept, counts))
    assert sum(pruned.head_counts) == budget
    with torch.no_grad():
        removed = pruned(ids).logits
        cached = _cached_logits(pruned, ids, prefix=5)
    torch.testing.assert_close(removed, gated, atol=1e-5, rtol=0)
    torch.testing.assert_close(cached, removed[:, 4:], atol=1e-5, rtol=0)
    assert config_cost(pruned.config).params == sum(p.numel() for p in pruned.parameters())
    specs = pruned.config.layer_specs()
    if granularity == "group":  # whole groups: every kept group still has both its query heads
        assert all(s["kv_groups"] is None and s["n_heads"] == 2 * s["n_kv_heads"] for s in specs)
        assert sum(s["n_kv_heads"] for s in specs) == budget // 2  # 16 kv heads -> 9: exactly 7 went
    if granularity == "balanced":  # one grouped-query layout per layer (SDPA enable_gqa, llama.cpp)
        assert all(s["kv_groups"] is None and s["n_heads"] % s["n_kv_heads"] == 0 for s in specs)


def test_group_granularity_kv_cache_bytes_match_the_cache_tensors():
    model = _llama_like()
    adapter = get_adapter(model)
    counts = adapter.head_counts()
    kept = apply_granularity("group", _scores(), kv_groups_of(adapter), 10)  # 5 of 16 groups
    adapter.prune_heads(prune_spec(kept, counts))
    kv = [s["n_kv_heads"] for s in model.config.layer_specs()]
    assert sum(kv) == 5 and adapter.kv_head_counts() == kv
    assert model.transformer.h[0].attn.qkv_proj.weight.shape[0] == (2 * kv[0] + 2 * kv[0]) * HEAD_DIM  # k/v rows gone
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        expected = 2 * sum(k * HEAD_DIM for k in kv) * size
        assert kv_cache_bytes_per_token(model.config, dtype) == expected
        m = model.to(dtype)
        B, T = 3, 7
        with torch.no_grad():
            out = m(torch.randint(0, VOCAB, (B, T)), use_cache=True)
        cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
        assert _cache_bytes(cache) == expected * B * T
        from headbudget.evaluation.cost import model_kv_cache_bytes

        assert model_kv_cache_bytes(m) == expected
    dense = _llama_like()
    assert kv_cache_bytes_per_token(dense.config) == 2 * LAYERS * KV * HEAD_DIM * 4


def test_balanced_layers_have_equal_groups_and_the_budget_is_met_exactly():
    groups = [[h // 2 for h in range(HEADS)]] * LAYERS
    for budget in range(LAYERS, LAYERS * HEADS + 1):
        kept = apply_granularity("balanced", _scores(budget), groups, budget)
        # a layer holds s x m heads (s in 1..2, m in 1..4): 1, 2, 3, 4, 6 or 8; 29 and 31 are out of reach
        # (three 8s + 5, ...) and round to the nearest reachable total, ties down
        assert len(kept) == {29: 28, 31: 30}.get(budget, budget)
        per_layer = [[i % HEADS for i in kept if i // HEADS == layer] for layer in range(LAYERS)]
        for heads in per_layer:
            sizes = [sum(1 for h in heads if h // 2 == g) for g in {h // 2 for h in heads}]
            assert heads and len(set(sizes)) == 1
    kept = apply_granularity("group", _scores(), groups, 3)  # below one group per layer: one group each
    assert len(kept) == 2 * LAYERS
    kept = apply_granularity("group", _scores(), groups, 11)  # odd: nearest reachable total, ties down
    assert len(kept) == 10


def test_unequal_groups_attend_without_copying_the_cache():
    """A pruned layer with groups [1, 2, 2, 2] used to index_select the whole K/V cache to one row per query
    head on every decode step; now it runs one SDPA per run of equal groups on views (same logits)."""
    model = _llama_like()
    model.prune_heads({0: [0], 2: [2, 3, 5]})  # layer 0 groups [1, 2, 2, 2]; layer 2 [2, 1, 2] (kv head 1 gone)
    assert model.config.layer_specs()[0]["kv_groups"] == [1, 2, 2, 2]
    assert model.config.layer_specs()[2]["kv_groups"] == [2, 1, 2]
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference = model(ids, output_attentions=True).logits  # explicit softmax on one kv row per query

    calls: list[str] = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", str(func))
            if name in ("index_select", "repeat_interleave", "repeat", "gather", "take_along_dim"):
                calls.append(name)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Spy():
        logits = model(ids).logits
        cached = _cached_logits(model, ids, prefix=4)
    assert calls == []
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(cached, reference[:, 3:], atol=1e-5, rtol=0)


def test_hf_llama_group_granularity_removes_kv_rows():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM)).eval()
    adapter = get_adapter(hf)
    counts = adapter.head_counts()
    scores = _scores()[:2]
    kept = apply_granularity("group", scores, kv_groups_of(adapter), 6)
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad(), adapter.set_gate_values(gate_mask(kept, counts)):
        gated = hf(ids).logits
    adapter.prune_heads(prune_spec(kept, counts))
    assert sum(adapter.kv_head_counts()) == 3 and sum(adapter.head_counts()) == 6
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, gated, atol=1e-5, rtol=0)
    from headbudget.evaluation.cost import model_kv_cache_bytes

    assert model_kv_cache_bytes(hf) == 2 * 3 * HEAD_DIM * 4


def test_prune_cli_granularity_group_reports_kv_cache_bytes(tmp_path, capsys):
    from headbudget.cli.main import main
    from headbudget.models.tokenizers import ByteTokenizer

    run = tmp_path / "run"
    _llama_like(vocab=257).save_pretrained(run / "model")  # the byte tokenizer's 257 ids
    ByteTokenizer().save(run / "tokenizer")
    out = tmp_path / "out"
    assert main(["prune", str(run), "--task", "lm", "--data", str(TEXT), "--method", "magnitude", "--keep", "12",
                 "--granularity", "group", "--context", "16", "--calib-windows", "2", "--no-progress",
                 "--device", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rep = json.loads((out / "report.json").read_text())
    kv = rep["cost"]["kv_cache_bytes_per_token"]
    assert kv == {"before": 2 * LAYERS * KV * HEAD_DIM * 4, "after": 2 * 6 * HEAD_DIM * 4}  # 12 heads = 6 groups
    assert f"KV-cache bytes / token {kv['before']:,} -> {kv['after']:,}" in printed
    assert f"| KV-cache bytes / token | {kv['before']:,} | {kv['after']:,} |" in (out / "report.md").read_text()
    specs = json.loads((out / "model" / "config.json").read_text())["schedule"]["layers"]
    assert sum(s["n_kv_heads"] for s in specs) == 6 and all(s["n_heads"] == 2 * s["n_kv_heads"] for s in specs)


def test_granularity_job_is_checked_and_fingerprinted():
    from dataclasses import replace

    from headbudget.pruning.job import PruneJob
    from headbudget.pruning.pipeline import _job_fingerprint, check_job

    job = PruneJob("m", "lm", None, "out", data=str(TEXT), method="magnitude", keep=4, granularity="groups")
    with pytest.raises(ValueError, match=names("granularity", "head, group, balanced", "'groups'")):
        check_job(job)
    assert "granularity" not in _job_fingerprint(replace(job, granularity="head"))  # older runs stay resumable
    assert _job_fingerprint(replace(job, granularity="group"))["granularity"] == "group"


def test_balanced_after_a_method_without_scores_keeps_its_heads_first(tmp_path):
    """michel has no single final score: its kept set ranks first (1 kept, 0 not); balanced then keeps an
    equal number of query heads per kv head in every layer, at the budget."""
    from headbudget.models.tokenizers import ByteTokenizer
    from headbudget.pruning.job import PruneJob
    from headbudget.pruning.pipeline import run_prune

    run = tmp_path / "run"
    _llama_like(vocab=257).save_pretrained(run / "model")
    ByteTokenizer().save(run / "tokenizer")
    res = run_prune(PruneJob(str(run), "lm", None, str(tmp_path / "out"), data=str(TEXT), method="michel", keep=12,
                             granularity="balanced", context=16, calib_windows=2, finetune_epochs=0, progress=False,
                             device="cpu", save_model=False))
    rep, details = res["report"], res["details"]
    assert rep["heads_kept"] == 12 and details["granularity"] == "balanced"
    for layer, heads in rep["kept"].items():
        sizes = [sum(1 for h in heads if h // 2 == g) for g in {h // 2 for h in heads}]
        assert len(set(sizes)) == 1, (layer, heads)
    kv = rep["cost"]["kv_cache_bytes_per_token"]
    kv_heads = sum(len({h // 2 for h in heads}) for heads in rep["kept"].values())
    assert kv == {"before": 2 * LAYERS * KV * HEAD_DIM * 4, "after": 2 * kv_heads * HEAD_DIM * 4}


def _layouts(granularity: str, scores: list[float], groups: list[int]) -> dict[int, tuple[float, list[int]]]:
    from headbudget.pruning.granularity import layer_layouts

    return layer_layouts(granularity, np.array(scores, dtype=np.float64), groups)


def test_group_layouts_are_indexed_by_query_heads_kept_not_groups_kept():
    # unequal groups (a pruned layer): group 0 holds 3 query heads, groups 1 and 2 one each.  One group may
    # be 1 or 3 heads, two groups 2 or 4: the budget counts query heads, so every head count is a layout
    scores, groups = [1.0, 1.0, 1.0, 2.0, 1.5], [0, 0, 0, 1, 2]
    assert _layouts("group", scores, groups) == {
        1: (2.0, [3]), 2: (3.5, [3, 4]), 3: (3.0, [0, 1, 2]), 4: (5.0, [0, 1, 2, 3]), 5: (6.5, [0, 1, 2, 3, 4])}
    assert apply_granularity("group", [scores], [groups], 1) == [3]
    assert apply_granularity("group", [scores], [groups], 2) == [3, 4]
    # equal groups of one head: the best group of each size replaces an earlier, worse one
    assert _layouts("group", [1.0, 5.0, 3.0], [0, 1, 2]) == {1: (5.0, [1]), 2: (8.0, [1, 2]), 3: (9.0, [0, 1, 2])}


def test_balanced_layouts_take_each_groups_best_heads_and_the_best_layout_of_each_size():
    # each group's best heads first: group 0 keeps head 0 (3.0), group 1 head 2 (2.0)
    assert _layouts("balanced", [3.0, 1.0, 2.0, 0.0], [0, 0, 1, 1]) == {
        1: (3.0, [0]), 2: (5.0, [0, 2]), 4: (6.0, [0, 1, 2, 3])}
    assert apply_granularity("balanced", [[3.0, 1.0, 2.0, 0.0]], [[0, 0, 1, 1]], 2) == [0, 2]
    # two heads either as 1 x 2 groups (heads 0, 2: 6.0) or 2 x 1 group (heads 0, 1: 9.0): the better one
    assert _layouts("balanced", [5.0, 4.0, 1.0, 0.0], [0, 0, 1, 1]) == {
        1: (5.0, [0]), 2: (9.0, [0, 1]), 4: (10.0, [0, 1, 2, 3])}


def test_balanced_takes_the_best_scoring_groups_first_not_the_lowest_index():
    # group 1 (heads 2, 3) is the better group for one head and for two: it is taken before group 0
    assert _layouts("balanced", [0.0, 1.0, 5.0, 4.0], [0, 0, 1, 1]) == {
        1: (5.0, [2]), 2: (9.0, [2, 3]), 4: (10.0, [0, 1, 2, 3])}
    assert apply_granularity("balanced", [[0.0, 1.0, 5.0, 4.0]], [[0, 0, 1, 1]], 1) == [2]
    assert apply_granularity("balanced", [[0.0, 1.0, 5.0, 4.0]], [[0, 0, 1, 1]], 2) == [2, 3]


def test_the_layer_programme_keeps_the_best_scoring_split_of_the_budget():
    # 3 heads over two layers as 1 + 2 (5 + 5 = 10) or 2 + 1 (10 + 5 = 15): the programme meets 1 + 2 first
    # but must keep 2 + 1
    scores, groups = [[5.0, 5.0, 0.0], [5.0, 0.0, 0.0]], [[0, 1, 2], [0, 1, 2]]
    for granularity in ("group", "balanced"):
        assert apply_granularity(granularity, scores, groups, 3) == [0, 1, 3], granularity
    # with grouped heads: layer 0's second group is worth more than layer 1's
    scores = [[4.0, 4.0, 3.0, 3.0], [1.0, 1.0, 0.0, 0.0]]
    groups = [[0, 0, 1, 1], [0, 0, 1, 1]]
    assert apply_granularity("group", scores, groups, 6) == [0, 1, 2, 3, 4, 5]
