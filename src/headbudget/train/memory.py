"""Peak memory of a block of work: the CUDA allocator's peak, or the process RSS sampled on CPU.

    >>> with PeakMemory(torch.device("cpu")) as mem:                        # doctest: +SKIP
    ...     trainer.run()
    >>> mem.peak_mb                                                         # doctest: +SKIP
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch


class PeakMemory:
    """Peak memory during a block: CUDA allocator peak, or sampled process RSS on CPU (approximate)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def rss() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:  # not Linux
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            self.peak_bytes = max(self.peak_bytes, self.rss())

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peak_bytes = self.rss()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes, self.rss())

    @property
    def peak_mb(self) -> float:
        cuda = self.device.type == "cuda"
        return (torch.cuda.max_memory_allocated(self.device) if cuda else self.peak_bytes) / 2**20
