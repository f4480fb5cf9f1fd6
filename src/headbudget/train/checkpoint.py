"""Atomic training checkpoints (``<out>/checkpoints/step_000100.pt``), keeping the last K.

A checkpoint is written to a temporary file in the same directory and renamed into place, so a
crash mid-write never leaves a truncated ``step_*.pt``; older ones beyond ``keep_last`` are removed
only after the new one exists.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> for s in (10, 20, 30):
    ...     _ = save_checkpoint({"step": s}, d, s, keep_last=2)
    >>> [p.name for p in list_checkpoints(d)]
    ['step_000020.pt', 'step_000030.pt']
"""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"^step_(\d+)\.pt$")


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step_{step:06d}.pt"


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first (temporary files are ignored)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def save_checkpoint(state: dict[str, Any], directory: str | os.PathLike, step: int, keep_last: int = 2) -> Path:
    """Write ``state`` atomically as ``step_{step}.pt`` and delete all but the newest ``keep_last``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(d, step)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{final.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if keep_last > 0:
        for old in list_checkpoints(d)[:-keep_last]:
            old.unlink(missing_ok=True)
    return final


def load_latest_checkpoint(directory: str | os.PathLike) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads, or None when there is none."""
    for path in reversed(list_checkpoints(directory)):
        try:
            return path, torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:  # a damaged file (should not happen with atomic writes): try older
            warnings.warn(f"skipping unreadable checkpoint {path}: {exc}", stacklevel=2)
    return None
