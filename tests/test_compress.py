"""Compression: SVD exactness and truncation error, grouping identity, allocation, pipeline and CLI."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import assert_names, error_line, names
from headbudget.compression.allocation import ALLOCATIONS, allocate, divisors
from headbudget.compression.grouping import adjacent_groups, group_heads, groups_from_labels
from headbudget.compression.pipeline import attention_parameters, compress_model
from headbudget.compression.svd import (
    CompressionError,
    factor_product,
    layer_factors,
    rotary_reason,
    svd_compress,
)
from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
from headbudget.schedules import LayerSpec


def _model(schedule="uniform", bias=True, vocab=64, seed=0, noise=0.05):
    g = torch.Generator().manual_seed(seed)
    m = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", schedule, vocab_size=vocab, bias=bias)).eval()
    with torch.no_grad():  # non-trivial biases and weights (default init has zero biases)
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return m


def _ids(vocab=64, T=24, seed=1):
    return torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("schedule,bias", [("uniform", True), ("prism", True), ("uniform", False)])
def test_svd_full_rank_reproduces_logits(schedule, bias):
    m = _model(schedule, bias)
    x = _ids()
    ref = m(x).logits
    c = copy.deepcopy(m)
    full = [b.attn.qk_head_dim for b in m.transformer.h]
    svd_compress(c, full)
    assert (c(x).logits - ref).abs().max().item() <= 1e-4
    # and with explicit attention probabilities (the non-SDPA path)
    assert (c(x, output_attentions=True).logits - ref).abs().max().item() <= 1e-4


def test_svd_truncation_error_equals_tail_singular_values():
    torch.manual_seed(0)
    a = torch.randn(33, 16, dtype=torch.float64)
    b = torch.randn(32, 16, dtype=torch.float64)
    f = factor_product(a, b)
    full = a @ b.T
    assert torch.allclose(f.product(), full, atol=1e-10)
    ref_sigma = torch.linalg.svdvals(full)[:16]
    assert torch.allclose(f.sigma, ref_sigma, atol=1e-10)
    for r in (1, 4, 9, 15):
        err = torch.linalg.matrix_norm(full - f.product(r)).item()
        assert err == pytest.approx(ref_sigma[r:].pow(2).sum().sqrt().item(), rel=1e-9)
        assert err == pytest.approx(f.tail_norm(r), rel=1e-9)


def test_compressed_layer_realises_truncated_form():
    """The new q/k weights of head h are exactly the rank-r truncation of [W_Q|b_Q]^T [W_K|0]."""
    m = _model()
    attn = m.transformer.h[1].attn
    f = layer_factors(attn, 1)
    dq = attn.qk_head_dim
    W = attn.projections()["q"][0].double()
    full = torch.cat([W[:dq], attn.projections()["q"][1].double()[:dq, None]], 1).T @ torch.cat(
        [attn.projections()["k"][0].double()[:dq], torch.zeros(dq, 1, dtype=torch.float64)], 1)
    svd_compress(m, [32, 5, 32, 32])
    a = m.transformer.h[1].attn
    qa = torch.cat([a.projections()["q"][0].double()[:5], a.projections()["q"][1].double()[:5, None]], 1)
    ka = torch.cat([a.projections()["k"][0].double()[:5], a.projections()["k"][1].double()[:5, None]], 1)
    err = torch.linalg.matrix_norm(full - qa.T @ ka).item()
    assert err == pytest.approx(f["qk"][0].tail_norm(5), rel=1e-4)
    assert m.config.head_schedule[1] == LayerSpec(4, 32, 4, 5, 5)


def test_svd_save_load_roundtrip(tmp_path):
    m = _model()
    c, info = compress_model(m, "svd", 0.5, "later_layers_first")
    assert info["qk_ranks"] == [24, 19, 13, 8] and info["kept_fraction"] == 0.5
    c.save_pretrained(tmp_path / "m")
    back = HeadBudgetForCausalLM.from_pretrained(tmp_path / "m").eval()
    x = _ids()
    assert torch.equal(back(x).logits, c(x).logits)
    assert [b.attn.qk_head_dim for b in back.transformer.h] == [24, 19, 13, 8]
    assert back.transformer.h[0].attn.scale == pytest.approx(1 / 32**0.5)  # logit scale kept
    # the input model is untouched
    assert all(b.attn.qk_head_dim == 32 for b in m.transformer.h)
    assert sum(attention_parameters(c)) < sum(attention_parameters(m))


def test_grouping_one_head_per_group_is_identity():
    m = _model()
    x = _ids()
    ref = m(x).logits
    c = copy.deepcopy(m)
    group_heads(c, [[[0], [1], [2], [3]], [[2], [0], [3], [1]], None, adjacent_groups(4, 4)])
    assert torch.equal(c(x).logits, ref) or (c(x).logits - ref).abs().max().item() <= 1e-5
    assert [b.attn.n_kv_heads for b in c.transformer.h] == [4, 4, 4, 4]


def test_grouping_mean_pools_kv_and_permutes_queries():
    m = _model()
    c = copy.deepcopy(m)
    info = group_heads(c, [[[0, 3], [1, 2]], None, None, None])
    a0, b0 = m.transformer.h[0].attn, c.transformer.h[0].attn
    assert info["per_layer"][0]["head_order"] == [0, 3, 1, 2]
    assert b0.n_kv_heads == 2 and b0.projections()["k"][0].shape[0] == 64
    expect_k = (a0.projections()["k"][0][0:32] + a0.projections()["k"][0][96:128]) / 2
    assert torch.allclose(b0.projections()["k"][0][0:32], expect_k)
    expect_v_b = (a0.projections()["v"][1][32:64] + a0.projections()["v"][1][64:96]) / 2
    assert torch.allclose(b0.projections()["v"][1][32:64], expect_v_b)
    assert torch.equal(b0.projections()["q"][0][32:64], a0.projections()["q"][0][96:128])
    assert torch.equal(b0.o_proj.weight[:, 32:64], a0.o_proj.weight[:, 96:128])
    assert c.config.head_schedule[0].n_kv_heads == 2
    assert groups_from_labels([0, 1, 0, 1]) == [[0, 2], [1, 3]]
    # Unequal groups are kept as an index map: grouping heads {0, 1, 3} and {2} equals averaging their k/v.
    u = copy.deepcopy(m)
    group_heads(u, [[[0, 1, 3], [2]], None, None, None])
    assert u.transformer.h[0].attn.kv_groups == [3, 1] and u.config.head_schedule[0].kv_groups == (3, 1)
    ref = copy.deepcopy(m)
    with torch.no_grad():  # the same model built by hand: k/v rows of heads 0, 1, 3 replaced by their mean
        w = ref.transformer.h[0].attn.qkv_proj.weight
        d = 32
        for off in (128, 256):  # k rows start at 128, v rows at 256 (4 heads x 32)
            rows = [w[off + h * d: off + (h + 1) * d] for h in (0, 1, 3)]
            mean = sum(rows) / 3
            for h in (0, 1, 3):
                w[off + h * d: off + (h + 1) * d] = mean
        b = ref.transformer.h[0].attn.qkv_proj.bias
        for off in (128, 256):
            mean = sum(b[off + h * d: off + (h + 1) * d] for h in (0, 1, 3)) / 3
            for h in (0, 1, 3):
                b[off + h * d: off + (h + 1) * d] = mean
    x = torch.randint(0, 64, (2, 12))
    assert (u(x).logits - ref(x).logits).abs().max() <= 1e-5
    with pytest.raises(CompressionError, match=names("layer 2", "groups")):
        group_heads(copy.deepcopy(m), [None, None, [[0, 1], [1, 2]], None])


def test_allocations_same_total():
    full = [64] * 6
    for keep in (0.25, 0.5, 0.75):
        got = {a: allocate(full, keep, a) for a in ALLOCATIONS}
        for a, ranks in got.items():
            assert abs(sum(ranks) - keep * 384) <= 1, (a, ranks)
        assert got["later_layers_first"][0] > got["later_layers_first"][-1]
        assert got["earlier_layers_first"][0] < got["earlier_layers_first"][-1]
        assert len(set(got["uniform"])) == 1
    kv = allocate([12] * 12, 0.5, "later_layers_first", candidates=[divisors(12)] * 12)
    assert sum(kv) == 72 and all(12 % k == 0 for k in kv)
    with pytest.raises(CompressionError, match=names("--keep-ratio", 0)):
        allocate(full, 0, "uniform")


def test_gpt2_conversion_and_rotary_refusal():
    from transformers import GPT2Config, GPT2LMHeadModel

    from headbudget.models import to_headbudget

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32)).eval()
    m = to_headbudget(hf)
    x = torch.randint(0, 100, (1, 16))
    ref = hf(x).logits
    c, info = compress_model(m, "svd", 1.0, "uniform")
    assert info["qk_ranks"] == [16, 16]
    assert (c(x).logits - ref).abs().max().item() <= 1e-4

    class Fake:
        config = type("C", (), {"model_type": "llama", "rope_theta": 10000.0})()

    reason = rotary_reason(Fake())
    assert_names(reason, "'llama'", "rope_theta")  # the model type and the config field that says rotary
    m.config.position = "rotary"  # pretend: the QK form must be refused, values/outputs and grouping allowed
    with pytest.raises(CompressionError, match=names("'headbudget'", "position_embedding_type='rotary'")):
        svd_compress(copy.deepcopy(m), qk_ranks=[8, 8], v_ranks=[8, 8])
    c, info = compress_model(m, "svd", 0.5)
    assert info["qk_ranks"] == [16, 16] and info["v_ranks"] == [8, 8] and info["paths"].startswith("value/output")
    compress_model(m, "group", 0.5)


def test_value_output_svd_on_a_llama_gqa_model_is_exact_at_full_rank_and_shares_kv_rows():
    from transformers import LlamaConfig, LlamaForCausalLM

    from headbudget.models import to_headbudget

    torch.manual_seed(0)
    m = to_headbudget(LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=80, attention_bias=True)))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    m.prune_heads({1: [0, 1, 5]})  # unequal groups (2 + 3) in layer 1
    x = torch.randint(0, 80, (2, 12))
    ref = m(x).logits
    full, _ = compress_model(m, "svd", 1.0)
    assert (full(x).logits - ref).abs().max() <= 1e-4
    half, info = compress_model(m, "svd", 0.5)
    a = half.transformer.h[1].attn
    assert info["v_ranks"] == [4, 4] and a.qk_head_dim == 8 and a.v_head_dim == 4 and a.kv_groups == [2, 3]
    assert a.projections()["v"][0].shape == (2 * 4, 64)  # still one value row block per kv head
    # truncation error of each kv head's form equals its dropped singular values (independent SVD)
    f = layer_factors(m.transformer.h[1].attn, 1, qk=False)
    for fv in f["vo"]:
        dense = fv.product()
        sig = torch.linalg.svdvals(dense)
        assert torch.allclose(sig[:8], fv.sigma[:8], rtol=1e-6, atol=1e-8)
        assert (dense - fv.product(4)).norm().item() == pytest.approx(sig[4:].pow(2).sum().sqrt().item(), rel=1e-6)


def test_compress_cli(tmp_path, capsys):
    from headbudget.cli.main import main
    from headbudget.models.tokenizers import make_tokenizer

    m = _model(vocab=257)
    m.save_pretrained(tmp_path / "model")
    make_tokenizer("byte").save(tmp_path / "model" / "tokenizer")
    data = tmp_path / "text.txt"
    data.write_text("Shall I compare thee to a summer's day?\n" * 12)
    out = tmp_path / "out"
    rc = main([
        "compress", str(tmp_path / "model"), "--method", "svd", "--keep-ratio", "0.5", "--allocation",
        "later_layers_first", "--data", str(data), "--out", str(out), "--sweep", "0.5,1.0", "--context", "64",
        "--max-windows", "3", "--threads", "1", "--no-progress",
    ])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["qk_ranks"] == [24, 19, 13, 8]
    assert report["attention_params_after"] < report["attention_params_before"]
    sweep = json.loads((out / "sweep.json").read_text())
    assert len(sweep["runs"]) == 6 and (out / "sweep.png").stat().st_size > 1000
    full = [r for r in sweep["runs"] if r["keep"] == 1.0]
    assert all(r["ppl"] == pytest.approx(sweep["baseline_ppl"], rel=1e-4) for r in full)
    back = HeadBudgetForCausalLM.from_pretrained(out / "model")
    assert back.config.head_schedule[3].qk_head_dim == 8
    # the source's (legacy model/tokenizer/) tokenizer is saved at the compressed model's root
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out / "model")("Hi", add_special_tokens=False)["input_ids"] == [72, 105]
    # size before/after: real parameter counts, FLOPs from the schedule (headbudget.accounting)
    from headbudget.accounting import flops_per_token

    assert report["params_before"] == sum(p.numel() for p in m.parameters())
    assert report["params_after"] == sum(p.numel() for p in back.parameters()) < report["params_before"]
    for model, key in ((m, "flops_per_token_before"), (back, "flops_per_token_after")):
        assert report[key] == flops_per_token(model.config.head_schedule, 257, model.config.n_positions)["total"]
    assert report["flops_per_token_after"] < report["flops_per_token_before"]
    assert "perplexity" in capsys.readouterr().out
    # user errors: exit 2 with a one-line message
    assert main(["compress", str(tmp_path / "model"), "--keep-ratio", "1.5", "--out", str(out)]) == 2
    assert_names(error_line(capsys.readouterr().err, "compress"), "--keep-ratio", "(0, 1]", "1.5")
    assert main(["compress", str(tmp_path / "nope"), "--out", str(tmp_path / "out2")]) == 2
    assert_names(error_line(capsys.readouterr().err, "compress"), tmp_path / "nope")
    assert not (tmp_path / "out2").exists()  # the refused command left no folder behind


def test_compress_cli_on_hf_gpt2_directory(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from headbudget.cli.main import main
    from headbudget.models import to_headbudget

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32)).eval()
    hf.save_pretrained(tmp_path / "gpt2")
    groups = tmp_path / "groups.json"
    groups.write_text(json.dumps({"0": [[0, 2], [1, 3]]}))  # layer 1: allocated (keep 0.5 -> 2 kv heads)
    rc = main(["compress", str(tmp_path / "gpt2"), "--method", "group", "--keep-ratio", "0.5", "--groups", str(groups),
               "--out", str(tmp_path / "out"), "--threads", "1", "--no-progress"])
    assert rc == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["model_kind"] == "gpt2" and report["n_kv_heads"] == [2, 2]
    assert report["head_order"][0] == [0, 2, 1, 3]
    back = HeadBudgetForCausalLM.from_pretrained(tmp_path / "out" / "model").eval()
    ref = to_headbudget(hf)
    x = torch.randint(0, 100, (1, 12))
    # query/output of layer 0 are the permuted originals; K is the mean of heads 0 and 2
    a, b = ref.transformer.h[0].attn, back.transformer.h[0].attn
    assert torch.allclose(b.projections()["k"][0][:16], (a.projections()["k"][0][:16] + a.projections()["k"][0][32:48]) / 2, atol=1e-6)
    assert torch.isfinite(back(x).logits).all()


def test_run_compress_sweep_without_text_is_refused_before_anything_is_written(tmp_path):
    """A sweep plots perplexity: without text it is a one-line error, and no compressed model is left behind
    (the check used to come after OUT/model was written)."""
    from headbudget.compression.job import CompressJob
    from headbudget.compression.pipeline import run_compress

    _model().save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match=names("sweep", "data")):
        run_compress(CompressJob(str(tmp_path / "model"), str(tmp_path / "out"), sweep=(0.5,), progress=False),
                     threads=1)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("changes", "values"), [
    ({"keep_ratio": 1.5}, ("--keep-ratio", 1.5)),
    ({"kv_heads": 2}, ("--kv-heads", "merge-kv")),
    ({"groups": "g.json", "method": "svd"}, ("--groups", "group")),
    ({"method": "merge-kv"}, ("--kv-heads", "--kv-budget")),
    ({"method": "merge-kv", "kv_budget": 0.5, "merge_rule": "fitted"}, ("--merge-rule fitted", "--calib-data")),
])
def test_the_library_refuses_a_job_that_cannot_run_before_it_opens_anything(tmp_path, changes, values):
    """run_compress and run_merge_kv check the whole job first (the command checks it with the same function
    before torch loads): the model path does not exist, and the job's own error comes first."""
    from headbudget.compression.job import CompressJob
    from headbudget.compression.merge_kv_pipeline import run_merge_kv
    from headbudget.compression.pipeline import run_compress

    job = CompressJob(str(tmp_path / "no-model"), str(tmp_path / "out"), progress=False, **changes)
    with pytest.raises(ValueError) as info:
        (run_merge_kv if job.method == "merge-kv" else run_compress)(job, threads=1)
    assert_names(str(info.value), *values)
