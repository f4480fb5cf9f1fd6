"""Kept only for tests/test_baselines.py; the classification data lives in :mod:`headbudget.data.classification`."""

from headbudget.data.classification import ClassificationCollator, load_task

__all__ = ["ClassificationCollator", "load_task"]
