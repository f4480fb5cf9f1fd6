"""headbudget: adaptive head budgeting for Transformers.

    >>> import headbudget
    >>> from headbudget.schedules import prism
    >>> prism(12, 768).heads[:4]
    (3, 3, 3, 3)

Importing the package does not import torch or transformers, so ``headbudget schedule`` answers at once.
Saved models still load with ``AutoModelForCausalLM.from_pretrained(dir)`` after ``import headbudget``: a
one-shot import hook registers the ``headbudget`` model type right after transformers loads (at once if it
already is).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

__version__ = "0.1.0"


def _register_auto_classes() -> None:
    try:
        from headbudget.models import register_auto_classes
    except ImportError:  # torch missing, or headbudget.models is mid-import (it registers itself)
        return
    register_auto_classes()


class _LoaderThenRegister(importlib.abc.Loader):
    """transformers' own loader, followed by the registration once its ``__init__`` has run."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        _register_auto_classes()

    def __getattr__(self, name: str) -> Any:  # resource readers, is_package, ... of the real loader
        return getattr(self._inner, name)


class _TransformersHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of the ``transformers`` import, then leaves sys.meta_path."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != "transformers":
            return None
        # one shot, and lets the lookup below see the real finders only
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _TransformersHook)]
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoaderThenRegister(spec.loader)
        return spec


if "transformers" in sys.modules:  # already paid for: register now
    _register_auto_classes()
elif not any(isinstance(f, _TransformersHook) for f in sys.meta_path):
    sys.meta_path.insert(0, _TransformersHook())


try:  # lm-eval's registry is light (no torch); the model class is imported only when lm-eval asks
    from headbudget import evaluation  # noqa: F401  (registers the lm-eval model "headbudget" when installed)
except ImportError:
    pass
