"""Honest ranks that time their rounds while a load runs."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from types import TracebackType

from coordd.client.sync import CoordClient
from coordd.proto.messages import StepReport


class HonestRounds:
    """`dp` real clients of one group driven through rounds from one thread (every rank
    starts, then every rank waits), until stopped or `max_rounds`; keeps each round's
    latency (first start to last decision), and every error."""

    def __init__(
        self, address: str, dp: int, *, group: str = "default", wait_timeout: float = 10.0
    ) -> None:
        self.clients = [
            CoordClient(address, dp_rank=r, dp_size=dp, config_fingerprint="load", group=group)
            for r in range(dp)
        ]
        self.wait_timeout = wait_timeout
        self.latencies: list[float] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def connect(self, timeout: float = 10.0) -> HonestRounds:
        for client in self.clients:
            client.connect(timeout=timeout)
        return self

    def round(self) -> float:
        report = StepReport(num_tokens=8, num_tokens_padded=8)
        t0 = time.perf_counter()
        pending = [c.start(report) for c in self.clients]
        for p in pending:
            p.wait(timeout=self.wait_timeout)
        return time.perf_counter() - t0

    def run(self, rounds: int) -> list[float]:
        """`rounds` rounds now; their latencies."""
        out = [self.round() for _ in range(rounds)]
        self.latencies.extend(out)
        return out

    def start(self, max_rounds: int = 1_000_000, pause: float = 0.0) -> HonestRounds:
        """Run rounds in a thread until `stop()` (or the first error, or `max_rounds`)."""

        def loop() -> None:
            for _ in range(max_rounds):
                if self._stop.is_set():
                    return
                try:
                    self.latencies.append(self.round())
                except Exception as exc:  # a failed round is data for the caller
                    self.errors.append(exc)
                    return
                if pause:
                    time.sleep(pause)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 15.0) -> list[float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.latencies

    def close(self) -> None:
        self.stop()
        for client in self.clients:
            client.close()

    def __enter__(self) -> HonestRounds:
        return self.connect()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def p50_ms(latencies: Sequence[float]) -> float:
    return statistics.median(latencies) * 1000 if latencies else float("nan")
