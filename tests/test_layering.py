"""The package's import structure: layers that follow the data flow, no import circle, no private name shared
across subpackages, no file over 500 lines, no function over 80.

The layers are an import-linter contract in ``pyproject.toml`` (``lint-imports`` checks it from the command line
too); circles are found on the same import graph (grimp's, which sees imports inside functions and under
``if TYPE_CHECKING:``: a lazy import is still a dependency, it only moves the failure from import time to call
time) by the standard library's topological sort.

    >>> sorted(import_graph("headbudget")["headbudget.accounting"])
    ['headbudget.schedules']
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import grimp
import pytest
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "headbudget"
MAX_LINES = 500
MAX_FUNCTION_LINES = 80
#: functions allowed over MAX_FUNCTION_LINES because one screen really is one idea ({"path:name": why})
LONG_FUNCTIONS_ALLOWED: dict[str, str] = {}


def import_graph(package: str) -> dict[str, set[str]]:
    """``{module: {modules of the package it imports}}``, every import at any depth."""
    graph = grimp.build_graph(package, cache_dir=None)
    return {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}


def import_cycle(graph: Mapping[str, set[str]]) -> list[str]:
    """One circle of imports (first == last), or ``[]``."""
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as exc:
        return list(reversed(exc.args[1]))
    return []


def layers_kept(config: Path) -> bool:
    """Whether the import-linter contracts of ``config`` hold (a broken one is printed with its import chain)."""
    return lint_imports(config_filename=str(config), no_cache=True, no_logo=True) == 0


def long_files(src: Path = SRC, limit: int = MAX_LINES) -> dict[str, int]:
    """``{path relative to src: lines}`` of every source file over ``limit`` lines."""
    counts = {str(p.relative_to(src)): len(p.read_text(encoding="utf-8").splitlines()) for p in src.rglob("*.py")}
    return {k: v for k, v in sorted(counts.items()) if v > limit}


def long_functions(src: Path = SRC, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """``{"path:qualified name": lines}`` of every function (or method) over ``limit`` lines, decorators
    excluded, docstring included."""
    found = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                n = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and n > limit:
                    found[name] = n
                visit(child, name + ".")

    for path in sorted(src.rglob("*.py")):
        visit(ast.parse(path.read_text(encoding="utf-8")), f"{path.relative_to(src)}:")
    return found


def private_imports_across_rooms(sources: Mapping[str, tuple[str, bool]]) -> list[str]:
    """``from headbudget.<room>.x import _name`` where the importer is in another room (subpackage):
    a private helper shared inside one room is that room's business, across rooms it is an API."""
    found = []
    for mod, (text, _) in sources.items():
        room = mod.split(".")[1] if mod.count(".") else mod
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ImportFrom) or node.level or not (node.module or "").startswith("headbudget."):
                continue
            target_room = node.module.split(".")[1]
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__") and target_room != room:
                    found.append(f"{mod} imports {node.module}.{alias.name}")
    return found



# ---------------------------------------------------------------------- the package
def test_the_graph_sees_lazy_imports():
    graph = import_graph("headbudget")
    assert "headbudget.models.surgery" in graph["headbudget.loading"]  # imported inside a function
    assert len(graph) > 80 and sum(map(len, graph.values())) > 150


def test_no_import_cycle():
    assert import_cycle(import_graph("headbudget")) == []


def test_layers_follow_the_data_flow():
    assert layers_kept(ROOT / "pyproject.toml")


def test_no_source_file_over_500_lines():
    assert long_files() == {}


def test_no_function_over_80_lines():
    assert {k: v for k, v in long_functions().items() if k not in LONG_FUNCTIONS_ALLOWED} == {}


def test_no_private_name_is_imported_across_rooms():
    sources = {".".join(("headbudget", *p.relative_to(SRC).with_suffix("").parts)): (p.read_text(), False)
               for p in SRC.rglob("*.py")}
    assert private_imports_across_rooms(sources) == []


# ---------------------------------------------------------------------- the checks themselves
@pytest.fixture
def package(tmp_path, monkeypatch):
    """``package(low="...", high="...")`` writes the package ``hbfake`` (its modules ``low``, ``high`` and an
    empty ``cli``) and returns its pyproject with the layers ``cli`` over ``high`` over ``low``."""
    def write(**modules: str) -> Path:
        pkg = tmp_path / "hbfake"
        pkg.mkdir()
        for name, text in {"__init__": "", "cli": "", **modules}.items():
            (pkg / f"{name}.py").write_text(text)
        config = tmp_path / "pyproject.toml"
        config.write_text('[tool.importlinter]\nroot_package = "hbfake"\n[[tool.importlinter.contracts]]\n'
                          'name = "layers"\ntype = "layers"\ncontainers = ["hbfake"]\nexhaustive = true\n'
                          'layers = ["cli", "high", "low"]\n')
        return config

    monkeypatch.syspath_prepend(str(tmp_path))
    return write


def test_a_downward_import_keeps_the_layers_and_a_lazy_upward_one_breaks_them(package):
    config = package(low="", high="from hbfake import low\n")
    assert layers_kept(config)
    (config.parent / "hbfake" / "low.py").write_text("def f():\n    import hbfake.high\n")
    assert not layers_kept(config)


def test_a_circle_through_a_lazy_import_and_type_checking_is_found(package):
    package(low="def f():\n    from hbfake import high\n",
            high="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hbfake import cli\n",
            cli="from hbfake.low import f\n")
    assert import_cycle(import_graph("hbfake")) in (
        ["hbfake.low", "hbfake.high", "hbfake.cli", "hbfake.low"],
        ["hbfake.high", "hbfake.cli", "hbfake.low", "hbfake.high"],
        ["hbfake.cli", "hbfake.low", "hbfake.high", "hbfake.cli"])


def test_long_files_counts_lines(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "big.py").write_text("x = 1\n" * 501)
    (tmp_path / "small.py").write_text("x = 1\n" * 500)
    assert long_files(tmp_path) == {"pkg/big.py": 501}


def test_long_functions_counts_nested_functions_and_methods(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    (tmp_path / "m.py").write_text(f"def short():\n{body}\n"  # 81 lines: over
                                   f"class C:\n    def method(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n"
                                   "def tiny():\n    return 1\n")
    found = long_functions(tmp_path)
    assert found == {"m.py:short": 81, "m.py:C.method": 81}



def test_a_private_import_across_rooms_is_found():
    sources = {"headbudget.pruning.gated": ("from headbudget.pruning.importance import _ok\n"
                                            "from headbudget.models.surgery.base import _bad\n", False)}
    assert private_imports_across_rooms(sources) == [
        "headbudget.pruning.gated imports headbudget.models.surgery.base._bad"]
