"""``headbudget compress MODEL --method merge-kv``: load, calibrate, merge key/value heads, measure, write.

    >>> report = run_merge_kv(CompressJob("runs/smol", "runs/smol-kv1", method="merge-kv", kv_heads=1,
    ...                                   data="../shared/data/text/tinyshakespeare.txt"))   # doctest: +SKIP
    >>> report["kv_bytes_per_token_before"], report["kv_bytes_per_token_after"]  # doctest: +SKIP
    (92160, 30720)

Calibration uses the first ``calib_tokens`` tokens of ``calib_data`` (default: of ``data``, whose perplexity
is then scored on the tokens after them).  The output is a plain transformers checkpoint when every layer has
the same count and the source is Llama/Mistral/Qwen2, else headbudget's own format.  See docs/allocation.md.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headbudget.compression import pipeline
from headbudget.compression.job import CompressJob, check_compress_job
from headbudget.compression.merge_kv import (
    KV_ALLOCATIONS,
    allocate_kv,
    allowed_counts,
    check_counts,
    collect_grams,
    kv_units,
    kv_values_per_token,
    layer_sensitivity,
    measured_kv_bytes_per_token,
    merge_kv_model,
)
from headbudget.compression.svd import CompressionError
from headbudget.devices import resolve_device, resolve_dtype
from headbudget.io import atomic_write_json
from headbudget.progress import quiet_unless_progress
from headbudget.threads import torch_threads


def _windows(ids: torch.Tensor, length: int) -> torch.Tensor:
    """Non-overlapping windows of ``length`` tokens (the last partial one dropped; one short window if
    there are fewer tokens than that)."""
    n = len(ids) // length
    return ids[:n * length].view(n, length) if n else ids[None]


def plan_counts(model: nn.Module, kv_heads: int | None, kv_budget: float | None, kv_allocation: str,
                sensitivity: list[dict[int, float]] | None) -> list[int]:
    """Per-layer key/value head counts for ``--kv-heads N`` (every layer) or ``--kv-budget F``."""
    blocks = model.transformer.h
    if (kv_heads is None) == (kv_budget is None):
        raise CompressionError("--method merge-kv needs --kv-heads N or --kv-budget FRACTION (one of them)")
    if kv_heads is not None:
        return check_counts(model, [kv_heads] * len(blocks))
    if kv_allocation not in KV_ALLOCATIONS:
        raise CompressionError(f"unknown --kv-allocation {kv_allocation!r}; choose from {', '.join(KV_ALLOCATIONS)}")
    return allocate_kv([allowed_counts(b.attn) for b in blocks], kv_units(model), kv_budget,
                       sensitivity if kv_allocation == "sensitivity" else None)


@quiet_unless_progress
def run_merge_kv(job: CompressJob, threads: int | None = None) -> dict[str, Any]:
    """``compress --method merge-kv``: merge ``job.model``'s key/value heads (``job.kv_heads`` per layer, or
    ``job.kv_budget`` of the cache bytes), write ``job.out/model/`` and ``job.out/report.json``, return the
    report.  Fitting runs on the CPU; ``job.dtype``/``job.device`` as for the other compress methods.

        >>> run_merge_kv(CompressJob("smollm2.gguf", "runs/kv50", method="merge-kv", kv_budget=0.5, data="t.txt"))  # doctest: +SKIP
    """
    check_compress_job(job)
    dtype, device = resolve_dtype(job.dtype) or torch.float32, resolve_device(job.device)
    with torch_threads(threads):
        return _run(job, dtype, device)


def _run(job: CompressJob, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    from headbudget.loading import resolve_model

    src = resolve_model(job.model)
    need_tok = bool(job.data or job.calib_data or job.tokenizer)
    model, tok = pipeline._load_model_and_tokenizer(job.model, job.tokenizer, need_tokenizer=need_tok)
    if job.kv_heads is not None:  # a count the layers cannot take is refused before any calibration
        plan_counts(model, job.kv_heads, job.kv_budget, job.kv_allocation, None)
    ctx = min(job.context, model.config.n_positions)
    ids = pipeline._token_ids(tok, job.data, None) if job.data else None
    if job.calib_data:
        calib = pipeline._token_ids(tok, job.calib_data, None)[:job.calib_tokens]
    elif ids is not None:
        calib, ids = ids[:job.calib_tokens], ids[job.calib_tokens:]
        if len(ids) < 2:
            raise CompressionError(f"--data has no tokens left for perplexity after the first {job.calib_tokens} "
                                   "calibration tokens (lower --calib-tokens or give --calib-data)")
    else:
        calib = None
    if ids is not None and job.max_tokens:
        ids = ids[:job.max_tokens]
    grams = collect_grams(model, _windows(calib, ctx)) if job.merge_rule == "fitted" else None
    sensitivity = None
    if job.kv_budget is not None and job.kv_allocation == "sensitivity":
        sens_windows = _windows(calib[:job.sensitivity_tokens], ctx)
        sensitivity = layer_sensitivity(model, job.merge_rule, grams, sens_windows, progress=job.progress)
    counts = plan_counts(model, job.kv_heads, job.kv_budget, job.kv_allocation, sensitivity)
    merged = copy.deepcopy(model)
    info = merge_kv_model(merged, counts, job.merge_rule, grams)

    def ppl(m: nn.Module) -> dict[str, Any] | None:
        if ids is None:
            return None
        if dtype != torch.float32 or (device is not None and device.type != "cpu"):
            m = copy.deepcopy(m).to(device=device, dtype=dtype)
        stride = job.stride or max(1, ctx // 2)
        return pipeline.evaluate_perplexity(m, ids, ctx, stride, job.max_windows, job.progress)

    before, after = ppl(model), ppl(merged)
    saved, fmt = _save(merged.to(dtype), Path(job.out) / "model", tok)
    report = {
        "model": str(job.model), "model_kind": pipeline._source_family(src), "method": "merge-kv",
        "merge_rule": job.merge_rule, "kv_heads": job.kv_heads, "kv_budget": job.kv_budget,
        "kv_allocation": job.kv_allocation if job.kv_budget is not None else None,
        "n_heads": [b.attn.n_heads for b in model.transformer.h], **info, **_sizes(model, merged, saved, dtype),
        "layer_sensitivity": None if sensitivity is None else [{str(k): v for k, v in s.items()} for s in sensitivity],
        "calibration_tokens": 0 if calib is None else int(calib.numel()),
        "calibration_data": job.calib_data or job.data,
        "layers_before": pipeline.layer_table(model), "layers_after": pipeline.layer_table(merged),
        "perplexity_before": before, "perplexity_after": after, "data": job.data,
        "output_format": fmt, "schedule_after": merged.config.schedule,
    }
    atomic_write_json(Path(job.out) / "report.json", report)
    return report


def _sizes(model: nn.Module, merged: nn.Module, saved: nn.Module, dtype: torch.dtype) -> dict[str, Any]:
    """KV values and bytes per token (from the layouts, and measured on the cache of one forward of the source
    and of the saved model), attention and total parameters, before and after."""
    from headbudget.evaluation.cost import model_cost

    before, after = kv_values_per_token(model), kv_values_per_token(merged)
    elem = torch.empty(0, dtype=dtype).element_size()
    return {"kv_values_per_token_before": before, "kv_values_per_token_after": after,
            "kv_dtype": str(dtype).removeprefix("torch."),
            "kv_bytes_per_token_before": before * elem, "kv_bytes_per_token_after": after * elem,
            "kv_bytes_ratio": after / before,
            "kv_bytes_per_token_measured_before": measured_kv_bytes_per_token(
                model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)),
            "kv_bytes_per_token_measured_after": measured_kv_bytes_per_token(saved),
            "attention_params_before": sum(pipeline.attention_parameters(model)),
            "attention_params_after": sum(pipeline.attention_parameters(merged)),
            "params_before": model_cost(model)["params"], "params_after": model_cost(merged)["params"]}


def _save(model: nn.Module, out_dir: Path, tok: Any) -> tuple[nn.Module, str]:
    """A plain transformers folder when the layout has one (uniform Llama/Mistral/Qwen2), else headbudget's;
    returns the saved model (for the cache measurement) and the format's name."""
    from headbudget.models.convert import LLAMA_FAMILY, ConversionError, to_hf

    saved = model
    if model.config.family in LLAMA_FAMILY:
        with contextlib.suppress(ConversionError):
            saved = to_hf(model)
    pipeline.save_model_atomic(saved, out_dir, tok)
    return saved, "headbudget" if saved is model else f"transformers {type(saved).__name__}"


def format_merge_report(report: dict[str, Any]) -> str:
    """A short summary of a merge-kv report."""
    kv_b, kv_a = report["n_kv_heads_before"], report["n_kv_heads"]
    lines = [f"merge-kv ({report['merge_rule']}) of {report['model']} ({report['model_kind']}): "
             + (f"--kv-heads {report['kv_heads']}" if report["kv_heads"] is not None else
                f"--kv-budget {report['kv_budget']} ({report['kv_allocation']})"),
             f"kv heads per layer {','.join(map(str, kv_b))} -> {','.join(map(str, kv_a))} "
             f"({sum(kv_b)} -> {sum(kv_a)})",
             f"KV cache per token ({report['kv_dtype']}): {report['kv_bytes_per_token_before']:,} -> "
             f"{report['kv_bytes_per_token_after']:,} bytes ({report['kv_bytes_ratio']:.4f}; measured on the cache "
             f"{report['kv_bytes_per_token_measured_before']:,} -> {report['kv_bytes_per_token_measured_after']:,})",
             f"params {report['params_before']:,} -> {report['params_after']:,}; saved as {report['output_format']}"]
    if report.get("perplexity_before"):
        pb, pa = report["perplexity_before"], report["perplexity_after"]
        lines.append(f"perplexity {pb['ppl']:.3f} -> {pa['ppl']:.3f} over {pb['tokens_scored']:,} held-out tokens "
                     f"(context {pb['context']}, stride {pb['stride']}; calibrated on {report['calibration_tokens']:,})")
    return "\n".join(lines)


__all__ = ["format_merge_report", "plan_counts", "run_merge_kv"]
