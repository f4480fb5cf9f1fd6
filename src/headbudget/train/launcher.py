"""torchrun workers that die with their launcher: :func:`die_with_launcher`.

Without it the workers of a killed launcher train on as orphans to the end of the run and race a later
``--resume`` in the same folder.  :class:`~headbudget.train.trainer.Trainer` calls it in every process of a
multi-process run.
"""

from __future__ import annotations

import os
import sys
import time

_WATCHING_LAUNCHER = False


def die_with_launcher() -> None:
    """End this process (SIGTERM) when its parent, the ``torchrun`` launcher, dies, even by ``kill -9``.

    Without it the workers of a killed launcher train on as orphans to the end of the run and race a
    later ``--resume`` in the same folder.  Linux: ``prctl(PR_SET_PDEATHSIG)``; elsewhere a daemon
    thread that notices the parent pid change.  Called by every :class:`~headbudget.train.trainer.Trainer` of a multi-process run.

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
            pr_set_pdeathsig = 1
            if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0) == 0:
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
