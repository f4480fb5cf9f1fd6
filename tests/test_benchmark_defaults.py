"""Every benchmark script runs in a fresh clone: no argparse default names a file that exists only on the machine
the script was written on (a model under /work/cache, a text under an absolute /work/shared).

Inputs a benchmark reads by default must be in the repository (tracked by git) or in the data folder next to it
(``../shared/data``, where the docs put the data); outputs it writes by default go under the repository (or a
scratch folder under /tmp).
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))
#: destinations a benchmark writes (or downloads into), never reads as its input
OUTPUTS = {"out", "results", "plot", "work", "json", "cache"}
#: places that exist on one machine only
MACHINE_ONLY = ("/work/", "/root/", "/home/", "/Users/", "/mnt/", "/data/", "/scratch/")


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parser(name: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The script's own parser, caught as its main() parses (before any argument is checked)."""
    def caught(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Parsed(self)

    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_bench", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses in the script look their module up there
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # scripts that import a sibling script
    spec.loader.exec_module(module)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    monkeypatch.setattr(sys, "argv", [f"benchmarks/{name}.py"])
    with pytest.raises(_Parsed) as got:
        module.main()
    return got.value.parser


def _tracked() -> set[str] | None:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return set(out.splitlines())


def _paths(default: object) -> list[str]:
    values = default if isinstance(default, (list, tuple)) else [default]
    out = []
    for v in values:
        if isinstance(v, Path):
            out.append(str(v))
        elif isinstance(v, str):
            # a path has a "/" between names; "2/3" (a fraction) is none
            out += [piece for piece in v.split(",") if "/" in piece and not re.fullmatch(r"[\d./]+", piece)]
    return out


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_defaults_exist_in_a_fresh_clone(name, monkeypatch):
    parser = _parser(name, monkeypatch)
    tracked = _tracked()
    for action in parser._actions:
        for raw in _paths(action.default):
            path = Path(raw) if Path(raw).is_absolute() else ROOT / raw  # the docs run them from the repository
            path = Path(*path.parts)  # normalised, without resolving links
            flag = action.option_strings[0] if action.option_strings else action.dest
            where = f"benchmarks/{name}.py {flag} default {raw}"
            if action.dest in OUTPUTS:
                assert _inside(path, ROOT) or _inside(path, Path("/tmp")), f"{where}: written outside the clone"
                continue
            resolved = path.resolve()
            if _inside(resolved, SHARED.resolve()):
                continue  # the data folder next to the repository, as every doc names it
            assert _inside(resolved, ROOT), f"{where}: read from outside the clone"
            rel = resolved.relative_to(ROOT).as_posix()
            if tracked is not None:
                assert rel in tracked or any(t.startswith(rel + "/") for t in tracked), \
                    f"{where}: not in the repository (only on the machine it was written on)"
            else:
                assert resolved.exists(), f"{where}: no such file"


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_code_names_no_machine_only_path(name):
    """A path literal such as "/work/shared/..." works only where the clone sits in /work: the scripts find the
    data folder from their own location instead.  (Docstrings may show an example command.)"""
    tree = ast.parse((ROOT / "benchmarks" / f"{name}.py").read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    found = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and id(n) not in docstrings and n.value.startswith(MACHINE_ONLY)]
    assert found == []
