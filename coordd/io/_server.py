"""The daemon's I/O shell: moves bytes between one ZeroMQ ROUTER socket and the groups'
`Coordinator`s.

One coordd serves several named groups (vLLM builds one DP group per TP/PP position of its
workers, plus one for its engine cores), each with its own `Coordinator` and `Observer`; a peer
(ZeroMQ routing id) belongs to the group it registered with, so a fault in one group never
touches another's rounds. The loop watches the socket's descriptor and drains every queued
frame in one callback; a decision is encoded once for every rank; the only timer is the earliest
deadline over the groups.

Liveness comes from libzmq's ZMTP heartbeats: a rank that stops answering has its connection
closed, the socket monitor reports the closed descriptor, and the descriptor a rank registered
from (the SRCFD of its Hello) names the rank lost. A rank is the connection that registered it
(`coordd.io._identity`); routing ids are never logged or shown.

Each wire has its shell beside the server: `coordd.io._rank_shell` (a rank's Hello, bad
frames, a member over its share) and `coordd.io._relay_hub` (relays' registrations and
bundles); the server drains the socket and hands each its frames.

What to do is decided in the sans-IO core and carried out here (in the manner of h11): the
group registry (`coordd.core._registry`) returns actions (`coordd.io._carry_out`), and the
admission of peers that hold no rank (`coordd.core._admission`) returns `Shut`s, which
`coordd.io._guard` carries out once the server has caught up with its monitor
(`catch_up_monitor`): every descriptor then names a connection libzmq holds.
"""

# Whole though over 500 lines: the drain, the monitor and the sends share the one socket and
# its counters on the hot path; the parts that do not (actions, outbox, guard, descriptors, the
# rank wire's registrations and the relay wire) live apart.

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence

import zmq

from coordd.core._admission import Admission
from coordd.core._group_names import GroupRules
from coordd.core._registry import DETACHED, MEMBER, Registry
from coordd.core._settings import ServerSettings
from coordd.io import _limits as limits
from coordd.io._carry_out import CarryOut
from coordd.io._curve import CurveGate
from coordd.io._deadlines import Deadlines
from coordd.io._descriptors import Descriptors
from coordd.io._group import Group
from coordd.io._guard import Guard
from coordd.io._identity import frame_address
from coordd.io._outbox import Outbox
from coordd.io._rank_shell import MEMBER_MASK, RankShell
from coordd.io._relay_hub import RelayHub
from coordd.io._router import drop_parts, open_router
from coordd.io._stats import ServerStats, shell_counters
from coordd.ops.observer import Observer, ServerEvents
from coordd.ops.view import RelayedGroup, ShellCounters
from coordd.proto.coordinator import Send
from coordd.proto.errors import ProtocolError
from coordd.proto.messages import (
    GatherReport,
    Hello,
    StepReport,
    decode_to_coordinator,
)

__all__ = ["CoordServer"]

log = logging.getLogger("coordd")

# Plain ints for the hot path: pyzmq's constants are enum.Flag members, and `int & Flag`
# builds a new Flag through enum's Python code.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_SRCFD = int(zmq.SRCFD)
_ACCEPTED = int(zmq.EVENT_ACCEPTED)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)

#: Most messages handled in one turn of the event loop: then the loop runs its timers (step
#: timeouts), the HTTP endpoints and the monitor, and the drain goes on at its next turn. One
#: peer sending as fast as it can no longer holds the loop for the length of its flood.
DRAIN_BUDGET = 512
#: Most parts of a refused multipart message dropped in one turn of the loop.
DROP_BUDGET = 50_000
#: Turns in a row that closed connections may wait for the frames before them to be read
#: (so a rank's last report counts before its loss), before the monitor goes first anyway.
MONITOR_PATIENCE = 8
#: Passes over the monitor's queued events before an action on descriptors gives up (and
#: waits for its next chance): each pass reads up to 4 * DRAIN_BUDGET events.
MONITOR_PASSES = 8


class CoordServer:
    """Serve every DP group on one ROUTER socket bound to `settings.address`: the I/O shell
    around the group registry (`coordd.core._registry`) and the admission of strangers
    (`coordd.core._admission`). It drains the socket and the monitor, runs the one timer, and
    carries out what those decide. `curve`: the CURVE gate, when coordd runs with CURVE."""

    def __init__(
        self,
        settings: ServerSettings,
        *,
        context: zmq.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        curve: CurveGate | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.wall = wall
        self.started_wall = wall()
        self._curve = curve
        self.registry: Registry[Group] = Registry(
            settings.dp_size,
            lambda name, c: Group(name, c, Observer(c.snapshot, name=name, wall=wall)),
            max_groups=settings.max_groups,
            step_timeout=settings.step_timeout,
            on_rank_loss=settings.on_rank_loss,
            rules=GroupRules(settings.groups, always=settings.expected_names),
            key_refusal=curve.key_refusal if curve is not None and curve.binds else None,
        )
        self.stats = ServerStats()
        #: Refusals outside any group (bad names, the limit, reports from unknown peers).
        self.events = ServerEvents()
        self._router = open_router(
            context or zmq.Context(),
            settings.address,
            heartbeat_interval=settings.heartbeat_interval,
            heartbeat_timeout=settings.heartbeat_timeout,
            max_connections=settings.max_connections,
            ipc_mode=settings.ipc_mode,
            gated=settings.gated,
            max_handshake_rate=settings.max_handshake_rate,
            handshake_ipv4_prefix=settings.handshake_ipv4_prefix,
            configure_socket=curve.configure if curve is not None else None,
        )
        self._sock = self._router.sock
        self._outbox = Outbox(self._sock, self.stats)
        self._monitor = self._router.monitor
        #: Whose each registered descriptor is now (a closed one's number may be reused).
        self.descriptors = Descriptors(
            lambda fd: self.registry.peer_on(fd) or self.relays.fd_peer.get(fd),
            self._connection_closed,
        )
        #: Relays' registrations and bundles: the groups served through relays.
        self.relays = RelayHub(
            self._sock,
            descriptors=self.descriptors,
            dp_size=settings.dp_size,
            step_timeout=settings.step_timeout,
            max_groups=settings.max_groups,
            rules=self.registry.rules,
            flat_groups=self.registry.groups,
            clock=clock,
            wall=wall,
            key_refusal=curve.key_refusal if curve is not None and curve.binds else None,
            on_rank_loss=settings.on_rank_loss,
            root=settings.relay_root,
        )
        #: The connections that hold no rank: cap, flood cut-off, grace, memory pressure.
        self.admission = Admission(
            settings.max_connections,
            self._held_fds,
            now=clock(),
            evictable=self.registry.evictable_fds,
        )
        self.relays.may_answer = self.admission.may_answer
        #: Carries out admission's decisions: shutdowns, the grace timer, the memory watch.
        self.guard = Guard(
            self.admission,
            self,
            clock=clock,
            stranger_grace=settings.stranger_grace,
            max_rss_mb=settings.max_rss_mb,
            gate=self._router.gate,
        )
        #: Dropping the rest of a refused multipart message (over several turns).
        self._dropping = False
        self._again_pending = False
        self._monitor_waited = 0
        #: Set while frames are handled (a close read meanwhile waits for none).
        self._in_frames = False
        #: Set while a monitor event is carried out (a catch-up meanwhile reads no other).
        self._in_monitor = False
        #: Groups with an open round, and the one timer for their deadlines.
        self._deadlines = Deadlines(clock, self)
        #: Carries out what the registry decides.
        self._carry_out = CarryOut(
            self.registry,
            self.admission,
            self._deadlines,
            self._outbox,
            events=self.events,
            stats=self.stats,
            watch=self._router.watch,
            max_groups=settings.max_groups,
            clock=clock,
        )
        #: The rank wire's registrations and faults (the relay wire's are `relays`').
        self.ranks = RankShell(
            self.registry,
            admission=self.admission,
            guard=self.guard,
            carry_out=self._carry_out,
            outbox=self._outbox,
            descriptors=self.descriptors,
            relays=self.relays,
            stats=self.stats,
            gate=self._router.gate,
            catch_up=self.catch_up_monitor,
            clock=clock,
            wall=wall,
        )
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def bound_address(self) -> str:
        return self._router.bound_address

    @property
    def groups(self) -> dict[str, Group]:
        """The groups by name, in the order they were created."""
        return self.registry.groups

    async def serve(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then say goodbye to every rank and close."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.fileno(), self._on_frames)
        self._loop.add_reader(self._monitor.fileno(), self.drain)
        self._deadlines.loop = self._loop
        self.relays.loop = self._loop
        logs = (self.ranks.bad_frame_log, self.relays.refused_log, *self.events.aggregated())
        for aggregated in logs:
            aggregated.schedule = self._loop.call_later
        self.guard.start(self._loop)
        self.drain()
        log.info(
            "coordd serving dp=%d on %s (at most %d groups)",
            self.settings.dp_size,
            self.bound_address,
            self.settings.max_groups,
        )
        try:
            await stop.wait()
        finally:
            self._loop.remove_reader(self._sock.fileno())
            self._loop.remove_reader(self._monitor.fileno())
            self._deadlines.cancel()
            self.relays.cancel()
            self.guard.stop()
            for group in self.groups.values():
                self.send(group.coordinator.shutdown(), group.observer)
            self.close(linger=0.5)

    def close(self, linger: float = 0.0) -> None:
        self._router.close(linger)

    def counters(self) -> ShellCounters:
        """The shell's counts now, for metrics and /status (`coordd.ops.view.ServerView`)."""
        curve = self._curve
        return shell_counters(
            self.stats,
            self.admission,
            self.guard.memory,
            self._router.gate,
            None if curve is None else lambda: curve.refused,
        )

    def takeovers_refused(self) -> Counter[tuple[str, str]]:
        """Attempts to speak for a rank over a connection that did not register it."""
        return self.registry.takeovers.refused

    def group_of(self, peer: bytes) -> Group | None:
        """The group `peer` registered with, or None."""
        return self.registry.group_of(peer)

    def introduced_fds(self) -> Collection[int]:
        """The descriptors of open connections that said a Hello (a rank's or a relay's)."""
        relays = self.relays.fd_peer
        if not relays:
            return self.registry.introduced_fds()
        return {*self.registry.introduced_fds(), *relays}

    def _held_fds(self) -> set[int]:
        """Descriptors admission never shuts: registered ranks' and relays'."""
        fds = self.registry.registered_fds()
        return fds | self.relays.fds() if self.relays.fd_peer else fds

    def relayed_groups(self) -> dict[str, RelayedGroup]:
        """The groups served through relays, as readiness, /status and metrics read them."""
        return self.relays.views()

    # -- the hot path -----------------------------------------------------------------------

    def drain(self) -> None:
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
        if self.admission.over():
            self.catch_up_monitor()  # which closes the excess
        self._deadlines.after_drain()
        if more:
            self._again()

    def _on_frames(self) -> None:
        """The ROUTER's FD fired: frames only (the monitor's own FD brings closed connections
        to `drain`, and only work on the monitor socket can swallow its edge)."""
        self._in_frames = True  # `_drain_frames`, written out: once per wakeup
        try:
            more = self._handle_frames()
        finally:
            self._in_frames = False
        self._deadlines.after_drain()
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
            self.drain()

    def _drain_frames(self) -> bool:
        """Handle up to DRAIN_BUDGET queued messages; True if some may be left."""
        self._in_frames = True
        try:
            return self._handle_frames()
        finally:
            self._in_frames = False

    def _handle_frames(self) -> bool:
        admission = self.admission
        if admission.pressure.on:
            self.catch_up_monitor()  # memory pressure: new connections are shut at once
        if self._dropping and not self._drop_parts():
            return True
        now = self.clock()
        if now >= admission.window_end:
            self.guard.new_window(now, self.groups.values())
        # locals for what every message uses (most wakeups bring one: no more than that)
        sock = self._sock
        recv = sock.recv
        stats = self.stats
        clock = self.clock
        standing = self.registry.standing
        touched = self._deadlines.touched
        member_counts = admission.member_counts
        relay_peers = self.relays.peer_fd
        ranks = self.ranks
        # what connections coordd shut down still have queued is dropped undecoded (a
        # flood's backlog); not at debug level, which logs a line per bad frame
        shut = admission if admission.shut and not log.isEnabledFor(logging.DEBUG) else None
        for handled in range(DRAIN_BUDGET):
            # Most wakeups bring one message: after it, one EVENTS check is cheaper than the
            # zmq.Again that would end the loop.
            if handled == 1 and not int(sock.getsockopt(_EVENTS)) & _POLLIN:
                return False
            try:
                # A ROUTER's routing id part is always followed by a payload part (libzmq
                # prefetches it), so the id is read as bytes with no RCVMORE check.
                peer = recv(_NOBLOCK)
            except zmq.Again:
                return False
            stats.frames_in += 1
            frame = recv(_NOBLOCK, copy=False)  # a Frame (not copied), for its SRCFD
            if frame.more:
                # refused at its second payload part; the rest is dropped part by part
                self.ranks.bad_frame(peer, "more than one payload frame", frame)
                self._dropping = True
                if not self._drop_parts():
                    return True
                continue
            srcfd = frame.get(_SRCFD)
            group, stands = standing(peer, srcfd)
            if (
                group is None
                and shut is not None
                and srcfd in shut.shut
                and shut.from_shut(srcfd, limits.socket_ident(srcfd))
            ):
                continue
            if relay_peers and peer in relay_peers and self.relays.handle(peer, frame):
                continue  # a registered relay's bundle: no rank decode first
            try:
                message = decode_to_coordinator(frame.buffer)
            except ProtocolError as exc:
                if group is None and self.relays.from_stranger(peer, srcfd, frame):
                    # a stranger's relay messages count toward the cut-off, as its Hellos do
                    self.guard.stranger_sent(peer, srcfd)
                    continue
                if ranks.bad_frame(peer, str(exc), frame):
                    return True  # a member cut off: the next drain drops what it queued
                continue
            if group is None:
                # a stranger: its Hellos count toward the flood cut-off as much as the rest
                self.guard.stranger_sent(peer, srcfd)
                if type(message) is Hello:
                    ranks.hello(peer, message, frame)
                else:
                    self._carry_out.stranger(peer, message)
                continue
            coordinator = group.coordinator
            if stands == MEMBER:
                # a member's input is bounded too (one report per round, and a few more)
                count = member_counts.get(peer, 0) + 1
                member_counts[peer] = count
                if not count & MEMBER_MASK and ranks.member_over(peer, group, srcfd, count):
                    return True  # cut off: the next drain drops what it queued undecoded
                if type(message) is StepReport or type(message) is GatherReport:
                    waited = message.waited_us
                    # the rank's wait for its previous round, counted only under the rank
                    # that sent it (a report claiming another rank is refused in `receive`)
                    if waited >= 0 and coordinator.rank_of(peer) == message.dp_rank:
                        group.observer.waited(message.dp_rank, message.seq, waited)
                elif type(message) is Hello:
                    ranks.hello(peer, message, frame)
                    continue
            elif stands == DETACHED:
                # its registering connection closed: a stranger now, for the cut-off
                self.guard.stranger_sent(peer, srcfd)
                if type(message) is Hello:
                    ranks.hello(peer, message, frame)
                    continue
            else:
                address = frame_address(frame)
                other = self.registry.other_connection(peer, message, address, clock())
                self._carry_out(other)
                continue
            touched.add(group)
            sends = coordinator.receive(peer, message, clock())
            if sends:  # most reports only join the open round: nothing to send
                self._outbox.send(sends, group.observer)
        return True

    def _drop_parts(self) -> bool:
        """Drop parts of the refused multipart message being read, up to DROP_BUDGET; True
        once its last part is gone."""
        done, dropped = drop_parts(self._sock, DROP_BUDGET)
        self.stats.parts_dropped += dropped
        self._dropping = not done
        return done

    def _drain_monitor(self) -> bool:
        """Accepted and closed connections (a rank that registered over a closed one is lost,
        in its own group only). True if any event."""
        monitor = self._monitor
        registry = self.registry
        seen = False
        budget = 4 * DRAIN_BUDGET
        self._in_monitor = True
        try:
            while budget and int(monitor.getsockopt(_EVENTS)) & _POLLIN:
                budget -= 1
                seen = True
                frames = monitor.recv_multipart(_NOBLOCK)
                event, fd = struct.unpack("=HI", frames[0][:6])
                if event == _ACCEPTED:
                    self.guard.accepted(fd)
                elif event == _DISCONNECTED:
                    if self.descriptors.closed_early(fd):
                        continue
                    if not self._in_frames and registry.holds_fd(fd):
                        # what that rank sent just before it closed (a Goodbye, a last
                        # report) can come after the frames' drain, with its close: it
                        # counts first
                        closing = self.descriptors.closing
                        closing.add(fd)
                        self._drain_frames()
                        if fd not in closing:
                            continue  # carried out when a new connection spoke over fd
                        closing.discard(fd)
                    self._connection_closed(fd)
        finally:
            self._in_monitor = False
        return seen

    def _connection_closed(self, fd: int) -> None:
        self.descriptors.forget(fd)
        self.admission.closed_fd(fd)
        self._carry_out(self.registry.closed(fd, self.clock()))
        if fd in self.relays.fd_peer:
            self.relays.closed(fd)

    def catch_up_monitor(self) -> bool:
        """Read the monitor's events (a bounded number of passes) and tell the groups of ranks
        lost in them; True if none is left, so that every descriptor admission and the
        registry hold is one libzmq holds (a close is announced before its descriptor is
        released): what acting on a descriptor needs."""
        if self._in_monitor:
            return False  # within an event's carrying out: the events after it wait
        for _ in range(MONITOR_PASSES):
            if not self._drain_monitor():
                break
        self._deadlines.after_drain()
        if int(self._monitor.getsockopt(_EVENTS)) & _POLLIN:
            return False
        if self.admission.over():
            self.guard.enforce_cap()
        return True

    def send(self, sends: Sequence[Send], observer: Observer) -> None:
        self._outbox.send(sends, observer)

    def messages_queued(self) -> bool:
        """Whether messages are queued unread (the memory guard's check, between drains)."""
        if int(self._sock.getsockopt(_EVENTS)) & _POLLIN:
            self._again()  # EVENTS may have taken the FD's edge: drain without it
            return True
        return False
