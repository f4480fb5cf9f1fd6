"""The settings of one ``headbudget compress`` run (:class:`CompressJob`): each field declares its flag once
(:func:`headbudget.typed_config.option`); the command's flags, ``--config`` and ``--print_config`` are generated
from them (:mod:`headbudget.cli.dataclass_flags`).  Importing this module needs no torch.

    >>> job = CompressJob("runs/cpu-small/model", "runs/svd50", keep=0.5, sweep=(0.25, 0.5))
    >>> job.method, job.allocation, job.context
    ('svd', 'uniform', 256)
"""

from __future__ import annotations

from dataclasses import dataclass

from headbudget.typed_config import device_option, dtype_option, option

#: headbudget.compression.pipeline.METHODS and headbudget.compression.allocation.ALLOCATIONS (not imported:
#: they import torch; tests/test_cli_config.py checks they agree)
METHOD_NAMES = ("svd", "group")
ALLOCATION_NAMES = ("uniform", "later_layers_first", "earlier_layers_first")


@dataclass
class CompressJob:
    """Everything ``headbudget compress`` needs; ``run_compress(job.model, job.method, ...)`` runs it."""

    model: str = option(help="model or run folder, or GGUF file, of any decoder headbudget converts (GPT-2, "
                             "Llama, ...)", metavar="MODEL")
    out: str = option(help="output directory")
    method: str = option("svd", choices=METHOD_NAMES,
                         help="svd: per-head rank reduction of W_Q W_K^T and W_V W_O; group: share K/V within "
                              "head groups")
    keep: float = option(0.5, help="kept fraction of the attention rank budget (svd) or of the K/V heads (group)")
    allocation: str = option("uniform", choices=ALLOCATION_NAMES, help="how the kept budget is spread over layers")
    strength: float = option(0.5, help="slope of the non-uniform allocations: keep factors from (1+s) to (1-s) x "
                                       "mean")
    groups: str | None = option(
        None, help='JSON file with explicit head groups for --method group: a list with one entry per layer (a '
                   'list of head-index lists, or null to allocate that layer), or an object {"LAYER": groups} '
                   'naming some layers; e.g. CAHP clusters')
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


__all__ = ["ALLOCATION_NAMES", "METHOD_NAMES", "CompressJob"]
