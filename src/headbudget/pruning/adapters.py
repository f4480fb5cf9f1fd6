"""Per-family head adapters: gate, inspect and physically remove attention heads.

transformers 5 dropped ``head_mask`` and ``prune_heads`` from its models, so every family gets an
adapter that finds each layer's query/key/value/output projections and head counts itself:

* ``"bert"``: BERT-family encoders (BERT, RoBERTa, XLM-R, ELECTRA, all-MiniLM ...), any model that
  contains an ``encoder.layer[i].attention.self.{query,key,value}`` / ``attention.output.dense`` stack
  (so a ``BertModel`` wrapped in a custom pooling/classifier module works too);
* ``"gpt2"``: GPT-2 (``h[i].attn.c_attn`` fused Conv1D + ``c_proj``);
* ``"llama"``: Llama/Mistral/Qwen-style decoders with grouped-query attention
  (``layers[i].self_attn.{q,k,v,o}_proj``);
* ``"headbudget"``: :class:`headbudget.models.HeadBudgetForCausalLM` (delegates removal to the model).

Gating multiplies each head's slice of the *input of the output projection* (a forward pre-hook on
``attention.output.dense`` / ``c_proj`` / ``o_proj``), so a gate of 0 is exactly the same as removing
the head, and ``d loss / d gate`` is the gradient importance of Michel et al.

Grouped-query attention and partial groups.  A key/value head is removed only when all of its query
heads are removed.  When a group loses only some of its queries, the KV head stays and its remaining
queries keep using it.  Because transformers' attention kernels need every KV head to serve the same
number of queries (``num_key_value_groups``), the layer is re-laid out: with ``s_i`` remaining queries
in group ``i`` the new group size is ``g = gcd(s_i)`` and KV head ``i`` is stored ``s_i / g`` times
(exact copies of its k/v rows).  The forward is therefore exact (removed == gated to zero), at the cost
of some duplicated KV rows in layers with uneven groups; ``prune_heads(..., partial_groups="refuse")``
raises instead.  The layout depends only on the set of kept heads, so it is reproduced on load.

    >>> from transformers import BertConfig, BertForSequenceClassification
    >>> model = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2,
    ...     num_attention_heads=4, intermediate_size=64, vocab_size=100))
    >>> adapter = get_adapter(model)
    >>> adapter.prune_heads({0: [1, 3]})
    >>> adapter.head_counts(), adapter.original_heads()[0]
    ([2, 4], [0, 2])
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headbudget.io import atomic_write_text

KEPT_HEADS_FILE = "kept_heads.json"
_STATE_ATTR = "_headbudget_prune_state"


def _layer_key(layer: Any, num_layers: int) -> int:
    try:
        idx = int(layer)
    except (TypeError, ValueError):
        raise ValueError(f"layer {layer!r} is not an integer layer index") from None
    if not 0 <= idx < num_layers:
        raise ValueError(f"layer {idx} out of range: the model has {num_layers} layers (0..{num_layers - 1})")
    return idx


def _slice_linear_out(lin: nn.Linear, rows: torch.Tensor) -> None:
    """Keep output features ``rows`` of an ``nn.Linear`` (weight rows and bias)."""
    lin.weight = nn.Parameter(lin.weight.data.index_select(0, rows).clone(), lin.weight.requires_grad)
    if lin.bias is not None:
        lin.bias = nn.Parameter(lin.bias.data.index_select(0, rows).clone(), lin.bias.requires_grad)
    lin.out_features = int(rows.numel())


def _slice_linear_in(lin: nn.Linear, cols: torch.Tensor) -> None:
    """Keep input features ``cols`` of an ``nn.Linear`` (weight columns)."""
    lin.weight = nn.Parameter(lin.weight.data.index_select(1, cols).clone(), lin.weight.requires_grad)
    lin.in_features = int(cols.numel())


def _head_rows(heads: Sequence[int], dim: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    idx = [offset + h * dim + j for h in heads for j in range(dim)]
    return torch.tensor(idx, dtype=torch.long, device=device)


class HeadAdapter:
    """Common machinery; subclasses describe one model family.

    Subclasses implement ``_out_proj(li)`` (the module whose input is the concatenated head outputs),
    ``_out_head_dim(li)`` (per-head width of that input), ``_attn_module(li)`` (the module whose
    forward returns ``(output, attention_probs)``), ``head_counts``, ``kv_head_counts`` and
    ``_remove(li, keep)`` (physical removal keeping current head indices ``keep``).
    """

    family: str = ""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    # ----------------------------------------------------------------- bookkeeping
    @property
    def num_layers(self) -> int:
        raise NotImplementedError

    def head_counts(self) -> list[int]:
        """Current number of query heads in every layer."""
        raise NotImplementedError

    def kv_head_counts(self) -> list[int]:
        """Current number of (physically stored) key/value heads in every layer."""
        raise NotImplementedError

    def _initial_heads(self, layer: int) -> int:
        return self.head_counts()[layer]

    def _state(self) -> dict[str, Any]:
        state = self.model.__dict__.get(_STATE_ATTR)
        if state is None:
            state = {"kept": {li: list(range(self._initial_heads(li))) for li in range(self.num_layers)}}
            self.model.__dict__[_STATE_ATTR] = state
        return state

    def original_heads(self) -> dict[int, list[int]]:
        """Original (pre-pruning) indices of the heads still present, per layer."""
        return {li: list(v) for li, v in self._state()["kept"].items()}

    def pruned_heads_record(self) -> dict[int, list[int]]:
        """JSON-able ``{layer: [original kept heads]}`` (``json.dumps`` writes the keys as strings)."""
        return self.original_heads()

    # ----------------------------------------------------------------- gating
    def _out_proj(self, layer: int) -> nn.Module:
        raise NotImplementedError

    def _out_head_dim(self, layer: int) -> int:
        raise NotImplementedError

    def _param_ref(self) -> torch.Tensor:
        return next(self.model.parameters())

    @contextlib.contextmanager
    def _gate_hooks(self, gates: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
        counts = self.head_counts()
        if len(gates) != self.num_layers:
            raise ValueError(f"expected gate values for {self.num_layers} layers, got {len(gates)}")
        for li, g in enumerate(gates):
            if g.shape != (counts[li],):
                raise ValueError(f"layer {li}: gate shape {tuple(g.shape)} does not match {counts[li]} heads")
        handles = []
        for li, g in enumerate(gates):
            dim = self._out_head_dim(li)

            def pre_hook(module: nn.Module, args: tuple, _g: torch.Tensor = g, _d: int = dim) -> tuple:
                x = args[0]
                h = _g.shape[0]
                gx = x.view(*x.shape[:-1], h, _d) * _g.to(dtype=x.dtype, device=x.device).view(h, 1)
                return (gx.reshape(x.shape), *args[1:])

            handles.append(self._out_proj(li).register_forward_pre_hook(pre_hook))
        try:
            yield gates
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def gates(self) -> Iterator[list[torch.Tensor]]:
        """Per-layer head gates (init 1.0, ``requires_grad``) active inside the block.

        >>> with adapter.gates() as gates:
        ...     model(**batch).loss.backward()
        ...     importance = [g.grad.abs() for g in gates]
        """
        ref = self._param_ref()
        gates = [
            torch.ones(n, dtype=torch.float32, device=ref.device, requires_grad=True)
            for n in self.head_counts()
        ]
        with self._gate_hooks(gates) as g:
            yield g

    @contextlib.contextmanager
    def set_gate_values(
        self, values: Sequence[Sequence[float] | torch.Tensor] | Mapping[int, Sequence[float] | torch.Tensor]
    ) -> Iterator[list[torch.Tensor]]:
        """Fixed gate values (no grad) inside the block; a mapping leaves unnamed layers at 1.0."""
        ref = self._param_ref()
        counts = self.head_counts()
        if isinstance(values, Mapping):
            gates = [torch.ones(n, dtype=torch.float32, device=ref.device) for n in counts]
            for layer, v in values.items():
                gates[_layer_key(layer, self.num_layers)] = torch.as_tensor(
                    v, dtype=torch.float32, device=ref.device
                ).detach()
        else:
            gates = [torch.as_tensor(v, dtype=torch.float32, device=ref.device).detach() for v in values]
        with self._gate_hooks(gates) as g:
            yield g

    # ----------------------------------------------------------------- attention probabilities
    def _attn_module(self, layer: int) -> nn.Module:
        raise NotImplementedError

    @contextlib.contextmanager
    def _eager(self) -> Iterator[None]:
        configs: dict[int, Any] = {}
        for li in range(self.num_layers):
            cfg = getattr(self._attn_module(li), "config", None)
            if cfg is not None:
                configs[id(cfg)] = cfg
        saved = {k: c._attn_implementation_internal for k, c in configs.items()}
        try:
            for c in configs.values():
                c._attn_implementation_internal = "eager"
            yield
        finally:
            for k, c in configs.items():
                c._attn_implementation_internal = saved[k]

    @torch.no_grad()
    def attention_probs(self, **inputs: Any) -> list[torch.Tensor]:
        """Attention probabilities per layer, each ``(B, H_l, T, T)``, from one eager forward in eval mode.

        Padded *key* columns get probability 0 when ``attention_mask`` is passed; rows of padded
        queries are still returned (callers cut them away).
        """
        captured: list[torch.Tensor | None] = [None] * self.num_layers
        handles = []
        for li in range(self.num_layers):

            def hook(module: nn.Module, args: tuple, output: Any, _l: int = li) -> None:
                captured[_l] = output[1]

            handles.append(self._attn_module(li).register_forward_hook(hook))
        was_training = self.model.training
        self.model.eval()
        try:
            with self._eager():
                self.model(**inputs)
        finally:
            for handle in handles:
                handle.remove()
            self.model.train(was_training)
        missing = [li for li, p in enumerate(captured) if p is None]
        if missing:
            raise RuntimeError(
                f"{self.family} adapter: no attention probabilities captured for layers {missing}"
            )
        return [p for p in captured if p is not None]

    # ----------------------------------------------------------------- removal
    def _remove(self, layer: int, keep: list[int], **opts: Any) -> None:
        raise NotImplementedError

    def _check_removal(self, layer: int, keep: list[int], **opts: Any) -> None:
        """Hook for family-specific refusals (before anything is modified)."""

    def prune_heads(self, heads: Mapping[int | str, Sequence[int]], **opts: Any) -> None:
        """Physically remove heads, given as *current* indices per layer.

        Everything is validated before any weight changes: a layer/head out of range or removing a
        layer's last head raises ``ValueError`` naming the layer and the model is left untouched.
        """
        counts = self.head_counts()
        removals: dict[int, set[int]] = {}
        for layer, hs in heads.items():
            li = _layer_key(layer, self.num_layers)
            remove = removals.setdefault(li, set())
            for h in hs:
                hi = int(h)
                if not 0 <= hi < counts[li]:
                    raise ValueError(f"layer {li}: head {hi} out of range (the layer has {counts[li]} heads)")
                remove.add(hi)
        plan: dict[int, list[int]] = {}
        for li, remove in sorted(removals.items()):
            if not remove:
                continue
            if len(remove) >= counts[li]:
                raise ValueError(
                    f"layer {li}: cannot remove all {counts[li]} heads; every layer must keep at least one head"
                )
            keep = [h for h in range(counts[li]) if h not in remove]
            self._check_removal(li, keep, **opts)
            plan[li] = keep
        state = self._state()
        for li, keep in plan.items():
            self._remove(li, keep, **opts)
            state["kept"][li] = [state["kept"][li][h] for h in keep]

    def prune_to(self, kept: Mapping[int | str, Sequence[int]], **opts: Any) -> None:
        """Keep exactly the given *original* head indices per layer (layers not named are untouched)."""
        orig = self.original_heads()
        spec: dict[int, list[int]] = {}
        for layer, ks in kept.items():
            li = _layer_key(layer, self.num_layers)
            want = {int(h) for h in ks}
            unknown = want - set(orig[li])
            if unknown:
                raise ValueError(f"layer {li}: heads {sorted(unknown)} are not present (present: {orig[li]})")
            spec[li] = [i for i, h in enumerate(orig[li]) if h not in want]
        self.prune_heads(spec, **opts)


# ===================================================================== BERT family
class BertAdapter(HeadAdapter):
    """BERT/RoBERTa/MiniLM encoders: ``layer[i].attention.self`` + ``attention.output.dense``."""

    family = "bert"

    def __init__(self, model: nn.Module, layers: nn.ModuleList) -> None:
        super().__init__(model)
        self.layers = layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _self(self, li: int) -> nn.Module:
        return self.layers[li].attention.self

    def head_counts(self) -> list[int]:
        return [int(self._self(li).num_attention_heads) for li in range(self.num_layers)]

    def kv_head_counts(self) -> list[int]:
        return self.head_counts()

    def _out_proj(self, li: int) -> nn.Module:
        return self.layers[li].attention.output.dense

    def _out_head_dim(self, li: int) -> int:
        return int(self._self(li).attention_head_size)

    def _attn_module(self, li: int) -> nn.Module:
        return self._self(li)

    def _remove(self, li: int, keep: list[int], **opts: Any) -> None:
        sa = self._self(li)
        d = int(sa.attention_head_size)
        rows = _head_rows(keep, d, sa.query.weight.device)
        for lin in (sa.query, sa.key, sa.value):
            _slice_linear_out(lin, rows)
        _slice_linear_in(self._out_proj(li), rows)
        sa.num_attention_heads = len(keep)
        sa.all_head_size = len(keep) * d


# ===================================================================== GPT-2
class GPT2Adapter(HeadAdapter):
    """GPT-2: fused ``c_attn`` Conv1D (weight ``[in, 3E]``: q | k | v) and ``c_proj`` (weight ``[E, out]``)."""

    family = "gpt2"

    def __init__(self, model: nn.Module, blocks: nn.ModuleList) -> None:
        super().__init__(model)
        self.blocks = blocks

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def _attn(self, li: int) -> nn.Module:
        return self.blocks[li].attn

    def head_counts(self) -> list[int]:
        return [int(self._attn(li).num_heads) for li in range(self.num_layers)]

    def kv_head_counts(self) -> list[int]:
        return self.head_counts()

    def _out_proj(self, li: int) -> nn.Module:
        return self._attn(li).c_proj

    def _out_head_dim(self, li: int) -> int:
        return int(self._attn(li).head_dim)

    def _attn_module(self, li: int) -> nn.Module:
        return self._attn(li)

    def _remove(self, li: int, keep: list[int], **opts: Any) -> None:
        attn = self._attn(li)
        d = int(attn.head_dim)
        split = int(attn.split_size)
        dev = attn.c_attn.weight.device
        cols = torch.cat([_head_rows(keep, d, dev, offset=k * split) for k in range(3)])
        c_attn = attn.c_attn
        c_attn.weight = nn.Parameter(c_attn.weight.data.index_select(1, cols).clone())
        c_attn.bias = nn.Parameter(c_attn.bias.data.index_select(0, cols).clone())
        c_attn.nf = int(cols.numel())
        rows = _head_rows(keep, d, dev)
        c_proj = attn.c_proj
        c_proj.weight = nn.Parameter(c_proj.weight.data.index_select(0, rows).clone())
        c_proj.nx = int(rows.numel())
        attn.num_heads = len(keep)
        attn.split_size = len(keep) * d


# ===================================================================== Llama / Mistral (GQA)
class LlamaAdapter(HeadAdapter):
    """Llama/Mistral/Qwen-style decoders: ``layers[i].self_attn.{q,k,v,o}_proj`` with GQA.

    See the module docstring for partial KV groups (kept and duplicated to a uniform group size,
    or refused with ``partial_groups="refuse"``).
    """

    family = "llama"

    def __init__(self, model: nn.Module, layers: nn.ModuleList) -> None:
        super().__init__(model)
        self.layers = layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _attn(self, li: int) -> nn.Module:
        return self.layers[li].self_attn

    def head_counts(self) -> list[int]:
        return [
            self._attn(li).q_proj.out_features // int(self._attn(li).head_dim)
            for li in range(self.num_layers)
        ]

    def kv_head_counts(self) -> list[int]:
        return [
            self._attn(li).k_proj.out_features // int(self._attn(li).head_dim)
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

    def _out_proj(self, li: int) -> nn.Module:
        return self._attn(li).o_proj

    def _out_head_dim(self, li: int) -> int:
        return int(self._attn(li).head_dim)

    def _attn_module(self, li: int) -> nn.Module:
        return self._attn(li)

    def _check_removal(self, li: int, keep: list[int], partial_groups: str = "keep", **opts: Any) -> None:
        if partial_groups not in ("keep", "refuse"):
            raise ValueError(f"partial_groups must be 'keep' or 'refuse', got {partial_groups!r}")
        if partial_groups == "refuse":
            kv = self._state()["kv"][li]
            kept_groups = {kv[h] for h in keep}
            for g in kept_groups:
                members = [h for h in range(len(kv)) if kv[h] == g]
                if any(h not in keep for h in members):
                    raise ValueError(
                        f"layer {li}: removing part of KV group {g} (query heads {members}) is refused "
                        "(partial_groups='refuse'); remove all of its query heads or none"
                    )

    def _remove(self, li: int, keep: list[int], **opts: Any) -> None:
        attn = self._attn(li)
        d = int(attn.head_dim)
        state = self._state()
        kv_orig = state["kv"][li]
        groups_now = len(kv_orig) // self.kv_head_counts()[li]
        # physical KV index currently serving each query head
        phys_now = [h // groups_now for h in range(len(kv_orig))]
        new_kv_orig = [kv_orig[h] for h in keep]
        # sizes of the remaining groups, in order (queries of one KV head are contiguous)
        sizes: list[tuple[int, int]] = []  # (original kv, count)
        first_query: dict[int, int] = {}
        for pos, (h, g) in enumerate(zip(keep, new_kv_orig)):
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
        q_rows = _head_rows(keep, d, dev)
        kv_rows = _head_rows(kv_phys_keep, d, dev)
        _slice_linear_out(attn.q_proj, q_rows)
        _slice_linear_out(attn.k_proj, kv_rows)
        _slice_linear_out(attn.v_proj, kv_rows)
        _slice_linear_in(attn.o_proj, q_rows)
        attn.num_key_value_groups = new_group
        for name, value in (("num_heads", len(keep)), ("num_key_value_heads", len(kv_phys_keep))):
            if hasattr(attn, name):
                setattr(attn, name, value)
        state["kv"][li] = new_kv_orig


# ===================================================================== headbudget
class HeadBudgetAdapter(HeadAdapter):
    """headbudget's own :class:`HeadBudgetForCausalLM`; removal delegates to ``model.prune_heads``."""

    family = "headbudget"

    @property
    def num_layers(self) -> int:
        return len(self.model.transformer.h)

    def _attn(self, li: int) -> nn.Module:
        return self.model.transformer.h[li].attn

    def head_counts(self) -> list[int]:
        return [int(self._attn(li).n_heads) for li in range(self.num_layers)]

    def kv_head_counts(self) -> list[int]:
        return [int(self._attn(li).n_kv_heads) for li in range(self.num_layers)]

    def _out_proj(self, li: int) -> nn.Module:
        return self._attn(li).o_proj

    def _out_head_dim(self, li: int) -> int:
        return int(self._attn(li).v_head_dim)

    def _attn_module(self, li: int) -> nn.Module:
        return self._attn(li)

    @torch.no_grad()
    def attention_probs(self, **inputs: Any) -> list[torch.Tensor]:
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model(**inputs, output_attentions=True)
        finally:
            self.model.train(was_training)
        return list(out.attentions)

    def _check_removal(self, li: int, keep: list[int], **opts: Any) -> None:
        n = self.head_counts()[li]
        self._attn(li).plan_pruning([h for h in range(n) if h not in keep])  # raises before any change

    def _remove(self, li: int, keep: list[int], **opts: Any) -> None:
        n = self.head_counts()[li]
        self.model.prune_heads({li: [h for h in range(n) if h not in keep]})


# ===================================================================== dispatch
def _find_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    for _, mod in model.named_modules():
        layers = getattr(mod, "layer", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            att = getattr(layers[0], "attention", None)
            if att is not None and hasattr(getattr(att, "self", None), "query") and hasattr(att, "output"):
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


# ===================================================================== save / load
def save_pruned(model: nn.Module, out_dir: str | os.PathLike[str], tokenizer: Any = None) -> Path:
    """``save_pretrained`` plus ``kept_heads.json`` (original kept heads per layer, re-applied by :func:`load_pruned`).

    >>> save_pruned(model, "runs/pruned")            # then: model = load_pruned("runs/pruned")
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    adapter = get_adapter(model)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    record: dict[str, Any] = {
        "family": adapter.family,
        "architecture": type(model).__name__,
        "head_counts": adapter.head_counts(),
        "kept": {str(li): hs for li, hs in adapter.pruned_heads_record().items()},
    }
    if isinstance(adapter, LlamaAdapter):
        record["query_to_kv"] = {str(li): v for li, v in adapter.query_to_kv().items()}
        record["kv_head_counts"] = adapter.kv_head_counts()
    atomic_write_text(out / KEPT_HEADS_FILE, json.dumps(record, indent=1) + "\n")
    return out


def _load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single = path / "model.safetensors"
    if single.exists():
        return load_file(str(single))
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        sd: dict[str, torch.Tensor] = {}
        for shard in shards:
            sd.update(load_file(str(path / shard)))
        return sd
    raise FileNotFoundError(f"{path}: no model.safetensors (or sharded index) to load")


def load_pruned(model_dir: str | os.PathLike[str], dtype: torch.dtype | None = None) -> nn.Module:
    """Load a model written by :func:`save_pruned`: build it from its config, re-apply the kept heads,
    then load the (already pruned) weights.  A directory without ``kept_heads.json`` loads unpruned."""
    import transformers

    path = Path(model_dir)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json (not a saved model directory)")
    record_path = path / KEPT_HEADS_FILE
    record = json.loads(record_path.read_text()) if record_path.exists() else None
    config = transformers.AutoConfig.from_pretrained(path)
    arch = (record or {}).get("architecture") or (config.architectures or [None])[0]
    if getattr(config, "model_type", None) == "headbudget" or (record or {}).get("family") == "headbudget":
        from headbudget.models import HeadBudgetForCausalLM

        model = HeadBudgetForCausalLM.from_pretrained(path, dtype=dtype)
        if record is not None:
            model.__dict__[_STATE_ATTR] = {"kept": {int(li): list(v) for li, v in record["kept"].items()}}
        return model
    cls = getattr(transformers, arch or "", None)
    if cls is None:
        raise ValueError(f"{path}: unknown architecture {arch!r} in config/kept_heads.json")
    if record is None:
        return cls.from_pretrained(path, dtype=dtype)
    model = cls._from_config(config)
    adapter = get_adapter(model)
    try:
        adapter.prune_to({int(li): v for li, v in record["kept"].items()})
    except ValueError as exc:
        raise ValueError(f"{record_path}: {exc}") from None
    sd = _load_state_dict(path)
    result = model.load_state_dict(sd, strict=False)
    tied = set()
    tied_keys = getattr(model, "_tied_weights_keys", None) or {}
    tied.update(tied_keys if isinstance(tied_keys, (dict, list, set, tuple)) else [])
    missing = [k for k in result.missing_keys if k not in tied and not k.endswith("position_ids")]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{path}: weights do not match the pruned {arch}: missing {missing[:5]}, "
            f"unexpected {list(result.unexpected_keys)[:5]}"
        )
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    if dtype is not None:
        model.to(dtype)
    model.eval()
    return model


__all__ = [
    "BertAdapter",
    "GPT2Adapter",
    "HeadAdapter",
    "HeadBudgetAdapter",
    "KEPT_HEADS_FILE",
    "LlamaAdapter",
    "get_adapter",
    "load_pruned",
    "save_pruned",
]
