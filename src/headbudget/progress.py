"""The one progress bar of headbudget (:class:`ProgressBar`, a ``tqdm.auto.tqdm``), wherever it writes.

On a terminal (or in a notebook) it is tqdm as ever.  Written to a file or a pipe, tqdm's in-place updates
would be ``\\r``-separated copies of the line, several a second (one endless line of hundreds of KB); there it
prints a plain line when the bar starts, at most every :data:`PLAIN_INTERVAL_S` seconds after, and at close.

    >>> from headbudget.progress import ProgressBar as tqdm    # a drop-in for ``from tqdm.auto import tqdm``
    >>> for _ in tqdm(range(3), desc="demo", disable=True):
    ...     pass
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from tqdm.auto import tqdm as _auto_tqdm

__all__ = ["PLAIN_INTERVAL_S", "ProgressBar", "library_bars", "quiet_unless_progress"]

#: seconds between two lines of a bar written off a terminal (its start and final state are always written)
PLAIN_INTERVAL_S = 30.0

# in a notebook tqdm.auto draws a widget, which has no \r problem: leave it alone
_NOTEBOOK = any(c.__module__ == "tqdm.notebook" for c in _auto_tqdm.__mro__)


class ProgressBar(_auto_tqdm):  # type: ignore[misc,valid-type]
    """``tqdm.auto.tqdm`` that writes plain lines at a modest interval off a terminal."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        stream = kwargs.get("file")
        try:
            terminal = bool((sys.stderr if stream is None else stream).isatty())
        except (AttributeError, ValueError):  # no isatty, or a closed stream
            terminal = False
        self._plain = not _NOTEBOOK and not terminal
        self._plain_t: float | None = None  # when the last plain line was written
        self._plain_n: float | None = None  # and at which count
        self._plain_closing = False
        if self._plain:
            # tqdm itself would redraw at every update past 0.1 s (and its monitor thread every 10 s): let it
            # try no more often than a line may be written; display() keeps the interval whoever refreshes
            kwargs["mininterval"] = max(float(kwargs.get("mininterval") or 0.0), PLAIN_INTERVAL_S)
            kwargs["maxinterval"] = max(float(kwargs.get("maxinterval") or 0.0), PLAIN_INTERVAL_S)
            kwargs["dynamic_ncols"] = False
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if not self._plain:
            return bool(super().display(msg=msg, pos=pos))
        if self._plain_closing or msg == "":  # closing, or clearing for tqdm.write: nothing to erase
            return False
        now = time.monotonic()
        if msg is None and self._plain_t is not None and now - self._plain_t < PLAIN_INTERVAL_S:
            return True  # a refresh between two lines (set_postfix, tqdm.write): the next line shows it
        self._write_line(str(self) if msg is None else msg)
        self._plain_t, self._plain_n = now, self.n
        return True

    def clear(self, nolock: bool = False) -> None:
        if not self._plain:
            super().clear(nolock=nolock)  # plain lines stay in the log: nothing to clear

    def close(self) -> None:
        if self._plain and not self.disable:
            if self._plain_n != self.n:  # the final state, unless the last line already showed it
                self._write_line(str(self))
            self._plain_closing = True
            self.leave = False  # tqdm would redraw the bar and end it with a newline: the line has one
        super().close()

    def _write_line(self, line: str) -> None:
        self.fp.write(line.rstrip("\r") + "\n")
        getattr(self.fp, "flush", lambda: None)()


@contextlib.contextmanager
def library_bars(enabled: bool) -> Iterator[None]:
    """transformers' and datasets' own progress bars (loading weights, writing shards, reading data files) off
    unless ``enabled``, restored afterwards: ``--no-progress`` / ``--quiet`` silence them too."""
    if enabled:
        yield
        return
    from transformers.utils import logging as hf_logging

    try:
        import datasets  # an optional dependency (lm-eval's, the hub's)
    except ImportError:
        datasets = None
    hf_on = hf_logging.is_progress_bar_enabled()
    ds_on = datasets is not None and datasets.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if ds_on:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if hf_on:
            hf_logging.enable_progress_bar()
        if ds_on:
            datasets.enable_progress_bars()


F = TypeVar("F", bound=Callable[..., Any])


def quiet_unless_progress(fn: F) -> F:
    """``fn(job, ...)`` run under :func:`library_bars` of ``job.progress``: a pipeline whose job turns its bars
    off turns the libraries' off too."""
    @functools.wraps(fn)
    def run(job: Any, *args: Any, **kwargs: Any) -> Any:
        with library_bars(bool(getattr(job, "progress", True))):
            return fn(job, *args, **kwargs)

    return run  # type: ignore[return-value]
