"""Read a llama.cpp ``deci`` or ``llama`` GGUF file into a :class:`~headbudget.models.HeadBudgetForCausalLM`.

transformers has no class for ``deci``, what :mod:`headbudget.models.export_gguf` writes for a pruned model.
Consecutive key/value heads with identical weights (the exporter's copies) read as one; see docs/export.md.

    >>> from headbudget.models.import_gguf import read_gguf
    >>> model = read_gguf("smol-fisher70.gguf")       # doctest: +SKIP
    >>> model.config.layer_specs()[0]["kv_groups"]    # doctest: +SKIP
    [3, 1, 2]
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from headbudget.models.config import HeadBudgetConfig
from headbudget.models.convert import _assemble

#: the GGUF architectures read here (a llama file also opens through transformers)
ARCHITECTURES = ("deci", "llama")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    fld = reader.fields.get(key)
    return default if fld is None else fld.contents()


def _per_layer(value: Any, n_layer: int, key: str, where: str) -> list[int]:
    values = [int(v) for v in value] if isinstance(value, list) else [int(value)] * n_layer
    if len(values) != n_layer:
        raise ValueError(f"{where}: {key} lists {len(values)} layers, block_count is {n_layer}")
    return values


def _array(tensor: Any) -> np.ndarray:
    from gguf.quants import dequantize

    return np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


def _torch(tensor: Any) -> torch.Tensor:
    return torch.from_numpy(_array(tensor).copy())


def _rotate_half(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`headbudget.models.export_gguf.interleave_rotary`: interleaved pairs -> rotate half."""
    half = rows.shape[0] // n_heads // 2
    return rows.reshape(n_heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _rope_parameters(reader: Any, tensors: dict[str, Any], where: str) -> dict[str, Any]:
    """``rope_parameters`` of the file: default rotary, or linear when ``rope_freqs`` divides every frequency
    by one factor; other per-frequency factors (llama3) are not recoverable as parameters and are refused."""
    arch = _field(reader, "general.architecture")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(_field(reader, f"{arch}.rope.freq_base",
                                                                              10000.0))}
    if "rope_freqs.weight" in tensors:
        factors = _array(tensors["rope_freqs.weight"]).ravel()
        if not np.all(factors == factors[0]):
            raise ValueError(f"{where}: rope_freqs holds per-frequency factors (llama3 rotary scaling), which "
                             "headbudget does not read back from a GGUF file")
        if factors[0] != 1.0:
            rope.update(rope_type="linear", factor=float(factors[0]))
    return rope


def _dedupe_kv(k: torch.Tensor, v: torch.Tensor, kb: torch.Tensor | None, vb: torch.Tensor | None, n_kv: int,
               n_heads: int) -> tuple[list[int], list[int]]:
    """(kept key/value head indices, query heads each serves): consecutive heads with equal k and v rows
    (and biases) are one head written several times."""
    per = n_heads // n_kv
    parts = [t.chunk(n_kv) if t is not None else [None] * n_kv for t in (k, v, kb, vb)]

    def same(a: int, b: int) -> bool:
        return all(p[a] is None or torch.equal(p[a], p[b]) for p in parts)

    keep, groups = [0], [per]
    for j in range(1, n_kv):
        if same(keep[-1], j):
            groups[-1] += per
        else:
            keep.append(j)
            groups.append(per)
    return keep, groups


def _layer(tensors: dict[str, Any], i: int, n_heads: int, n_kv: int, hd: int) -> tuple[dict[str, Any],
                                                                                          dict[str, torch.Tensor]]:
    """One block's schedule entry and state dict (headbudget names)."""
    def get(name: str, rotary_heads: int = 0) -> torch.Tensor | None:
        t = tensors.get(f"blk.{i}.{name}")
        t = None if t is None else _torch(t)
        return _rotate_half(t, rotary_heads) if rotary_heads and t is not None else t

    q, qb = get("attn_q.weight", n_heads), get("attn_q.bias", n_heads)
    k, kb = get("attn_k.weight", n_kv), get("attn_k.bias", n_kv)
    v, vb = get("attn_v.weight"), get("attn_v.bias")
    keep, groups = _dedupe_kv(k, v, kb, vb, n_kv, n_heads)

    def kept(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.view(n_kv, hd, *t.shape[1:])[keep].flatten(0, 1)

    k, v, kb, vb = kept(k), kept(v), kept(kb), kept(vb)
    spec: dict[str, Any] = {"n_heads": n_heads, "head_dim": hd, "n_kv_heads": len(keep)}
    if len(set(groups)) > 1:
        spec["kv_groups"] = groups
    p = f"transformer.h.{i}."
    sd = {p + "ln_1.weight": get("attn_norm.weight"), p + "ln_2.weight": get("ffn_norm.weight"),
          p + "attn.qkv_proj.weight": torch.cat([q, k, v])}
    if qb is not None:
        sd[p + "attn.qkv_proj.bias"] = torch.cat([qb, kb, vb])
    for ours, theirs in (("attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
                         ("mlp.down_proj", "ffn_down")):
        for t in ("weight", "bias"):
            value = get(f"{theirs}.{t}")
            if value is not None:
                sd[p + f"{ours}.{t}"] = value
    return spec, sd


def read_gguf(path: str | os.PathLike) -> torch.nn.Module:
    """The model of a ``deci`` or ``llama`` GGUF file as a float32 headbudget model (eval mode); a file of
    another architecture, or with a layer llama.cpp's deci marks attention-free, is a one-line ValueError."""
    import gguf

    where = str(path)
    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{where}: GGUF architecture {arch!r} is not one headbudget reads (reads: "
                         f"{', '.join(ARCHITECTURES)})")
    tensors = {t.name: t for t in reader.tensors}
    n_layer, d_model = int(_field(reader, f"{arch}.block_count")), int(_field(reader, f"{arch}.embedding_length"))
    heads = _per_layer(_field(reader, f"{arch}.attention.head_count"), n_layer, "attention.head_count", where)
    kv_heads = _per_layer(_field(reader, f"{arch}.attention.head_count_kv", heads), n_layer,
                          "attention.head_count_kv", where)
    ffn = _per_layer(_field(reader, f"{arch}.feed_forward_length"), n_layer, "feed_forward_length", where)
    for i, (h, kv) in enumerate(zip(heads, kv_heads)):
        if h == 0 or kv == 0 or h % kv:
            raise ValueError(f"{where}: layer {i} has {h} query and {kv} key/value heads: headbudget reads layers "
                             "with attention whose query heads split evenly over the key/value heads")
    hd = int(_field(reader, f"{arch}.attention.key_length", d_model // heads[0]))
    if int(_field(reader, f"{arch}.attention.value_length", hd)) != hd:
        raise ValueError(f"{where}: key_length {hd} and value_length differ: headbudget heads have one size")
    layers, sd = [], {"transformer.wte.weight": _torch(tensors["token_embd.weight"]),
                      "transformer.ln_f.weight": _torch(tensors["output_norm.weight"])}
    for i in range(n_layer):
        spec, layer_sd = _layer(tensors, i, heads[i], kv_heads[i], hd)
        layers.append(spec)
        sd.update(layer_sd)
    tied = "output.weight" not in tensors
    if not tied:
        sd["lm_head.weight"] = _torch(tensors["output.weight"])
    has_qkv_bias = "blk.0.attn_q.bias" in tensors
    config = HeadBudgetConfig(
        schedule={"d_model": d_model, "layers": layers, "name": str(_field(reader, "general.name", arch)),
                  "head_dim_multiple": 1},
        vocab_size=int(sd["transformer.wte.weight"].shape[0]), n_positions=int(_field(reader, f"{arch}.context_length")),
        dropout=0.0, bias=False, qkv_bias=has_qkv_bias, o_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors, norm="rmsnorm", mlp="gated_silu",
        intermediate_size=ffn if len(set(ffn)) > 1 else ffn[0], position="rotary",
        rope_parameters=_rope_parameters(reader, tensors, where),
        layer_norm_epsilon=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")), family="llama",
        tie_word_embeddings=tied, bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"))
    return _assemble(config, sd)


def _is_deci(path: str | os.PathLike) -> bool:
    try:
        import gguf
    except ImportError:
        return False
    return _field(gguf.GGUFReader(path), "general.architecture") == "deci"


def read_if_deci(path: str | os.PathLike) -> torch.nn.Module | None:
    """:func:`read_gguf` of a ``deci`` file (transformers has no class for it), else None: transformers reads
    the other architectures itself (and says what it lacks, the gguf package included)."""
    return read_gguf(path) if _is_deci(path) else None


def deci_tokenizer(path: str | os.PathLike) -> Any | None:
    """The tokenizer of a ``deci`` file, else None: AutoTokenizer picks a class by the file's architecture,
    and transformers has none for deci, so the plain fast tokenizer it builds for a llama file is used."""
    path = Path(path)
    if not _is_deci(path):
        return None
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: cannot load its tokenizer ({str(exc).strip().splitlines()[0]})") from None


__all__ = ["ARCHITECTURES", "deci_tokenizer", "read_gguf", "read_if_deci"]
