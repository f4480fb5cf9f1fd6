"""Moved to :mod:`headbudget.models.surgery.families`; this old path warns and re-exports it."""

import warnings

from headbudget.models.surgery import families as _moved

warnings.warn("headbudget.pruning.adapters.families moved to headbudget.models.surgery.families",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(_moved, name)
