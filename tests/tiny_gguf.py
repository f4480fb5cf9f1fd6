"""A tiny Llama-GQA GGUF file written with the ``gguf`` package, for tests (no download)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def write_tiny_llama_gguf(path: Path, context: int = 64) -> torch.nn.Module:
    """A tiny Llama-GQA written as F32 GGUF the way llama.cpp lays it out (rotary rows of q/k permuted,
    byte-level GPT-2-style vocabulary: 256 byte tokens + <|endoftext|>); returns the reference model.
    Shared by the loader tests and the docs-command tests (``context`` 2048 fits 5-shot prompts)."""
    gguf = pytest.importorskip("gguf")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                      tie_word_embeddings=False, bos_token_id=256, eos_token_id=256)
    model = LlamaForCausalLM(cfg).eval()
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(context)
    w.add_embedding_length(32)
    w.add_block_count(2)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(8)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    u = bytes_to_unicode()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([u[b] for b in range(256)] + ["<|endoftext|>"])
    w.add_token_types([1] * 256 + [3])
    w.add_token_scores([0.0] * 257)
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(256)

    def perm(x, n):  # llama.cpp's rotary row order, which transformers undoes on load
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    names = {"input_layernorm": "attn_norm", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(2):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", perm(sd[p + "self_attn.q_proj.weight"], 4))
        w.add_tensor(f"blk.{i}.attn_k.weight", perm(sd[p + "self_attn.k_proj.weight"], 2))
        for hf_name, gg_name in names.items():
            w.add_tensor(f"blk.{i}.{gg_name}.weight", sd[f"{p}{hf_name}.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model
