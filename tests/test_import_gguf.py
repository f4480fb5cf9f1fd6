"""headbudget reads back every GGUF layout ``headbudget export`` writes: ``deci`` (pruned: per-layer heads, key/value
heads and MLP widths, duplicated key/value heads for unequal query groups) and ``llama`` (uniform, also pruned or
merged to fewer heads than d_model / head size), through :func:`headbudget.loading.load_model_and_tokenizer` and
``headbudget perplexity FILE.gguf``, with the exported model's logits."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import names
from headbudget.cli.main import main

gguf = pytest.importorskip("gguf")

from test_export_gguf import fields, pruned_headbudget, save_model_dir, tiny_bpe_tokenizer, tiny_llama  # noqa: E402


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _export(model, path):
    from headbudget.models.export_gguf import export_gguf

    return export_gguf(model, tiny_bpe_tokenizer(), path, "f32", tokenizer_pre="gpt-2")


def test_pruned_deci_file_loads_back_with_equal_logits_and_its_own_kv_groups(tmp_path):
    from headbudget.loading import load_model_and_tokenizer
    from headbudget.models import HeadBudgetForCausalLM

    model = pruned_headbudget()  # heads 3 and 2, layer 0's groups [1, 2]: written as three kv heads
    plan = _export(model, tmp_path / "p.gguf")
    assert plan.arch == "deci" and plan.n_kv_heads == [3, 2]
    back, tok = load_model_and_tokenizer(tmp_path / "p.gguf")
    assert isinstance(back, HeadBudgetForCausalLM)
    # the duplicated key/value head is read as one again: headbudget's cache holds it once
    assert back.config.layer_specs() == model.config.layer_specs()
    assert [s["kv_groups"] for s in back.config.layer_specs()] == [[1, 2], None]
    ids = torch.randint(0, 264, (2, 20), generator=torch.Generator().manual_seed(4))
    assert torch.allclose(_logits(back, ids), _logits(model, ids), atol=1e-5)
    assert tok("the cat")["input_ids"] == tiny_bpe_tokenizer()("the cat")["input_ids"] == [116, 257, 32, 99, 97, 116]


def test_per_layer_mlp_widths_biases_and_gcd_groups_read_back(tmp_path):
    """Six query heads on two kv heads pruned to groups [2, 3] (written as five kv heads), per-layer MLP widths
    48 and 64, q/k/v biases, tied embeddings, linear rotary scaling."""
    from headbudget.loading import load_model
    from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM

    torch.manual_seed(0)
    cfg = HeadBudgetConfig(
        schedule={"d_model": 48, "layers": [{"n_heads": 6, "head_dim": 8, "n_kv_heads": 2}] * 2, "head_dim_multiple": 1},
        vocab_size=264, n_positions=64, bias=False, qkv_bias=True, norm="rmsnorm", mlp="gated_silu",
        intermediate_size=[48, 64], position="rotary", tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    model = HeadBudgetForCausalLM(cfg).eval()
    with torch.no_grad():  # biases are zero at init: give them values a reader could get wrong
        for block in model.transformer.h:
            block.attn.qkv_proj.bias.normal_()
    model.prune_heads({0: [0]})
    plan = _export(model, tmp_path / "g.gguf")
    assert plan.n_kv_heads == [5, 2] and plan.feed_forward == [48, 64]
    assert fields(tmp_path / "g.gguf")["deci.feed_forward_length"] == [48, 64]
    back = load_model(tmp_path / "g.gguf")
    assert back.config.intermediate_sizes() == [48, 64] and back.config.tie_word_embeddings
    assert back.config.layer_specs()[0]["kv_groups"] == [2, 3]
    assert back.config.rope_parameters["rope_type"] == "linear" and back.config.rope_parameters["factor"] == 2.0
    ids = torch.randint(0, 264, (1, 40), generator=torch.Generator().manual_seed(5))
    assert torch.allclose(_logits(back, ids), _logits(model, ids), atol=1e-5)


def test_uniformly_pruned_llama_file_loads_back_with_equal_logits(tmp_path):
    """Every layer keeps 2 of 4 query heads on 1 kv head: ``llama`` with key_length 8 (not 32 / 2)."""
    from headbudget.loading import load_model_and_tokenizer
    from headbudget.models import to_headbudget

    model = to_headbudget(tiny_llama())
    model.prune_heads({0: [0, 1], 1: [0, 1]})
    plan = _export(model, tmp_path / "u.gguf")
    assert plan.arch == "llama" and fields(tmp_path / "u.gguf")["llama.attention.key_length"] == 8
    back, _ = load_model_and_tokenizer(tmp_path / "u.gguf", as_headbudget=True)
    assert back.config.layer_specs() == model.config.layer_specs()
    ids = torch.randint(0, 264, (1, 20), generator=torch.Generator().manual_seed(6))
    assert torch.allclose(_logits(back, ids), _logits(model, ids), atol=1e-5)


def test_perplexity_of_the_pruned_gguf_is_the_pruned_models(tmp_path):
    model, tok = pruned_headbudget(), tiny_bpe_tokenizer()
    model_dir = save_model_dir(model, tok, tmp_path / "pruned")
    assert main(["export", str(model_dir), "--out", str(tmp_path / "p.gguf"), "--tokenizer-pre", "gpt-2"]) == 0
    text = tmp_path / "t.txt"
    text.write_text("the theme of the thesis: the three thin thieves thought the thing through. " * 8)
    got = {}
    for name, src in (("folder", model_dir), ("gguf", tmp_path / "p.gguf")):
        assert main(["perplexity", str(src), "--data", str(text), "--context", "32", "--quiet",
                     "--json", str(tmp_path / f"{name}.json")]) == 0
        got[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert got["gguf"]["tokens_scored"] == got["folder"]["tokens_scored"] == 409
    assert got["gguf"]["ppl"] == pytest.approx(got["folder"]["ppl"], rel=1e-6)


def test_an_attention_free_deci_layer_is_one_line(tmp_path):
    from headbudget.models.import_gguf import read_gguf

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "deci")
    w.add_block_count(2)
    w.add_embedding_length(32)
    w.add_head_count([4, 0])
    w.add_head_count_kv([2, 0])
    w.add_feed_forward_length([64, 64])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=names(tmp_path / "x.gguf", "layer 1", "0 query", "0 key/value")) as exc:
        read_gguf(tmp_path / "x.gguf")
    assert "\n" not in str(exc.value)
