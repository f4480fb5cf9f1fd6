"""Docstrings show a real call: every module's ``>>>`` examples run, with the standard library's doctest, and
print what they say they print.

An example that needs a trained model, ../shared data or a download says ``# doctest: +SKIP`` on its line; a
module whose optional extra (lm-eval, gguf, ...) is not installed is skipped.  Each module's examples run in a
fresh temporary working directory, with :mod:`tempfile`'s folders made under it too, so nothing is written
into the repository or left behind; the repository's files an example reads by their path from its root
(``configs/cpu-small.yaml``, ``tests/fixtures/...``) are copied there first.
"""

from __future__ import annotations

import doctest
import importlib
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
#: repository folders that examples read by their path from the repository root
REPO_INPUTS = ("configs", "tests/fixtures")
#: the import names of pyproject.toml's optional extras: a module that needs a missing one is skipped
OPTIONAL = ("lm_eval", "gguf", "accelerate", "datasets", "tensorboard")
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE  # pytest --doctest-modules' ELLIPSIS, and whitespace


def module_names(package: str = "headbudget") -> list[str]:
    """Every module under ``src/<package>`` by its dotted name (a package by its ``__init__``), found on disk
    so that collecting imports nothing."""
    names = []
    for path in sorted((SRC / package).rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def import_or_skip(name: str):
    """``name`` imported; a skip when the import fails for want of an optional extra, else the error."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing in OPTIONAL:
            pytest.importorskip(missing, reason=f"{name} needs the optional {missing}")
        raise


@pytest.mark.parametrize("name", module_names())
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    module = import_or_skip(name)
    source = Path(module.__file__).read_text(encoding="utf-8")
    for folder in REPO_INPUTS:
        if f"{folder}/" in source:
            shutil.copytree(REPO / folder, tmp_path / folder)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    reports: list[str] = []
    for test in doctest.DocTestFinder().find(module, name):
        runner.run(test, out=reports.append)
    failed = f"{runner.failures} of {runner.tries} examples in {name} failed:\n"
    assert runner.failures == 0, failed + "".join(reports)
