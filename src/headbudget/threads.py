"""One CPU thread policy for every command (``headbudget.cli.main`` applies ``--threads``): N torch threads,
or without it the cores the load average leaves idle (at least one, shared among DDP ranks).  Oversubscribed
OpenMP threads are the worst case on a shared machine: on 2 cores with another busy job, torch's default of
2 threads ran evaluation 3x slower than 1 thread and training up to ~8x.

    >>> from headbudget.threads import configure_threads
    >>> configure_threads(None) >= 1       # torch.set_num_threads(idle cores); returns the count
    True
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager

THREADS_HELP = ("torch CPU threads (default: the cores the load average leaves idle, at least 1; on a "
                "shared CPU oversubscribed threads can be several times slower than one)")


def auto_threads(world_size: int | None = None) -> int:
    """The idle cores (``cpu_count - loadavg[0]``, rounded, capped at torch's current count) divided
    among ``world_size`` processes (default ``$WORLD_SIZE`` or 1); at least 1."""
    import torch

    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    n = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0]
    except (OSError, AttributeError):  # no load average on this platform
        busy = 0.0
    return max(1, min(torch.get_num_threads(), int(n - busy + 0.5)) // max(1, world_size))


def resolve_threads(requested: int | None, world_size: int | None = None) -> int:
    """``requested`` when given (>= 1), else :func:`auto_threads`; 0 also means automatic (the
    training config's convention).  A negative count is a ValueError naming ``--threads``."""
    if requested is None or requested == 0:
        return auto_threads(world_size)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
        raise ValueError(f"--threads must be a positive integer, got {requested!r}")
    return requested


def configure_threads(requested: int | None, world_size: int | None = None) -> int:
    """Set torch's intra-op threads by the policy above and return the count."""
    import torch

    torch.set_num_threads(n := resolve_threads(requested, world_size))
    return n


@contextmanager
def torch_threads(requested: int | None, world_size: int | None = None) -> Iterator[int]:
    """:func:`configure_threads` inside the block, the previous count restored after it."""
    import torch

    old = torch.get_num_threads()
    try:
        yield configure_threads(requested, world_size)
    finally:
        torch.set_num_threads(old)


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    """The one ``--threads`` flag (same meaning and help on every command)."""
    parser.add_argument("--threads", type=int, default=None, metavar="N", help=THREADS_HELP)
