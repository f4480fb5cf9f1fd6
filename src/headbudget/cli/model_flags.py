"""The ``--device`` and ``--dtype`` flags, the same on every command that loads a model
(``eval``, ``perplexity``, ``attention``, ``prune``, ``prune-compare``, ``compress``); their values
are resolved by :func:`headbudget.loading.resolve_device` and :func:`headbudget.loading.resolve_dtype`.

    >>> import argparse
    >>> p = argparse.ArgumentParser(); add_device_flag(p); add_dtype_flag(p)
    >>> vars(p.parse_args(["--dtype", "bfloat16"]))
    {'device': None, 'dtype': 'bfloat16'}
"""

from __future__ import annotations

import argparse

# the names of headbudget.loading.DTYPES (not imported: parsers are built without torch)
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


def add_device_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")


def add_dtype_flag(p: argparse.ArgumentParser, auto: str = "the checkpoint's own") -> None:
    # a plain string, checked by headbudget.loading.resolve_dtype: a bad value is one error line
    p.add_argument("--dtype", default="auto", metavar="{" + ",".join(DTYPE_NAMES) + "}",
                   help=f"float type of the model's weights (default auto: {auto}); bfloat16/float16 "
                   "halve memory and, on hardware with fast half-precision, time")
