"""Prefill and decode speed of pruned grouped-query models: dense vs each granularity.

    python benchmarks/decode.py --contexts 512,2048,8192 --batches 1,8 --keep-ratios 0.7,0.5 \\
        --granularities head,group,balanced --new-tokens 64 --repeats 5 --prefill-batch 1 \\
        --out benchmarks/results/decode.json

SmolLM2-135M (GGUF, converted to a headbudget model by :func:`headbudget.loading.load_model_and_tokenizer`)
is scored once with a library importance (``--importance fisher`` on ``--calib-windows`` windows of the
text, or ``magnitude``), and pruned to every keep ratio at every granularity
(:func:`headbudget.pruning.granularity.apply_granularity`).  All models live in one process and are timed
*interleaved*: every repeat prefills each model in turn, then decodes one step of every model at a time
(the order rotated each repeat), so load from other processes hits all models alike; medians over repeats
are reported, every repeat's figure is kept in the JSON.

Per row (context T, batch B, model): prefill tokens/s (a ``[--prefill-batch, T]`` prompt, timed once per
context and model), greedy decode tokens/s over ``--new-tokens`` steps at batch B (the prefill cache,
repeated to B rows -- what is in the cache does not change the cost of a step), and the KV-cache bytes
measured on the cache tensors after decoding.  The goal is judged on decoding: the *expected*
speed-up is the reduction of FLOPs plus bytes moved per decoded token,
``(F_dense + M_dense) / (F_pruned + M_pruned)`` with ``F`` = forward FLOPs per token at context T
(:func:`headbudget.accounting.config_cost`) and ``M = (parameter bytes + B x T x KV-cache bytes per
token) / B`` (every weight is read once per step, every cached key/value once per row); a FLOP and a
byte count as one unit each.  ``goal_met``: measured decode speed-up >= 0.8 x expected.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

# the data folder next to the repository (../shared/data), wherever the clone is
TEXT = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "text" / "tinyshakespeare.txt")


def _cache_of(out: Any) -> Any:
    return out.past_key_values if getattr(out, "past_key_values", None) is not None else out.cache


def cache_bytes(cache: Any) -> int:
    """Bytes held by a DynamicCache's key and value tensors."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@torch.no_grad()
def run_interleaved(models: dict[str, Any], prompt: torch.Tensor, batches: list[int], new_tokens: int,
                    first: int = 0) -> dict[str, dict[str, Any]]:
    """Every model prefills ``prompt`` (batch ``B_p``; one after the other), then decodes ``new_tokens`` greedy
    steps at every batch in ``batches`` (multiples of ``B_p``) from its cache, cropped back to the prompt and
    repeated to the batch.  Decode steps are interleaved model by model (step 1 of every model, step 2 ...),
    so load from other processes falls on all models alike; ``first`` rotates who goes first."""
    labels = list(models)
    labels = labels[first % len(labels):] + labels[:first % len(labels)]
    res: dict[str, dict[str, Any]] = {}
    state: dict[str, list[Any]] = {}
    for label in labels:
        t = time.perf_counter()
        out = models[label](prompt, use_cache=True, logits_to_keep=1)
        res[label] = {"prefill_s": time.perf_counter() - t, "decode_s": {}, "cache_bytes": {}}
        state[label] = [_cache_of(out), out.logits[:, -1].argmax(-1, keepdim=True)]
    bp, length = prompt.shape[0], prompt.shape[1]
    for batch in batches:
        tokens = {}
        for label in labels:
            cache, first_token = state[label]
            extra = cache.get_seq_length() - length  # the previous batch's decoded tokens
            if extra:
                cache.crop(-extra)  # transformers 5: a negative count removes that many tokens
            if batch > cache.layers[0].keys.shape[0]:
                cache.batch_repeat_interleave(batch // cache.layers[0].keys.shape[0])
            tokens[label] = first_token.repeat_interleave(batch // bp, 0)
            res[label]["decode_s"][batch] = 0.0
        for _ in range(new_tokens):
            for label in labels:
                t = time.perf_counter()
                out = models[label](tokens[label], cache=state[label][0], use_cache=True)
                tokens[label] = out.logits[:, -1].argmax(-1, keepdim=True)
                res[label]["decode_s"][batch] += time.perf_counter() - t
                state[label][0] = _cache_of(out)
        for label in labels:
            res[label]["cache_bytes"][batch] = cache_bytes(state[label][0])
    return res


def use_index_select(model: Any) -> Any:
    """``model`` with the attention of unequal-group layers as it was before such layers attended on views of
    the cache (one SDPA call per run of equal-size groups): the whole K/V cache ``index_select``-ed to one row
    per query head on every step, then one SDPA call (the baseline).

    The forward below deliberately copies that earlier ``HeadBudgetAttention.forward`` from
    ``modeling_headbudget.py`` (same q/k/v split, rotary, cache update); only the gather differs. It is frozen
    here on purpose so the benchmark keeps measuring the old path: do not make it call the model's code."""
    import types

    import torch.nn.functional as F

    from headbudget.models.modeling_headbudget import apply_rotary

    def forward(self, x, mask, rotary=None, head_gate=None, cache=None, output_attentions=False):
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
        if self.kv_groups is not None:
            index = torch.tensor(self.kv_index, device=x.device)
            k, v = k.index_select(1, index), v.index_select(1, index)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                           scale=self.scale, enable_gqa=k.shape[1] != H)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * self.v_head_dim)), None

    for block in model.transformer.h:
        block.attn.forward = types.MethodType(forward, block.attn)
    return model


def build_models(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The dense model and one pruned copy per (granularity, keep ratio), with how each was made."""
    from headbudget.loading import load_model_and_tokenizer
    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.granularity import apply_granularity, kv_groups_of
    from headbudget.pruning.importance import ImportanceContext, prune_spec, select_top
    from headbudget.pruning.lm import lm_batches, lm_data
    from headbudget.pruning.methods import score_heads

    dense, tok = load_model_and_tokenizer(args.model, "causal", as_headbudget=True)
    dense = dense.float().eval()
    limit = int(dense.config.n_positions)  # prompt + generated tokens must fit: refuse before any timing
    if max(args.contexts) + args.new_tokens > limit:
        raise SystemExit(f"decode.py: --contexts {max(args.contexts)} + --new-tokens {args.new_tokens} exceeds the "
                         f"model's {limit} positions; use --contexts {limit - args.new_tokens} or fewer")
    adapter = get_adapter(dense)
    counts, groups = adapter.head_counts(), kv_groups_of(adapter)
    data = lm_data(tok, args.data, context=args.calib_context, calib_windows=args.calib_windows,
                   vocab_size=dense.config.vocab_size)
    ctx = ImportanceContext(adapter, dense, lm_batches(data, 1), seed=0, progress=False)
    t = time.perf_counter()
    scores = score_heads(args.importance, ctx)  # the registry's scorer of that name
    score_s = time.perf_counter() - t
    dense.eval()
    models, info = {"dense": dense}, {"dense": {"granularity": None, "keep_ratio": 1.0}}
    total = sum(counts)
    for ratio in args.keep_ratios:
        target = max(len(counts), int(round(ratio * total)))
        head_kept = select_top(scores, target)
        for gran in args.granularities:
            kept = apply_granularity(gran, scores, groups, target, kept=head_kept)
            model = copy.deepcopy(dense)
            get_adapter(model).prune_heads(prune_spec(kept, counts))
            label = f"{gran}@{ratio:g}"
            models[label] = model.eval()
            info[label] = {"granularity": gran, "keep_ratio": ratio, "target_heads": target}
            if gran == "head" and args.index_select_baseline:
                models[label + "-index_select"] = use_index_select(copy.deepcopy(model)).eval()
                info[label + "-index_select"] = dict(info[label], granularity="head (index_select, before the fix)")
    for label, model in models.items():
        specs = model.config.layer_specs()
        info[label].update(heads=sum(s["n_heads"] for s in specs), kv_heads=sum(s["n_kv_heads"] for s in specs),
                           unequal_layers=sum(s["kv_groups"] is not None for s in specs),
                           params=sum(p.numel() for p in model.parameters()))
    info["dense"]["importance"] = {"name": args.importance, "windows": int(len(data.calib)),
                                   "context": args.calib_context, "seconds": round(score_s, 2)}
    return models, info


def expected_costs(model: Any, context: int, batch: int) -> dict[str, float]:
    """FLOPs and bytes moved per decoded token at ``context`` (see the module docstring)."""
    from headbudget.accounting import config_cost, kv_cache_bytes_per_token

    dtype = next(model.parameters()).dtype
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = kv_cache_bytes_per_token(model.config, dtype)
    flops = config_cost(model.config, context).flops_per_token
    moved = (param_bytes + batch * context * kv) / batch
    return {"flops_per_token": flops, "bytes_per_decoded_token": moved, "kv_cache_bytes_per_token": kv}


def live_cache_bytes(models: dict[str, Any], context: int, batch: int, new_tokens: int) -> int:
    """KV-cache bytes alive at once in :func:`run_interleaved`: every model's cache at the largest batch
    and the full length (steps are interleaved, so all caches live together), plus one layer's copy per
    model (``DynamicCache`` concatenates a layer's keys/values on each step)."""
    from headbudget.accounting import kv_cache_bytes_per_token

    total = 0
    for model in models.values():
        per_token = kv_cache_bytes_per_token(model.config, next(model.parameters()).dtype)
        total += per_token * batch * (context + new_tokens) * (1 + 1 / model.config.n_layer)
    return int(total)


def check_memory(models: dict[str, Any], args: argparse.Namespace, available: int | None = None) -> None:
    """Refuse, in one line and before any timing, a run whose caches cannot fit in free memory (at context
    8176 and batch 8 the seven default models' caches need ~16 GB; such a run was OOM-killed after 20 min)."""
    import psutil

    need = live_cache_bytes(models, max(args.contexts), max(args.batches), args.new_tokens)
    available = psutil.virtual_memory().available if available is None else available
    if need > 0.9 * available:
        raise SystemExit(f"decode.py: the KV caches of {len(models)} models at context {max(args.contexts)} and "
                         f"batch {max(args.batches)} need {need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB is free; "
                         "give fewer --keep-ratios/--granularities per run (each run has its own dense row)")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    models, info = build_models(args)
    check_memory(models, args)
    labels = list(models)
    vocab = int(models["dense"].config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    batches = sorted(args.batches)
    if any(b % args.prefill_batch for b in batches):
        raise ValueError(f"--batches {batches} must be multiples of --prefill-batch {args.prefill_batch}")
    prompts = {c: torch.randint(0, vocab, (args.prefill_batch, c), generator=gen) for c in args.contexts}
    times: dict[tuple, list[dict[str, Any]]] = {}
    run_interleaved(models, prompts[args.contexts[0]][:, :16], batches[:1], 2)  # warm-up
    for rep in range(args.repeats):
        for c in args.contexts:
            for label, r in run_interleaved(models, prompts[c], batches, args.new_tokens, first=rep).items():
                times.setdefault((c, label), []).append(r)
        print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    results = []
    for c in args.contexts:
        for b in batches:
            base = None
            for label in labels:
                runs = times[(c, label)]
                prefill = statistics.median(args.prefill_batch * c / r["prefill_s"] for r in runs)
                decode = statistics.median(b * args.new_tokens / r["decode_s"][b] for r in runs)
                cost = expected_costs(models[label], c + args.new_tokens // 2, b)
                row = {"context": c, "batch": b, "prefill_batch": args.prefill_batch, "model": label, **info[label],
                       "prefill_tok_s": prefill, "decode_tok_s": decode,
                       "decode_tok_s_runs": [b * args.new_tokens / r["decode_s"][b] for r in runs],
                       "prefill_tok_s_runs": [args.prefill_batch * c / r["prefill_s"] for r in runs],
                       "kv_cache_bytes_measured": runs[-1]["cache_bytes"][b], **cost}
                if label == "dense":
                    base = row
                else:
                    assert base is not None
                    expected = ((base["flops_per_token"] + base["bytes_per_decoded_token"])
                                / (cost["flops_per_token"] + cost["bytes_per_decoded_token"]))
                    speedup = decode / base["decode_tok_s"]
                    row.update(prefill_speedup=prefill / base["prefill_tok_s"], decode_speedup=speedup,
                               flops_ratio=base["flops_per_token"] / cost["flops_per_token"],
                               bytes_ratio=base["bytes_per_decoded_token"] / cost["bytes_per_decoded_token"],
                               expected_decode_speedup=expected, goal_met=speedup >= 0.8 * expected)
                results.append(row)
    return {"model": args.model, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "new_tokens": args.new_tokens, "repeats": args.repeats, "contexts": args.contexts,
            "batches": batches, "prefill_batch": args.prefill_batch, "importance": info["dense"].get(
                "importance"), "rows": results}


def table(summary: dict[str, Any]) -> str:
    head = ("| T | B | model | heads | kv heads | unequal layers | KV B/token | prefill tok/s | decode tok/s | "
            "decode x | expected x | 0.8 goal |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in summary["rows"]:
        speed = r.get("decode_speedup")
        lines.append(
            f"| {r['context']} | {r['batch']} | {r['model']} | {r['heads']} | {r['kv_heads']} | {r['unequal_layers']} "
            f"| {r['kv_cache_bytes_per_token']:,} | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.1f} | "
            + (f"{speed:.3f} | {r['expected_decode_speedup']:.3f} | {'yes' if r['goal_met'] else 'NO'} |"
               if speed is not None else "1 | 1 | – |"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x]

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True,
                   help="a causal LM (GGUF file or folder), e.g. SmolLM2-135M-Instruct unpacked from its wheel")
    p.add_argument("--data", default=TEXT, help="text for the calibration windows of the importance")
    p.add_argument("--importance", choices=("fisher", "magnitude"), default="fisher")
    p.add_argument("--calib-windows", type=int, default=4)
    p.add_argument("--calib-context", type=int, default=128)
    p.add_argument("--keep-ratios", type=lambda s: [float(x) for x in s.split(",")], default=[0.7, 0.5])
    p.add_argument("--granularities", type=lambda s: s.split(","), default=["head", "group", "balanced"])
    p.add_argument("--contexts", type=ints, default=[512, 2048, 8192])
    p.add_argument("--batches", type=ints, default=[1, 8])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prefill-batch", type=int, default=1,
                   help="batch of the timed prefill, once per context and model; every decode batch starts from "
                        "its cache repeated to that batch (what is cached does not change the cost of a step)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--index-select-baseline", action="store_true",
                   help="also time every head-granularity model with the attention before the fix (the whole "
                        "K/V cache index_select-ed per step in unequal-group layers)")
    p.add_argument("--out", default="benchmarks/results/decode.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    summary = measure(args)
    from headbudget.io import atomic_write_text

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(summary, indent=1) + "\n")
    print(table(summary))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
