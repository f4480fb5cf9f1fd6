"""The ``--device`` and ``--dtype`` flags, the same on every command that loads a model
(``eval``, ``perplexity``, ``attention``, ``prune``, ``prune-compare``, ``compress``); their values
are resolved by :func:`headbudget.loading.resolve_device` and :func:`headbudget.loading.resolve_dtype`.
They are generated from the one declaration of the ``device`` / ``dtype`` fields
(:func:`headbudget.typed_config.device_option`, :func:`~headbudget.typed_config.dtype_option`) that the jobs'
dataclasses use too, for commands whose other flags are not (yet) a dataclass.

    >>> import argparse
    >>> p = argparse.ArgumentParser(); add_device_flag(p); add_dtype_flag(p)
    >>> {k: v for k, v in vars(p.parse_args(["--dtype", "bfloat16"])).items() if not k.startswith("_")}
    {'device': None, 'dtype': 'bfloat16'}
"""

from __future__ import annotations

import argparse
import dataclasses

from headbudget.cli.dataclass_flags import add_dataclass_flags
from headbudget.typed_config import DTYPE_NAMES, device_option, dtype_option

__all__ = ["DTYPE_NAMES", "add_device_flag", "add_dtype_flag"]


def add_device_flag(p: argparse.ArgumentParser) -> None:
    add_dataclass_flags(p, dataclasses.make_dataclass("DeviceFlag", [("device", str | None, device_option())]))


def add_dtype_flag(p: argparse.ArgumentParser, auto: str = "the checkpoint's own") -> None:
    add_dataclass_flags(p, dataclasses.make_dataclass("DtypeFlag", [("dtype", str, dtype_option(auto))]))
