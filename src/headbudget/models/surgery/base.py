"""What every adapter shares: gating, head bookkeeping, weight norms, removal (one family per subclass in
:mod:`headbudget.models.surgery.families`); the interface the rest of the package sees is
:class:`headbudget.models.surgery.interface.HeadAdapter`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from operator import attrgetter
from typing import Any

import numpy as np
import torch
from torch import nn

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


def _rows_sq(weight: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """Squared L2 norm of ``n`` consecutive ``dim``-row blocks of a ``[out, in]`` weight."""
    w = weight.detach().float()[: n * dim]
    return (w.reshape(n, dim, -1) ** 2).sum((1, 2))


class AdapterBase:
    """Common machinery; subclasses describe one model family.

    ``layers`` is the model's stack of blocks.  Subclasses name where a block's heads live (the class
    attributes below, or overrides of the lookups that read them), and implement ``qkv_weights(li)``,
    ``kv_head_counts`` when key/value heads are grouped, and ``_remove(li, kept)`` (physical removal
    keeping current head indices ``kept``).
    """

    family: str = ""
    #: whether ``_remove(li, [])`` can take every head of a layer (the attention block then adds only its
    #: output-projection bias); the decoders refuse: their attention kernels and KV caches need a head per layer
    empty_layers: bool = False
    #: dotted paths from a block to its attention module (whose forward returns ``(output, attention_probs)``)
    #: and to its output projection (whose input is the concatenated head outputs); the attention module's
    #: attributes holding its query-head count and the per-head width of the output projection's input
    _attn_path = _out_path = _heads_attr = _dim_attr = ""

    def __init__(self, model: nn.Module, layers: nn.ModuleList) -> None:
        self.model = model
        self.layers = layers

    def _attns(self) -> list[nn.Module]:
        return [self.attention_module(li) for li in range(self.num_layers)]

    # ----------------------------------------------------------------- bookkeeping
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def head_counts(self) -> list[int]:
        """Current number of query heads in every layer."""
        return [int(getattr(a, self._heads_attr)) for a in self._attns()]

    def kv_head_counts(self) -> list[int]:
        """Current number of (physically stored) key/value heads in every layer; one per query head
        unless the family groups them."""
        return self.head_counts()

    def _state(self) -> dict[str, Any]:
        state = self.model.__dict__.get(_STATE_ATTR)
        if state is None:
            state = {"kept": {li: list(range(n)) for li, n in enumerate(self.head_counts())}}
            self.model.__dict__[_STATE_ATTR] = state
        return state

    def original_heads(self) -> dict[int, list[int]]:
        """Original (pre-pruning) indices of the heads still present, per layer."""
        return {li: list(v) for li, v in self._state()["kept"].items()}

    def pruned_heads_record(self) -> dict[int, list[int]]:
        """JSON-able ``{layer: [original kept heads]}`` (``json.dumps`` writes the keys as strings)."""
        return self.original_heads()

    # ----------------------------------------------------------------- weights
    def out_proj(self, layer: int) -> nn.Module:
        return attrgetter(self._out_path)(self.layers[layer])

    def out_head_dim(self, layer: int) -> int:
        return int(getattr(self.attention_module(layer), self._dim_attr))

    def qkv_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def out_proj_weight(self, layer: int) -> torch.Tensor:
        return self.out_proj(layer).weight

    def _stored_kv(self, layer: int) -> list[int]:
        """The stored key/value head every current query head reads (headbudget keeps unequal groups)."""
        n, n_kv = self.head_counts()[layer], self.kv_head_counts()[layer]
        kv_index = getattr(self.attention_module(layer), "kv_index", None)
        return list(kv_index) if kv_index is not None else [h // (n // n_kv) for h in range(n)]

    def kv_group(self, layer: int) -> list[int]:
        """The key/value group of every current query head: heads of one group free their key/value head
        only together.  Without grouped key/value heads every query head is its own group."""
        return self._stored_kv(layer)

    def head_weight_norms(self) -> list[np.ndarray]:
        """Per layer, every head's weight L2 norm: its query, key and value rows (for grouped-query attention
        the key/value rows of the head's group) plus its columns of the output projection."""
        out = []
        for layer, (n, n_kv) in enumerate(zip(self.head_counts(), self.kv_head_counts())):
            q, k, v = self.qkv_weights(layer)
            group = torch.tensor(self._stored_kv(layer), dtype=torch.long)
            o = self.out_proj_weight(layer).detach().float().T.contiguous()
            sq = (_rows_sq(q, n, q.shape[0] // n) + _rows_sq(k, n_kv, k.shape[0] // n_kv)[group]
                  + _rows_sq(v, n_kv, v.shape[0] // n_kv)[group] + _rows_sq(o, n, self.out_head_dim(layer)))
            out.append(torch.sqrt(sq).double().numpy())
        return out

    # ----------------------------------------------------------------- gating
    @contextlib.contextmanager
    def gate_hooks(self, gates: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
        """Multiply each head's output by the caller's own ``gates[layer][head]`` inside the block (for gates
        of shape ``(batch, heads)``, example b's by ``gates[layer][b, head]``); :meth:`gates` and
        :meth:`set_gate_values` build them for the common cases."""
        counts = self.head_counts()
        if len(gates) != self.num_layers:
            raise ValueError(f"expected gate values for {self.num_layers} layers, got {len(gates)}")
        for li, g in enumerate(gates):
            if g.dim() not in (1, 2) or g.shape[-1] != counts[li]:
                raise ValueError(f"layer {li}: gate shape {tuple(g.shape)} does not match {counts[li]} heads")
        handles = []
        for li, g in enumerate(gates):
            dim = self.out_head_dim(li)

            def pre_hook(module: nn.Module, args: tuple, _g: torch.Tensor = g, _d: int = dim) -> tuple:
                x = args[0]
                h = _g.shape[-1]
                # (H,) gates every example alike; (B, H) gates each example with its own row, so that one
                # backward pass gives every example's own gate gradient (the batched empirical Fisher)
                lead = (_g.shape[0], *([1] * (x.dim() - 2))) if _g.dim() == 2 else ()
                gx = x.view(*x.shape[:-1], h, _d) * _g.to(dtype=x.dtype, device=x.device).view(*lead, h, 1)
                return (gx.reshape(x.shape), *args[1:])

            handles.append(self.out_proj(li).register_forward_pre_hook(pre_hook))
        try:
            yield gates
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def gates(self) -> Iterator[list[torch.Tensor]]:
        """Per-layer head gates (init 1.0, ``requires_grad``) active inside the block.

        >>> from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
        >>> from headbudget.models.surgery import get_adapter
        >>> model = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", "uniform", vocab_size=64))
        >>> adapter, ids = get_adapter(model), torch.arange(8)[None]
        >>> with adapter.gates() as gates:
        ...     model(input_ids=ids, labels=ids).loss.backward()
        ...     importance = [g.grad.abs() for g in gates]
        """
        device = next(self.model.parameters()).device
        gates = [torch.ones(n, dtype=torch.float32, device=device, requires_grad=True)
                 for n in self.head_counts()]
        with self.gate_hooks(gates) as g:
            yield g

    @contextlib.contextmanager
    def set_gate_values(
        self, values: Sequence[Sequence[float] | torch.Tensor] | Mapping[int, Sequence[float] | torch.Tensor]
    ) -> Iterator[list[torch.Tensor]]:
        """Fixed gate values (no grad) inside the block; a mapping leaves unnamed layers at 1.0."""
        device = next(self.model.parameters()).device
        if isinstance(values, Mapping):
            gates = [torch.ones(n, dtype=torch.float32, device=device) for n in self.head_counts()]
            for layer, v in values.items():
                gates[_layer_key(layer, self.num_layers)] = torch.as_tensor(v, dtype=torch.float32,
                                                                            device=device).detach()
        else:
            gates = [torch.as_tensor(v, dtype=torch.float32, device=device).detach() for v in values]
        with self.gate_hooks(gates) as g:
            yield g

    # ----------------------------------------------------------------- attention probabilities
    def attention_module(self, layer: int) -> nn.Module:
        return attrgetter(self._attn_path)(self.layers[layer])

    @contextlib.contextmanager
    def eager_attention(self) -> Iterator[None]:
        configs = {id(c): c for c in (getattr(a, "config", None) for a in self._attns()) if c is not None}
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
        """Attention probabilities per layer, each ``(B, H_l, T, T)``, from one eager forward in eval mode;
        padded key columns get probability 0, padded query rows are still returned (callers cut them away)."""
        captured: list[torch.Tensor | None] = [None] * self.num_layers
        handles = []
        for li in range(self.num_layers):

            def hook(module: nn.Module, args: tuple, output: Any, _l: int = li) -> None:
                captured[_l] = output[1]

            handles.append(self.attention_module(li).register_forward_hook(hook))
        was_training = self.model.training
        self.model.eval()
        try:
            with self.eager_attention():
                self.model(**inputs)
        finally:
            for handle in handles:
                handle.remove()
            self.model.train(was_training)
        missing = [li for li, p in enumerate(captured) if p is None]
        if missing:
            raise RuntimeError(f"{self.family} adapter: no attention probabilities captured for layers "
                               f"{missing}")
        return [p for p in captured if p is not None]

    # ----------------------------------------------------------------- removal
    def _remove(self, layer: int, kept: list[int], **opts: Any) -> None:
        raise NotImplementedError

    def _check_removal(self, layer: int, kept: list[int], **opts: Any) -> None:
        """Hook for family-specific refusals (before anything is modified)."""

    def prune_heads(self, heads: Mapping[int | str, Sequence[int]], **opts: Any) -> None:
        """Physically remove heads, given as *current* indices per layer.  Everything is validated first:
        a bad layer/head or (without ``empty_layers``) a layer's last head raises ``ValueError``, nothing
        changed."""
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
            if len(remove) >= counts[li] and not self.empty_layers:
                raise ValueError(
                    f"layer {li}: cannot remove all {counts[li]} heads; every layer of a {self.family} model must "
                    "keep at least one head (only BERT-family encoders can lose a whole layer's attention)")
            kept = [h for h in range(counts[li]) if h not in remove]
            self._check_removal(li, kept, **opts)
            plan[li] = kept
        state = self._state()
        for li, kept in plan.items():
            self._remove(li, kept, **opts)
            state["kept"][li] = [state["kept"][li][h] for h in kept]

    def prune_to(self, kept: Mapping[int | str, Sequence[int]], **opts: Any) -> None:
        """Keep exactly the given *original* head indices per layer (layers not named are untouched)."""
        orig = self.original_heads()
        spec: dict[int, list[int]] = {}
        for layer, ks in kept.items():
            li = _layer_key(layer, self.num_layers)
            want = {int(h) for h in ks}
            if unknown := want - set(orig[li]):
                raise ValueError(f"layer {li}: heads {sorted(unknown)} are not present (present: {orig[li]})")
            spec[li] = [i for i, h in enumerate(orig[li]) if h not in want]
        self.prune_heads(spec, **opts)
