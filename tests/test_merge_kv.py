"""merge-kv: fitted and mean merges of key/value heads (rotary and not), counts, cache bytes, allocation, outputs."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import assert_names, names
from headbudget.compression.merge_kv import (
    allocate_kv,
    allowed_counts,
    collect_grams,
    fit_layer,
    kv_values_per_token,
    layer_sensitivity,
    measured_kv_bytes_per_token,
    merge_kv_model,
    merge_layer,
)
from headbudget.compression.svd import CompressionError
from headbudget.models import to_headbudget

CORPUS = Path(__file__).parent / "fixtures" / "lm" / "tiny_corpus.txt"


# ----------------------------------------------------------------------------- tiny models
def _noisy(model, seed=0, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-zero biases (default init has zero biases)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model.eval()


def hf_model(family: str, heads: int = 4, kv: int = 2, hidden: int = 32, layers: int = 2, vocab: int = 264):
    import transformers as tf

    torch.manual_seed(0)
    if family == "gpt2":
        cfg = tf.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=128)
        return _noisy(tf.GPT2LMHeadModel(cfg))
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=128)
    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
           "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}[family]
    return _noisy(cls[1](cls[0](**common)))


def hb_model(family: str, **kw):
    return to_headbudget(hf_model(family, **kw)).float().eval()


def _ids(vocab=264, T=24, n=2, seed=1):
    return torch.randint(0, vocab, (n, T), generator=torch.Generator().manual_seed(seed))


def _make_identical(model, groups):
    """Copy the first kv head of each group onto the others (k and v rows, biases too), in every layer."""
    with torch.no_grad():
        for b in model.transformer.h:
            a = b.attn
            w = a.qkv_proj.weight
            bias = a.qkv_proj.bias
            nq, nk = a.n_heads * a.qk_head_dim, a.n_kv_heads * a.qk_head_dim
            for base, width in ((nq, a.qk_head_dim), (nq + nk, a.v_head_dim)):
                for g in groups:
                    for other in g[1:]:
                        src = slice(base + g[0] * width, base + (g[0] + 1) * width)
                        dst = slice(base + other * width, base + (other + 1) * width)
                        w[dst] = w[src]
                        if bias is not None:
                            bias[dst] = bias[src]
    return model


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("family,heads,kv,target,groups", [
    ("llama", 4, 2, 1, [[0, 1]]),
    ("mistral", 4, 2, 1, [[0, 1]]),
    ("qwen2", 4, 2, 1, [[0, 1]]),  # q/k/v biases
    ("gpt2", 4, 4, 2, [[0, 1], [2, 3]]),
])
def test_fitted_merge_of_identical_heads_changes_nothing(family, heads, kv, target, groups):
    m = _make_identical(hb_model(family, heads=heads, kv=kv), groups)
    x = _ids()
    ref = m(x).logits
    grams = collect_grams(m, _ids(T=32, n=4, seed=3))
    merge_kv_model(m, [target] * 2, "fitted", grams)
    assert [b.attn.n_kv_heads for b in m.transformer.h] == [target, target]
    assert (m(x).logits - ref).abs().max().item() < 1e-5


def _rope(t, cos, sin):
    """HF's rotate-half rotation of (T, width) rows."""
    half = t.shape[-1] // 2
    return t * cos.double() + torch.cat([-t[:, half:], t[:, :half]], -1) * sin.double()


def _hand_merged_attention(attn, fits, x, cos_sin):
    """The merged layer computed from the ORIGINAL query/output weights and the fits, without the folds: each
    query head reads member g's approximated keys k_g ~= c_g z' (rotary, per plane, applied before the
    rotation) or K' T_g (no rotary) and values V' B_g."""
    p = attn.projections()
    d = x.shape[-1]
    xt = torch.cat([x.double(), torch.ones(*x.shape[:-1], 1, dtype=torch.float64)], -1)  # (T, d+1)
    dq, dv = attn.qk_head_dim, attn.v_head_dim
    wq = torch.cat([p["q"][0], (p["q"][1] if p["q"][1] is not None else torch.zeros(len(p["q"][0])))[:, None]], 1)
    wo = p["o"][0].double()
    T = x.shape[0]
    out = torch.zeros(T, d, dtype=torch.float64)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for fit in fits:
        kp, vp = xt @ fit.key.T, xt @ fit.value.T  # shared key and value, (T, width)
        for h in fit.queries:
            g = attn.kv_index[h]
            q = xt @ wq[h * dq:(h + 1) * dq].double().T
            if fit.rotary:
                half = dq // 2
                zk = torch.complex(kp[:, :half], kp[:, half:]) * fit.key_maps[g]  # c_g z'
                k = torch.cat([zk.real, zk.imag], -1)
                q, k = _rope(q, *cos_sin), _rope(k, *cos_sin)
            else:
                k = kp @ fit.key_maps[g]
            probs = ((q @ k.T) / math.sqrt(attn.head_dim)).masked_fill(~causal, float("-inf")).softmax(-1)
            out += probs @ (vp @ fit.value_maps[g]) @ wo[:, h * dv:(h + 1) * dv].T
    if p["o"][1] is not None:
        out += p["o"][1].double()
    return out


@pytest.mark.parametrize("family,heads,kv,target", [("llama", 6, 3, 1), ("qwen2", 4, 2, 1), ("gpt2", 4, 4, 2)])
def test_merged_attention_equals_hand_computation(family, heads, kv, target):
    m = hb_model(family, heads=heads, kv=kv, hidden=48 if heads == 6 else 32)
    grams = collect_grams(m, _ids(T=32, n=4, seed=3))
    attn = m.transformer.h[1].attn
    x = torch.randn(20, m.config.n_embd, generator=torch.Generator().manual_seed(5))
    rotary = m.config.position == "rotary"
    cos_sin = m.transformer._rotary(attn.qk_head_dim, torch.arange(20)[None], torch.float32) if rotary else None
    fits = fit_layer(attn, target, "fitted", grams[1], rotary)
    assert all(len(f.members) == kv // target for f in fits) and all(f.key_maps and f.value_maps for f in fits)
    expected = _hand_merged_attention(attn, fits, x, None if cos_sin is None else (cos_sin[0][0], cos_sin[1][0]))
    merge_layer(attn, target, "fitted", grams[1], rotary)
    got, _ = attn(x[None], None, None if cos_sin is None else cos_sin)
    assert (got[0].double() - expected).abs().max().item() < 1e-5
    # and the merge changed the layer (not a no-op): it is not the unmerged output
    assert attn.n_kv_heads == target


def test_rotary_fold_commutes_with_the_rotation_at_every_offset():
    # The folded query (conj(c) q) against z' equals q against c z' at every pair of positions, also far apart.
    m = hb_model("llama", heads=4, kv=2)
    attn = m.transformer.h[0].attn
    grams = collect_grams(m, _ids(T=32, n=4, seed=3))
    x = torch.randn(100, m.config.n_embd, generator=torch.Generator().manual_seed(6))
    pos = torch.arange(100)[None] * 7  # positions up to 693
    cos, sin = m.transformer._rotary(attn.qk_head_dim, pos, torch.float32)
    fits = fit_layer(attn, 1, "fitted", grams[0], True)
    expected = _hand_merged_attention(attn, fits, x, (cos[0], sin[0]))
    merge_layer(attn, 1, "fitted", grams[0], True)
    got, _ = attn(x[None], None, (cos, sin))
    assert (got[0].double() - expected).abs().max().item() < 1e-5


def test_mean_rule_is_the_hand_averaged_projections():
    m = hb_model("qwen2", heads=4, kv=2)
    a = m.transformer.h[0].attn
    before = {k: (w.clone(), None if b is None else b.clone()) for k, (w, b) in a.projections().items()}
    merge_kv_model(m, [1, 2], "mean")
    after = a.projections()
    for name in ("k", "v"):
        w, b = before[name]
        assert torch.allclose(after[name][0], (w[:8] + w[8:]) / 2, atol=1e-7)
        assert torch.allclose(after[name][1], (b[:8] + b[8:]) / 2, atol=1e-7)
    assert torch.equal(after["q"][0], before["q"][0]) and torch.equal(after["q"][1], before["q"][1])
    assert torch.equal(after["o"][0], before["o"][0])
    assert m.transformer.h[1].attn.n_kv_heads == 2  # layer 1 kept its count: untouched


# ----------------------------------------------------------------------------- counts, parameters, cache bytes
def test_counts_parameters_and_kv_bytes_are_exact():
    # SmolLM2's layout in small: 9 query heads of 8 dims, 3 kv heads, 3 layers, d_model 72
    m = hb_model("llama", heads=9, kv=3, hidden=72, layers=3)
    assert allowed_counts(m.transformer.h[0].attn) == [3, 1]
    assert kv_values_per_token(m) == 3 * 3 * 2 * 8 == 144
    assert measured_kv_bytes_per_token(m) == 144 * 4
    attn_params = sum(p.numel() for b in m.transformer.h for p in b.attn.parameters())
    total = sum(p.numel() for p in m.parameters())
    merge_kv_model(m, [1, 3, 1], "mean")
    assert [b.attn.n_kv_heads for b in m.transformer.h] == [1, 3, 1]
    assert kv_values_per_token(m) == (1 + 3 + 1) * 2 * 8 == 80
    assert measured_kv_bytes_per_token(m) == 80 * 4
    removed = 2 * 2 * (2 * 8 * 72)  # two layers lose two kv heads: k and v rows of 8 x 72
    assert sum(p.numel() for b in m.transformer.h for p in b.attn.parameters()) == attn_params - removed
    assert sum(p.numel() for p in m.parameters()) == total - removed
    assert m.config.schedule["layers"][0]["n_kv_heads"] == 1
    with pytest.raises(CompressionError, match=names("--kv-heads 2", "layer 0", "9", "3", "1, 3")):
        merge_kv_model(hb_model("llama", heads=9, kv=3, hidden=72, layers=3), [2, 2, 2], "mean")


# ----------------------------------------------------------------------------- allocation
def test_budget_allocation_is_exact_with_divisor_counts_and_spares_sensitive_layers():
    sens = [{3: 0.0, 1: s} for s in (0.9, 0.1, 0.8, 0.2, 0.3, 0.05)]
    counts = allocate_kv([[3, 1]] * 6, [16] * 6, 10 / 18, sens)  # 18 kv heads -> 10: four layers at 1
    assert counts == [3, 1, 3, 1, 1, 1]
    assert sum(c * 16 for c in counts) == 10 * 16
    # uniform: the same cache, layers spread over depth; a budget every layer can meet exactly: all alike
    uni = allocate_kv([[3, 1]] * 6, [16] * 6, 10 / 18)
    assert sorted(uni) == [1, 1, 1, 1, 3, 3] and uni != counts
    assert allocate_kv([[3, 1]] * 6, [16] * 6, 1 / 3) == [1] * 6
    # GPT-2's 12 heads: counts stay divisors of 12; 50% of 4 x 12 heads is exactly 24
    gpt = allocate_kv([[12, 6, 4, 3, 2, 1]] * 4, [128] * 4, 0.5,
                      [{12: 0, 6: 0.5, 4: 1, 3: 2, 2: 3, 1: 4}, {12: 0, 6: 0.01, 4: 0.02, 3: 0.03, 2: 0.04, 1: 0.05},
                       {12: 0, 6: 0.5, 4: 1, 3: 2, 2: 3, 1: 4}, {12: 0, 6: 0.5, 4: 1, 3: 2, 2: 3, 1: 4}])
    assert sum(gpt) <= 24 and all(12 % c == 0 for c in gpt) and gpt[1] == 1
    with pytest.raises(CompressionError, match=names("--kv-budget", "0.1", "0.3333")):
        allocate_kv([[3, 1]] * 2, [16] * 2, 0.1)


def test_measured_sensitivity_merges_the_layer_whose_heads_are_alike_first():
    m = hb_model("llama", heads=4, kv=2, layers=3)
    with torch.no_grad():  # layer 1's two kv heads made identical: merging it is free, the others are not
        one = copy.deepcopy(m)
        _make_identical(one, [[0, 1]])
        m.transformer.h[1].load_state_dict(one.transformer.h[1].state_dict())
    windows = _ids(T=32, n=4, seed=3)
    grams = collect_grams(m, windows)
    sens = layer_sensitivity(m, "fitted", grams, windows)
    assert abs(sens[1][1]) < 1e-5 and sens[0][1] > 1e-4 and sens[2][1] > 1e-4
    counts = allocate_kv([allowed_counts(b.attn) for b in m.transformer.h], [16] * 3, 5 / 6, sens)
    assert counts == [2, 1, 2]
    assert [b.attn.n_kv_heads for b in m.transformer.h] == [2, 2, 2]  # measuring left the model as it was


# ----------------------------------------------------------------------------- the command and its outputs
def _save_source(model, path: Path) -> Path:
    from tests.test_export_gguf import tiny_bpe_tokenizer

    model.save_pretrained(path)
    tiny_bpe_tokenizer().save_pretrained(path)
    return path


def _expected_merge(src: Path, counts, rule, calib_tokens=1024, context=64):
    """The merge the command should have made, recomputed from the library."""
    from headbudget.compression.merge_kv_pipeline import _windows
    from headbudget.loading import load_model, load_tokenizer

    model = load_model(str(src), as_headbudget=True).float()
    tok = load_tokenizer(None, model_dir=str(src))
    ids = torch.tensor(tok(CORPUS.read_text(), add_special_tokens=False)["input_ids"])
    grams = collect_grams(model, _windows(ids[:calib_tokens], context))
    merge_kv_model(model, counts, rule, grams)
    return model, ids[calib_tokens:]


def test_cli_kv_heads_writes_a_plain_transformers_folder_with_equal_logits(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from headbudget.cli.main import main
    from headbudget.evaluation.perplexity import perplexity

    src = _save_source(hf_model("llama", heads=4, kv=2), tmp_path / "src")
    out = tmp_path / "out"
    rc = main(["compress", str(src), "--method", "merge-kv", "--kv-heads", "1", "--data", str(CORPUS),
               "--calib-tokens", "1024", "--context", "64", "--max-windows", "4", "--out", str(out),
               "--threads", "1", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    back = AutoModelForCausalLM.from_pretrained(out / "model")
    assert type(back) is LlamaForCausalLM and back.config.num_key_value_heads == 1
    assert "auto_map" not in json.loads((out / "model" / "config.json").read_text())  # no remote code
    expected, held = _expected_merge(src, [1, 1], "fitted")
    x = _ids()
    assert (back(x).logits - expected(x).logits).abs().max().item() < 1e-5
    report = json.loads((out / "report.json").read_text())
    assert report["n_kv_heads"] == [1, 1] and report["n_kv_heads_before"] == [2, 2]
    assert report["kv_bytes_per_token_before"] == report["kv_bytes_per_token_measured_before"] == 2 * 2 * 2 * 8 * 4
    assert report["kv_bytes_per_token_after"] == report["kv_bytes_per_token_measured_after"] == 2 * 1 * 2 * 8 * 4
    assert report["params_after"] == sum(p.numel() for p in back.parameters()) == \
        report["params_before"] - 2 * 2 * 8 * 32
    assert report["output_format"] == "transformers LlamaForCausalLM" and report["calibration_tokens"] == 1024
    # perplexity is scored on the tokens after the calibration ones
    ppl = perplexity(back, None, input_ids=held, context=64, stride=32, max_windows=4)
    assert report["perplexity_after"]["ppl"] == pytest.approx(ppl["ppl"], rel=1e-5)
    assert "KV cache per token (float32): 256 -> 128 bytes (0.5000" in capsys.readouterr().out


def test_cli_kv_budget_on_gpt2_writes_headbudget_format(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from headbudget.cli.main import main

    src = _save_source(hf_model("gpt2", heads=4, kv=4, layers=3), tmp_path / "src")
    out = tmp_path / "out"
    rc = main(["compress", str(src), "--method", "merge-kv", "--kv-budget", "0.5", "--merge-rule", "mean",
               "--kv-allocation", "uniform", "--out", str(out), "--threads", "1", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    # 12 kv heads -> at most 6, counts divisors of 4: spread 4,4,4 -> 2,2,2
    assert report["n_kv_heads"] == [2, 2, 2] and report["kv_bytes_ratio"] == 0.5
    assert report["output_format"] == "headbudget"
    back = AutoModelForCausalLM.from_pretrained(out / "model")
    expected = hb_model("gpt2", heads=4, kv=4, layers=3)
    merge_kv_model(expected, [2, 2, 2], "mean")
    x = _ids()
    assert (back(x).logits - expected(x).logits).abs().max().item() < 1e-5
    assert report["kv_bytes_per_token_measured_after"] == 3 * 2 * 2 * 8 * 4


def test_non_uniform_merge_exports_to_gguf_as_deci_and_uniform_as_llama(tmp_path, capsys):
    pytest.importorskip("gguf")
    from tests.test_export_gguf import fields, llamacpp_reference_logits, tiny_bpe_tokenizer

    from headbudget.cli.main import main

    m = hb_model("llama", heads=4, kv=2, layers=2)
    grams = collect_grams(m, _ids(T=32, n=4, seed=3))
    for counts, arch in (([1, 2], "deci"), ([1, 1], "llama")):
        merged = copy.deepcopy(m)
        merge_kv_model(merged, counts, "fitted", grams)
        folder = tmp_path / arch
        merged.save_pretrained(folder)
        tiny_bpe_tokenizer().save_pretrained(folder)
        path = tmp_path / f"{arch}.gguf"
        assert main(["export", str(folder), "--format", "gguf", "--out", str(path), "--tokenizer-pre", "gpt-2"]) == 0
        kv = fields(path)
        assert kv["general.architecture"] == arch
        assert kv[f"{arch}.attention.head_count_kv"] == (counts if arch == "deci" else 1)
        ids = _ids(n=1, T=20)[0]
        with torch.no_grad():
            ref = merged(ids[None]).logits[0]
        assert torch.allclose(llamacpp_reference_logits(path, ids), ref, atol=1e-4)
        # and headbudget reads its own file back (deci by headbudget, llama by transformers), same logits
        from headbudget.loading import load_model

        back = load_model(path, as_headbudget=True)
        assert [s["n_kv_heads"] for s in back.config.layer_specs()] == counts
        with torch.no_grad():
            assert torch.allclose(back(ids[None]).logits[0], ref, atol=1e-5)
    assert "duplicated" not in capsys.readouterr().err  # equal groups: nothing copied


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("headbudget compress: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_cli_one_line_errors(tmp_path, capsys):
    from headbudget.cli.main import main

    src = _save_source(hf_model("llama", heads=9, kv=3, hidden=72, layers=2), tmp_path / "src")
    base = ["compress", str(src), "--method", "merge-kv", "--threads", "1", "--no-progress"]
    assert main([*base, "--kv-heads", "2", "--merge-rule", "mean", "--out", str(tmp_path / "a")]) == 2
    assert_names(_one_line(capsys.readouterr().err), "--kv-heads 2", "layer 0", "9", "3", "1, 3")
    for bad in ("1.5", "0"):
        assert main([*base, "--kv-budget", bad, "--out", str(tmp_path / "b")]) == 2
        assert_names(_one_line(capsys.readouterr().err), "--kv-budget", "(0, 1]", float(bad))
    assert main([*base, "--out", str(tmp_path / "c")]) == 2
    assert_names(_one_line(capsys.readouterr().err), "--kv-heads", "--kv-budget")
    assert main([*base, "--kv-heads", "1", "--out", str(tmp_path / "d")]) == 2  # fitted without text
    assert_names(_one_line(capsys.readouterr().err), "--merge-rule fitted", "--data", "--calib-data")
    assert main(["compress", str(src), "--kv-heads", "1", "--out", str(tmp_path / "e")]) == 2
    assert_names(_one_line(capsys.readouterr().err), "--kv-heads", "--method merge-kv")
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_unequal_groups_of_a_pruned_model_merge_and_identical_heads_stay_exact():
    # headbudget's own layout after pruning a GQA model: layer 0 keeps query heads 1-3 (kv groups [1, 2])
    m = hb_model("llama", heads=4, kv=2)
    _make_identical(m, [[0, 1]])
    m.prune_heads({0: [0]})
    a = m.transformer.h[0].attn
    assert a.kv_groups == [1, 2] and allowed_counts(a) == [2, 1]  # 3 queries: 1 divides, 2 is its own count
    x = _ids()
    ref = m(x).logits
    merge_kv_model(m, [1, 1], "fitted", collect_grams(m, _ids(T=32, n=4, seed=3)))
    assert (a.n_kv_heads, a.kv_groups, m.config.schedule["layers"][0]["n_kv_heads"]) == (1, None, 1)
    assert (m(x).logits - ref).abs().max().item() < 1e-5


def test_setting_names_agree_with_the_library():
    from headbudget.compression.job import KV_ALLOCATION_NAMES, MERGE_RULE_NAMES
    from headbudget.compression.merge_kv import KV_ALLOCATIONS, MERGE_RULES

    assert (MERGE_RULE_NAMES, KV_ALLOCATION_NAMES) == (MERGE_RULES, KV_ALLOCATIONS)
