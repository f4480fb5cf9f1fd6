"""benchmarks/decode.py refuses, before any timing, a run whose live KV caches cannot fit in memory, and scores
heads through the pruning-method registry."""

import types
from pathlib import Path

import pytest

from conftest import load_benchmark, names
from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM


@pytest.fixture(scope="module")
def decode():
    return load_benchmark("decode")


def test_live_cache_bytes_counts_every_model_at_the_largest_batch(decode):
    model = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", "uniform", vocab_size=64))
    # cpu-tiny: 4 layers x (k + v) x 4 kv heads x 32 dims x 4 bytes = 4096 bytes per token
    per_token = 4 * 2 * 4 * 32 * 4
    got = decode.live_cache_bytes({"a": model, "b": model}, context=100, batch=8, new_tokens=16)
    assert got == int(2 * per_token * 8 * 116 * (1 + 1 / 4))


def test_a_run_that_cannot_fit_is_refused_in_one_line(decode):
    model = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", "uniform", vocab_size=64))
    args = types.SimpleNamespace(contexts=[512, 100], batches=[1, 8], new_tokens=16)
    need = decode.live_cache_bytes({"dense": model}, 512, 8, 16)
    decode.check_memory({"dense": model}, args, available=2 * need)  # fits: no error
    with pytest.raises(SystemExit, match=names("decode.py", "1 models", "context 512", "batch 8")):
        decode.check_memory({"dense": model}, args, available=need)


def test_decode_benchmark_scores_through_the_registry():
    text = (Path(__file__).resolve().parents[1] / "benchmarks" / "decode.py").read_text()
    assert "IMPORTANCES" not in text and "score_heads(args.importance, ctx)" in text
