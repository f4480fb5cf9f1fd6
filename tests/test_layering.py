"""The package's import structure: no import circle, no upward import across layers, no file over 500 lines, no function over 80.

Reads every module of ``src/headbudget`` with :mod:`ast` (nothing is imported), so the checks see
module-level imports *and* imports inside functions: a lazy import is still a dependency, it only
moves the failure from import time to call time, and one under ``if TYPE_CHECKING:`` is a dependency
of the design (the pipeline <-> workloads circle of issue 21 was one).  Only the imports inside a
module-level ``__getattr__`` that warns a DeprecationWarning are left out of the circle check
(:func:`is_deprecation_shim`): such a shim serves old import paths only, lazily, so it closes no circle at
import time; it still may not reach a higher layer.  Modules imported by name (``importlib.import_module`` in the
command table of cli/main.py and the lazy table of evaluation/__init__.py) are not seen.

    >>> graph = import_graph(SRC)
    >>> sorted(graph["headbudget.accounting"])
    ['headbudget.schedules']
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "headbudget"
PACKAGE = "headbudget"
MAX_LINES = 500
MAX_FUNCTION_LINES = 80
#: functions allowed over MAX_FUNCTION_LINES because one screen really is one idea ({"path:name": why})
LONG_FUNCTIONS_ALLOWED: dict[str, str] = {}

# Layers, bottom (0) to top.  A module may import modules of its own layer or below, never above.
# Keys are dotted names below ``headbudget`` (a package's submodules inherit its rank; the longest key
# that is a prefix of a module wins, so a module can sit lower than its package).  "" is headbudget/__init__.
LAYER_NAMES = ("base", "schedules", "models", "data/train", "evaluation/analysis",
               "pruning/compression/experiments", "cli")
LAYERS: dict[str, int] = {
    # base utilities: no headbudget imports beyond each other
    "io": 0, "threads": 0, "devices": 0, "run_dir": 0, "weight_shapes": 0, "typed_config": 0,
    "data.text": 0,  # the one text/JSONL reader; config files are read with it at every layer
    "model_files": 0,  # checks on a model folder's files and a GGUF header, before any loader opens them
    "progress": 0,  # the one progress bar (plain lines off a terminal), used at every layer
    # schedules: types and generators, budgets and their cost accounting, and the spec parser above them
    "schedules": 1, "accounting": 1, "budget_report": 1, "budget": 1, "schedule_spec": 1,
    # the model family, head surgery for every family, and the loader that opens any model and tokenizer
    "models": 2, "loading": 2, "export": 2,
    "data.tokenizers": 2,  # the tokenizer files a model folder holds, which the loader opens
    "data": 3, "train": 3,
    "evaluation": 4, "analysis": 4,
    "pruning": 5, "compression": 5, "experiments": 5,
    "cli": 6,
    "": 6,  # headbudget/__init__.py registers the auto classes and the lm-eval model
}


# ---------------------------------------------------------------------- graph
def module_name(path: Path, src: Path) -> str:
    """``src/headbudget/models/config.py`` -> ``headbudget.models.config`` (``__init__`` -> the package)."""
    parts = [PACKAGE, *path.relative_to(src).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_deprecation_shim(node: ast.AST) -> bool:
    """A module-level ``def __getattr__`` that warns a DeprecationWarning: the lazy home of an old import
    path (``headbudget.pruning.importance.IMPORTANCES`` -> ``headbudget.pruning.methods``).  Any other
    ``__getattr__`` is ordinary code and its imports count."""
    return (isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
            and any(isinstance(n, ast.Name) and n.id == "DeprecationWarning" for n in ast.walk(node)))


def _imports(tree: ast.Module, shims: bool = False) -> Iterable[ast.Import | ast.ImportFrom]:
    """Every import statement at any depth, except (unless ``shims``) in a deprecation ``__getattr__``."""
    stack: list[ast.AST] = [n for n in tree.body if shims or not is_deprecation_shim(n)]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        stack.extend(ast.iter_child_nodes(node))


def _targets(node: ast.Import | ast.ImportFrom, current: str, is_package: bool, known: set[str]) -> set[str]:
    """The headbudget modules an import statement loads (``from pkg import sub`` names the submodule)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = current.split(".") if is_package else current.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    out = set()
    for name in names:
        # the longest known module that is a prefix: ``import headbudget.models.config as c`` -> that module
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != current:
            out.add(name)
    return out


def import_graph_from_sources(sources: Mapping[str, tuple[str, bool]], shims: bool = False) -> dict[str, set[str]]:
    """``{module: (source text, is_package)}`` -> ``{module: {headbudget modules it imports}}``.

    >>> sorted(import_graph_from_sources({"headbudget.a": ("import headbudget.b", False),
    ...                                   "headbudget.b": ("", False)})["headbudget.a"])
    ['headbudget.b']
    """
    known = set(sources)
    graph: dict[str, set[str]] = {}
    for name, (text, is_package) in sources.items():
        tree = ast.parse(text, filename=name)
        graph[name] = set()
        for node in _imports(tree, shims):
            graph[name] |= _targets(node, name, is_package, known)
    return graph


def read_sources(src: Path = SRC) -> dict[str, tuple[str, bool]]:
    return {module_name(p, src): (p.read_text(encoding="utf-8"), p.name == "__init__.py")
            for p in sorted(src.rglob("*.py"))}


def import_graph(src: Path = SRC, shims: bool = False) -> dict[str, set[str]]:
    return import_graph_from_sources(read_sources(src), shims)


def import_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One shortest cycle through every strongly connected component of more than one module.

    Each cycle is listed from its alphabetically first module and closed (first == last).

    >>> import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    [['a', 'b', 'c', 'a']]
    >>> import_cycles({"a": {"b"}, "b": set()})
    []
    """
    edges = {k: sorted(set(v)) for k, v in graph.items()}
    for targets in list(edges.values()):
        for t in targets:
            edges.setdefault(t, [])
    # Tarjan's strongly connected components (iterative: no recursion limit on deep graphs)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            child = next(it, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))
    cycles = []
    for comp in sorted(components):
        members = set(comp)
        start = comp[0]
        # breadth-first from start back to start inside the component: the shortest cycle through it
        parents: dict[str, str] = {}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for node in frontier:
                for child in edges[node]:
                    if child == start:
                        found = node
                        break
                    if child in members and child not in parents:
                        parents[child] = node
                        nxt.append(child)
                if found is not None:
                    break
            frontier = nxt
        path = [start]
        node = found
        while node != start:
            path.append(node)
            node = parents[node]
        cycles.append([start, *reversed(path[1:]), start])
    return cycles


def layer_of(module: str) -> int:
    """The rank of a headbudget module: the entry in :data:`LAYERS` of its longest listed prefix.

    >>> layer_of("headbudget.data.text"), layer_of("headbudget.data.loader"), layer_of("headbudget")
    (0, 3, 6)
    """
    name = module.partition(".")[2]
    while name not in LAYERS:
        if not name:
            raise KeyError(f"{module}: no layer for it; add its top-level name to LAYERS in tests/test_layering.py")
        name = name.rpartition(".")[0]
    return LAYERS[name]


def upward_imports(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """``importer (layer) -> imported (layer)`` for every import of a higher layer.

    >>> upward_imports({"headbudget.schedules": {"headbudget.cli.main"}, "headbudget.cli.main": set()})
    ['headbudget.schedules (schedules) -> headbudget.cli.main (cli)']
    """
    out = []
    for src_mod in sorted(graph):
        for dst in sorted(graph[src_mod]):
            if layer_of(dst) > layer_of(src_mod):
                out.append(f"{src_mod} ({LAYER_NAMES[layer_of(src_mod)]}) -> {dst} ({LAYER_NAMES[layer_of(dst)]})")
    return out


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


# ---------------------------------------------------------------------- the package
@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(SRC)


def test_the_graph_sees_every_kind_of_import(graph):
    # module level, ``from pkg import submodule``, relative, and inside a function (loading's lazy imports)
    assert "headbudget.schedules" in graph["headbudget.accounting"]
    assert "headbudget.models.surgery" in graph["headbudget.loading"]  # imported inside _load_causal
    assert "headbudget.models.surgery.base" in graph["headbudget.models.surgery.checkpoint"]
    assert len(graph) > 80 and sum(map(len, graph.values())) > 150


def test_no_import_cycle(graph):
    cycles = import_cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_upward_import():
    up = upward_imports(import_graph(SRC, shims=True))  # an old import path may not reach up either
    assert not up, (f"imports of a higher layer (order: {' < '.join(LAYER_NAMES)}):\n" + "\n".join(up))


def test_every_module_has_a_layer(graph):
    assert {m: layer_of(m) for m in graph}  # KeyError names a module no LAYERS entry covers


def test_no_source_file_over_500_lines():
    assert long_files() == {}


def test_no_function_over_80_lines():
    assert {k: v for k, v in long_functions().items() if k not in LONG_FUNCTIONS_ALLOWED} == {}


# ---------------------------------------------------------------------- the checks themselves
def _graph(_shims: bool = False, **modules: str) -> dict[str, set[str]]:
    """A synthetic package: ``_graph(a="from headbudget import b")`` (keys without ``headbudget.``;
    a key ending in ``__init__`` is a package)."""
    sources = {}
    for key, text in modules.items():
        is_package = key.endswith("__init__")
        name = ".".join(["headbudget", *key.removesuffix("__init__").strip("_").split("__")]).rstrip(".")
        sources[name] = (text, is_package)
    return import_graph_from_sources(sources, _shims)


def test_a_deliberate_circle_through_a_lazy_import_is_found():
    g = _graph(
        schedules="",
        budget="from headbudget.schedules import X\nfrom headbudget import budget_report\n",
        budget_report="import headbudget.accounting as acc\n",
        accounting="def f():\n    from headbudget.schedules import uniform\n",
    )
    assert import_cycles(g) == []
    g = _graph(
        schedules="def f():\n    import headbudget.budget\n",  # the old lazy import closes the circle
        budget="from headbudget.budget_report import r\n",
        budget_report="from headbudget.accounting import a\n",
        accounting="from headbudget.schedules import HeadSchedule\n",
    )
    assert import_cycles(g) == [["headbudget.accounting", "headbudget.schedules", "headbudget.budget",
                                 "headbudget.budget_report", "headbudget.accounting"]]


def test_a_circle_under_type_checking_and_relative_imports_is_found():
    g = _graph(
        pruning____init__="",
        pruning__pipeline="from .workloads import run\n",
        pruning__workloads="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import pipeline\n",
    )
    assert import_cycles(g) == [["headbudget.pruning.pipeline", "headbudget.pruning.workloads",
                                 "headbudget.pruning.pipeline"]]


def test_only_a_warning_getattr_is_a_shim():
    shim = ("def __getattr__(name):\n    import warnings\n    warnings.warn(name, DeprecationWarning)\n"
            "    from headbudget import schedule_spec\n    return getattr(schedule_spec, name)\n")
    plain = "def __getattr__(name):\n    from headbudget import schedule_spec\n    return schedule_spec\n"
    assert _graph(schedules=shim, schedule_spec="import headbudget.schedules")["headbudget.schedules"] == set()
    g = _graph(schedules=plain, schedule_spec="import headbudget.schedules")
    assert import_cycles(g) == [["headbudget.schedule_spec", "headbudget.schedules", "headbudget.schedule_spec"]]


def test_a_shim_that_reaches_up_is_an_upward_import():
    shim = ("def __getattr__(name):\n    import warnings\n    warnings.warn(name, DeprecationWarning)\n"
            "    from headbudget.pruning import adapters\n    return getattr(adapters, name)\n")
    modules = dict(loading=shim, pruning__adapters="import headbudget.loading\n")
    assert import_cycles(_graph(**modules)) == []  # lazy: no circle at import time
    assert upward_imports(_graph(True, **modules)) == [
        "headbudget.loading (models) -> headbudget.pruning.adapters (pruning/compression/experiments)"]


def test_an_upward_import_is_found_with_both_layers():
    g = _graph(loading="def f():\n    from headbudget.pruning.adapters import load_pruned\n",
               pruning__adapters="", data__text="", typed_config="from headbudget.data.text import read_text\n")
    assert upward_imports(g) == ["headbudget.loading (models) -> headbudget.pruning.adapters "
                                 "(pruning/compression/experiments)"]


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


def test_the_old_lazy_imports_put_back_into_a_copy_of_the_package_fail(tmp_path):
    import shutil

    copy = tmp_path / "headbudget"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "schedules.py").open("a") as f:
        f.write("\n\ndef _budgeted():\n    import headbudget.budget as budget\n    return budget\n")
    with (copy / "loading.py").open("a") as f:
        f.write("\n\ndef _pruned(d):\n    from headbudget.pruning.adapters import load_pruned\n    return load_pruned(d)\n")
    g = import_graph(copy)
    assert ["headbudget.accounting", "headbudget.schedules", "headbudget.budget", "headbudget.budget_report",
            "headbudget.accounting"] in import_cycles(g)
    assert "headbudget.loading (models) -> headbudget.pruning.adapters (pruning/compression/experiments)" in (
        upward_imports(g))


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


def test_no_private_name_is_imported_across_rooms():
    assert private_imports_across_rooms(read_sources()) == []


def test_a_private_import_across_rooms_is_found():
    sources = {"headbudget.pruning.gated": ("from headbudget.pruning.importance import _ok\n"
                                            "from headbudget.models.surgery.base import _bad\n", False)}
    assert private_imports_across_rooms(sources) == ["headbudget.pruning.gated imports headbudget.models.surgery.base._bad"]
