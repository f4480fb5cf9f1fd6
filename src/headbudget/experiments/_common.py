"""Small helpers shared by the synthetic experiments: the recorded config, flag parsing and result files."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from headbudget.io import atomic_write_json

__all__ = ["RUN_SETTINGS", "recorded_config", "write_result"]

#: config fields that say where and how a run reports (its --out folder, its progress bars), not what it
#: measures: left out of the config recorded in the result JSON
RUN_SETTINGS = ("out", "progress")


def recorded_config(cfg: Any) -> dict[str, Any]:
    """The experiment config as its result JSON records it (tuples as lists; :data:`RUN_SETTINGS` left out)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items() if k not in RUN_SETTINGS}


def write_result(result: dict[str, Any], out_dir: str | os.PathLike, name: str,
                 plot: Callable[[dict[str, Any], str], Any]) -> tuple[str, str]:
    """Write ``NAME.json`` and ``NAME.png`` (drawn by ``plot``) into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    json_path = atomic_write_json(out / f"{name}.json", result)
    png_path = out / f"{name}.png"
    plot(result, str(png_path))
    return str(json_path), str(png_path)
