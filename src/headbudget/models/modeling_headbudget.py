"""A decoder whose attention layout is chosen per layer: the headbudget model. Imports torch and transformers only.

Every layer has its own query heads, key/value heads, head widths and (after pruning a grouped-query model)
unequal query groups; block options make it GPT-2 (the default) or Llama/Mistral/Qwen2.  The fast path is
``scaled_dot_product_attention``; ``output_attentions=True`` uses an explicit softmax (same logits).
This file, ``configuration_headbudget.py`` and ``rotary_headbudget.py`` are copied next to every saved
checkpoint: it opens with ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` anywhere.

    >>> from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    >>> model = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", "prism", vocab_size=300))
    >>> model(torch.randint(0, 300, (2, 16))).logits.shape
    torch.Size([2, 16, 300])
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_headbudget import HeadBudgetConfig
from .rotary_headbudget import rope_problem, rotary_inv_freq

try:  # transformers >= 5 tracks which tensors were initialised (so loading does not re-init them)
    from transformers import initialization as init
except ImportError:  # pragma: no cover
    from torch.nn import init

# transformers 5 renamed the cache argument/field from ``past_key_values`` to ``cache``.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

HeadMask = torch.Tensor | Sequence[torch.Tensor | None] | None

#: the files ``save_pretrained`` copies into every saved folder (this one imports the other two)
CODE_FILES = ("configuration_headbudget.py", "modeling_headbudget.py", "rotary_headbudget.py")


# ----------------------------------------------------------------------------- norms and positions
class HeadBudgetRMSNorm(nn.Module):
    """RMSNorm computed in float32, as Llama's (so converted models give identical logits)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def make_norm(config: HeadBudgetConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return HeadBudgetRMSNorm(config.n_embd, config.layer_norm_epsilon)
    return nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q and k (B, heads, T, dim) by position; cos/sin are (B, T, dim)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# ----------------------------------------------------------------------------- attention
class HeadBudgetAttention(nn.Module):
    """Causal self-attention for one layer, shaped by its schedule entry.  One fused projection gives rows
    ``[q heads | k heads | v heads]``; query heads are stored grouped by their key/value head, and
    ``kv_index[h]`` names the key/value head of query head ``h`` (unequal groups need no weight copies)."""

    def __init__(self, config: HeadBudgetConfig, layer_idx: int) -> None:
        super().__init__()
        spec = config.layer_specs()[layer_idx]
        self.layer_idx, self.rotary = layer_idx, config.position == "rotary"
        self._set_spec(spec)
        self.qkv_proj = nn.Linear(config.n_embd, sum(self.split_sizes), bias=config.qkv_bias)
        self.o_proj = nn.Linear(spec["n_heads"] * spec["v_head_dim"], config.n_embd, bias=config.o_bias)
        self.attn_dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def _set_spec(self, spec: dict) -> None:
        self.n_heads, self.head_dim, self.n_kv_heads = spec["n_heads"], spec["head_dim"], spec["n_kv_heads"]
        self.qk_head_dim, self.v_head_dim = spec["qk_head_dim"], spec["v_head_dim"]
        self.kv_groups = spec["kv_groups"]  # None: every kv head serves n_heads // n_kv_heads queries
        sizes = self.kv_groups or [self.n_heads // self.n_kv_heads] * self.n_kv_heads
        self.kv_index = [g for g, size in enumerate(sizes) for _ in range(size)]  # query head -> kv head
        # Unequal groups run as one grouped-query SDPA call per run of consecutive equal-size groups:
        # (first query head, first kv head, kv heads, queries per kv head).  A run of q and of the cache is a
        # view, so a decode step never copies the cache (index_select per query head made decoding slow).
        self.kv_runs: list[tuple[int, int, int, int]] = []
        q0 = g0 = 0
        for size, run in itertools.groupby(sizes):
            n = len(list(run))
            self.kv_runs.append((q0, g0, n, size))
            q0, g0 = q0 + n * size, g0 + n
        self.split_sizes = (self.n_heads * self.qk_head_dim, self.n_kv_heads * self.qk_head_dim,
                            self.n_kv_heads * self.v_head_dim)
        # The scale follows the nominal head_dim, so low-rank q/k keep the original logit scale.
        self.scale = 1.0 / math.sqrt(spec["head_dim"])

    @property
    def spec(self) -> dict:
        keys = ("n_heads", "head_dim", "n_kv_heads", "qk_head_dim", "v_head_dim", "kv_groups")
        return {k: getattr(self, k) for k in keys}

    def forward(self, x, mask, rotary=None, head_gate=None, cache: Cache | None = None, output_attentions=False):
        B, T, _ = x.shape
        H, KV = self.n_heads, self.n_kv_heads
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(B, T, H, self.qk_head_dim).transpose(1, 2)
        k = k.view(B, T, KV, self.qk_head_dim).transpose(1, 2)
        v = v.view(B, T, KV, self.v_head_dim).transpose(1, 2)
        if rotary is not None:
            q, k = apply_rotary(q, k, *rotary)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if output_attentions and KV != H:  # the explicit softmax below needs one kv row per query head
            index = torch.tensor(self.kv_index, device=x.device)
            k, v = k.index_select(1, index), v.index_select(1, index)
        # mask is None => plain causal attention over keys == queries (no cache prefix, no padding).
        is_causal = mask is None and T > 1
        dropout = self.attn_dropout if self.training else 0.0
        probs = None
        if output_attentions:
            scores = (q @ k.transpose(-2, -1)) * self.scale
            allowed = mask if mask is not None else torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")).float(), dim=-1).to(q.dtype)
            y = F.dropout(probs, dropout, self.training) @ v
        elif self.kv_groups is None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
                                               scale=self.scale, enable_gqa=k.shape[1] != H)
        else:  # unequal groups: one call per run of equal groups, on views of q and of the cache
            y = torch.cat([
                F.scaled_dot_product_attention(
                    q[:, q0:q0 + n * size], k[:, g0:g0 + n], v[:, g0:g0 + n], attn_mask=mask, dropout_p=dropout,
                    is_causal=is_causal, scale=self.scale, enable_gqa=size > 1)
                for q0, g0, n, size in self.kv_runs], dim=1)
        if head_gate is not None:  # gate each head's output: zero == the head removed
            y = y * head_gate.to(y.dtype).view(1, H, 1, 1)
        y = y.transpose(1, 2).reshape(B, T, H * self.v_head_dim)
        return self.resid_dropout(self.o_proj(y)), probs

    # -- weight surgery: every pruning and compression goes through these two methods -------------
    def projections(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """``{"q"|"k"|"v"|"o": (weight, bias)}``; q/k/v weights are (heads*width, d), o is (d, heads*v_width)."""
        w = self.qkv_proj.weight.split(self.split_sizes)
        b = self.qkv_proj.bias.split(self.split_sizes) if self.qkv_proj.bias is not None else (None,) * 3
        return {"q": (w[0], b[0]), "k": (w[1], b[1]), "v": (w[2], b[2]), "o": (self.o_proj.weight, self.o_proj.bias)}

    @torch.no_grad()
    def set_projections(self, spec: dict, q, k, v, o) -> None:
        """Replace the weights with a new layout ``spec``; q/k/v/o are (weight, bias) pairs."""
        self._set_spec(spec)
        ref = self.qkv_proj.weight
        weight = torch.cat([q[0], k[0], v[0]])
        if tuple(weight.shape) != (sum(self.split_sizes), ref.shape[1]):
            raise ValueError(f"layer {self.layer_idx}: q/k/v weights {tuple(weight.shape)} do not fit {spec}")
        self.qkv_proj = nn.Linear(ref.shape[1], weight.shape[0], bias=q[1] is not None).to(ref)
        self.qkv_proj.weight.copy_(weight)
        if q[1] is not None:
            self.qkv_proj.bias.copy_(torch.cat([q[1], k[1], v[1]]))
        self.o_proj = nn.Linear(o[0].shape[1], o[0].shape[0], bias=o[1] is not None).to(ref)
        self.o_proj.weight.copy_(o[0])
        if o[1] is not None:
            self.o_proj.bias.copy_(o[1])

    def plan_pruning(self, heads: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """Check a removal; return (query heads kept, kv heads kept, new group sizes). Raises on bad input."""
        heads = sorted({int(h) for h in heads})
        for h in heads:
            if not 0 <= h < self.n_heads:
                raise ValueError(f"layer {self.layer_idx}: head {h} out of range (layer has {self.n_heads})")
        keep = [h for h in range(self.n_heads) if h not in heads]
        if not keep:
            raise ValueError(f"layer {self.layer_idx}: refusing to remove all {self.n_heads} heads "
                             "(a layer keeps at least one)")
        kv_keep = sorted({self.kv_index[h] for h in keep})  # a kv head goes only with all its queries
        groups = [sum(1 for h in keep if self.kv_index[h] == g) for g in kv_keep]
        return keep, kv_keep, groups

    @torch.no_grad()
    def prune(self, heads: Sequence[int]) -> None:
        """Remove query heads (and any key/value head left without queries) in place."""
        keep, kv_keep, groups = self.plan_pruning(heads)
        p = self.projections()

        def rows(wb, idx, dim):  # heads idx of a (weight, bias) pair
            return tuple(None if t is None else t.view(-1, dim, *t.shape[1:])[idx].flatten(0, 1) for t in wb)

        dq, dv = self.qk_head_dim, self.v_head_dim
        o_w = self.o_proj.weight.view(-1, self.n_heads, dv)[:, keep].flatten(1)
        spec = dict(self.spec, n_heads=len(keep), n_kv_heads=len(kv_keep),
                    kv_groups=groups if len(set(groups)) > 1 else None)
        self.set_projections(spec, rows(p["q"], keep, dq), rows(p["k"], kv_keep, dq),
                             rows(p["v"], kv_keep, dv), (o_w, p["o"][1]))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Checkpoints written before q/k/v were fused store them separately: fuse on load.
        for t in ("weight", "bias"):
            parts = [prefix + f"{p}_proj.{t}" for p in "qkv"]
            if all(n in state_dict for n in parts):
                state_dict[prefix + f"qkv_proj.{t}"] = torch.cat([state_dict.pop(n) for n in parts])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


# ----------------------------------------------------------------------------- MLP and block
class HeadBudgetMLP(nn.Module):
    """GPT-2's 4x GELU MLP (``mlp="gelu"``) or Llama's gated SiLU MLP (``mlp="gated_silu"``)."""

    def __init__(self, config: HeadBudgetConfig, layer_idx: int) -> None:
        super().__init__()
        d, hidden, bias = config.n_embd, config.intermediate_sizes()[layer_idx], config.mlp_bias
        self.gated = config.mlp == "gated_silu"
        if self.gated:
            self.gate_proj = nn.Linear(d, hidden, bias=bias)
            self.up_proj = nn.Linear(d, hidden, bias=bias)
            self.down_proj = nn.Linear(hidden, d, bias=bias)
        else:
            self.c_fc = nn.Linear(d, hidden, bias=bias)
            self.c_proj = nn.Linear(hidden, d, bias=bias)
        self.dropout = nn.Dropout(config.dropout)
        # GPT-2's tanh approximation ("gelu_new", the default) gives GPT-2 weights identical logits; "gelu" is
        # the exact erf GELU (BERT, nanoGPT), cheaper on CPU.
        self.gelu_approximate = "none" if config.hidden_act == "gelu" else "tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate=self.gelu_approximate)))

    @property
    def out_proj(self) -> nn.Linear:
        return self.down_proj if self.gated else self.c_proj


class HeadBudgetBlock(nn.Module):
    def __init__(self, config: HeadBudgetConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = HeadBudgetAttention(config, layer_idx)
        self.ln_2 = make_norm(config)
        self.mlp = HeadBudgetMLP(config, layer_idx)

    def forward(self, x, mask, rotary=None, head_gate=None, cache=None, output_attentions=False):
        a, probs = self.attn(self.ln_1(x), mask, rotary, head_gate, cache, output_attentions)
        x = x + a
        return x + self.mlp(self.ln_2(x)), probs


# ----------------------------------------------------------------------------- the model
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
            init.normal_(module.out_proj.weight, mean=0.0, std=std)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save as usual, plus the model's code files, so the folder opens without headbudget."""
        super().save_pretrained(save_directory, *args, **kwargs)
        here = os.path.dirname(os.path.abspath(__file__))
        for name in CODE_FILES:
            shutil.copyfile(os.path.join(here, name), os.path.join(save_directory, name))


class HeadBudgetModel(HeadBudgetPreTrainedModel):
    """The decoder stack without the LM head (``model.transformer``)."""

    def __init__(self, config: HeadBudgetConfig) -> None:
        super().__init__(config)
        if config.position == "rotary" and (problem := rope_problem(config.rope_parameters)):
            raise ValueError(problem)  # refused here, not at the first forward
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        if config.position == "learned":
            self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(HeadBudgetBlock(config, i) for i in range(config.n_layer))
        self.ln_f = make_norm(config)
        self._rope: dict[int, tuple[torch.Tensor, float]] = {}  # head_dim -> (inv_freq, scaling), built lazily
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.wte = value

    def _rotary(self, head_dim: int, position_ids: torch.Tensor, dtype: torch.dtype):
        if head_dim not in self._rope:
            self._rope[head_dim] = rotary_inv_freq(self.config, head_dim)
        inv_freq, scaling = self._rope[head_dim]
        freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)

    def _gates(self, head_mask: HeadMask) -> list[torch.Tensor | None]:
        if head_mask is None:
            return [None] * len(self.h)
        if len(head_mask) != len(self.h):
            raise ValueError(f"head_mask has {len(head_mask)} rows but the model has {len(self.h)} layers")
        heads = [block.attn.n_heads for block in self.h]
        for i, (row, n) in enumerate(zip(head_mask, heads)):
            if row is not None and row.shape[-1] < n:
                raise ValueError(f"layer {i}: head_mask has {row.shape[-1]} entries for {n} heads")
        return [None if row is None else row[..., :n] for row, n in zip(head_mask, heads)]  # rows are padded

    def forward(self, input_ids, attention_mask=None, position_ids=None, head_mask: HeadMask = None,
                cache: Cache | None = None, use_cache: bool = False, output_attentions: bool = False):
        B, T = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        span = int(position_ids.max()) + 1 if position_ids is not None else past + T
        if span > self.config.n_positions:
            raise ValueError(f"sequence length {span} exceeds n_positions={self.config.n_positions}")
        if use_cache and cache is None:
            cache = DynamicCache()
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=input_ids.device).unsqueeze(0)
        x = self.wte(input_ids)
        if self.config.position == "learned":
            x = x + self.wpe(position_ids)
        x = self.drop(x)
        rotary = {}
        if self.config.position == "rotary":
            pos = position_ids.expand(B, T)
            rotary = {d: self._rotary(d, pos, x.dtype) for d in {b.attn.qk_head_dim for b in self.h}}
        mask = self._mask(attention_mask, B, T, past, input_ids.device, self.config.attention_window)
        cache = cache if use_cache else None
        all_probs = []
        for block, gate in zip(self.h, self._gates(head_mask)):
            x, probs = block(x, mask, rotary.get(block.attn.qk_head_dim), gate, cache, output_attentions)
            all_probs.append(probs)
        return self.ln_f(x), cache, (tuple(all_probs) if output_attentions else None)

    @staticmethod
    def _mask(attention_mask, B, T, past, device, window=None) -> torch.Tensor | None:
        """Boolean (B, 1, T, past+T) mask, or None for the plain causal case (fast SDPA path).  A 4-D
        ``attention_mask`` (boolean, or additive floats: 0 = attend) is taken as it is (e.g. a token tree)."""
        if attention_mask is not None and attention_mask.dim() == 4:
            if attention_mask.dtype == torch.bool:
                return attention_mask
            return attention_mask > torch.finfo(attention_mask.dtype).min / 2
        S = past + T
        if past == 0 and (attention_mask is None or bool(attention_mask.all())) and (window is None or S <= window):
            return None
        q_pos = torch.arange(past, S, device=device).view(T, 1)
        k_pos = torch.arange(S, device=device).view(1, S)
        allowed = k_pos <= q_pos  # (T, S) causal with cache offset
        if window is not None:  # sliding-window attention (Mistral): the last `window` positions
            allowed = allowed & (q_pos - k_pos < window)
        allowed = allowed.view(1, 1, T, S).expand(B, 1, T, S)
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, -S:].bool().view(B, 1, 1, S)
            # A padding query would otherwise attend to nothing (NaN): let it see itself.
            allowed = allowed | (k_pos.view(1, 1, 1, S) == q_pos.view(1, 1, T, 1))
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

    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None, head_mask: HeadMask = None,
                cache: Cache | None = None, past_key_values: Cache | None = None, use_cache: bool | None = None,
                output_attentions: bool = False, return_dict: bool = True, logits_to_keep: int = 0, **kwargs):
        """Logits (and mean next-token loss when ``labels`` is given; labels are shifted inside, -100 ignored)."""
        cache = cache if cache is not None else past_key_values
        use_cache = bool(use_cache if use_cache is not None else (cache is not None))
        hidden, cache, attentions = self.transformer(input_ids, attention_mask, position_ids, head_mask,
                                                     cache, use_cache, output_attentions)
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

    def sync_schedule(self) -> None:
        """Write every layer's current attention layout back into ``config.schedule`` (after surgery)."""
        from .configuration_headbudget import _compact

        layers = [_compact(block.attn.spec) for block in self.transformer.h]
        neutral = all(s["n_heads"] * s["head_dim"] == self.config.n_embd for s in layers) and \
            self.config.schedule.get("neutral", True)
        # The attention budget before the first surgery, so a pruned profile can be re-widened to it.
        dense = self.config.schedule.get("dense_budget") or sum(
            s["n_heads"] * s["head_dim"] for s in self.config.schedule["layers"])
        self.config.schedule = dict(self.config.schedule, layers=layers, neutral=neutral, dense_budget=dense)
        self.config.num_attention_heads = max(s["n_heads"] for s in layers)
        self.config.num_key_value_heads = max(s["n_kv_heads"] for s in layers)

    def prune_heads(self, heads_to_prune: dict[int, Sequence[int]]) -> None:
        """Physically remove heads ``{layer: [current head, ...]}``; all layers are checked before any
        changes, and ``config.schedule`` follows so ``save_pretrained``/``from_pretrained`` round-trip it."""
        blocks = self.transformer.h
        for layer, heads in heads_to_prune.items():
            if not 0 <= int(layer) < len(blocks):
                raise ValueError(f"layer {layer} out of range (model has {len(blocks)} layers)")
            blocks[int(layer)].attn.plan_pruning(heads)
        for layer, heads in heads_to_prune.items():
            if heads:
                blocks[int(layer)].attn.prune(heads)
        self.sync_schedule()
