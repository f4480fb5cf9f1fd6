"""Moved to :mod:`headbudget.models.surgery.base`; this old path warns and re-exports it."""

import warnings

from headbudget.models.surgery import base as _moved

warnings.warn("headbudget.pruning.adapters.base moved to headbudget.models.surgery.base",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(_moved, name)
