"""Compress a trained model (SVD or K/V grouping) at a per-layer allocation, and measure what it costs.

    >>> from headbudget.compression.pipeline import compress_model
    >>> from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    >>> m = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", "uniform", vocab_size=64))
    >>> small, info = compress_model(m, "svd", keep_ratio=0.5, allocation="later_layers_first")
    >>> info["qk_ranks"], info["kept_fraction"]
    ([24, 19, 13, 8], 0.5)

``compress_model`` never changes its input (it works on a deep copy); ``run_compress`` is the engine of
``headbudget compress`` (see docs/allocation.md).
"""

from __future__ import annotations

import copy
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headbudget.compression.allocation import ALLOCATIONS, allocate, divisors
from headbudget.compression.grouping import adjacent_groups, check_groups, group_heads
from headbudget.compression.job import CompressJob, check_compress_job, read_groups
from headbudget.compression.svd import CompressionError, rotary_reason, svd_compress
from headbudget.devices import resolve_device, resolve_dtype
from headbudget.io import atomic_write_dir, atomic_write_json, new_figure, read_text, save_figure
from headbudget.progress import ProgressBar, quiet_unless_progress
from headbudget.threads import torch_threads

METHODS = ("svd", "group", "merge-kv")  # merge-kv: headbudget.compression.merge_kv (needs calibration)
HELDOUT_SEED = 1_000_003  # synthetic evaluation text: a seed no training config uses


def attention_parameters(model: nn.Module) -> list[int]:
    """Parameters of q/k/v/o (weights and biases) per layer, counted from the modules."""
    return [sum(p.numel() for lin in (b.attn.qkv_proj, b.attn.o_proj) for p in lin.parameters())
            for b in model.transformer.h]


def layer_table(model: nn.Module) -> list[dict[str, int]]:
    """Per-layer layout: heads, kv heads, head_dim, qk/v widths, attention params."""
    attns = [b.attn for b in model.transformer.h]
    return [{"layer": i, "n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads, "head_dim": a.head_dim,
             "qk_head_dim": a.qk_head_dim, "v_head_dim": a.v_head_dim, "attention_params": n}
            for i, (a, n) in enumerate(zip(attns, attention_parameters(model)))]


def _require_headbudget(model: nn.Module) -> None:
    if not hasattr(model, "transformer") or not hasattr(model.transformer, "h") or \
            not all(hasattr(b.attn, "qkv_proj") for b in model.transformer.h):
        raise CompressionError(f"{type(model).__name__} is not a headbudget model; open it with "
                               "headbudget.loading.load_model(path, as_headbudget=True)")


def compress_model(
    model: nn.Module, method: str, keep_ratio: float = 0.5, allocation: str = "uniform", *,
    groups: Sequence[Sequence[Sequence[int]] | None] | dict[int, Sequence[Sequence[int]]] | None = None,
    strength: float = 0.5, progress: bool = False,
) -> tuple[nn.Module, dict[str, Any]]:
    """A compressed deep copy of ``model`` and a description of what was kept.  ``svd`` allocates per-layer
    ranks with ``sum_l n_heads_l * rank_l = keep_ratio * sum_l n_heads_l * head_dim_l``; ``group`` keeps
    ``keep_ratio`` of the K/V heads (divisors per layer, adjacent heads grouped) except where explicit
    ``groups`` (a list, None = allocate that layer, or a dict {layer: groups}; e.g. CAHP clusters via
    :func:`headbudget.compression.grouping.groups_from_labels`) say otherwise (the kept fraction is then
    reported, not enforced)."""
    _require_headbudget(model)
    if method not in METHODS:
        raise CompressionError(f"unknown compression method {method!r}; choose from {', '.join(METHODS)}")
    if allocation not in ALLOCATIONS:
        raise CompressionError(f"unknown allocation {allocation!r}; choose from {', '.join(ALLOCATIONS)}")
    if method == "merge-kv":
        raise CompressionError("merge-kv takes key/value head counts, not --keep-ratio: use "
                               "headbudget.compression.merge_kv.merge_kv_model (or merge_kv_pipeline.run_merge_kv)")
    blocks = model.transformer.h
    heads = [b.attn.n_heads for b in blocks]
    info: dict[str, Any] = {"method": method, "keep": keep_ratio, "allocation": allocation, "strength": strength}
    if method == "svd":
        full = [b.attn.v_head_dim for b in blocks]
        ranks = allocate(full, keep_ratio, allocation, weights=heads, strength=strength)
        # Rotary or grouped-query layers have no fixed per-head query/key form: reduce only values/outputs.
        value_only = rotary_reason(model) is not None or any(b.attn.n_kv_heads != b.attn.n_heads for b in blocks)
        qk_ranks = [b.attn.qk_head_dim for b in blocks] if value_only else ranks
        out = copy.deepcopy(model)
        res = svd_compress(out, qk_ranks, ranks, progress=progress)
        info.update(qk_ranks=qk_ranks, v_ranks=ranks, full_ranks=full,
                    paths="value/output only (rotary or grouped-query layers)" if value_only else "query/key and value/output",
                    kept_fraction=round(sum(r * h for r, h in zip(ranks, heads)) /
                                        sum(f * h for f, h in zip(full, heads)), 6),
                    qk_rel_error=[sum(x) / len(x) if x else 0.0 for x in (lr["qk_rel_error"] for lr in res["per_layer"])],
                    vo_rel_error=[sum(x) / len(x) for x in (lr["vo_rel_error"] for lr in res["per_layer"])])
        return out, info
    # grouping
    if any(b.attn.n_kv_heads != b.attn.n_heads for b in blocks):
        raise CompressionError("K/V grouping needs multi-head attention in every layer (the model is already grouped)")
    if isinstance(groups, dict):
        bad = [k for k in groups if not 0 <= int(k) < len(blocks)]
        if bad:
            raise CompressionError(f"the head groups name layer {bad[0]}, but the model has {len(blocks)} layers")
        explicit = [groups.get(i, groups.get(str(i))) for i in range(len(blocks))]
    else:
        explicit = list(groups) if groups is not None else [None] * len(blocks)
    if len(explicit) != len(blocks):
        raise CompressionError(f"the head groups cover {len(explicit)} layers but the model has {len(blocks)}")
    for i, g in enumerate(explicit):
        if g is not None:
            check_groups(g, heads[i], i)
    n_kv = allocate(heads, keep_ratio, allocation, candidates=[divisors(h) for h in heads], strength=strength)
    layer_groups = [g if g is not None else adjacent_groups(h, k) for g, h, k in zip(explicit, heads, n_kv)]
    out = copy.deepcopy(model)
    res = group_heads(out, layer_groups)
    kv = [len(g) for g in layer_groups]
    info.update(n_kv_heads=kv, n_heads=heads, groups=layer_groups,
                head_order=[lr["head_order"] for lr in res["per_layer"]],
                kept_fraction=round(sum(kv) / sum(heads), 6))
    return out, info


def read_eval_text(data: str) -> str:
    """Text to score: a file or Hugging Face dataset (:func:`headbudget.io.read_text`), or
    ``synthetic[:N_WORDS]``: the built-in grammar's text drawn with a seed training never uses (held out)."""
    if data.split(":", 1)[0] == "synthetic" and not Path(data).exists():
        from headbudget.data.sources import read_source

        return "\n\n".join(read_source(data, seed=HELDOUT_SEED).documents)
    return read_text(data)


def _source_family(src: Any) -> str:
    """The source checkpoint's ``model_type`` (``headbudget``, ``gpt2``, ...; ``gguf`` for a GGUF file)."""
    if src.gguf_file:
        return "gguf"
    if not src.is_local:
        return str(src.where)
    try:
        return str(json.loads((Path(src.where) / "config.json").read_text()).get("model_type"))
    except (OSError, ValueError):
        return "unknown"


def evaluate_perplexity(model: nn.Module, ids: torch.Tensor, context: int, stride: int,
                        max_windows: int | None = None, progress: bool = False) -> dict[str, Any]:
    """Sliding-window perplexity (headbudget.evaluation.perplexity) of token ids."""
    from headbudget.evaluation.perplexity import perplexity

    return perplexity(model, None, input_ids=ids, context=context, stride=stride, max_windows=max_windows,
                      progress=progress)


def save_model_atomic(model: nn.Module, out_dir: Path, tokenizer: Any = None) -> Path:
    """``save_pretrained`` of the model (and the tokenizer, at the folder root) in a temporary sibling
    folder, then moved into place."""

    def write(tmp: Path) -> None:
        model.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    return atomic_write_dir(out_dir, write)


def plot_sweep(sweep: dict[str, Any], path: Path) -> None:
    """Perplexity vs kept fraction, one line per allocation, the uncompressed model dashed."""
    fig, ax = new_figure(figsize=(6.4, 4.4))
    for alloc in ALLOCATIONS:
        pts = sorted((r["keep"], r["ppl"]) for r in sweep["runs"] if r["allocation"] == alloc)
        if pts:
            ax.plot([k for k, _ in pts], [p for _, p in pts], marker="o", label=alloc)
    ax.axhline(sweep["baseline_ppl"], color="grey", ls="--", label=f"uncompressed ({sweep['baseline_ppl']:.2f})")
    ax.set_xlabel("kept fraction of the attention " + ("rank budget" if sweep["method"] == "svd" else "K/V heads"))
    ax.set_ylabel("perplexity")
    ax.set_yscale("log")
    ax.set_title(f"{sweep['method']} compression: quality vs budget")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=8)
    save_figure(fig, path)


@quiet_unless_progress
def run_compress(job: CompressJob, *, threads: int | None = None) -> dict[str, Any]:
    """Load ``job.model``, compress, evaluate and write ``job.out/model/``, ``job.out/report.json`` (and the sweep).
    ``threads``: torch's threads meanwhile (None: the idle cores).  Compression runs in float32 on the CPU; perplexity is measured in
    ``job.dtype`` (auto: float32; also the saved type) on ``job.device`` (default: cuda when available).

        >>> run_compress(CompressJob("runs/prism/model", "runs/svd50", keep_ratio=0.5, data="wikitext2"))  # doctest: +SKIP
    """
    check_compress_job(job)
    groups = read_groups(job.groups) if job.groups else None
    dtype, device = resolve_dtype(job.dtype) or torch.float32, resolve_device(job.device)
    with torch_threads(threads):
        return _run_compress(job, groups, dtype, device)


def _run_compress(job: CompressJob, groups: Sequence[Sequence[Sequence[int]] | None] | None, dtype: torch.dtype,
                  device: torch.device) -> dict[str, Any]:
    from headbudget.loading import resolve_model

    sweep, context, progress = list(job.sweep), job.context, job.progress
    src = resolve_model(job.model)
    model, tok = _load_model_and_tokenizer(job.model, job.tokenizer, need_tokenizer=bool(job.data or job.tokenizer))
    ids = _token_ids(tok, job.data, job.max_tokens) if job.data else None
    stride = job.stride or max(1, context // 2)
    if ids is not None and progress:  # say up front how much scoring is ahead (a sweep repeats it)
        _announce_scoring(len(ids), model.config.n_positions, context, stride, job.max_windows,
                          2 + (len(sweep) * len(ALLOCATIONS) if sweep else 0))

    def ppl(m: nn.Module) -> dict[str, Any] | None:
        if ids is None:
            return None
        if dtype != torch.float32 or (device is not None and device.type != "cpu"):
            m = copy.deepcopy(m).to(device=device, dtype=dtype)  # the float32 CPU original is compressed on
        return evaluate_perplexity(m, ids, context, stride, job.max_windows, progress)

    before = ppl(model)
    compressed, info = compress_model(model, job.method, job.keep_ratio, job.allocation, groups=groups,
                                      strength=job.strength, progress=progress)
    report = _compress_report(str(job.model), _source_family(src), job.data, model, compressed, info, before,
                              ppl(compressed))
    out_dir = Path(job.out)
    save_model_atomic(compressed.to(dtype), out_dir / "model", tok)
    if sweep:
        report["sweep"] = _sweep(model, job.method, sweep, groups, job.strength, ppl, before, progress)
        atomic_write_json(out_dir / "sweep.json", report["sweep"])
        plot_sweep(report["sweep"], out_dir / "sweep.png")
    atomic_write_json(out_dir / "report.json", report)
    return report


def _load_model_and_tokenizer(model_path: str, tokenizer: str | None, need_tokenizer: bool) -> tuple[nn.Module, Any]:
    """The model as a float32 headbudget model and its tokenizer (``None`` when it has none and none is
    needed: the compressed model carries the source's tokenizer, perplexity needs one)."""
    from headbudget.loading import check_vocab, load_model, load_tokenizer

    model = load_model(model_path, as_headbudget=True).float()
    try:
        tok = load_tokenizer(tokenizer, model_dir=None if tokenizer else model_path)
        check_vocab(model, tok, model_path)
    except ValueError:
        if need_tokenizer:
            raise
        tok = None
    return model, tok


def _token_ids(tok: Any, data: str, max_tokens: int | None) -> torch.Tensor:
    """The token ids of ``data`` (:func:`read_eval_text`), the first ``max_tokens`` of them."""
    ids = torch.tensor(tok(read_eval_text(data), add_special_tokens=False)["input_ids"], dtype=torch.long)
    if max_tokens:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"{data}: fewer than 2 tokens")
    return ids


def _announce_scoring(n_tokens: int, n_positions: int, context: int, stride: int, max_windows: int | None,
                      passes: int) -> None:
    from headbudget.evaluation.perplexity import window_plan

    n_win = min(len(window_plan(n_tokens, min(context, n_positions), stride)), max_windows or math.inf)
    print(f"scoring {n_tokens:,} tokens ({n_win} windows of {context}) x {passes} models; "
          "--max-tokens/--max-windows make it shorter", file=sys.stderr, flush=True)


def _compress_report(name: str, kind: str, data: str | None, model: nn.Module, compressed: nn.Module,
                     info: dict[str, Any], before: dict[str, Any] | None, after: dict[str, Any] | None
                     ) -> dict[str, Any]:
    """``report.json``: the source, what was kept, before/after parameters, FLOPs per token and perplexity."""
    from headbudget.evaluation.cost import model_cost

    p_before, p_after = sum(attention_parameters(model)), sum(attention_parameters(compressed))
    cost_before, cost_after = model_cost(model), model_cost(compressed)
    return {"model": name, "model_kind": kind, **info,
            "attention_params_before": p_before, "attention_params_after": p_after,
            "attention_params_ratio": p_after / p_before,
            "layers_before": layer_table(model), "layers_after": layer_table(compressed),
            "params_before": cost_before["params"], "params_after": cost_after["params"],
            "flops_per_token_before": cost_before["flops_per_token"],
            "flops_per_token_after": cost_after["flops_per_token"], "flops_context": cost_before["context"],
            "perplexity_before": before, "perplexity_after": after, "data": data,
            "schedule_after": compressed.config.schedule}


def _sweep(model: nn.Module, method: str, sweep: Sequence[float], groups: Any, strength: float,
           ppl: Any, before: dict[str, Any], progress: bool) -> dict[str, Any]:
    """``sweep.json``: perplexity at every kept fraction by every allocation, the best one per fraction."""
    runs = []
    for k, a in ProgressBar([(k, a) for k in sweep for a in ALLOCATIONS], desc="sweep", disable=not progress):
        m, inf = compress_model(model, method, k, a, groups=groups, strength=strength)
        r = ppl(m)
        runs.append({"keep": k, "allocation": a, "ppl": r["ppl"], "loss": r["loss"],
                     "kept_fraction": inf["kept_fraction"], "attention_params": sum(attention_parameters(m)),
                     "per_layer": inf.get("qk_ranks", inf.get("n_kv_heads"))})
    return {"method": method, "baseline_ppl": before["ppl"], "runs": runs,
            "best_by_keep": {str(k): min((r for r in runs if r["keep"] == k), key=lambda r: r["ppl"])["allocation"]
                             for k in sweep}}


def format_report(report: dict[str, Any]) -> str:
    """A short human-readable summary of a compression report."""
    lines = [f"{report['method']} compression of {report['model']} ({report['model_kind']}), keep {report['keep']} "
             f"({report['allocation']}): kept fraction {report['kept_fraction']:.3f}"]
    before, after = report["layers_before"], report["layers_after"]
    lines.append("layer  heads  kv_heads  qk_dim  v_dim   attn params before -> after")
    for b, a in zip(before, after):
        lines.append(f"{a['layer']:>5}  {a['n_heads']:>5}  {b['n_kv_heads']:>3}->{a['n_kv_heads']:<3} "
                     f"{b['qk_head_dim']:>3}->{a['qk_head_dim']:<3} {b['v_head_dim']:>3}->{a['v_head_dim']:<3} "
                     f"{b['attention_params']:>10,} -> {a['attention_params']:,}")
    lines.append(f"attention params {report['attention_params_before']:,} -> {report['attention_params_after']:,} "
                 f"({report['attention_params_ratio']:.3f}); total {report['params_before']:,} -> "
                 f"{report['params_after']:,}; forward FLOPs/token (context {report['flops_context']}) "
                 f"{report['flops_per_token_before']:,} -> {report['flops_per_token_after']:,} "
                 f"({report['flops_per_token_after'] / report['flops_per_token_before']:.3f})")
    if report.get("perplexity_before"):
        pb, pa = report["perplexity_before"], report["perplexity_after"]
        lines.append(f"perplexity {pb['ppl']:.3f} -> {pa['ppl']:.3f} over {pb['tokens_scored']:,} tokens "
                     f"(context {pb['context']}, stride {pb['stride']})")
    if report.get("sweep"):
        sw = report["sweep"]
        lines.append("sweep (perplexity): keep  " + "  ".join(f"{a:>20}" for a in ALLOCATIONS) + "  best")
        for k in sorted({r["keep"] for r in sw["runs"]}):
            vals = {r["allocation"]: r["ppl"] for r in sw["runs"] if r["keep"] == k}
            lines.append(f"                    {k:<5} " + "  ".join(
                f"{vals.get(a, math.nan):>20.3f}" for a in ALLOCATIONS) + f"  {sw['best_by_keep'][str(k)]}")
    return "\n".join(lines)
