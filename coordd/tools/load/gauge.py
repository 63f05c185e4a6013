"""A process's resident memory and descriptors, sampled while a load runs."""

from __future__ import annotations

import os
import threading
from types import TracebackType


class ProcessGauge:
    """Samples a process's resident memory and open descriptors (Linux /proc) every
    `interval` seconds in a thread; `peak_rss_mb`, `peak_fds` and `alive` afterwards."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid = pid
        self.interval = interval
        self.peak_rss_mb = 0.0
        self.peak_fds = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss_mb(self) -> float:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    @property
    def alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().split(") ", 1)[1][0] not in "ZX"
        except OSError:
            return False

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak_rss_mb = max(self.peak_rss_mb, self.rss_mb())
                self.peak_fds = max(self.peak_fds, self.fds())
                self.samples += 1
            except OSError:
                return
            self._stop.wait(self.interval)

    def __enter__(self) -> ProcessGauge:
        self._thread.start()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
