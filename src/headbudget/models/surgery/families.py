"""One :class:`~headbudget.models.surgery.base.AdapterBase` subclass per model family, and
:func:`get_adapter`, which picks it."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from headbudget.models.surgery.base import (
    AdapterBase,
    _head_rows,
    _slice_linear_in,
    _slice_linear_out,
)
from headbudget.models.surgery.interface import HeadAdapter


# ===================================================================== BERT family
class NoHeadSelfAttention(nn.Module):
    """What replaces a BERT layer's ``attention.self`` once all its heads are removed.

    It returns an empty head output (``[..., 0]`` features), so ``attention.output.dense`` (its input columns
    gone too) adds only its bias, followed as before by dropout, the residual and LayerNorm: exactly the dense
    layer with every head of that layer gated to 0.  The original's sizes stay readable (0 heads of the same
    width) and it has no weights, so a saved pruned model reloads by removing the same heads.

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
    """BERT/RoBERTa/MiniLM encoders: ``layer[i].attention.self`` + ``attention.output.dense``.

    A layer may lose all its heads (:class:`NoHeadSelfAttention` then stands in for its self-attention)."""

    family = "bert"
    empty_layers = True

    def attention_module(self, li: int) -> nn.Module:
        return self.layers[li].attention.self

    def head_counts(self) -> list[int]:
        return [int(self.attention_module(li).num_attention_heads) for li in range(self.num_layers)]

    def out_proj(self, li: int) -> nn.Module:
        return self.layers[li].attention.output.dense

    def out_head_dim(self, li: int) -> int:
        return int(self.attention_module(li).attention_head_size)

    def qkv_weights(self, li: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sa = self.attention_module(li)
        return sa.query.weight, sa.key.weight, sa.value.weight

    def _remove(self, li: int, kept: list[int], **opts: Any) -> None:
        sa = self.attention_module(li)
        d = int(sa.attention_head_size)
        out_proj = self.out_proj(li)
        rows = _head_rows(kept, d, out_proj.weight.device)
        _slice_linear_in(out_proj, rows)
        if not kept:  # zero-size q/k/v cannot be reshaped into heads: the whole self-attention goes
            self.layers[li].attention.self = NoHeadSelfAttention(sa)
            return
        for lin in (sa.query, sa.key, sa.value):
            _slice_linear_out(lin, rows)
        sa.num_attention_heads = len(kept)
        sa.all_head_size = len(kept) * d


# ===================================================================== GPT-2
class GPT2Adapter(AdapterBase):
    """GPT-2: fused ``c_attn`` Conv1D (weight ``[in, 3E]``: q | k | v) and ``c_proj`` (weight ``[E, out]``)."""

    family = "gpt2"

    def attention_module(self, li: int) -> nn.Module:
        return self.layers[li].attn

    def head_counts(self) -> list[int]:
        return [int(self.attention_module(li).num_heads) for li in range(self.num_layers)]

    def out_proj(self, li: int) -> nn.Module:
        return self.attention_module(li).c_proj

    def out_head_dim(self, li: int) -> int:
        return int(self.attention_module(li).head_dim)

    def qkv_weights(self, li: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w = self.attention_module(li).c_attn.weight.T  # Conv1D weights are [in, out]
        return tuple(w.split(w.shape[0] // 3))  # type: ignore[return-value]

    def out_proj_weight(self, li: int) -> torch.Tensor:
        return self.out_proj(li).weight.T

    def _remove(self, li: int, kept: list[int], **opts: Any) -> None:
        attn = self.attention_module(li)
        d = int(attn.head_dim)
        split = int(attn.split_size)
        dev = attn.c_attn.weight.device
        cols = torch.cat([_head_rows(kept, d, dev, offset=k * split) for k in range(3)])
        c_attn = attn.c_attn
        c_attn.weight = nn.Parameter(c_attn.weight.data.index_select(1, cols).clone())
        c_attn.bias = nn.Parameter(c_attn.bias.data.index_select(0, cols).clone())
        c_attn.nf = int(cols.numel())
        rows = _head_rows(kept, d, dev)
        c_proj = attn.c_proj
        c_proj.weight = nn.Parameter(c_proj.weight.data.index_select(0, rows).clone())
        c_proj.nx = int(rows.numel())
        attn.num_heads = len(kept)
        attn.split_size = len(kept) * d


# ===================================================================== Llama / Mistral (GQA)
class LlamaAdapter(AdapterBase):
    """Llama/Mistral/Qwen-style decoders: ``layers[i].self_attn.{q,k,v,o}_proj`` with GQA.

    See the module docstring for partial KV groups (kept and duplicated to a uniform group size,
    or refused with ``partial_groups="refuse"``).
    """

    family = "llama"

    def attention_module(self, li: int) -> nn.Module:
        return self.layers[li].self_attn

    def head_counts(self) -> list[int]:
        return [
            self.attention_module(li).q_proj.out_features // int(self.attention_module(li).head_dim)
            for li in range(self.num_layers)
        ]

    def kv_head_counts(self) -> list[int]:
        return [
            self.attention_module(li).k_proj.out_features // int(self.attention_module(li).head_dim)
            for li in range(self.num_layers)
        ]

    def _state(self) -> dict[str, Any]:
        state = super()._state()
        if "kv" not in state:
            # original KV head of every current query head
            qs, kvs = self.head_counts(), self.kv_head_counts()
            state["kv"] = {
                li: [h // (qs[li] // kvs[li]) for h in range(qs[li])] for li in range(self.num_layers)
            }
        return state

    def query_to_kv(self) -> dict[int, list[int]]:
        """Original KV head used by every current query head, per layer."""
        return {li: list(v) for li, v in self._state()["kv"].items()}

    def kv_group(self, layer: int) -> list[int]:
        return self.query_to_kv()[layer]  # by original KV head: a pruned layer may store a head twice

    def out_proj(self, li: int) -> nn.Module:
        return self.attention_module(li).o_proj

    def out_head_dim(self, li: int) -> int:
        return int(self.attention_module(li).head_dim)

    def qkv_weights(self, li: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn = self.attention_module(li)
        return attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight

    def _check_removal(self, li: int, kept: list[int], partial_groups: str = "keep", **opts: Any) -> None:
        if partial_groups not in ("keep", "refuse"):
            raise ValueError(f"partial_groups must be 'keep' or 'refuse', got {partial_groups!r}")
        if partial_groups == "refuse":
            kv = self._state()["kv"][li]
            kept_groups = {kv[h] for h in kept}
            for g in kept_groups:
                members = [h for h in range(len(kv)) if kv[h] == g]
                if any(h not in kept for h in members):
                    raise ValueError(
                        f"layer {li}: removing part of KV group {g} (query heads {members}) is refused "
                        "(partial_groups='refuse'); remove all of its query heads or none"
                    )

    def _remove(self, li: int, kept: list[int], **opts: Any) -> None:
        attn = self.attention_module(li)
        d = int(attn.head_dim)
        state = self._state()
        kv_orig = state["kv"][li]
        groups_now = len(kv_orig) // self.kv_head_counts()[li]
        # physical KV index currently serving each query head
        phys_now = [h // groups_now for h in range(len(kv_orig))]
        new_kv_orig = [kv_orig[h] for h in kept]
        # sizes of the remaining groups, in order (queries of one KV head are contiguous)
        sizes: list[tuple[int, int]] = []  # (original kv, count)
        first_query: dict[int, int] = {}
        for pos, (h, g) in enumerate(zip(kept, new_kv_orig)):
            if sizes and sizes[-1][0] == g:
                sizes[-1] = (g, sizes[-1][1] + 1)
            else:
                sizes.append((g, 1))
                first_query[g] = h
            del pos
        new_group = 0
        for _, s in sizes:
            new_group = math.gcd(new_group, s)
        kv_phys_keep: list[int] = []
        for g, s in sizes:
            kv_phys_keep.extend([phys_now[first_query[g]]] * (s // new_group))
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
        state["kv"][li] = new_kv_orig


# ===================================================================== headbudget
class HeadBudgetAdapter(AdapterBase):
    """headbudget's own :class:`HeadBudgetForCausalLM`; removal delegates to ``model.prune_heads``."""

    family = "headbudget"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, model.transformer.h)

    def attention_module(self, li: int) -> nn.Module:
        return self.layers[li].attn

    def head_counts(self) -> list[int]:
        return [int(self.attention_module(li).n_heads) for li in range(self.num_layers)]

    def kv_head_counts(self) -> list[int]:
        return [int(self.attention_module(li).n_kv_heads) for li in range(self.num_layers)]

    def out_proj(self, li: int) -> nn.Module:
        return self.attention_module(li).o_proj

    def out_head_dim(self, li: int) -> int:
        return int(self.attention_module(li).v_head_dim)

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

    def _check_removal(self, li: int, kept: list[int], **opts: Any) -> None:
        n = self.head_counts()[li]
        self.attention_module(li).plan_pruning([h for h in range(n) if h not in kept])  # raises before any change

    def _remove(self, li: int, kept: list[int], **opts: Any) -> None:
        n = self.head_counts()[li]
        self.model.prune_heads({li: [h for h in range(n) if h not in kept]})


# ===================================================================== dispatch
def _find_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    for _, mod in model.named_modules():
        layers = getattr(mod, "layer", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            att = getattr(layers[0], "attention", None)
            sa = getattr(att, "self", None)  # a layer without heads has no query projection left
            if att is not None and (hasattr(sa, "query") or isinstance(sa, NoHeadSelfAttention)) \
                    and hasattr(att, "output"):
                return "bert", layers
        blocks = getattr(mod, "h", None)
        if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
            attn = getattr(blocks[0], "attn", None)
            if attn is not None and hasattr(attn, "c_attn") and hasattr(attn, "c_proj"):
                return "gpt2", blocks
        layers = getattr(mod, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            attn = getattr(layers[0], "self_attn", None)
            if attn is not None and all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
                if hasattr(attn, "head_dim") and hasattr(attn, "num_key_value_groups"):
                    return "llama", layers
    return None


def get_adapter(model: nn.Module) -> HeadAdapter:
    """The head adapter for ``model``; ``ValueError`` naming the class when the family is unsupported."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) == "headbudget" or type(model).__name__ == "HeadBudgetForCausalLM":
        return HeadBudgetAdapter(model)
    found = _find_layers(model)
    if found is None:
        raise ValueError(
            f"unsupported model class {type(model).__name__}: head pruning supports BERT-family encoders, "
            "GPT-2, Llama/Mistral-style decoders and HeadBudgetForCausalLM"
        )
    family, layers = found
    cls = {"bert": BertAdapter, "gpt2": GPT2Adapter, "llama": LlamaAdapter}[family]
    return cls(model, layers)
