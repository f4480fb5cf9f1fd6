"""The one rule for Python that task files name: a user's task YAML (in ``--tasks``, under ``--include-path``,
or pulled in by ``include:`` or a group) whose ``!function`` would run Python is refused before lm-eval loads
anything, unless ``--allow-code``; lm-eval's loader is guarded too, and templates render in Jinja's sandbox.
headbudget's own task files and lm-eval's library are installed code and need no consent.

    >>> check_task_code(task_manager(["my_tasks/t.yaml"]), ["my_tasks/t.yaml"])   # doctest: +SKIP
    TaskCodeError: my_tasks/t.yaml: !function utils.process_docs would run Python from my_tasks/utils.py; ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from headbudget.io import read_text

#: headbudget's own lm-eval task files (and the prompts.py they name)
BUILTIN_TASKS_DIR = Path(__file__).resolve().with_name("lm_eval_tasks")


class TaskCodeError(ValueError):
    """A user's task YAML names Python (``!function module.name``) and running it was not allowed."""


def _trusted_yaml(path: str | Path) -> bool:
    """Whether a task YAML may name Python without ``allow_code``: headbudget's own (``lm_eval_tasks/``,
    calling ``prompts.py``) and lm-eval's library are code already installed."""
    dirs = [BUILTIN_TASKS_DIR]
    with contextlib.suppress(ImportError, AttributeError, TypeError):
        import lm_eval.tasks

        dirs.append(Path(lm_eval.tasks.__file__).resolve().parent)
    return any(Path(path).resolve().is_relative_to(d) for d in dirs)


def _python_of(spec: str, base_dir: Path) -> str:
    """Where lm-eval takes ``!function spec`` from: ``module.py`` beside the YAML, else an importable module."""
    module = spec.rpartition(".")[0]
    local = base_dir / f"{module.replace('.', '/')}.py"
    return f"Python from {local}" if module and local.exists() else f"Python (module {module or spec!r})"


def _named_python(path: Path, seen: set[Path]) -> Iterator[tuple[Path, str, str]]:
    """``(YAML file, tag, where its Python comes from)`` for every ``!function`` (or ``!!python/...``) tag
    of the user's YAML ``path`` and the files it pulls in with ``include:``; trusted files are skipped, and
    one that does not parse is left to lm-eval's loader (which refuses it, or meets :func:`code_guard`)."""
    import yaml

    path = Path(path).expanduser()
    real = path.resolve()
    if real in seen or _trusted_yaml(real):
        return
    seen.add(real)
    found: list[tuple[str, str]] = []

    _Scan = type("_Scan", (yaml.SafeLoader,), {})  # records the tags that name Python, constructs nothing

    def function(loader: yaml.Loader, node: yaml.Node) -> None:
        spec = str(loader.construct_scalar(node)) if isinstance(node, yaml.ScalarNode) else str(node.value)
        found.append((f"!function {spec}", _python_of(spec, real.parent)))

    def python_tag(loader: yaml.Loader, suffix: str, node: yaml.Node) -> None:  # !!python/name:os.system
        found.append((f"!!python/{suffix}", f"Python (module {suffix.partition(':')[2].rpartition('.')[0]!r})"))

    _Scan.add_constructor("!function", function)
    _Scan.add_multi_constructor("tag:yaml.org,2002:python/", python_tag)
    _Scan.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        cfg = yaml.load(read_text(path), Loader=_Scan)  # noqa: S506 (a SafeLoader subclass)
    except (OSError, ValueError, yaml.YAMLError):
        return
    for tag, python in found:
        yield path, tag, python
    includes = cfg.get("include") if isinstance(cfg, dict) else None
    for inc in includes if isinstance(includes, list) else [includes] if includes else []:
        if isinstance(inc, str):
            yield from _named_python(Path(inc) if Path(inc).is_absolute() else path.parent / inc, seen)


def _task_yaml_files(tm: Any, tasks: Sequence[str]) -> Iterator[Path]:
    """The YAML files lm-eval reads for ``tasks``: each task's file, a group's members, a tag's tasks."""
    import yaml

    _AnyTag = type("_AnyTag", (yaml.SafeLoader,), {})  # the structure only: every tag (!function ...) as None
    _AnyTag.add_multi_constructor("!", lambda loader, suffix, node: None)
    _AnyTag.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    index = tm.task_index
    todo: list[Any] = list(tasks)
    done: set[str] = set()
    while todo:
        item = todo.pop()
        if isinstance(item, dict):  # a group's member with overrides, or an inline (sub)group
            name = item.get("group", item.get("task"))
            if isinstance(name, str) and name in index:
                todo.append(name)
            elif isinstance(item.get("task"), list):
                todo.extend(item["task"])
            continue
        if not isinstance(item, str) or item in done:
            continue
        done.add(item)
        entry = index.get(item)
        yaml_path = getattr(entry, "yaml_path", None)
        if entry is None and Path(item).is_file():  # a YAML file named in --tasks
            yaml_path = Path(item)
        if entry is not None:
            todo.extend(getattr(entry, "tags", ()) if getattr(entry.kind, "name", "") == "TAG" else ())
        if yaml_path is None:
            continue
        yield Path(yaml_path)
        cfg = getattr(entry, "cfg", None)
        if cfg is None:
            with contextlib.suppress(OSError, ValueError, yaml.YAMLError):
                cfg = yaml.load(read_text(yaml_path), Loader=_AnyTag)  # noqa: S506 (a SafeLoader subclass)
        members = cfg.get("task") if isinstance(cfg, dict) else None
        if isinstance(members, list):  # a group (lm-eval builds each member it names)
            todo.extend(members)


def check_task_code(tm: Any, tasks: Sequence[str], allow_code: bool = False) -> None:
    """Raise :class:`TaskCodeError` naming the first user's task YAML read for ``tasks`` that names
    Python (module docstring), unless ``allow_code``."""
    if allow_code:
        return
    seen: set[Path] = set()
    for yaml_path in _task_yaml_files(tm, tasks):
        for where, tag, python in _named_python(yaml_path, seen):
            via = "" if where == Path(yaml_path).expanduser() else f" (included by {yaml_path})"
            raise TaskCodeError(f"{where}{via}: {tag} would run {python}; pass --allow-code to allow it")


@contextlib.contextmanager
def code_guard(allow_code: bool) -> Iterator[None]:
    """While lm-eval builds tasks, unless ``allow_code``: an untrusted YAML's ``!function`` is refused (paths
    :func:`check_task_code` did not foresee) and templates render sandboxed (:func:`sandboxed_templates`)."""
    if allow_code:
        yield
        return
    from lm_eval.tasks import _yaml_loader

    original = getattr(_yaml_loader, "_import_func_in_yml", None)

    def guarded(qual: str, base_dir: Path) -> Any:
        if not _trusted_yaml(Path(base_dir) / "_"):
            raise TaskCodeError(f"a task YAML in {base_dir}: !function {qual} would run "
                                f"{_python_of(qual, Path(base_dir))}; pass --allow-code to allow it")
        return original(qual, base_dir)

    if original is not None:
        _yaml_loader._import_func_in_yml = guarded
    try:
        with sandboxed_templates(allow_code):
            yield
    finally:
        if original is not None:
            _yaml_loader._import_func_in_yml = original


@contextlib.contextmanager
def sandboxed_templates(allow_code: bool) -> Iterator[None]:
    """lm-eval renders task templates with a plain Jinja environment, in which
    ``{{ cycler.__init__.__globals__.os.system(...) }}`` runs code; unless ``allow_code`` they render in
    Jinja's sandbox, which every ordinary template (fields, indexing, filters, method calls) passes."""
    try:
        import lm_eval.utils as lm_utils
        from jinja2.exceptions import SecurityError
        from jinja2.sandbox import SandboxedEnvironment
    except ImportError:
        lm_utils = None
    plain = getattr(lm_utils, "env", None)
    if allow_code or plain is None:
        yield
        return
    sandbox = SandboxedEnvironment(loader=plain.loader, undefined=plain.undefined,
                                   keep_trailing_newline=plain.keep_trailing_newline)
    sandbox.filters.update(plain.filters)
    lm_utils.env = sandbox
    try:
        yield
    except SecurityError as exc:
        raise TaskCodeError(f"a task's Jinja template was stopped: {exc} (templates render in Jinja's sandbox; "
                            "pass --allow-code to allow it)") from None
    finally:
        lm_utils.env = plain


__all__ = ["BUILTIN_TASKS_DIR", "TaskCodeError", "check_task_code", "code_guard", "sandboxed_templates"]
