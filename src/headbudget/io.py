"""Atomic file writes: a temp file in the same folder, then ``os.replace``.

Nothing half-written is ever left at the target path, even if the process dies mid-write.

    >>> from headbudget.io import atomic_write_json
    >>> p = atomic_write_json("/tmp/headbudget-io-example.json", {"ok": True})
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` (parents created) through a temporary file and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_json(path: str | os.PathLike, data: Any, indent: int = 2) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=indent) + "\n")


def atomic_write_dir(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """Fill a folder through ``write(tmp)`` in a temporary sibling, then move it to ``path`` (replacing it).

    >>> atomic_write_dir("/tmp/headbudget-io-model", lambda d: (d / "config.json").write_text("{}"))
    PosixPath('/tmp/headbudget-io-model')
    """
    import shutil

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        write(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def new_figure(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """A matplotlib figure on the Agg canvas (no global backend change), with its axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(*args, **kwargs)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    return fig, ax


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Save a matplotlib figure atomically (format from the suffix, PNG by default)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix or ".png"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=suffix)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=dpi, bbox_inches="tight", format=suffix[1:])
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
