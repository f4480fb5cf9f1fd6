"""Kept only for the documented ``from headbudget.pruning.adapters import get_adapter, load_pruned, save_pruned``
(docs/pruning-models.md, benchmarks/); the real home is :mod:`headbudget.models.surgery`."""

from headbudget.models.surgery import get_adapter, load_pruned, save_pruned

__all__ = ["get_adapter", "load_pruned", "save_pruned"]
