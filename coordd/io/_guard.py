"""The shell side of admission (`coordd.core._admission`): it carries out the `Shut`s the core
decides (`shutdown(2)` through `coordd.io._limits`, only where the descriptor still names its
socket), runs the stranger-grace timer and the memory watch, and writes the aggregated log
lines. Every decision that names descriptors goes through `act`, which first has the server
catch up with its monitor (`GuardHost.catch_up_monitor`): the one place that rule is kept."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from coordd.core import _daemon_defaults as defaults
from coordd.core._admission import FLOOD, Admission, Shut
from coordd.core._logs import Aggregated
from coordd.core._peers import peer_label
from coordd.io import _limits as limits
from coordd.io import _memory as memory
from coordd.io._gate import HandshakeGate
from coordd.io._group import Group
from coordd.io._hosts import GuardHost

log = logging.getLogger("coordd")


class Guard:
    """Carry out `admission`'s decisions, asking the server (`host`) to catch up with its
    monitor first, which descriptors said a Hello, and whether messages wait unread."""

    def __init__(
        self,
        admission: Admission,
        host: GuardHost,
        *,
        clock: Callable[[], float],
        stranger_grace: float,
        max_rss_mb: float,
        gate: HandshakeGate | None,
        shutdown: Callable[[int, int | None], bool] = limits.shutdown_fd,
    ) -> None:
        self.admission = admission
        self.clock = clock
        self._host = host
        self._shutdown = shutdown
        #: A connection that said no Hello this long after it was accepted is shut down (0:
        #: never); see coordd.io._gate for why.
        self.stranger_grace = stranger_grace
        self._grace_timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        if gate is not None:
            gate.pressure = admission.pressure  # one flag, read by both
            gate.handshakes = admission.handshakes  # which spared connections are through
        #: Over `max_rss_mb` (0: off, the default in-process: the host's memory is not
        #: coordd's; `coordd serve` sets it), connections that hold no rank are closed.
        self.memory: memory.MemoryWatch | None = None
        if max_rss_mb:
            self.memory = memory.MemoryWatch(
                max_rss_mb,
                strangers=admission.strangers,
                pressure=self._memory_pressure,
                clock=clock,
                backlog=host.messages_queued,
            )
            if gate is not None:
                gate.over = self.memory.over
        self._evicted_log = Aggregated(log, "connection closed over the cap", clock=clock)
        # info: a client built before its connect() (it reconnects and says Hello then) is
        # closed so too; the metric counts them (connections_closed_total{reason="silent"})
        self._expired_log = Aggregated(
            log, "silent connection closed", level=logging.INFO, clock=clock
        )
        self._cut_log = Aggregated(log, "flooding peer cut off", clock=clock)
        self._member_log = Aggregated(log, "member cut off", clock=clock)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        for aggregated in (self._evicted_log, self._expired_log, self._cut_log, self._member_log):
            aggregated.schedule = loop.call_later
        if self.memory is not None:
            self.memory.start(loop)
        if self.stranger_grace:
            self._grace_timer = loop.call_later(self._grace_period(), self._expire_silent)

    def stop(self) -> None:
        self._loop = None
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        if self.memory is not None:
            self.memory.stop()

    def act(self, decide: Callable[[], list[Shut]]) -> int | None:
        """The one place where admission decides on descriptors: with the monitor current
        (else None: the decision waits for its next chance), carry out what it decides; how
        many connections were shut down."""
        if not self._host.catch_up_monitor():
            return None
        return self.shut(decide())

    def shut(self, shuts: Iterable[Shut]) -> int:
        """Carry out `shuts` (`shutdown(2)` on each descriptor that still names its socket;
        decided with the monitor current, or naming the connection just accepted); how many
        were done."""
        done = 0
        admission = self.admission
        for shut in shuts:
            if not self._shutdown(shut.fd, shut.ident):
                continue
            admission.done(shut)
            done += 1
            if shut.reason == FLOOD:
                self._cut_log(
                    peer=peer_label(shut.peer),
                    messages=admission.flood,
                    detail=f"more than {admission.flood} messages in a second from a peer "
                    "that holds no rank: connection shut down (over ipc, its process's new "
                    f"connections too for {defaults.BAN_SECONDS:g}s)",
                )
        return done

    def accepted(self, fd: int) -> None:
        """A connection was accepted (refused at once under pressure, or from a banned
        process: the event names it)."""
        if self.memory is not None:
            self.memory.poke()  # a burst grows coordd fast: look sooner
        ident = limits.socket_ident(fd)
        pid = limits.peer_pid(fd, ident)
        self.shut(self.admission.accepted(fd, self.clock(), ident=ident, pid=pid))

    def stranger_sent(self, peer: bytes, fd: int) -> None:
        """Count a message from a peer that holds no rank; at the flood cut-off, cut it off."""
        admission = self.admission
        now = self.clock()
        flood = admission.stranger_message(peer, fd, now)
        if admission.wants_socket(peer, now):
            admission.first_socket(peer, limits.socket_ident(fd), now)
        if flood:
            self.act(lambda: admission.cut(peer, fd, now))

    def cut_member(self, peer: bytes, fd: int, detail: str) -> bool:
        """End member `peer`'s connection on `fd` (a protocol violation: over its share of
        messages, or junk); True if it was shut down (else the next check tries again)."""
        done = self.act(lambda: self.admission.member_shut(fd, peer))
        if not done:
            return False
        self._member_log(peer=peer_label(peer), detail=detail)
        return True

    def new_window(self, now: float, groups: Iterable[Group]) -> None:
        """A new one-second window of message counts: each group's rounds so far are the
        base its members' shares are reckoned from."""
        self.admission.new_window(now)
        for group in groups:
            coordinator = group.coordinator
            group.window_rounds = coordinator.decisions + coordinator.failures

    def member_over(self, peer: bytes, group: Group, fd: int, count: int) -> str | None:
        """Member `peer` has sent `count` messages over `fd` in this window: if that is over
        its share (`Admission.member_over`), end its connection (over the connection that
        registered it: a member, or one that left its group and kept the connection; either
        is cut off alone). The violation's detail if it was cut off, else None."""
        coordinator = group.coordinator
        rounds = coordinator.decisions + coordinator.failures - group.window_rounds
        if not self.admission.member_over(count, rounds):
            return None
        detail = (
            f"protocol violation: {count} messages in under a second, over a rank's share "
            f"(its group had {rounds} rounds in that time; a rank sends one report a round)"
        )
        return detail if self.cut_member(peer, fd, detail) else None

    def enforce_cap(self) -> None:
        """Over the cap: close the oldest connections that hold no rank (the server calls
        this with its monitor current)."""
        closed = self.shut(self.admission.enforce())
        if closed:
            self._evicted_log(
                connections=len(self.admission.open),
                cap=self.admission.cap,
                closed=closed,
                detail="the oldest connections that registered no rank were closed",
            )

    def _memory_pressure(self, on: bool) -> int:
        """Over the memory budget (coordd.io._memory): refuse new connections (the one flag,
        which the ZAP gate reads too) and close every one that holds no rank. How many were
        closed (0 with events still queued: the next check tries again)."""
        self.admission.pressure.on = on
        if not on:
            return 0
        now = self.clock()
        return self.act(lambda: self.admission.shed(now)) or 0

    def _grace_period(self) -> float:
        """How often silent connections are looked for: a quarter of the grace, at most 1 s."""
        return min(1.0, self.stranger_grace / 4)

    def _expire_silent(self) -> None:
        """Shut down the connections that said no Hello within the grace (the timer's
        callback; it schedules the next). With messages queued unread, a Hello may be among
        them: the grace is then tripled, not dropped (a flood must not make claims last)."""
        loop = self._loop
        if loop is None:
            return
        self._grace_timer = loop.call_later(self._grace_period(), self._expire_silent)
        grace = self.stranger_grace * (3 if self._host.messages_queued() else 1)
        before = self.clock() - grace
        closed = self.act(lambda: self.admission.expire(before, self._host.introduced_fds()))
        if closed:
            self._expired_log(
                closed=closed,
                total=self.admission.expired,
                detail=f"connections that said no Hello within {grace:g}s were closed",
            )
