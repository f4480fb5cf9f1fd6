"""torchrun workers that die with their launcher: :func:`die_with_launcher`."""

from __future__ import annotations

import os
import sys
import time

_WATCHING_LAUNCHER = False


def die_with_launcher() -> None:
    """End this process (SIGTERM) when its parent, the ``torchrun`` launcher, dies, even by ``kill -9``.

    Without it the workers of a killed launcher train on as orphans and race a later ``--resume`` in the same
    folder.  Linux: ``prctl(PR_SET_PDEATHSIG)``; elsewhere a daemon thread that notices the parent pid change.

    >>> die_with_launcher()   # in a torchrun worker: gone within a second of its launcher
    """
    global _WATCHING_LAUNCHER
    if _WATCHING_LAUNCHER:
        return
    import signal

    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0) == 0:  # PDEATHSIG
                _WATCHING_LAUNCHER = True
                if os.getppid() != parent:  # it died before the signal was armed
                    os.kill(os.getpid(), signal.SIGTERM)
                return
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    import threading

    threading.Thread(target=watch, name="headbudget-launcher-watch", daemon=True).start()
    _WATCHING_LAUNCHER = True
