"""A clock a test moves by hand, for everything of coordd's that takes its time passed in
(the coordinator, the registry and admission, the gate's rate, log throttles, the memory
guard): deterministic timeouts without sleeps, as trio's MockClock."""

from __future__ import annotations


class FakeClock:
    """Callable like `time.monotonic`; time moves only when the test says so."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move time forward by `seconds` (never back) and return the new time."""
        if seconds < 0:
            raise ValueError(f"a clock moves forward, not by {seconds}")
        self.now += seconds
        return self.now
