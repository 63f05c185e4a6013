"""coordd's memory budget: when its resident memory passes `--max-rss-mb`, the connections that
hold no rank (strangers) are closed, and freed memory is given back to the OS.

Why (issue 11, part B): libzmq queues what a peer sends before coordd can look at it, and
nothing in libzmq bounds that queue without risking its abort (RCVHWM, libzmq #4841): a burst
of garbage from many peers, or one multipart message of millions of parts (held until whole),
grows coordd by hundreds of MB before any per-message rule sees a frame. The only lever coordd
has is closing a connection (`coordd.limits`): libzmq then stops reading it and drops the
parts of a message not yet whole; the whole messages already queued are still handed to coordd,
which drops them cheaply. glibc keeps freed memory in its arenas, so the guard then trims them
(`malloc_trim`), which is what brings the RSS back down.

`RssBudget` is the policy (pure, with the time passed in); `MemoryWatch` is the daemon's shell:
a timer that reads /proc/self/statm (one pread, ~2 us) every FAST_INTERVAL while a stranger is
connected and every SLOW_INTERVAL otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from coordd.logs import Aggregated

log = logging.getLogger("coordd")

MB = 1 << 20
#: Default budget. The target is 100 MB; a flood adds 5-20 MB between reaching the budget and
#: the guard's action (a check, the monitor read, the handshakes refused) on 2 busy cores, and
#: a quiet coordd holds ~35 MB: room on both sides.
DEFAULT_MAX_RSS_MB = 64
#: Most and least budget `--max-rss-mb` takes (0 turns the guard off).
MIN_RSS_MB = 32
MAX_RSS_MB = 1 << 20
#: Check period while some connection holds no rank (a flood builds up fast: ~60 MB/s of
#: multipart parts, more from many peers), and otherwise (ranks only: cheap).
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
        #: under pressure found strangers to close).
        self.own = 0
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
        so the RSS is not coordd's own level then: taken as such, it ratcheted the threshold
        up behind a flood whose reconnects were shut as soon as seen (0 strangers open at
        every check), and coordd grew to 150-190 MB at a 64 MB budget."""
        self.peak = max(self.peak, rss)
        if not strangers and not backlog and now - self.pressure_at >= SETTLE:
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


#: libzmq asks the ZAP handler bound here (one per context) before admitting a connection.
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = "coordd"
#: The ZAP status text of a refusal (status 300: a temporary failure).
REFUSAL = b"coordd is over its memory budget (--max-rss-mb): try again"


#: The gate serving each context's ZAP endpoint (one per context): `coordd serve` with CURVE
#: starts it with the key check first, and the memory budget then shares it.
_GATES: dict[int, PressureGate] = {}
_GATES_LOCK = threading.Lock()
#: The ZAP protocol version libzmq speaks.
ZAP_VERSION = b"1.0"


class PressureGate:
    """coordd's ZAP handler: refuses connections in their handshake under memory pressure
    (before libzmq reads a single message from them), and with CURVE admits only the client
    keys `curve(domain, z85_key)` accepts.

    Closing a stranger's connection is not enough: a ZeroMQ peer reconnects within ~100 ms and
    sends its backlog again, and coordd reads the monitor's ACCEPTED event only after libzmq
    has started reading the new connection (a burst of 50 peers slipped ~65 MB/s through that
    gap). Refused by ZAP, a connection costs an accept and a handshake, no queued messages.
    Runs in its own thread (the loop may be busy dropping what was already queued).

    Statuses: 200 admitted (with CURVE, the User-Id is the client's z85 key: the key-to-rank
    binding reads it at Hello); 400 an unknown key (libzmq's client reports
    HANDSHAKE_FAILED_AUTH and does not retry: the key will not change); 300 memory pressure
    (the client's handshake stalls until coordd's HANDSHAKE_IVL, then it reconnects: it is
    let in once the pressure is over). A known key under pressure gets 300, an unknown one
    400 whatever the pressure."""

    def __init__(
        self, context: zmq.Context, curve: Callable[[str, bytes], bool] | None = None
    ) -> None:
        self.refusing = False
        #: Asked for each handshake too (`MemoryWatch.over`): refuse if it says so.
        self.over: Callable[[], bool] = lambda: False
        self.curve = curve
        #: refused for memory pressure (300), admitted (200), refused for their key (400)
        self.refused = 0
        self.admitted = 0
        self.bad_keys = 0
        self._context_id = id(context)
        self._sock = context.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError:
            self._sock.close(linger=0)
            raise
        # stop() wakes the thread through this pair (no timed polling: idle costs nothing)
        wake = f"inproc://coordd-zap-stop-{id(self):x}"
        self._wake_in = context.socket(zmq.PAIR)
        self._wake_in.bind(wake)
        self._wake_out = context.socket(zmq.PAIR)
        self._wake_out.connect(wake)
        self._thread = threading.Thread(target=self._run, name="coordd-zap", daemon=True)
        self._stopped = False

    @classmethod
    def start(
        cls, context: zmq.Context, curve: Callable[[str, bytes], bool] | None = None
    ) -> PressureGate | None:
        """The context's gate, serving: this process's own if one was started on `context`
        (CURVE starts it first), else a new one; None if something else serves ZAP there."""
        with _GATES_LOCK:
            gate = _GATES.get(id(context))
            if gate is not None:
                if curve is not None and gate.curve is None:
                    gate.curve = curve
                return gate
            try:
                gate = cls(context, curve)
            except zmq.ZMQError:
                return None
            _GATES[id(context)] = gate
        gate._thread.start()
        return gate

    def decide(self, request: list[bytes]) -> list[bytes]:
        """The reply to one ZAP request (version, request id, domain, address, routing id,
        mechanism, credentials...)."""
        version = request[0] if request else b""
        request_id = request[1] if len(request) > 1 else b""

        def reply(status: bytes, text: bytes, user: bytes = b"") -> list[bytes]:
            return [ZAP_VERSION, request_id, status, text, user, b""]

        if version != ZAP_VERSION or len(request) < 6:
            return reply(b"400", b"malformed ZAP request")
        user = b""
        if self.curve is not None:
            mechanism, credentials = request[5], request[6:]
            if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
                self.bad_keys += 1
                return reply(b"400", b"CURVE required")
            user = z85.encode(credentials[0])
            if not self.curve(request[2].decode("utf-8", "replace"), user):
                self.bad_keys += 1
                return reply(b"400", b"unknown CURVE key")
        if self.refusing or self.over():
            self.refused += 1
            return reply(b"300", REFUSAL)
        self.admitted += 1
        return reply(b"200", b"OK", user)

    def _run(self) -> None:
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        while True:
            try:
                ready = dict(poller.poll())
                if self._wake_in in ready:
                    return
                request = sock.recv_multipart()
            except zmq.ZMQError:  # pragma: no cover - the context is going away
                return
            try:
                answer = self.decide(request)
            except Exception:  # a bug here must not stop every future handshake
                log.exception("ZAP request failed; refused")
                request_id = request[1] if len(request) > 1 else b""
                answer = [ZAP_VERSION, request_id, b"500", b"internal error", b"", b""]
            try:
                sock.send_multipart(answer)
            except zmq.ZMQError:  # pragma: no cover
                return

    def stop(self) -> None:
        """Stop serving (once; CURVE and the server may both ask)."""
        with _GATES_LOCK:
            if self._stopped:
                return
            self._stopped = True
            if _GATES.get(self._context_id) is self:
                del _GATES[self._context_id]
        if self._thread.is_alive():
            self._wake_out.send(b"")
            self._thread.join(timeout=2.0)
        for sock in (self._sock, self._wake_in, self._wake_out):
            sock.close(linger=0)
