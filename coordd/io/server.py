"""The daemon's I/O shell: moves bytes between one ZeroMQ ROUTER socket and the groups'
`Coordinator`s.

One coordd serves several named groups (vLLM builds one DP group per TP/PP position of its
workers, plus one for its engine cores): each its own `Coordinator` (state, epoch, seq) and
`Observer` (metrics label), all with the same dp size and options. A group is created by the
first `Hello` naming it, up to `max_groups`; a peer (ZeroMQ routing id) belongs to the group it
registered with, and its reports go there by one dict lookup, so a fault in one group never
touches another's rounds.

The loop watches the socket's file descriptor and drains every queued frame in one callback,
with no asyncio future per message; a round's decision is encoded once and the same bytes go
to every rank. The only timer is the earliest deadline over the groups.

Liveness comes from libzmq: ZMTP heartbeats (PING/PONG, answered by each rank's ZeroMQ I/O
thread) on every connection, so a rank that stops answering has its connection closed; a socket
monitor reports the closed connection's file descriptor, and the descriptor a rank registered
from (the SRCFD of its Hello) names the rank, which becomes `Coordinator.peer_lost`.

A rank is the connection that registered it (`coordd.io.identity`): ROUTER_HANDOVER is off, so a
live connection's routing id cannot be taken over, and a message from a routing id counts only
if it came over the descriptor its Hello came in on; routing ids are never logged or shown.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from coordd.core import defaults
from coordd.core.logs import Aggregated
from coordd.core.peers import Takeovers, peer_label
from coordd.io import limits, memory
from coordd.io.gate import ZAP_DOMAIN, HandshakeGate, HandshakeRate
from coordd.io.identity import frame_address, new_router
from coordd.io.listen import BindError, IpcSocket, check_bind, explain_bind_failure
from coordd.ops.observer import Observer, ServerEvents
from coordd.ops.view import ShellCounters
from coordd.proto.coordinator import Coordinator, Send
from coordd.proto.errors import CoordError, CoordinatorUnavailable, ProtocolError, Rejected
from coordd.proto.messages import (
    MAX_DP_SIZE,
    MAX_MESSAGE_BYTES,
    Goodbye,
    Heartbeat,
    Hello,
    Reject,
    RejectReason,
    StepFailed,
    ToCoordinator,
    decode_to_coordinator,
    encode,
    failure_message,
    reject_message,
)
from coordd.proto.registration import check_basics
from coordd.proto.snapshot import OnRankLoss

log = logging.getLogger("coordd")

# Plain ints for the hot path: pyzmq's constants are enum.Flag members, and `int & Flag`
# builds a new Flag through enum's Python code (it was a third of coordd's Python time).
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_RCVMORE = int(zmq.RCVMORE)
_SRCFD = int(zmq.SRCFD)
_ACCEPTED = int(zmq.EVENT_ACCEPTED)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
#: The socket's send without pyzmq's Python wrapper (`zmq.Socket.send` checks its DRAFT
#: routing_id/group arguments in Python before it calls this): a round sends 2 * dp frames.
_send_frame = zmq.backend.Socket.send

#: Most messages handled in one turn of the event loop: then the loop runs its timers (step
#: timeouts), the HTTP endpoints and the monitor, and the drain goes on at its next turn. One
#: peer sending as fast as it can no longer holds the loop for the length of its flood.
DRAIN_BUDGET = 512
#: Most parts of a refused multipart message dropped in one turn (~25 ms of work).
DROP_BUDGET = 50_000
#: Turns in a row that closed connections may wait for the frames before them to be read
#: (so a rank's last report counts before its loss), before the monitor goes first anyway.
MONITOR_PATIENCE = 8
#: Answers to peers that registered with no group (an echo, a refusal): at most this many a
#: second over all of them, so a stranger's flood gets little back and queues little here.
STRANGER_ANSWERS_PER_S = 200.0
#: A peer that holds no rank and sends more messages than this in a second (bad frames,
#: reports it never registered for) has its connection shut down: libzmq's inbound queue is
#: unbounded (see RCVHWM), so a flood must be cut off at its source.
STRANGER_MESSAGES_PER_S = 2000
#: Which socket a stranger's first message came over is taken again after this long (a peer
#: that names itself keeps its routing id across connections: its new one is cut in time).
STRANGER_SOCKET_TTL = 5.0


@dataclass
class ServerStats:
    """Counters the metrics endpoint and the benchmark read."""

    frames_in: int = 0
    bad_frames: int = 0
    frames_out: int = 0
    disconnects: int = 0
    #: parts of refused multipart messages, dropped without decoding
    parts_dropped: int = 0
    #: answers to strangers not sent (over STRANGER_ANSWERS_PER_S)
    stranger_answers_dropped: int = 0
    #: connections of flooding strangers shut down (over STRANGER_MESSAGES_PER_S)
    cut_off: int = 0


def prepare_ipc_path(address: str, mode: int = 0o600) -> IpcSocket | None:
    """For ipc://, claim the path (`coordd.io.listen.IpcSocket`: the directory, the lock beside
    the socket, a stale socket removed); None for tcp. `BindError` if coordd may not."""
    return IpcSocket.claim(address, mode)


#: Longest group name; names are printable and hold no whitespace (they are metric labels and
#: log fields).
MAX_GROUP_NAME = 64


def group_name_problem(name: str) -> str | None:
    """Why `name` cannot name a group, or None if it can."""
    if not 1 <= len(name) <= MAX_GROUP_NAME:
        return f"it has {len(name)} characters"
    for char in name:
        if char.isspace() or not char.isprintable():
            return f"it holds {char!r}"
    return None


@dataclass(eq=False, slots=True)
class Group:
    """One named DP group: its state machine, what is counted about it, and its open round's
    deadline as the server last scheduled it."""

    name: str
    coordinator: Coordinator
    observer: Observer
    deadline: float | None = None


class CoordServer:
    """Serve every DP group on one ROUTER socket bound to `address`.

    Groups share `dp_size`, `step_timeout` and `on_rank_loss`; `max_groups` bounds how many
    exist (a Hello for another one is refused with `group_limit`, unless a group without
    members can make room), and `expect_groups` is how many must be formed for /readyz."""

    def __init__(
        self,
        address: str,
        *,
        dp_size: int,
        step_timeout: float = defaults.STEP_TIMEOUT,
        on_rank_loss: OnRankLoss = OnRankLoss.FAIL,
        max_groups: int = defaults.DEFAULT_MAX_GROUPS,
        expect_groups: int = 0,
        heartbeat_interval: float = defaults.HEARTBEAT_INTERVAL,
        heartbeat_timeout: float = defaults.HEARTBEAT_TIMEOUT,
        context: zmq.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        configure_socket: Callable[[zmq.Socket], None] | None = None,
        max_connections: int = defaults.DEFAULT_MAX_CONNECTIONS,
        ipc_mode: int = 0o600,
        max_rss_mb: float = 0,
        max_handshake_rate: float = 0,
        stranger_grace: float = defaults.STRANGER_GRACE,
    ) -> None:
        if not 1 <= dp_size <= MAX_DP_SIZE:
            raise ValueError(f"dp_size must be in 1..{MAX_DP_SIZE}, got {dp_size}")
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        if not 0 <= expect_groups <= max_groups:
            raise ValueError(f"expect_groups must be in 0..max_groups ({max_groups})")
        self.address = address
        self.dp_size = dp_size
        self.step_timeout = step_timeout
        self.on_rank_loss = on_rank_loss
        self.max_groups = max_groups
        self.expect_groups = expect_groups
        #: The groups by name, in the order they were created.
        self.groups: dict[str, Group] = {}
        self.stats = ServerStats()
        #: Refusals outside any group (bad names, the limit, reports from unknown peers).
        self.events = ServerEvents()
        #: Attempts to speak for a rank over a connection that did not register it.
        self.takeovers = Takeovers(clock)
        #: Clients refused by the CURVE gate, when coordd runs with CURVE.
        self.curve_refused: Callable[[], int] | None = None
        #: With CURVE keys bound to ranks: why a connection's key (its ZAP User-Id) may not
        #: register as a rank, or None (`coordd.io.curve.CurveGate.rank_refusal`).
        self.rank_keys: Callable[[str, int], str | None] | None = None
        self.clock = clock
        self.wall = wall
        self.started_wall = wall()
        self._last_epoch = 0
        self._context = context or zmq.Context()
        endpoint = check_bind(address)
        self._ipc = prepare_ipc_path(address, ipc_mode)
        # Its automatic routing ids start from a secret (a peer that held the next one could
        # make libzmq abort coordd; see coordd.io.identity.new_router).
        sock = new_router(self._context)
        if endpoint.ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        # Off: while a connection holds a routing id, libzmq drops a second connection that
        # presents it (on, the newcomer took the id over, and with it a rank's decisions); a
        # rank is the connection that registered it (see coordd.io.identity). On, it also lets any
        # peer abort coordd with its own id twice (libzmq #4841's path, measured in
        # tests/integration/test_routing_ids.py).
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_interval * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(heartbeat_timeout * 1000))
        # A peer that never reads its answers holds at most SEND_QUEUE of them here (then
        # the ROUTER drops what is sent to it); a rank reads its decision every round.
        sock.setsockopt(zmq.SNDHWM, defaults.SEND_QUEUE)
        # No inbound queue limit, on purpose: with one, a peer that sends faster than coordd
        # reads fills its pipe, libzmq stops reading its connection ("input stopped"), and if
        # the peer then disconnects, libzmq 4.3.5 marks the engine `_io_error` and a later
        # heartbeat (coordd's PING timer, or a PING still in the read buffer when reading
        # resumes) calls out_event() -> `Assertion failed: !_io_error
        # (src/stream_engine_base.cpp:310)`, aborting coordd (libzmq issue #4841; no release
        # fixes it; the PING can be the peer's own, so no coordd-side heartbeat setting avoids
        # it). Unbounded, the pipe never fills and that path is never taken; coordd
        # reads every peer in turn (fair queueing) and drops strangers' frames cheaply.
        sock.setsockopt(zmq.RCVHWM, 0)
        # A connection that never finishes its handshake (a key-less tcp+CURVE client, a
        # socket that sends nothing) is closed after this, freeing its descriptor.
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(defaults.HANDSHAKE_TIMEOUT * 1000))
        #: Under memory pressure or over the handshake rate, new connections are refused in
        #: their handshake (see coordd.io.gate).
        self.gate = HandshakeGate.start(self._context) if max_rss_mb or max_handshake_rate else None
        if self.gate is not None:
            sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
            if max_handshake_rate:
                # burst: as many as may connect at once (a whole engine starts together)
                self.gate.rate = HandshakeRate(max_handshake_rate, max(1, max_connections))
        if configure_socket is not None:
            configure_socket(sock)
        try:
            if self._ipc is not None:
                self._ipc.bind(sock)
            else:
                sock.bind(address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            if self.gate is not None:
                self.gate.stop()
            if self._ipc is not None:
                self._ipc.release()
            raise BindError(
                explain_bind_failure(address, endpoint, exc.errno or 0, exc.strerror)
            ) from None
        self.bound_address: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED)
        #: Open connections, capped: over the cap the oldest that holds no rank is closed.
        self.connections = limits.ConnectionGuard(max_connections, self._registered_fds)
        #: A connection that said no Hello this long after it was accepted is shut down (0:
        #: never); see coordd.io.gate for why.
        self.stranger_grace = stranger_grace
        self._grace_timer: asyncio.TimerHandle | None = None
        #: Over `max_rss_mb` (0: off, the default in-process: the host's memory is not
        #: coordd's; `coordd serve` sets it), connections that hold no rank are closed.
        self.memory: memory.MemoryWatch | None = None
        if max_rss_mb:
            self.memory = memory.MemoryWatch(
                max_rss_mb,
                strangers=self.connections.strangers,
                pressure=self._memory_pressure,
                clock=clock,
                backlog=self._backlog,
            )
            self.connections.on_accept = self.memory.poke
            if self.gate is not None:
                self.gate.over = self.memory.over
        #: Answers to strangers, rate-limited.
        self._stranger_answers = limits.TokenBucket(
            STRANGER_ANSWERS_PER_S, STRANGER_ANSWERS_PER_S, clock
        )
        #: Log lines a peer could cause once per message: aggregated.
        self._bad_frame_log = Aggregated(log, "bad frame dropped", clock=clock)
        self._evicted_log = Aggregated(log, "connection closed over the cap", clock=clock)
        # info: a client built before its connect() (it reconnects and says Hello then) is
        # closed so too; the metric counts them (connections_closed_total{reason="silent"})
        self._expired_log = Aggregated(
            log, "silent connection closed", level=logging.INFO, clock=clock
        )
        #: Dropping the rest of a refused multipart message (over several turns).
        self._dropping = False
        self._again_pending = False
        self._monitor_waited = 0
        #: Messages from peers that hold no rank in the current one-second window; the
        #: (peer, descriptor) pairs already cut off (never twice: a stale descriptor).
        self._stranger_counts: dict[bytes, int] = {}
        self._stranger_window_end = 0.0
        self._cut: dict[tuple[bytes, int], None] = {}
        #: The socket each stranger's first message came over (its descriptor's identity
        #: then), and when (taken again after STRANGER_SOCKET_TTL)
        self._stranger_socket: dict[bytes, tuple[int | None, float]] = {}
        self._cut_log = Aggregated(log, "flooding peer cut off", clock=clock)
        self._fd_peer: dict[int, bytes] = {}
        self._peer_fd: dict[bytes, int] = {}
        #: The group each peer registered with (its reports go there).
        self._peer_group: dict[bytes, Group] = {}
        #: Groups that got input since the last drain ended (failures and deadlines to check).
        self._touched: set[Group] = set()
        #: Groups with an open round, and its deadline.
        self._open: dict[Group, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then say goodbye to every rank and close."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.fileno(), self._on_frames)
        self._loop.add_reader(self._monitor.fileno(), self._drain)
        for aggregated in (
            self._bad_frame_log,
            self._evicted_log,
            self._expired_log,
            self._cut_log,
            *self.events.aggregated(),
        ):
            aggregated.schedule = self._loop.call_later
        if self.memory is not None:
            self.memory.start(self._loop)
        if self.stranger_grace:
            self._grace_timer = self._loop.call_later(self._grace_period(), self._expire_silent)
        self._drain()
        log.info(
            "coordd serving dp=%d on %s (at most %d groups)",
            self.dp_size,
            self.bound_address,
            self.max_groups,
        )
        try:
            await stop.wait()
        finally:
            self._loop.remove_reader(self._sock.fileno())
            self._loop.remove_reader(self._monitor.fileno())
            if self._timer is not None:
                self._timer.cancel()
            if self._grace_timer is not None:
                self._grace_timer.cancel()
            if self.memory is not None:
                self.memory.stop()
            for group in self.groups.values():
                self._send(group.coordinator.shutdown(), group.observer)
            self.close(linger=0.5)

    def close(self, linger: float = 0.0) -> None:
        if self._sock.closed:
            return
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=int(linger * 1000))
        if self.gate is not None:
            self.gate.stop()
        if self._ipc is not None:
            self._ipc.release()  # the socket only if it is still the one we bound

    def counters(self) -> ShellCounters:
        """The shell's counts now, for metrics and /status (`coordd.ops.view.ServerView`)."""
        stats, guard = self.stats, self.connections
        gate = self.gate
        return ShellCounters(
            frames_in=stats.frames_in,
            frames_out=stats.frames_out,
            bad_frames=stats.bad_frames,
            disconnects=stats.disconnects,
            connections_open=len(guard.open),
            closed_cap=guard.evicted,
            closed_flood=stats.cut_off,
            closed_banned=guard.refused,
            closed_silent=guard.expired,
            closed_messages_dropped=guard.dropped_shut,
            memory_shed=None if self.memory is None else self.memory.stats.shed_connections,
            memory_refused=None if gate is None else gate.refused,
            rate_refused=None if gate is None or gate.rate is None else gate.rate.refused,
            curve_refused=None if self.curve_refused is None else self.curve_refused(),
        )

    def takeovers_refused(self) -> Counter[tuple[str, str]]:
        return self.takeovers.refused

    def group_of(self, peer: bytes) -> Group | None:
        """The group `peer` registered with, or None."""
        return self._peer_group.get(peer)

    # -- the hot path -----------------------------------------------------------------------

    def _drain(self) -> None:
        """Handle queued frames, then closed connections, until both are empty or this turn's
        budget is spent (then the loop gets a turn and the drain goes on at the next).

        The FDs are edge-triggered, and a send can swallow the edge: so both are re-checked
        after any work, and a drain cut short is resumed by `call_soon` (no edge would come).
        Frames go first, so that what a rank sent before its connection closed (a last
        report, a Goodbye) counts before the loss does; under a flood that never empties the
        queue, closed connections wait at most MONITOR_PATIENCE turns.
        """
        more = False
        for _ in range(4):
            more = self._drain_frames()
            if more and self._monitor_waited < MONITOR_PATIENCE:
                self._monitor_waited += 1
                break
            self._monitor_waited = 0
            if not self._drain_monitor():
                break
            more = True
        self._drained()
        if more:
            self._again()

    def _on_frames(self) -> None:
        """The ROUTER's FD fired: frames only. The monitor's own FD brings closed connections
        (to `_drain`), and only work on the monitor socket can swallow its edge; checking it
        here too cost a syscall and an enum lookup on every wakeup (~4.6 per round at dp=8)."""
        more = self._drain_frames()
        self._drained()
        if more:
            self._again()

    def _again(self) -> None:
        """Resume the drain at the loop's next turn (once, however often asked)."""
        if not self._again_pending and self._loop is not None:
            self._again_pending = True
            self._loop.call_soon(self._resume)

    def _resume(self) -> None:
        self._again_pending = False
        if not self._sock.closed:
            self._drain()

    def _drained(self) -> None:
        """Once per drain, for each group that got input: a group failure nobody was sent (a
        rank lost between rounds) shows only in the failure counter, so the observer is told
        from there; and the group's deadline may have moved (the timer follows the earliest)."""
        touched = self._touched
        earlier = False
        if touched:
            timer_at = self._timer_at
            for group in touched:
                coordinator = group.coordinator
                if coordinator.failures != group.observer.failures_seen:
                    group.observer.group_failed(coordinator.snapshot())
                if coordinator.stops != group.observer.stops_seen:
                    group.observer.group_stopped(coordinator.snapshot())
                deadline = coordinator.next_deadline()
                if deadline != group.deadline:
                    group.deadline = deadline
                    if deadline is None:
                        self._open.pop(group, None)
                    else:
                        self._open[group] = deadline
                        if timer_at is None or deadline < timer_at:
                            earlier = True
            touched.clear()
        if earlier or (self._timer_at is None and self._open):
            self._schedule_deadline()

    def _drain_frames(self) -> bool:
        """Handle up to DRAIN_BUDGET queued messages; True if some may be left."""
        if self.connections.refusing:
            self._drain_monitor()  # memory pressure: new connections are shut at once
        if self._dropping and not self._drop_parts():
            return True
        now = self.clock()
        if now >= self._stranger_window_end:
            self._stranger_counts.clear()
            self._stranger_window_end = now + 1.0
        sock = self._sock
        stats = self.stats
        clock = self.clock
        peer_group = self._peer_group
        peer_fd = self._peer_fd
        touched = self._touched
        # what connections coordd shut down still have queued: dropped undecoded (a flood's
        # backlog; ~1 us a message instead of ~4); not at debug level (a line per bad frame)
        guard = self.connections
        shut = guard if guard.shut and not log.isEnabledFor(logging.DEBUG) else None
        for handled in range(DRAIN_BUDGET):
            # Until Again, not EVENTS per frame: getsockopt is a syscall plus an enum lookup
            # in pyzmq each time, Again one exception per drain. But after the first message,
            # one EVENTS check: most wakeups bring one message, and EVENTS (~1.1 us) is
            # cheaper than the Again that would end them (~2.6 us): -15 us a round at dp=8.
            if handled == 1 and not int(sock.getsockopt(_EVENTS)) & _POLLIN:
                return False
            try:
                # A ROUTER's first part is the routing id, and a payload part always follows
                # it (libzmq's router prefetches that part before it hands out the id): read
                # as bytes, with no Frame object and no RCVMORE check.
                peer = sock.recv(_NOBLOCK)
            except zmq.Again:
                return False
            stats.frames_in += 1
            frame = sock.recv(_NOBLOCK, copy=False)
            if frame.more:
                # Refused as soon as its second payload part shows: the rest is dropped
                # part by part (no bytes object, no decoding), DROP_BUDGET parts a turn.
                self._bad_frame(peer, "more than one payload frame", frame)
                self._dropping = True
                if not self._drop_parts():
                    return True
                continue
            if shut is not None and peer not in peer_group and shut.from_shut(frame.get(_SRCFD)):
                continue
            try:
                message = decode_to_coordinator(frame.buffer)
            except ProtocolError as exc:
                self._bad_frame(peer, str(exc), frame)
                continue
            if type(message) is Hello:
                self._on_hello(peer, message, frame)
                continue
            group = peer_group.get(peer)
            if group is None:
                self._stranger_sent(peer, frame)
                self._from_stranger(peer, message)
                continue
            fd = peer_fd.get(peer)
            if fd is not None and frame.get(_SRCFD) != fd:
                self._other_connection(peer, message, frame, group)
                continue
            touched.add(group)
            self._send(group.coordinator.receive(peer, message, clock()), group.observer)
        return True

    def _drop_parts(self) -> bool:
        """Drop parts of the refused multipart message being read, up to DROP_BUDGET; True
        once its last part is gone. libzmq hands a message over only whole, so every part is
        there: no wait."""
        recv = self._sock.recv
        dropped = 0
        try:
            while dropped < DROP_BUDGET:
                dropped += 1
                if not recv(_NOBLOCK, copy=False).more:
                    self._dropping = False
                    break
        except zmq.Again:  # pragma: no cover - a message is delivered whole
            dropped -= 1
            self._dropping = False
        self.stats.parts_dropped += dropped
        return not self._dropping

    def _registered_fds(self) -> set[int]:
        """The descriptors of connections that registered a rank now a member of its group
        (never closed for the connection cap)."""
        members = {
            member.peer
            for group in self.groups.values()
            for member in group.coordinator.snapshot().members.values()
        }
        return {fd for peer, fd in self._peer_fd.items() if peer in members}

    def _enforce_connection_cap(self) -> None:
        """Over the cap: close the oldest connections that hold no rank (see coordd.io.limits)."""
        guard = self.connections
        if guard.over():
            before = guard.evicted
            guard.enforce()
            if guard.evicted != before:
                self._evicted_log(
                    connections=len(guard.open),
                    cap=guard.cap,
                    closed=guard.evicted - before,
                    detail="the oldest connections that registered no rank were closed",
                )

    def _backlog(self) -> bool:
        """Whether messages are queued unread (the memory guard's check, between drains)."""
        if int(self._sock.getsockopt(_EVENTS)) & _POLLIN:
            self._again()  # EVENTS may have taken the FD's edge: drain without it
            return True
        return False

    def _memory_pressure(self, on: bool) -> int:
        """Over the memory budget (coordd.io.memory): refuse new connections and close every
        one that holds no rank, once the monitor is drained (its ACCEPTED events refused at
        once; no descriptor left in the guard is a closed connection's). How many were
        closed (0 with events still queued: the next check tries again)."""
        self.connections.refusing = on
        if self.gate is not None:
            self.gate.refusing = on
        if not on or not self._monitor_read():
            return 0
        return self.connections.shed()

    def _monitor_read(self) -> bool:
        """Read the monitor's events (a bounded number of turns) and tell the groups of
        ranks lost in them; True if none is left, so every descriptor in the connection guard
        is one libzmq holds (what shutting connections down by descriptor needs)."""
        for _ in range(8):
            if not self._drain_monitor():
                break
        self._drained()
        return not int(self._monitor.getsockopt(_EVENTS)) & _POLLIN

    def _grace_period(self) -> float:
        """How often silent connections are looked for: a quarter of the grace, at most 1 s."""
        return min(1.0, self.stranger_grace / 4)

    def _expire_silent(self) -> None:
        """Shut down the connections that said no Hello within the grace (the timer's
        callback; it schedules the next). With messages queued unread, a Hello may be among
        them: the grace is then tripled, not dropped (a flood must not make claims last)."""
        loop = self._loop
        if loop is None or self._sock.closed:
            return
        self._grace_timer = loop.call_later(self._grace_period(), self._expire_silent)
        if not self._monitor_read():
            return  # `open` is not current yet: next time
        grace = self.stranger_grace * (3 if self._backlog() else 1)
        closed = self.connections.expire(self.clock() - grace, self._fd_peer)
        if closed:
            self._expired_log(
                closed=closed,
                total=self.connections.expired,
                detail=f"connections that said no Hello within {grace:g}s were closed",
            )

    def _track_connection(self, peer: bytes, fd: int) -> None:
        old = self._peer_fd.get(peer)
        if old is not None and old != fd:
            self._fd_peer.pop(old, None)
        self._peer_fd[peer] = fd
        self._fd_peer[fd] = peer

    def _drain_monitor(self) -> bool:
        """Closed connections: the rank that registered over one is lost (in its own group
        only). True if any event."""
        monitor = self._monitor
        seen = False
        budget = 4 * DRAIN_BUDGET
        while budget and int(monitor.getsockopt(_EVENTS)) & _POLLIN:
            budget -= 1
            seen = True
            frames = monitor.recv_multipart(_NOBLOCK)
            event, fd = struct.unpack("=HI", frames[0][:6])
            if event == _ACCEPTED:
                self.connections.accepted(fd, self.clock())
                continue
            if event != _DISCONNECTED:
                continue
            self.connections.closed(fd)
            peer = self._fd_peer.pop(fd, None)
            if peer is None or self._peer_fd.get(peer) != fd:
                continue
            del self._peer_fd[peer]
            self.stats.disconnects += 1
            group = self._peer_group.get(peer)
            if group is None:
                continue
            self._touched.add(group)
            coordinator = group.coordinator
            rank = coordinator.snapshot().rank_of(peer)
            self._send(
                coordinator.peer_lost(peer, self.clock(), "connection closed"), group.observer
            )
            group.observer.lost(rank, peer, "connection closed")
        if seen:
            self._enforce_connection_cap()
        return seen

    def _send(self, sends: Sequence[Send], observer: Observer) -> None:
        sock = self._sock
        for peers, message in sends:
            observer.sent(peers, message)
            payload = encode(message)
            for peer in peers:
                try:
                    _send_frame(sock, peer, _SNDMORE_NOBLOCK)
                    _send_frame(sock, payload, _NOBLOCK)
                except zmq.ZMQError as exc:
                    log.debug("dropped a frame to %s: %s", peer_label(peer), exc)
                    continue
                self.stats.frames_out += 1

    def _send_one(self, peer: bytes, message: Reject | StepFailed | Heartbeat) -> None:
        """An answer from coordd itself, outside any group."""
        try:
            self._sock.send(peer, _SNDMORE_NOBLOCK)
            self._sock.send(encode(message), _NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("dropped a frame to %s: %s", peer_label(peer), exc)
            return
        self.stats.frames_out += 1

    def _stranger_sent(self, peer: bytes, frame: zmq.Frame) -> None:
        """Count a message from a peer that holds no rank; over STRANGER_MESSAGES_PER_S in a
        second, shut its connection down (once per connection; never a registered rank's;
        only if the peer's first message came over the socket now under the descriptor: after
        a burst, a shut connection's backlog was counted against the connection that took its
        number, and the cut banned an honest process for BAN_SECONDS)."""
        count = self._stranger_counts.get(peer, 0) + 1
        self._stranger_counts[peer] = count
        if count == 1:
            now = self.clock()
            seen = self._stranger_socket.get(peer)
            if seen is None or now - seen[1] > STRANGER_SOCKET_TTL:
                self._stranger_socket.pop(peer, None)
                self._stranger_socket[peer] = (limits.socket_ident(frame.get(_SRCFD)), now)
                if len(self._stranger_socket) > 4096:
                    del self._stranger_socket[next(iter(self._stranger_socket))]
        if count != STRANGER_MESSAGES_PER_S:
            return
        fd = frame.get(_SRCFD)
        if (peer, fd) in self._cut:
            return  # its connection was cut: what is left are its queued messages
        self._drain_monitor()  # `open` must be current: fd still this connection's
        if fd not in self.connections.open or fd in self._registered_fds():
            return
        seen = self._stranger_socket.get(peer)
        if seen is None or seen[0] != self.connections.open[fd]:
            # its first message came over another socket under this number: what is counted
            # is that one's backlog (numbers are reused at once), and a cut bans the process
            return
        self._cut[(peer, fd)] = None
        while len(self._cut) > 4096:
            del self._cut[next(iter(self._cut))]
        if self.connections.cut(fd, self.clock()):
            self.stats.cut_off += 1
            self._cut_log(
                peer=peer_label(peer),
                messages=count,
                detail=f"more than {STRANGER_MESSAGES_PER_S} messages in a second from a peer "
                "that holds no rank: connection shut down (over ipc, its process's new "
                f"connections too for {defaults.BAN_SECONDS:g}s)",
            )

    def _bad_frame(self, peer: bytes, why: str, frame: zmq.Frame | None = None) -> None:
        if frame is not None and peer not in self._peer_group:
            self._stranger_sent(peer, frame)
        self.stats.bad_frames += 1
        # One line each only at --log-level debug (the chaos checker counts them); the
        # warning is aggregated: a flood costs a few lines.
        label = peer_label(peer)
        log.debug("dropped a bad frame from %s: %s", label, why)
        self._bad_frame_log(peer=label, why=why, total=self.stats.bad_frames)

    # -- registration: which group a peer belongs to ----------------------------------------

    def _on_hello(self, peer: bytes, hello: Hello, frame: zmq.Frame) -> None:
        """Route a Hello to the group it names (created here on the first one)."""
        self._drain_monitor()
        if peer[:1] == b"\x00":
            # libzmq's name for a peer that set none, or a peer imitating one: never a rank,
            # and never exempt from the stranger grace (coordd.io.gate says why)
            error = Rejected(
                RejectReason.ROUTING_ID.value,
                "this connection set no routing id of its own (or one that starts with a zero "
                "byte, as ZeroMQ's own names do): coordd registers only connections that name "
                "themselves",
            )
            self._refuse(peer, hello, error)
            return
        fd = frame.get(_SRCFD)
        registered = self._peer_fd.get(peer)
        if registered is not None and registered != fd:
            # This routing id's registering connection is open (its close is not reported,
            # and libzmq admits one live connection per id): the Hello came over another one.
            self._other_connection(peer, hello, frame, self._peer_group.get(peer))
            return
        self._track_connection(peer, fd)
        if self.rank_keys is not None and self._key_refused(peer, hello, frame):
            return
        now = self.clock()
        bound = self._peer_group.get(peer)
        if bound is not None and bound.name != hello.group:
            held = bound.coordinator.snapshot().rank_of(peer)
            if held is not None:
                error = Rejected(
                    RejectReason.GROUP.value,
                    f"this connection is registered as rank {held} of group {bound.name!r}, "
                    f"not {_shown(hello.group)}: a client belongs to one group",
                    expected=bound.name,
                    got=_shown(hello.group),
                )
                self._refuse(peer, hello, error)
                return
        group = self.groups.get(hello.group)
        if group is None:
            group = self._create(peer, hello)
            if group is None:
                return
        if bound is not None and bound is not group:
            # No member of its old group (checked above): a rejoin it queued there is void.
            self._touched.add(bound)
            self._send(
                bound.coordinator.peer_lost(peer, now, "joined another group"), bound.observer
            )
        self._peer_group[peer] = group
        self._touched.add(group)
        address = frame_address(frame)
        group.observer.registering(peer, hello, address)
        sends = group.coordinator.receive(peer, hello, now)
        for _, answer in sends:
            if type(answer) is Reject and answer.reason is RejectReason.RANK_TAKEN:
                self.takeovers.refuse(
                    group.name,
                    Takeovers.RANK_HELD,
                    rank=hello.dp_rank,
                    address=address,
                    peer=peer,
                    detail=answer.text,
                )
        self._send(sends, group.observer)
        if len(self._peer_group) > 2 * self.dp_size * len(self.groups) + 256:
            self._forget_departed()

    def _key_refused(self, peer: bytes, hello: Hello, frame: zmq.Frame) -> bool:
        """A Hello over a connection whose CURVE key is bound to other ranks: refused (one
        leaked rank key cannot speak for another rank), counted and logged. True if refused."""
        assert self.rank_keys is not None
        try:
            key = str(frame.get("User-Id"))
        except zmq.ZMQError:
            key = ""
        why = self.rank_keys(key, hello.dp_rank)
        if why is None:
            return False
        error = Rejected(
            RejectReason.CURVE_KEY.value,
            f"this connection may not register as dp_rank {hello.dp_rank}: {why}",
            expected="a dp_rank its CURVE key is bound to",
            got=str(hello.dp_rank),
        )
        self.takeovers.refuse(
            _shown(hello.group),
            Takeovers.KEY_BOUND,
            rank=hello.dp_rank,
            address=frame_address(frame),
            peer=peer,
            detail=error.detail,
        )
        self._refuse(peer, hello, error)
        return True

    def _other_connection(
        self, peer: bytes, message: ToCoordinator, frame: zmq.Frame, group: Group | None
    ) -> None:
        """`message` came from routing id `peer` over another connection than the one that
        said its Hello, which coordd knows open: it does not count for the rank (refused,
        counted, logged with the address), and is answered as a stranger's."""
        rank = None
        if group is not None:
            rank = group.coordinator.snapshot().rank_of(peer)
        self.takeovers.refuse(
            group.name if group is not None else "-",
            Takeovers.OTHER_CONNECTION,
            rank=rank,
            address=frame_address(frame),
            peer=peer,
            detail=f"a {type(message).__name__} over another connection than the one that "
            "registered: not counted",
        )
        self._from_stranger(peer, message)

    def _create(self, peer: bytes, hello: Hello) -> Group | None:
        """A new group for `hello`, or None if it was refused (its name, its settings, the
        limit). A Hello that no group would admit creates none."""
        name = hello.group
        problem = group_name_problem(name)
        if problem is not None:
            error = Rejected(
                RejectReason.GROUP.value,
                f"field group: {_shown(name)} cannot name a group ({problem}); a group name is "
                f"1..{MAX_GROUP_NAME} printable characters without whitespace",
                expected=f"1..{MAX_GROUP_NAME} printable characters, no whitespace",
                got=_shown(name),
            )
            self._refuse(peer, hello, error)
            return None
        try:
            check_basics(hello, self.dp_size)
        except Rejected as refused:
            self._refuse(peer, hello, refused)
            return None
        if len(self.groups) >= self.max_groups and not self._evict_one():
            error = Rejected(
                RejectReason.GROUP_LIMIT.value,
                f"coordd serves {len(self.groups)} groups, its limit (--max-groups "
                f"{self.max_groups}): group {name!r} cannot be created",
                expected=f"at most {self.max_groups} groups",
                got=f"{len(self.groups) + 1} groups",
            )
            self._refuse(peer, hello, error)
            return None
        # Epochs grow across the groups too: a report's epoch names one group's epoch at most.
        epoch = self._last_epoch = max(int(self.wall() * 1000), self._last_epoch + 1)
        coordinator = Coordinator(
            self.dp_size,
            epoch=epoch,
            step_timeout=self.step_timeout,
            on_rank_loss=self.on_rank_loss,
        )
        group = Group(name, coordinator, Observer(coordinator.snapshot, name=name, wall=self.wall))
        self.groups[name] = group
        self.events.group_created(name, epoch, len(self.groups), self.max_groups)
        return group

    def _evict_one(self) -> bool:
        """Make room at the limit: drop the oldest group with no members and no open round
        (its ranks all left; a stranger's Hellos cannot hold the slots forever). True if one
        was dropped."""
        for name, group in self.groups.items():
            snap = group.coordinator.snapshot()
            if not snap.members and snap.round is None:
                del self.groups[name]
                self._open.pop(group, None)
                self._touched.discard(group)
                self._peer_group = {p: g for p, g in self._peer_group.items() if g is not group}
                self.events.group_dropped(name, snap.epoch)
                return True
        return False

    def _forget_departed(self) -> None:
        """Bound the peer map: keep the peers that are members of their group, and every peer
        of a group with an open round (one may be queued to rejoin at its end); a peer that
        left is answered as a stranger from then on."""
        live = {peer for group in self.groups.values() for peer in group.coordinator.holders()}
        self._peer_group = {
            p: g
            for p, g in self._peer_group.items()
            if p in live or g.coordinator.snapshot().round is not None
        }

    def _refuse(self, peer: bytes, hello: Hello, error: Rejected) -> None:
        reject = reject_message(error)
        self.events.rejected_hello(peer, hello, reject, _shown(hello.group))
        self._send_one(peer, reject)

    def _from_stranger(self, peer: bytes, message: ToCoordinator) -> None:
        """A message from a peer that registered with no group (never, before coordd
        restarted, or so long ago that it was forgotten). Answered at most
        STRANGER_ANSWERS_PER_S times a second over all strangers: a flood gets little back
        (and so queues little here)."""
        if isinstance(message, (Goodbye, Hello)):
            return
        if not self._stranger_answers.take():
            self.stats.stranger_answers_dropped += 1
            return
        if isinstance(message, Heartbeat):
            self._send_one(peer, message)
            return
        report = message  # a StepReport or a GatherReport
        error: CoordError
        if any(g.coordinator.snapshot().epoch == report.epoch for g in self.groups.values()):
            error = ProtocolError("report from a peer that has not registered", rank=report.dp_rank)
        else:
            error = CoordinatorUnavailable(
                f"epoch {report.epoch} is the current epoch of no group coordd serves "
                "(coordd restarted or the group re-formed): register again"
            )
        failure = failure_message(error, epoch=report.epoch, seq=report.seq, kind=report.kind)
        self.events.refused_report(peer, failure)
        self._send_one(peer, failure)

    # -- the one timer ----------------------------------------------------------------------

    def _schedule_deadline(self) -> None:
        """Arm the one timer for the earliest open deadline, lazily: a round that ends leaves
        it armed (it fires, finds nothing due and is armed again for what is open then) and a
        later deadline never moves it, so a round costs no timer call (cancelling and arming
        it again at each round's start and end cost two; about 4 us a round at dp=8)."""
        if not self._open or self._loop is None:
            return
        deadline = min(self._open.values())
        if deadline == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = deadline
        delay = max(0.0, deadline - self.clock())
        self._timer = self._loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        now = self.clock()
        for group, deadline in list(self._open.items()):
            if deadline <= now:
                self._touched.add(group)
                self._send(group.coordinator.on_deadline(now), group.observer)
        self._drain()


def _shown(name: str) -> str:
    """A group name as logs and answers show it: itself when valid, else its ascii() (cut)."""
    if group_name_problem(name) is None:
        return name
    return ascii(name[: MAX_GROUP_NAME + 1])
