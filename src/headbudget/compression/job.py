"""The settings of one ``headbudget compress`` run (:class:`CompressJob`): each field declares its flag once
(:func:`headbudget.typed_config.option`); the command's flags, ``--config`` and ``--print_config`` are generated
from them (:mod:`headbudget.cli.dataclass_flags`).  Importing this module needs no torch.

    >>> job = CompressJob("runs/cpu-small/model", "runs/svd50", keep_ratio=0.5, sweep=(0.25, 0.5))
    >>> job.method, job.allocation, job.context
    ('svd', 'uniform', 256)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headbudget.io import read_text
from headbudget.typed_config import device_option, dtype_option, option

#: headbudget.compression.pipeline.METHODS and headbudget.compression.allocation.ALLOCATIONS (not imported:
#: they import torch; tests/test_cli_config.py checks they agree)
METHOD_NAMES = ("svd", "group", "merge-kv")
#: headbudget.compression.merge_kv.MERGE_RULES and KV_ALLOCATIONS (same check)
MERGE_RULE_NAMES = ("fitted", "mean")
KV_ALLOCATION_NAMES = ("sensitivity", "uniform")
ALLOCATION_NAMES = ("uniform", "later_layers_first", "earlier_layers_first")


@dataclass
class CompressJob:
    """Everything ``headbudget compress`` needs; ``run_compress(job)`` runs it."""

    model: str = option(help="model or run folder, or GGUF file, of any decoder headbudget converts (GPT-2, "
                             "Llama, ...)", metavar="MODEL")
    out: str = option(help="output directory")
    method: str = option("svd", choices=METHOD_NAMES,
                         help="svd: per-head rank reduction of W_Q W_K^T and W_V W_O; group: share K/V within "
                              "head groups; merge-kv: merge key/value heads into fewer, every query head kept "
                              "(--kv-heads or --kv-budget)")
    keep_ratio: float = option(0.5, help="kept fraction of the attention rank budget (svd) or of the K/V heads "
                                        "(group)")
    allocation: str = option("uniform", choices=ALLOCATION_NAMES, help="how the kept budget is spread over layers")
    strength: float = option(0.5, help="slope of the non-uniform allocations: keep factors from (1+s) to (1-s) x "
                                       "mean")
    groups: str | None = option(
        None, help='JSON file with explicit head groups for --method group: a list with one entry per layer (a '
                   'list of head-index lists, or null to allocate that layer), or an object {"LAYER": groups} '
                   'naming some layers; e.g. CAHP clusters')
    kv_heads: int | None = option(None, help="merge-kv: key/value heads in every layer (must divide each layer's "
                                             "query heads and not exceed its key/value heads)")
    kv_budget: float | None = option(None, help="merge-kv: kept fraction of the KV-cache bytes per token, in (0, 1]; "
                                                "per-layer counts chosen by --kv-allocation")
    merge_rule: str = option("fitted", choices=MERGE_RULE_NAMES,
                             help="merge-kv: fitted (shared K/V fitted to calibration activations, queries and "
                                  "output re-fitted) or mean (plain mean of the heads' K/V projections)")
    kv_allocation: str = option("sensitivity", choices=KV_ALLOCATION_NAMES,
                                help="merge-kv with --kv-budget: sensitivity (merge first the layers whose merge "
                                     "raises calibration loss least) or uniform (counts spread evenly over depth)")
    calib_data: str | None = option(None, help="merge-kv: calibration text (default: the first --calib-tokens of "
                                               "--data, whose perplexity is then scored on the rest)")
    calib_tokens: int = option(4096, help="merge-kv: calibration tokens")
    sensitivity_tokens: int = option(1024, help="merge-kv: calibration tokens used to measure each layer's "
                                                "sensitivity (one forward per layer and count)")
    data: str | None = option(
        None, help="text for perplexity before/after: a file, an HF dataset NAME[:CONFIG], or synthetic[:N_WORDS] "
                   "(held-out text of the built-in grammar)")
    tokenizer: str | None = option(None, help="tokenizer folder or spec (default: the model's own, see "
                                              "headbudget.loading)")
    context: int = option(256, help="perplexity window (capped at the model's positions)")
    stride: int | None = option(None, help="perplexity stride (default context/2)")
    max_windows: int | None = option(None, help="score only the first N windows")
    max_tokens: int | None = option(None, help="use only the first N tokens of --data")
    sweep: tuple[float, ...] = option(
        (), help="comma list of kept fractions: compare all three allocations at each (needs --data)")
    device: str | None = device_option()
    dtype: str = dtype_option("float32; the compression itself always runs in float32, --dtype is the type "
                              "perplexity is measured in and the compressed model saved in")
    progress: bool = option(True, help="no progress bars", flag="--no-progress")


def _fraction(value: float, flag: str) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"{flag} must be in (0, 1], got {value}")


def check_compress_job(job: CompressJob) -> None:
    """A one-line error naming the flag of the first setting of ``job`` that cannot run (no file is read):
    merge-kv's flags only with merge-kv, exactly one of its targets, fractions in (0, 1], calibration text
    where the merge needs it.

        >>> check_compress_job(CompressJob("m", "o", method="merge-kv"))
        Traceback (most recent call last):
        ValueError: --method merge-kv needs --kv-heads N or --kv-budget FRACTION (one of them)
    """
    if job.context < 2:
        raise ValueError(f"--context must be >= 2, got {job.context}")
    given = [f for f, v in (("--kv-heads", job.kv_heads), ("--kv-budget", job.kv_budget),
                            ("--calib-data", job.calib_data)) if v is not None]
    if job.method != "merge-kv":
        if given:
            raise ValueError(f"{given[0]} only applies to --method merge-kv")
        _fraction(job.keep_ratio, "--keep-ratio")
        for k in job.sweep:
            _fraction(k, "--sweep")
        if job.groups and job.method != "group":
            raise ValueError("--groups only applies to --method group")
        if job.sweep and not job.data:
            raise ValueError("a sweep needs text data (it plots perplexity)")
        return
    if (job.kv_heads is None) == (job.kv_budget is None):
        raise ValueError("--method merge-kv needs --kv-heads N or --kv-budget FRACTION (one of them)")
    if job.kv_heads is not None and job.kv_heads < 1:
        raise ValueError(f"--kv-heads must be >= 1, got {job.kv_heads}")
    if job.kv_budget is not None:
        _fraction(job.kv_budget, "--kv-budget")
    for flag, value in (("--calib-tokens", job.calib_tokens), ("--sensitivity-tokens", job.sensitivity_tokens)):
        if value < 2:
            raise ValueError(f"{flag} must be >= 2, got {value}")
    if job.sweep or job.groups:
        raise ValueError(f"{'--sweep' if job.sweep else '--groups'} does not apply to --method merge-kv")
    if job.merge_rule not in MERGE_RULE_NAMES:
        raise ValueError(f"unknown --merge-rule {job.merge_rule!r}; choose from {', '.join(MERGE_RULE_NAMES)}")
    if not (job.data or job.calib_data):
        if job.merge_rule == "fitted":
            raise ValueError("--merge-rule fitted needs calibration text: --data or --calib-data")
        if job.kv_budget is not None and job.kv_allocation == "sensitivity":
            raise ValueError("--kv-allocation sensitivity needs calibration text: --data or --calib-data "
                             "(or --kv-allocation uniform)")


def read_groups(path: str) -> list[Any] | dict[int, Any]:
    """Read a --groups JSON file: ``[[[0, 1], [2, 3]], null, ...]`` (one entry per layer) or
    ``{"0": [[0, 1], [2, 3]]}`` (only the named layers)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--groups: no file {path}")
    try:
        data = json.loads(read_text(p))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    if isinstance(data, dict):  # {"layer": groups}: layers not named are allocated
        try:
            data = {int(k): v for k, v in data.items()}
        except ValueError:
            raise ValueError(f"{path}: keys must be layer indices, got {sorted(data)[:3]}") from None
    elif not isinstance(data, list):
        raise ValueError(f"{path}: expected a list with one entry per layer")
    for i, g in data.items() if isinstance(data, dict) else enumerate(data):
        if g is not None and not (isinstance(g, list) and all(isinstance(x, list) for x in g)):
            raise ValueError(f"{path}: layer {i}: expected a list of head-index lists or null, got {g!r}")
    return data


__all__ = ["ALLOCATION_NAMES", "KV_ALLOCATION_NAMES", "MERGE_RULE_NAMES", "METHOD_NAMES", "CompressJob",
           "check_compress_job", "read_groups"]
