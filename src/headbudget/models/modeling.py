"""A GPT-2-style decoder whose attention layout comes from a per-layer :class:`HeadSchedule`.

Pre-LayerNorm blocks, 4x GELU MLP, learned positions, tied embeddings; every layer's q/k/v/o
projections are sized from its schedule entry (heads, head widths, key/value heads).  The fast
path is ``scaled_dot_product_attention``; ``output_attentions=True`` switches to an explicit
softmax that returns the probabilities (same logits, tested).

    >>> from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    >>> model = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", "prism", vocab_size=300))
    >>> model(torch.randint(0, 300, (2, 16))).logits.shape
    torch.Size([2, 16, 300])
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from headbudget.models.config import HeadBudgetConfig
from headbudget.schedules import LayerSpec

try:  # transformers >= 5 tracks which tensors were initialised (so loading does not re-init them)
    from transformers import initialization as init
except ImportError:  # pragma: no cover
    from torch.nn import init

# transformers 5 renamed the cache argument/field from ``past_key_values`` to ``cache``.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

HeadMask = torch.Tensor | Sequence[torch.Tensor | None] | None


class HeadBudgetAttention(nn.Module):
    """Causal self-attention for one layer, shaped by its :class:`LayerSpec`."""

    def __init__(self, config: HeadBudgetConfig, layer_idx: int) -> None:
        super().__init__()
        spec = config.head_schedule[layer_idx]
        self.layer_idx = layer_idx
        d = config.n_embd
        self.q_proj = nn.Linear(d, spec.n_heads * spec.qk_head_dim, bias=config.bias)
        self.k_proj = nn.Linear(d, spec.n_kv_heads * spec.qk_head_dim, bias=config.bias)
        self.v_proj = nn.Linear(d, spec.n_kv_heads * spec.v_head_dim, bias=config.bias)
        self.o_proj = nn.Linear(spec.n_heads * spec.v_head_dim, d, bias=config.bias)
        self.attn_dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self._set_spec(spec)

    def _set_spec(self, spec: LayerSpec) -> None:
        self.n_heads, self.head_dim, self.n_kv_heads = spec.n_heads, spec.head_dim, spec.n_kv_heads
        self.qk_head_dim, self.v_head_dim = spec.qk_head_dim, spec.v_head_dim
        # The scale follows the nominal head_dim, so low-rank q/k keep the original logit scale.
        self.scale = 1.0 / math.sqrt(spec.head_dim)

    @property
    def spec(self) -> LayerSpec:
        return LayerSpec(self.n_heads, self.head_dim, self.n_kv_heads, self.qk_head_dim, self.v_head_dim)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        head_gate: torch.Tensor | None = None,
        cache: Cache | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, _ = x.shape
        H, KV = self.n_heads, self.n_kv_heads
        q = self.q_proj(x).view(B, T, H, self.qk_head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, KV, self.qk_head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, KV, self.v_head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        # mask is None => plain causal attention over keys == queries (no cache prefix, no padding).
        is_causal = mask is None and T > 1
        dropout = self.attn_dropout if self.training else 0.0
        probs = None
        if output_attentions:
            if KV != H:
                k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
            scores = (q @ k.transpose(-2, -1)) * self.scale
            allowed = mask if mask is not None else torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            y = F.dropout(probs, dropout, self.training) @ v
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, scale=self.scale,
                enable_gqa=KV != H,
            )
        if head_gate is not None:  # gate each head's output: zero == the head removed
            y = y * head_gate.to(y.dtype).view(1, H, 1, 1)
        y = y.transpose(1, 2).reshape(B, T, H * self.v_head_dim)
        return self.resid_dropout(self.o_proj(y)), probs

    def plan_pruning(self, heads: Sequence[int]) -> tuple[list[int], list[int]]:
        """Check a removal and return (query heads kept, key/value heads kept); raises on bad input."""
        heads = sorted({int(h) for h in heads})
        for h in heads:
            if not 0 <= h < self.n_heads:
                raise ValueError(f"layer {self.layer_idx}: head {h} out of range (layer has {self.n_heads})")
        keep = [h for h in range(self.n_heads) if h not in heads]
        if not keep:
            raise ValueError(
                f"layer {self.layer_idx}: refusing to remove all {self.n_heads} heads (a layer keeps at least one)"
            )
        group = self.n_heads // self.n_kv_heads
        kv_keep = sorted({h // group for h in keep})
        # Equal group sizes keep grouped-query attention a plain repeat; uneven groups would need an index map.
        sizes = {sum(1 for h in keep if h // group == g) for g in kv_keep}
        if len(sizes) > 1:
            raise ValueError(
                f"layer {self.layer_idx}: removing heads {heads} leaves key/value groups of unequal size "
                f"({group} query heads per kv head); remove whole groups or the same number from each"
            )
        return keep, kv_keep

    @torch.no_grad()
    def prune(self, heads: Sequence[int]) -> None:
        """Remove query heads (and any key/value head left without queries) in place."""
        keep, kv_keep = self.plan_pruning(heads)

        def rows(idx: list[int], width: int) -> torch.Tensor:
            return torch.cat([torch.arange(i * width, (i + 1) * width) for i in idx])

        def slice_out(lin: nn.Linear, index: torch.Tensor) -> nn.Linear:
            new = nn.Linear(lin.in_features, len(index), bias=lin.bias is not None).to(lin.weight)
            new.weight.copy_(lin.weight[index])
            if lin.bias is not None:
                new.bias.copy_(lin.bias[index])
            return new

        self.q_proj = slice_out(self.q_proj, rows(keep, self.qk_head_dim))
        self.k_proj = slice_out(self.k_proj, rows(kv_keep, self.qk_head_dim))
        self.v_proj = slice_out(self.v_proj, rows(kv_keep, self.v_head_dim))
        cols = rows(keep, self.v_head_dim)
        o = nn.Linear(len(cols), self.o_proj.out_features, bias=self.o_proj.bias is not None).to(self.o_proj.weight)
        o.weight.copy_(self.o_proj.weight[:, cols])
        if self.o_proj.bias is not None:
            o.bias.copy_(self.o_proj.bias)
        self.o_proj = o
        self._set_spec(LayerSpec(len(keep), self.head_dim, len(kv_keep), self.qk_head_dim, self.v_head_dim))


class HeadBudgetMLP(nn.Module):
    def __init__(self, config: HeadBudgetConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # tanh approximation, as GPT-2 ("gelu_new"), so GPT-2 weights give identical logits.
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class HeadBudgetBlock(nn.Module):
    def __init__(self, config: HeadBudgetConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias)
        self.attn = HeadBudgetAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias)
        self.mlp = HeadBudgetMLP(config)

    def forward(self, x, mask, head_gate=None, cache=None, output_attentions=False):
        a, probs = self.attn(self.ln_1(x), mask, head_gate, cache, output_attentions)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x, probs


class HeadBudgetPreTrainedModel(PreTrainedModel):
    config_class = HeadBudgetConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["HeadBudgetBlock"]
    _supports_sdpa = True
    supports_gradient_checkpointing = False

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        # GPT-2's scaled init of the two residual projections per block.
        std = self.config.initializer_range / math.sqrt(2 * self.config.n_layer)
        if isinstance(module, HeadBudgetAttention):
            init.normal_(module.o_proj.weight, mean=0.0, std=std)
        elif isinstance(module, HeadBudgetMLP):
            init.normal_(module.c_proj.weight, mean=0.0, std=std)


class HeadBudgetModel(HeadBudgetPreTrainedModel):
    """The decoder stack without the LM head (``model.transformer``)."""

    def __init__(self, config: HeadBudgetConfig) -> None:
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(HeadBudgetBlock(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.wte = value

    def _gates(self, head_mask: HeadMask) -> list[torch.Tensor | None]:
        if head_mask is None:
            return [None] * len(self.h)
        if len(head_mask) != len(self.h):
            raise ValueError(f"head_mask has {len(head_mask)} rows but the model has {len(self.h)} layers")
        gates = []
        for i, (row, block) in enumerate(zip(head_mask, self.h)):
            n = block.attn.n_heads
            if row is not None and row.shape[-1] < n:
                raise ValueError(f"layer {i}: head_mask has {row.shape[-1]} entries for {n} heads")
            gates.append(None if row is None else row[..., :n])  # (L, max_heads) tensors are padded
        return gates

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        head_mask: HeadMask = None,
        cache: Cache | None = None,
        use_cache: bool = False,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, Cache | None, tuple[torch.Tensor, ...] | None]:
        B, T = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        if past + T > self.config.n_positions:
            raise ValueError(f"sequence length {past + T} exceeds n_positions={self.config.n_positions}")
        if use_cache and cache is None:
            cache = DynamicCache()
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=input_ids.device).unsqueeze(0)
        x = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        mask = self._mask(attention_mask, B, T, past, input_ids.device)
        all_probs = [] if output_attentions else None
        for block, gate in zip(self.h, self._gates(head_mask)):
            x, probs = block(x, mask, gate, cache if use_cache else None, output_attentions)
            if output_attentions:
                all_probs.append(probs)
        x = self.ln_f(x)
        return x, (cache if use_cache else None), (tuple(all_probs) if output_attentions else None)

    @staticmethod
    def _mask(attention_mask, B, T, past, device) -> torch.Tensor | None:
        """Boolean (B, 1, T, past+T) mask, or None for the plain causal case (fast SDPA path)."""
        if past == 0 and (attention_mask is None or bool(attention_mask.all())):
            return None
        S = past + T
        q_pos = torch.arange(past, S, device=device).view(T, 1)
        allowed = torch.arange(S, device=device).view(1, S) <= q_pos  # (T, S) causal with cache offset
        allowed = allowed.view(1, 1, T, S).expand(B, 1, T, S)
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, -S:].bool().view(B, 1, 1, S)
            # A padding query would otherwise attend to nothing (NaN): let it see itself.
            allowed = allowed | (torch.arange(S, device=device).view(1, 1, 1, S) == q_pos.view(1, 1, T, 1))
        return allowed


class HeadBudgetForCausalLM(HeadBudgetPreTrainedModel, GenerationMixin):
    """Causal language model over :class:`HeadBudgetModel`, with ``generate()`` and a KV cache."""

    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config: HeadBudgetConfig) -> None:
        super().__init__(config)
        self.transformer = HeadBudgetModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new: nn.Linear) -> None:
        self.lm_head = new

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        head_mask: HeadMask = None,
        cache: Cache | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        output_attentions: bool = False,
        return_dict: bool = True,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits (and mean next-token loss when ``labels`` is given; labels are shifted inside, -100 ignored)."""
        cache = cache if cache is not None else past_key_values
        use_cache = bool(use_cache if use_cache is not None else (cache is not None))
        hidden, cache, attentions = self.transformer(
            input_ids, attention_mask, position_ids, head_mask, cache, use_cache, output_attentions
        )
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            # Shift the labels, not the logits: slicing the (B, T, V) logits would copy them.
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, attentions=attentions, **{_CACHE_FIELD: cache})

    @property
    def head_counts(self) -> list[int]:
        return [block.attn.n_heads for block in self.transformer.h]

    def prune_heads(self, heads_to_prune: dict[int, Sequence[int]]) -> None:
        """Physically remove heads ``{layer: [head, ...]}`` (indices into the layer's current heads).

        The schedule in ``config`` is updated (``neutral=False``) so ``save_pretrained``/``from_pretrained``
        round-trip the pruned model.  All layers are checked before any is changed.
        """
        blocks = self.transformer.h
        for layer, heads in heads_to_prune.items():
            if not 0 <= int(layer) < len(blocks):
                raise ValueError(f"layer {layer} out of range (model has {len(blocks)} layers)")
            blocks[int(layer)].attn.plan_pruning(heads)
        for layer, heads in heads_to_prune.items():
            if heads:
                blocks[int(layer)].attn.prune(heads)
        sched = self.config.head_schedule
        self.config.set_schedule(sched.with_layers([b.attn.spec for b in blocks], neutral=False))
