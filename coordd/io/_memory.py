"""coordd's memory budget: when its resident memory passes `--max-rss-mb`, the connections that
hold no rank (strangers) are closed, and freed memory is given back to the OS.

Why: libzmq queues what a peer sends before coordd can look at it, and
nothing in libzmq bounds that queue without risking its abort (RCVHWM, libzmq #4841): a burst
of garbage from many peers, or one multipart message of millions of parts (held until whole),
grows coordd by hundreds of MB before any per-message rule sees a frame. The only lever coordd
has is closing a connection (`coordd.io._limits`): libzmq then stops reading it and drops the
parts of a message not yet whole; the whole messages already queued are still handed to coordd,
which drops them cheaply. glibc keeps freed memory in its arenas, so the guard then trims them
(`malloc_trim`), which is what brings the RSS back down.

`RssBudget` is the policy (pure, with the time passed in); `MemoryWatch` is the daemon's shell:
a timer that reads /proc/self/statm (one pread) every FAST_INTERVAL while a stranger is
connected and every SLOW_INTERVAL otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from coordd.core._logs import Aggregated

log = logging.getLogger("coordd")

MB = 1 << 20
#: Check period while some connection holds no rank (a flood builds up fast), and otherwise
#: (ranks only: cheap).
FAST_INTERVAL = 0.015
SLOW_INTERVAL = 0.1
#: Least time between two trims while over the budget (a trim of a large heap takes ms).
TRIM_EVERY = 0.25
#: Strangers are closed only if the RSS is this far above what coordd held with none: a
#: coordd whose own state (many groups) outgrew the budget does not lock new ranks out.
STRANGER_SLACK_MB = 16
#: Pressure ends only this far under where it starts: at the edge it flapped every few checks,
#: and each release let 50 reconnecting peers burst in again.
HYSTERESIS_MB = 12
#: Under pressure, the RSS is taken as coordd's own level (which raises the threshold and can
#: end the pressure) only after this long with no stranger to close: meanwhile the closed
#: connections' queued messages are still being dropped, then trimmed. Without this, RSS that
#: does not come back down (no malloc_trim, fragmentation) would refuse new ranks for good.
SETTLE = 2.0
#: With messages queued unread, the RSS is taken as coordd's own level only once it has stayed
#: within this band for SETTLE: dropping a backlog moves it (down, at each trim; a flood
#: through connections shut as soon as seen moves it up), and a backlog that never empties
#: (ranks' own traffic, a drain slower than its input) must not hold the pressure on for good.
FLAT_MB = 2


@dataclass(frozen=True)
class Verdict:
    """What one check decided: memory pressure (close the strangers, refuse new
    connections), trim the heap."""

    pressure: bool = False
    trim: bool = False


class RssBudget:
    """The policy: given the RSS, the time and how many strangers are connected, decide.

    - Pressure starts over the budget and at least STRANGER_SLACK_MB above the level coordd
      held with no stranger connected, and ends HYSTERESIS_MB under that. Meanwhile the
      strangers are closed and new connections refused (a closed peer reconnects at once
      and sends again), every check.
    - Over the budget, or after pressure: trim, at most every TRIM_EVERY seconds, until a
      trim finds the RSS back under the budget.
    - Over the budget with nothing to close: say so once per episode (`warn`)."""

    def __init__(self, budget_mb: float, *, slack_mb: float = STRANGER_SLACK_MB) -> None:
        self.budget = int(budget_mb * MB)
        self.slack = int(slack_mb * MB)
        self.hysteresis = int(HYSTERESIS_MB * MB)
        #: RSS at the last check with no stranger connected (outside SETTLE after a check
        #: under pressure found strangers to close; with a backlog, once the RSS is flat).
        self.own = 0
        self.flat = int(FLAT_MB * MB)
        #: The band the RSS has stayed in since `flat_since`.
        self.band = (0, -1)
        self.flat_since = float("-inf")
        self.pressure = False
        self.pressure_at = float("-inf")
        self.trim_at = float("-inf")
        self.trim_due = False
        self.over = False
        self.warned = False
        self.peak = 0

    def interval(self, strangers: int) -> float:
        """Seconds to the next check: short while a stranger is connected or memory is to
        be given back."""
        return FAST_INTERVAL if strangers or self.over or self.trim_due else SLOW_INTERVAL

    def threshold(self) -> int:
        """RSS above which strangers are closed."""
        return max(self.budget, self.own + self.slack)

    def check(self, rss: int, now: float, strangers: int, backlog: bool = False) -> Verdict:
        """`backlog`: messages are queued unread. What peers sent before their connections
        closed (or were shut at once: banned, refused) is in the RSS until coordd drops it,
        so the RSS is not coordd's own level then (taken as such, it would ratchet the
        threshold up behind a flood). But a backlog can last (ranks' traffic, a slow drain):
        once the RSS has stayed within FLAT_MB for SETTLE, dropping it frees nothing more, and
        the RSS is taken all the same, so that the pressure does not outlast its cause."""
        self.peak = max(self.peak, rss)
        low, high = self.band
        low, high = min(low, rss), max(high, rss)
        if high - low > self.flat:
            low = high = rss
            self.flat_since = now
        self.band = (low, high)
        if (
            not strangers
            and now - self.pressure_at >= SETTLE
            and (not backlog or now - self.flat_since >= SETTLE)
        ):
            self.own = rss
        over = rss > self.budget
        if over and not self.over:
            self.warned = False
        self.over = over
        if self.pressure:
            pressure = rss > self.threshold() - self.hysteresis
        else:
            pressure = rss > self.threshold()
            if pressure:
                self.pressure_at = now
        if pressure:
            if strangers:
                self.pressure_at = now
            self.trim_due = True
        self.pressure = pressure
        trim = False
        if (over or self.trim_due) and now - self.trim_at >= TRIM_EVERY:
            trim = True
            self.trim_at = now
            # what coordd has not dropped yet is not freed by a trim: keep trimming while
            # over; once under the budget, this was the last one
            self.trim_due = over
        return Verdict(pressure=pressure, trim=trim)

    def warn(self) -> bool:
        """True once per episode of coordd's own memory (no stranger) over the budget."""
        if self.over and not self.warned and self.own > self.budget:
            self.warned = True
            return True
        return False


class RssReader:
    """coordd's resident set size in bytes, from /proc/self/statm (kept open: one pread)."""

    def __init__(self, path: str = "/proc/self/statm") -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def __call__(self) -> int:
        return int(os.pread(self._fd, 128, 0).split()[1]) * self._page

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


def malloc_trimmer() -> Callable[[], None] | None:
    """glibc's `malloc_trim(0)` (returns free memory of every arena to the OS), or None where
    the C library has none (musl)."""
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def run() -> None:
        trim(0)

    return run


@dataclass
class MemoryStats:
    checks: int = 0
    #: checks under memory pressure, and how many connections they closed
    pressured: int = 0
    shed_connections: int = 0
    trims: int = 0
    #: highest RSS a check saw, bytes
    peak_rss: int = 0
    rss: int = 0


class MemoryWatch:
    """The timer: reads the RSS, asks `RssBudget`, tells `pressure(on)` (under pressure it
    closes the strangers and refuses new connections; it returns how many it closed) and
    trims. `strangers()` is how many connections hold no rank now; `backlog()` whether
    messages are queued unread (then the RSS is not taken as coordd's own level)."""

    def __init__(
        self,
        budget_mb: float,
        *,
        strangers: Callable[[], int],
        pressure: Callable[[bool], int],
        clock: Callable[[], float],
        rss: Callable[[], int] | None = None,
        trim: Callable[[], None] | None = None,
        backlog: Callable[[], bool] | None = None,
    ) -> None:
        self.policy = RssBudget(budget_mb)
        self.stats = MemoryStats()
        self._strangers = strangers
        self._backlog = backlog or (lambda: False)
        self._pressure = pressure
        self._pressed = False
        self._clock = clock
        self._reader = RssReader() if rss is None else None
        self._rss: Callable[[], int] = rss if rss is not None else self._reader  # type: ignore[assignment]
        self._trim = trim if trim is not None else malloc_trimmer()
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._log = Aggregated(log, "memory budget: strangers closed", clock=clock)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._log.schedule = loop.call_later
        self._handle = loop.call_later(self.policy.interval(1), self.check)

    def over(self) -> bool:
        """Whether the RSS is over the pressure threshold now (read from any thread: the ZAP
        gate asks before admitting a connection, so a loop busy dropping a burst does not
        delay the refusal)."""
        try:
            return self._rss() > self.policy.threshold()
        except (OSError, ValueError, IndexError):  # pragma: no cover - no /proc
            return False

    def poke(self) -> None:
        """A connection was accepted: check within FAST_INTERVAL, not SLOW_INTERVAL (a burst
        grows coordd by 100+ MB/s from its first connections)."""
        loop, handle = self._loop, self._handle
        if loop is None or handle is None:
            return
        if handle.when() - loop.time() > FAST_INTERVAL:
            handle.cancel()
            self._handle = loop.call_later(FAST_INTERVAL, self.check)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._loop = None
        if self._reader is not None:
            self._reader.close()

    def check(self) -> None:
        """One check (the timer's callback; it schedules the next)."""
        strangers = self._strangers()
        try:
            rss = self._rss()
        except (OSError, ValueError, IndexError):  # pragma: no cover - no /proc
            rss = 0
        stats = self.stats
        stats.checks += 1
        stats.rss = rss
        stats.peak_rss = max(stats.peak_rss, rss)
        try:
            backlog = self._backlog()
        except zmq.ZMQError:  # pragma: no cover - the socket is closing
            backlog = True
        verdict = self.policy.check(rss, self._clock(), strangers, backlog)
        if verdict.pressure or self._pressed:
            self._pressed = verdict.pressure
            closed = self._pressure(verdict.pressure)
            stats.pressured += verdict.pressure
            if closed:
                stats.shed_connections += closed
                self._log(
                    rss_mb=round(rss / MB),
                    budget_mb=round(self.policy.budget / MB),
                    closed=stats.shed_connections,
                    detail="connections that hold no rank closed, new ones refused while over "
                    "--max-rss-mb",
                )
        if verdict.trim and self._trim is not None:
            self._trim()
            stats.trims += 1
        if self.policy.warn():
            log.warning(
                "coordd holds %d MB with no stranger connected, over --max-rss-mb %d: nothing "
                "to close; raise --max-rss-mb",
                rss // MB,
                self.policy.budget // MB,
            )
        if self._loop is not None:
            self._handle = self._loop.call_later(self.policy.interval(strangers), self.check)
