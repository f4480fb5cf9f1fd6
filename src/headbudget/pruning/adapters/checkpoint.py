"""Moved to :mod:`headbudget.models.surgery.checkpoint`; this old path warns and re-exports it."""

import warnings

from headbudget.models.surgery import checkpoint as _moved

warnings.warn("headbudget.pruning.adapters.checkpoint moved to headbudget.models.surgery.checkpoint",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(_moved, name)
