"""One :class:`~headbudget.models.surgery.base.AdapterBase` subclass per model family, and
:func:`get_adapter`, which picks it."""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch import nn

from headbudget.models.surgery.base import AdapterBase, _head_rows, _slice_linear_in, _slice_linear_out
from headbudget.models.surgery.interface import HeadAdapter


class NoHeadSelfAttention(nn.Module):
    """What replaces a BERT layer's ``attention.self`` once all its heads are removed.

    Its empty head output (``[..., 0]`` features) leaves ``attention.output.dense`` only its bias: exactly the
    layer with every head gated to 0.  It keeps the original's head width and has no weights, so a saved
    pruned model reloads by removing the same heads.

        >>> adapter.prune_heads({1: [0, 1, 2, 3]})                # doctest: +SKIP
        >>> type(model.bert.encoder.layer[1].attention.self).__name__, adapter.head_counts()  # doctest: +SKIP
        ('NoHeadSelfAttention', [4, 0])
    """

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.num_attention_heads = 0
        self.attention_head_size = int(original.attention_head_size)
        self.all_head_size = 0
        self.config = getattr(original, "config", None)  # the adapter's eager switch reads it
        self.layer_idx = getattr(original, "layer_idx", None)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        shape = hidden_states.shape[:-1]
        # zero heads' attention maps, [batch, 0, T, T], so attention_probs and output_attentions keep their layout
        probs = hidden_states.new_zeros(shape[0], 0, shape[-1], shape[-1])
        return hidden_states.new_zeros(*shape, 0), probs


class BertAdapter(AdapterBase):
    """BERT/RoBERTa/MiniLM encoders: ``layer[i].attention.self`` + ``attention.output.dense``; a layer may
    lose all its heads (:class:`NoHeadSelfAttention` then stands in for its self-attention)."""

    family = "bert"
    empty_layers = True
    _attn_path, _out_path = "attention.self", "attention.output.dense"
    _heads_attr, _dim_attr = "num_attention_heads", "attention_head_size"

    def qkv_weights(self, li: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sa = self.attention_module(li)
        return sa.query.weight, sa.key.weight, sa.value.weight

    def _remove(self, li: int, kept: list[int], **opts: Any) -> None:
        sa, out_proj = self.attention_module(li), self.out_proj(li)
        d = int(sa.attention_head_size)
        rows = _head_rows(kept, d, out_proj.weight.device)
        _slice_linear_in(out_proj, rows)
        if not kept:  # zero-size q/k/v cannot be reshaped into heads: the whole self-attention goes
            self.layers[li].attention.self = NoHeadSelfAttention(sa)
            return
        for lin in (sa.query, sa.key, sa.value):
            _slice_linear_out(lin, rows)
        sa.num_attention_heads = len(kept)
        sa.all_head_size = len(kept) * d


class GPT2Adapter(AdapterBase):
    """GPT-2: fused ``c_attn`` Conv1D (weight ``[in, 3E]``: q | k | v) and ``c_proj`` (weight ``[E, out]``)."""

    family = "gpt2"
    _attn_path, _out_path, _heads_attr, _dim_attr = "attn", "attn.c_proj", "num_heads", "head_dim"

    def qkv_weights(self, li: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w = self.attention_module(li).c_attn.weight.T  # Conv1D weights are [in, out]
        return tuple(w.split(w.shape[0] // 3))  # type: ignore[return-value]

    def out_proj_weight(self, li: int) -> torch.Tensor:
        return self.out_proj(li).weight.T

    def _remove(self, li: int, kept: list[int], **opts: Any) -> None:
        attn = self.attention_module(li)
        d, split, c_attn = int(attn.head_dim), int(attn.split_size), attn.c_attn
        dev = c_attn.weight.device
        cols = torch.cat([_head_rows(kept, d, dev, offset=k * split) for k in range(3)])
        c_attn.weight = nn.Parameter(c_attn.weight.data.index_select(1, cols).clone())
        c_attn.bias = nn.Parameter(c_attn.bias.data.index_select(0, cols).clone())
        c_attn.nf = int(cols.numel())
        rows = _head_rows(kept, d, dev)
        c_proj = attn.c_proj
        c_proj.weight = nn.Parameter(c_proj.weight.data.index_select(0, rows).clone())
        c_proj.nx = int(rows.numel())
        attn.num_heads = len(kept)
        attn.split_size = len(kept) * d


class LlamaAdapter(AdapterBase):
    """Llama/Mistral/Qwen-style decoders: ``layers[i].self_attn.{q,k,v,o}_proj`` with GQA; partial KV groups
    are kept and duplicated to a uniform group size, or refused with ``partial_groups="refuse"``."""

    family = "llama"
    _attn_path, _out_path, _dim_attr = "self_attn", "self_attn.o_proj", "head_dim"

    def head_counts(self) -> list[int]:
        return [a.q_proj.out_features // int(a.head_dim) for a in self._attns()]

    def kv_head_counts(self) -> list[int]:
        return [a.k_proj.out_features // int(a.head_dim) for a in self._attns()]

    def _state(self) -> dict[str, Any]:
        state = super()._state()
        if "kv" not in state:  # original KV head of every current query head
            qs, kvs = self.head_counts(), self.kv_head_counts()
            state["kv"] = {li: [h // (q // kv) for h in range(q)] for li, (q, kv) in enumerate(zip(qs, kvs))}
        return state

    def query_to_kv(self) -> dict[int, list[int]]:
        """Original KV head used by every current query head, per layer."""
        return {li: list(v) for li, v in self._state()["kv"].items()}

    def kv_group(self, layer: int) -> list[int]:
        return self.query_to_kv()[layer]  # by original KV head: a pruned layer may store a head twice

    def qkv_weights(self, li: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn = self.attention_module(li)
        return attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight

    def _check_removal(self, li: int, kept: list[int], partial_groups: str = "keep", **opts: Any) -> None:
        if partial_groups not in ("keep", "refuse"):
            raise ValueError(f"partial_groups must be 'keep' or 'refuse', got {partial_groups!r}")
        if partial_groups == "refuse":
            kv = self._state()["kv"][li]
            for g in {kv[h] for h in kept}:
                members = [h for h in range(len(kv)) if kv[h] == g]
                if any(h not in kept for h in members):
                    raise ValueError(
                        f"layer {li}: removing part of KV group {g} (query heads {members}) is refused "
                        "(partial_groups='refuse'); remove all of its query heads or none")

    def _remove(self, li: int, kept: list[int], **opts: Any) -> None:
        attn = self.attention_module(li)
        d = int(attn.head_dim)
        state = self._state()
        kv_orig = state["kv"][li]
        groups_now = len(kv_orig) // self.kv_head_counts()[li]  # query head h reads KV head h // groups_now
        # the remaining groups' query heads, in order (queries of one KV head are contiguous)
        runs = [list(hs) for _, hs in itertools.groupby(kept, key=lambda h: kv_orig[h])]
        new_group = math.gcd(*map(len, runs))
        kv_phys_keep = [run[0] // groups_now for run in runs for _ in range(len(run) // new_group)]
        dev = attn.q_proj.weight.device
        q_rows = _head_rows(kept, d, dev)
        kv_rows = _head_rows(kv_phys_keep, d, dev)
        _slice_linear_out(attn.q_proj, q_rows)
        _slice_linear_out(attn.k_proj, kv_rows)
        _slice_linear_out(attn.v_proj, kv_rows)
        _slice_linear_in(attn.o_proj, q_rows)
        attn.num_key_value_groups = new_group
        for name, value in (("num_heads", len(kept)), ("num_key_value_heads", len(kv_phys_keep))):
            if hasattr(attn, name):
                setattr(attn, name, value)
        state["kv"][li] = [kv_orig[h] for h in kept]


class HeadBudgetAdapter(AdapterBase):
    """headbudget's own :class:`HeadBudgetForCausalLM`; removal delegates to ``model.prune_heads``."""

    family = "headbudget"
    _attn_path, _out_path, _heads_attr, _dim_attr = "attn", "attn.o_proj", "n_heads", "v_head_dim"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, model.transformer.h)

    def kv_head_counts(self) -> list[int]:
        return [int(a.n_kv_heads) for a in self._attns()]

    def qkv_weights(self, li: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = self.attention_module(li).projections()
        return p["q"][0], p["k"][0], p["v"][0]

    @torch.no_grad()
    def attention_probs(self, **inputs: Any) -> list[torch.Tensor]:
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model(**inputs, output_attentions=True)
        finally:
            self.model.train(was_training)
        return list(out.attentions)

    def _check_removal(self, li: int, kept: list[int], **opts: Any) -> None:  # raises before any change
        self.attention_module(li).plan_pruning(sorted(set(range(self.head_counts()[li])) - set(kept)))

    def _remove(self, li: int, kept: list[int], **opts: Any) -> None:
        self.model.prune_heads({li: sorted(set(range(self.head_counts()[li])) - set(kept))})


def _find_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    for _, mod in model.named_modules():
        layers = getattr(mod, "layer", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            att = getattr(layers[0], "attention", None)
            sa = getattr(att, "self", None)  # a layer without heads has no query projection left
            if (hasattr(sa, "query") or isinstance(sa, NoHeadSelfAttention)) and hasattr(att, "output"):
                return "bert", layers
        blocks = getattr(mod, "h", None)
        if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
            attn = getattr(blocks[0], "attn", None)
            if hasattr(attn, "c_attn") and hasattr(attn, "c_proj"):
                return "gpt2", blocks
        layers = getattr(mod, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            attn = getattr(layers[0], "self_attn", None)
            if all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim",
                                              "num_key_value_groups")):
                return "llama", layers
    return None


def get_adapter(model: nn.Module) -> HeadAdapter:
    """The head adapter for ``model``; ``ValueError`` naming the class when the family is unsupported."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) == "headbudget" or type(model).__name__ == "HeadBudgetForCausalLM":
        return HeadBudgetAdapter(model)
    found = _find_layers(model)
    if found is None:
        raise ValueError(f"unsupported model class {type(model).__name__}: head pruning supports BERT-family "
                         "encoders, GPT-2, Llama/Mistral-style decoders and HeadBudgetForCausalLM")
    family, layers = found
    return {"bert": BertAdapter, "gpt2": GPT2Adapter, "llama": LlamaAdapter}[family](model, layers)
