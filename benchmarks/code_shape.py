"""The shape of headbudget's source: lines, files, import circles, imports inside functions, long functions and the
flag code, for the working tree or any commit, side by side.

    python benchmarks/code_shape.py                       # this tree
    python benchmarks/code_shape.py --rev b05c0a4 HEAD    # two commits (read with git, nothing checked out)

Circles are counted on the module import graph, every import at any depth (lazy ones and ``if TYPE_CHECKING:``
included), as strongly connected components of more than one module.  "Flag code" is the modules that build
command-line flags (``cli/dataclass_flags.py``, ``typed_config.py``, ``cli/common.py`` where present) plus every
hand-written ``add_argument`` call elsewhere in ``cli/``.  The lines are also split into code, docstrings,
comment-only and blank lines.  Writes a JSON next to the table with ``--json``.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAG_MODULES = ("cli/dataclass_flags.py", "typed_config.py", "cli/common.py")


def read_tree(rev: str | None) -> dict[str, str]:
    """``{path below src/headbudget: text}`` of the working tree (rev None) or of a commit."""
    if rev is None:
        base = ROOT / "src" / "headbudget"
        return {str(p.relative_to(base)): p.read_text(encoding="utf-8") for p in sorted(base.rglob("*.py"))}
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", rev, "src/headbudget"],
                           check=True, capture_output=True, text=True).stdout.split()
    return {n.removeprefix("src/headbudget/"): subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{n}"],
                                                               check=True, capture_output=True, text=True).stdout
            for n in names if n.endswith(".py")}


def module_of(path: str) -> str:
    parts = ["headbudget", *Path(path).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(tree: dict[str, str]) -> tuple[dict[str, set[str]], int]:
    """The module graph (every import statement at any depth) and how many import statements sit in functions."""
    known = {module_of(p) for p in tree}
    graph: dict[str, set[str]] = {}
    in_functions = 0
    for path, text in tree.items():
        mod, is_pkg = module_of(path), path.endswith("__init__.py")
        graph[mod] = set()
        module = ast.parse(text)
        funcs = [n for n in ast.walk(module) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        nested = {id(i) for f in funcs for i in ast.walk(f) if isinstance(i, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(module):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            internal = False
            for name in names:
                while name and name not in known:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    graph[mod].add(name)
                    internal = True
            in_functions += internal and id(node) in nested
    return graph, in_functions


def circles(graph: dict[str, set[str]]) -> int:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    count = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, it = work[-1]
            child = next(it, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                size = 0
                while True:
                    member = stack.pop()
                    on.discard(member)
                    size += 1
                    if member == node:
                        break
                count += size > 1
    return count


def long_functions(tree: dict[str, str], limit: int) -> int:
    return sum(1 for text in tree.values() for n in ast.walk(ast.parse(text))
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit)


def flag_code(tree: dict[str, str]) -> int:
    lines = sum(len(tree[p].splitlines()) for p in FLAG_MODULES if p in tree)
    add_argument = sum(text.count(".add_argument(") for p, text in tree.items()
                       if p.startswith("cli/") and p not in FLAG_MODULES)
    return lines + add_argument


def line_kinds(text: str) -> dict[str, int]:
    """One module's lines by kind, summing to all of them: docstring (module, class, function; its blank lines
    included), comment-only, blank, and the rest (code)."""
    lines = text.splitlines()
    doc = set()
    for n in ast.walk(ast.parse(text)):
        body = getattr(n, "body", None)
        if (isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            doc.update(range(body[0].lineno, body[0].end_lineno + 1))
    blank = sum(1 for i, line in enumerate(lines, 1) if not line.strip() and i not in doc)
    comment = sum(1 for i, line in enumerate(lines, 1) if line.strip().startswith("#") and i not in doc)
    return {"code": len(lines) - blank - len(doc) - comment, "docstring": len(doc), "comment": comment,
            "blank": blank}


def shape(rev: str | None) -> dict[str, int]:
    tree = read_tree(rev)
    graph, in_functions = import_graph(tree)
    kinds = [line_kinds(t) for t in tree.values()]
    return {"lines": sum(len(t.splitlines()) for t in tree.values()),
            **{f"  {k} lines": sum(d[k] for d in kinds) for k in ("code", "docstring", "comment", "blank")},
            "files": len(tree),
            "import circles": circles(graph), "internal imports": sum(map(len, graph.values())),
            "imports inside functions": in_functions, "functions over 50 lines": long_functions(tree, 50),
            "functions over 80 lines": long_functions(tree, 80), "flag code (lines + add_argument calls)":
                flag_code(tree)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", nargs="*", default=None, help="commits to measure (default: the working tree)")
    ap.add_argument("--json", default=None, help="write the table as JSON here")
    args = ap.parse_args(argv)
    revs = args.rev or [None]
    table = {rev or "working tree": shape(rev) for rev in revs}
    keys = list(next(iter(table.values())))
    width = max(map(len, keys))
    print(f"{'':{width}}  " + "  ".join(f"{c:>14}" for c in table))
    for k in keys:
        print(f"{k:{width}}  " + "  ".join(f"{table[c][k]:>14}" for c in table))
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
