"""Write a decoder as an f32/f16 GGUF file that llama.cpp runs.

A uniform layout is written as llama.cpp's ``llama`` architecture, a pruned one as ``deci`` (per-layer head
counts and MLP widths, one head size).  Unequal query groups (``kv_groups`` [3, 1, 2]) are written with
duplicated key/value heads, split by the groups' greatest common divisor (:attr:`GGUFPlan.extra_bytes` and
:meth:`GGUFPlan.duplication_note` give the cost); per-layer head widths and low-rank q/k/v are refused.
Weights and tokenizer metadata follow llama.cpp's converter (``convert_hf_to_gguf.py``); a model read from a
GGUF file keeps that file's tokenizer metadata.  See docs/export.md.

    >>> from headbudget.models.export_gguf import export_gguf
    >>> plan = export_gguf(model, tokenizer, "smol.gguf", outtype="f16")   # doctest: +SKIP
    >>> plan.arch, plan.n_heads[:3]                                      # doctest: +SKIP
    ('deci', [9, 6, 7])
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path
from typing import Any

import numpy as np
import torch

from headbudget.models.convert import to_headbudget
from headbudget.models.rotary_headbudget import default_inv_freq, rotary_inv_freq

OUTTYPES = ("f32", "f16")
#: bytes of one cached key or value element in llama.cpp: its default cache type is f16 (``-ctk/-ctv f16``)
LLAMACPP_CACHE_BYTES = 2

# llama.cpp's converter identifies a BPE pre-tokenizer by the sha256 of str(tokenizer.encode(CHECK_TEXT));
# these are its hashes for the families headbudget converts (convert_hf_to_gguf.py, get_vocab_base_pre).
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) "
    "✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you "
    "sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
KNOWN_PRE_TOKENIZERS = {
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # openai-community/gpt2
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # HuggingFaceTB/SmolLM
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Meta-Llama-3-8B
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5-7B
}


class GGUFExportError(ValueError):
    """A model or tokenizer llama.cpp cannot run as written (one line, names the layer or field)."""


@dataclass
class GGUFPlan:
    """What :func:`export_gguf` writes: the architecture and every layer's head counts as llama.cpp sees them."""

    arch: str
    head_dim: int
    n_heads: list[int]
    n_kv_heads: list[int]  # as written (after duplication)
    source_kv_heads: list[int]  # as in the model
    feed_forward: list[int]
    kv_copies: list[list[int]] = field(default_factory=list)  # per layer: source kv head of each written one
    extra_bytes: int = 0  # bytes the duplicated key/value weights add to the file (at the outtype)

    @property
    def duplicated_layers(self) -> list[int]:
        return [i for i, (a, b) in enumerate(zip(self.n_kv_heads, self.source_kv_heads)) if a != b]

    @property
    def kv_cache_bytes_per_token(self) -> int:
        """Bytes one token adds to llama.cpp's (f16) KV cache: k and v of every key/value head as written."""
        return 2 * sum(self.n_kv_heads) * self.head_dim * LLAMACPP_CACHE_BYTES

    def duplication_note(self, context: int | None = None) -> str | None:
        """One line saying what the duplicated key/value heads cost, or None when nothing was duplicated."""
        layers = self.duplicated_layers
        if not layers:
            return None
        extra = sum(self.n_kv_heads[i] - self.source_kv_heads[i] for i in layers)
        per_token = 2 * extra * self.head_dim  # k and v values per token in llama.cpp's KV cache
        note = (f"unequal query groups in {len(layers)} layer(s) ({', '.join(map(str, layers))}) written with "
                f"{extra} duplicated key/value head(s): +{self.extra_bytes} bytes of weights, "
                f"+{per_token} KV-cache values per token")
        if context:
            note += f" (+{per_token * context * 2} bytes of f16 cache at context {context})"
        return note


def _problem(message: str) -> GGUFExportError:
    return GGUFExportError(f"gguf export: {message}")


def plan_gguf(config: Any, outtype: str = "f32") -> GGUFPlan:
    """Check a :class:`~headbudget.models.HeadBudgetConfig` against llama.cpp and lay out its heads.

    >>> from headbudget.models import HeadBudgetConfig
    >>> cfg = HeadBudgetConfig(schedule={"d_model": 64, "layers": [{"n_heads": 4, "head_dim": 16, "n_kv_heads": 2},
    ...     {"n_heads": 3, "head_dim": 16, "n_kv_heads": 2, "kv_groups": [2, 1]}]}, vocab_size=100,
    ...     norm="rmsnorm", mlp="gated_silu", position="rotary", bias=False)
    >>> p = plan_gguf(cfg); p.arch, p.n_heads, p.n_kv_heads, p.kv_copies[1]
    ('deci', [4, 3], [2, 3], [0, 0, 1])
    """
    if (config.norm, config.mlp, config.position) != ("rmsnorm", "gated_silu", "rotary"):
        raise _problem(f"norm={config.norm}, mlp={config.mlp}, position={config.position}: llama.cpp's llama/deci "
                       "architectures need rmsnorm, gated_silu and rotary (GPT-2-style models are not exported)")
    if config.attention_window is not None:
        raise _problem(f"attention_window={config.attention_window} (sliding-window attention) has no llama/deci "
                       "equivalent")
    specs = config.layer_specs()
    head_dim = specs[0]["head_dim"]
    for i, s in enumerate(specs):
        if s["head_dim"] != head_dim:
            raise _problem(f"layer {i} has head_dim {s['head_dim']}, layer 0 has {head_dim}: llama.cpp's deci "
                           "architecture takes one head size (per-layer head widths are not supported)")
        if s["qk_head_dim"] != head_dim or s["v_head_dim"] != head_dim:
            raise _problem(f"layer {i} has q/k width {s['qk_head_dim']} and v width {s['v_head_dim']} with "
                           f"head_dim {head_dim}: low-rank heads have no llama.cpp architecture")
    ffn = config.intermediate_sizes()
    copies = []
    for s in specs:
        groups = s["kv_groups"] or [s["n_heads"] // s["n_kv_heads"]] * s["n_kv_heads"]
        unit = math.gcd(*groups)  # the largest equal group size every group splits into
        copies.append([g for g, size in enumerate(groups) for _ in range(size // unit)])
    n_heads, kv_in = [s["n_heads"] for s in specs], [s["n_kv_heads"] for s in specs]
    kv_out = [len(c) for c in copies]
    extra_rows = 2 * (sum(kv_out) - sum(kv_in)) * head_dim  # k and v rows
    uniform = len(set(n_heads)) == 1 and len(set(kv_out)) == 1 and len(set(ffn)) == 1 and kv_in == kv_out
    return GGUFPlan(arch="llama" if uniform else "deci", head_dim=head_dim, n_heads=n_heads, n_kv_heads=kv_out,
                    source_kv_heads=kv_in, feed_forward=ffn, kv_copies=copies,
                    extra_bytes=extra_rows * config.n_embd * (2 if outtype == "f16" else 4))


def gguf_kv_cache_bytes(model: torch.nn.Module) -> int | None:
    """:attr:`GGUFPlan.kv_cache_bytes_per_token` of ``model``'s GGUF export; None if llama.cpp can't run it.

    >>> from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    >>> cfg = HeadBudgetConfig(schedule={"d_model": 32, "layers": [{"n_heads": 3, "head_dim": 8, "n_kv_heads": 2,
    ...     "kv_groups": [1, 2]}]}, vocab_size=10, norm="rmsnorm", mlp="gated_silu", position="rotary", bias=False)
    >>> gguf_kv_cache_bytes(HeadBudgetForCausalLM(cfg))   # 3 kv heads as written x (k, v) x 8 x 2 bytes
    96
    """
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "headbudget":
        return None
    try:
        return plan_gguf(config).kv_cache_bytes_per_token
    except GGUFExportError:
        return None


def interleave_rotary(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q or k rows (weight or bias) from "rotate half" to llama.cpp's interleaved pairs, per head.

    >>> interleave_rotary(torch.arange(4.0), 1).tolist()
    [0.0, 2.0, 1.0, 3.0]
    """
    half = rows.shape[0] // n_heads // 2
    return rows.reshape(n_heads, 2, half, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _rope_freq_factors(config: Any, head_dim: int) -> np.ndarray | None:
    """llama.cpp's ``rope_freqs`` (divisors of each frequency), or None for default rotary."""
    params = dict(config.rope_parameters)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    inv_freq, scaling = rotary_inv_freq(config, head_dim)
    if scaling != 1.0:
        raise _problem(f"rope_type={rope_type!r} scales attention by {scaling}: only default, linear and llama3 "
                       "rotary are exported")
    return (default_inv_freq(float(params["rope_theta"]), head_dim) / inv_freq).to(torch.float32).numpy()


# ----------------------------------------------------------------------------- tokenizer metadata
def detect_pre_tokenizer(tokenizer: Any) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a tokenizer, found by the converter's test-string hash."""
    digest = sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()
    if digest not in KNOWN_PRE_TOKENIZERS:
        raise _problem(f"the tokenizer's pre-tokenizer is not one llama.cpp's converter recognises (sha256 "
                       f"{digest[:12]}...); name it with tokenizer_pre (--tokenizer-pre gpt-2|smollm|llama-bpe|qwen2)")
    return KNOWN_PRE_TOKENIZERS[digest]


def _looks_special(token: str) -> bool:
    # the converter's rule for added tokens that should be control tokens although not marked special
    return token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>")) \
        or (token.startswith("<unused") and token.endswith(">"))


def _write_tokenizer(writer: Any, gguf: Any, tokenizer: Any, vocab_size: int, tokenizer_pre: str | None) -> None:
    """The converter's ``_set_vocab_gpt2`` (plus LlamaModel.set_vocab's extras) for a transformers tokenizer."""
    vocab = getattr(tokenizer, "vocab", None) if getattr(tokenizer, "is_fast", False) else None
    if not isinstance(vocab, dict) or not vocab:
        raise _problem(f"tokenizer {type(tokenizer).__name__} is not a Hugging Face fast BPE tokenizer; llama.cpp "
                       "needs its vocabulary and merges (give --tokenizer a tokenizer folder)")
    if max(vocab.values()) >= vocab_size:
        raise _problem(f"the tokenizer has token id {max(vocab.values())}, the model only {vocab_size} embeddings")
    pre = tokenizer_pre or detect_pre_tokenizer(tokenizer)
    reverse = {i: tok for tok, i in vocab.items()}
    added, decoder = tokenizer.get_added_vocab(), tokenizer.added_tokens_decoder

    def entry(i: int) -> tuple[str, Any]:  # (token, token type) of id i
        token = reverse.get(i)
        if token is None:
            return f"[PAD{i}]", gguf.TokenType.UNUSED
        if token not in added:
            return token, gguf.TokenType.NORMAL
        if not decoder[i].normalized:  # llama.cpp takes added tokens as already normalised
            token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
        if decoder[i].special or _looks_special(token):
            return token, gguf.TokenType.CONTROL
        return token.replace("\u2581", " "), gguf.TokenType.USER_DEFINED

    tokens, types = zip(*map(entry, range(vocab_size)))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(list(tokens))
    writer.add_token_types(list(types))
    with tempfile.TemporaryDirectory(prefix="headbudget-gguf-tok.") as tmp:
        tokenizer.save_pretrained(tmp)  # gguf.SpecialVocab reads merges and special ids as the converter does
        config_file = Path(tmp) / "tokenizer_config.json"
        tok_config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        if tok_config.get("add_prefix_space") is not None:
            writer.add_add_space_prefix(tok_config["add_prefix_space"])
        gguf.SpecialVocab(tmp, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer)
    if vocab_size == 49152 and not any(key.endswith("add_bos_token") for kv in writer.kv_data for key in kv):
        writer.add_add_bos_token(False)  # the converter's rule for this vocabulary size (SmolLM2, granite)


def _copy_tokenizer(writer: Any, gguf: Any, source_gguf: str | os.PathLike) -> None:
    """Every ``tokenizer.*`` key of a GGUF file, as written there."""
    reader = gguf.GGUFReader(source_gguf)
    for key, fld in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = fld.types[0]
            sub = fld.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, fld.contents(), vtype, sub)


# ----------------------------------------------------------------------------- the writer
def _tensors(model: Any, plan: GGUFPlan, outtype: str) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, array) of every tensor, in the converter's naming and rotary order."""
    wide = np.float16 if outtype == "f16" else np.float32

    out: list[tuple[str, np.ndarray]] = []

    def add(name: str, t: torch.Tensor | None) -> None:  # absent biases are skipped
        if t is not None:  # 1-D tensors (norms, biases) stay float32, as the converter
            a = t.detach().to("cpu", torch.float32).contiguous().numpy()
            out.append((name, a.astype(wide) if a.ndim > 1 else a))

    tf, hd = model.transformer, plan.head_dim
    add("token_embd.weight", tf.wte.weight)
    for i, block in enumerate(tf.h):
        p, blk = block.attn.projections(), f"blk.{i}."
        copies = torch.tensor(plan.kv_copies[i])
        add(blk + "attn_norm.weight", block.ln_1.weight)
        for j, kind in enumerate(("weight", "bias")):  # q, k, v weights, then q, k, v biases
            for x, n in (("q", plan.n_heads[i]), ("k", plan.n_kv_heads[i]), ("v", None)):
                t = p[x][j]
                if t is not None and x != "q":  # one copy of a key/value head per written head
                    t = t.view(-1, hd, *t.shape[1:])[copies].flatten(0, 1)
                add(f"{blk}attn_{x}.{kind}", interleave_rotary(t, n) if n and t is not None else t)
        add(blk + "attn_output.weight", p["o"][0])
        add(blk + "attn_output.bias", p["o"][1])
        add(blk + "ffn_norm.weight", block.ln_2.weight)
        for ours, theirs in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            add(f"{blk}{theirs}.weight", getattr(block.mlp, ours).weight)
            add(f"{blk}{theirs}.bias", getattr(block.mlp, ours).bias)
    add("output_norm.weight", tf.ln_f.weight)
    if not model.config.tie_word_embeddings:
        add("output.weight", model.lm_head.weight)
    return out


def export_gguf(model: torch.nn.Module, tokenizer: Any, path: str | os.PathLike, outtype: str = "f32", *,
                source_gguf: str | os.PathLike | None = None, tokenizer_pre: str | None = None,
                name: str | None = None) -> GGUFPlan:
    """Write ``model`` (a headbudget decoder or a transformers Llama/Mistral/Qwen2) and its tokenizer to
    ``path`` atomically; ``source_gguf`` (the GGUF file the model was read from) supplies the tokenizer
    metadata verbatim.  Returns the :class:`GGUFPlan` written; refusals are :class:`GGUFExportError`."""
    try:
        import gguf
    except ImportError as exc:  # an optional extra
        raise _problem("the gguf package is not installed (pip install 'headbudget[gguf]')") from exc
    from headbudget.io import atomic_write_file

    if outtype not in OUTTYPES:
        raise _problem(f"outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")
    model = to_headbudget(model)
    config = model.config
    plan = plan_gguf(config, outtype)
    freq_factors = _rope_freq_factors(config, plan.head_dim)
    tensors = _tensors(model, plan, outtype)

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(tmp, plan.arch)
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(name or getattr(config, "name_or_path", None) or "headbudget")
        writer.add_block_count(config.n_layer)
        writer.add_context_length(config.n_positions)
        writer.add_embedding_length(config.n_embd)
        for add, per_layer in ((writer.add_feed_forward_length, plan.feed_forward), (writer.add_head_count,
                               plan.n_heads), (writer.add_head_count_kv, plan.n_kv_heads)):
            add(per_layer[0] if plan.arch == "llama" else per_layer)  # deci: one entry per layer
        writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
        writer.add_layer_norm_rms_eps(float(config.layer_norm_epsilon))
        if plan.arch == "deci" or plan.head_dim * plan.n_heads[0] != config.n_embd:
            writer.add_key_length(plan.head_dim)
            writer.add_value_length(plan.head_dim)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if outtype == "f16" else gguf.LlamaFileType.ALL_F32)
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(plan.head_dim)
        if source_gguf is not None:
            _copy_tokenizer(writer, gguf, source_gguf)
        else:
            _write_tokenizer(writer, gguf, tokenizer, config.vocab_size, tokenizer_pre)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        if freq_factors is not None:
            writer.add_tensor("rope_freqs.weight", freq_factors)
        for tensor_name, data in tensors:
            writer.add_tensor(tensor_name, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    try:
        atomic_write_file(path, write)
    except OSError as exc:  # a temporary sibling's name (mkstemp's own error) is gone when the message is read
        if exc.filename is not None and _is_temporary_of(Path(os.fsdecode(exc.filename)), Path(path)):
            exc.filename = str(path)
        raise
    return plan


def _is_temporary_of(name: Path, path: Path) -> bool:
    """Is ``name`` one of :func:`headbudget.io.atomic_write_file`'s temporary siblings of ``path``?"""
    return name.parent == path.parent and name.name.startswith(f".{path.name}.") and name.suffix == ".tmp"


__all__ = ["CHECK_TEXT", "GGUFExportError", "GGUFPlan", "LLAMACPP_CACHE_BYTES", "OUTTYPES", "detect_pre_tokenizer",
           "export_gguf", "gguf_kv_cache_bytes", "interleave_rotary", "plan_gguf"]
