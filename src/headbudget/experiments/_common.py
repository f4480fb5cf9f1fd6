"""Small helpers shared by the synthetic experiments: atomic JSON/PNG writes and timing."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
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


def atomic_write_json(path: str | os.PathLike, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def new_figure(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """``plt.subplots`` on the Agg backend without touching the global backend setting."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(*args, **kwargs)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    return fig, ax


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Save a :func:`new_figure` figure atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix or ".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=dpi, bbox_inches="tight", format=(path.suffix or ".png")[1:])
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Use ``n`` torch intra-op threads inside the block and restore the previous setting after.

    Small experiment tensors run much faster on one thread on a shared CPU (2 threads fighting other
    jobs can be 10x slower)."""
    import torch

    if not n:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def parse_int_list(text: str | list[int] | tuple[int, ...], flag: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` with a one-line error naming the flag."""
    if isinstance(text, (list, tuple)):
        values = list(text)
    else:
        try:
            values = [int(x) for x in str(text).split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"{flag}: expected a comma list of integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{flag}: expected positive integers, got {text!r}")
    return values
