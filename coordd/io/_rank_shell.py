"""The rank wire's registrations and refusals, in the shell: a rank's Hello, a frame that did
not decode, a member over its share of messages. The relay wire's peer is
`coordd.io._relay_hub.RelayHub`; the server's drain hands each its frames.

What to do is decided in the core (`coordd.core._registry`, `coordd.core._admission`) and
carried out here through `CarryOut` and `Guard`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from coordd.core._admission import MEMBER_CHECK, Admission
from coordd.core._logs import Aggregated
from coordd.core._peers import peer_label
from coordd.core._registry import Registry
from coordd.io._carry_out import CarryOut
from coordd.io._descriptors import Descriptors
from coordd.io._gate import HandshakeGate
from coordd.io._group import Group
from coordd.io._guard import Guard
from coordd.io._identity import frame_address
from coordd.io._outbox import Outbox
from coordd.io._relay_hub import RelayHub
from coordd.io._stats import ServerStats
from coordd.proto.messages import Hello, reject_message

__all__ = ["RankShell"]

log = logging.getLogger("coordd")

_SRCFD = int(zmq.SRCFD)
#: A member's message count is checked against its share when it is a multiple of this.
MEMBER_MASK = MEMBER_CHECK - 1


class RankShell:
    """Carries out the rank wire's registrations and its members' faults of form or volume.

    `catch_up`: the server's `catch_up_monitor` (a Hello is routed with the monitor read, as a
    closed connection's descriptor may be the Hello's now)."""

    def __init__(
        self,
        registry: Registry[Group],
        *,
        admission: Admission,
        guard: Guard,
        carry_out: CarryOut,
        outbox: Outbox,
        descriptors: Descriptors,
        relays: RelayHub,
        stats: ServerStats,
        gate: HandshakeGate | None,
        catch_up: Callable[[], bool],
        clock: Callable[[], float],
        wall: Callable[[], float],
    ) -> None:
        self.registry = registry
        self.admission = admission
        self.guard = guard
        self.carry_out = carry_out
        self.outbox = outbox
        self.descriptors = descriptors
        self.relays = relays
        self.stats = stats
        self.gate = gate
        self.catch_up = catch_up
        self.clock = clock
        self.wall = wall
        #: Log lines a peer could cause once per message: aggregated.
        self.bad_frame_log = Aggregated(log, "bad frame dropped", clock=clock)

    def member_over(self, peer: bytes, group: Group, fd: int, count: int) -> bool:
        """Member `peer` sent `count` messages over `fd` in this window: over its share, its
        connection is ended and its rank lost (`Guard.member_over`); True if it was."""
        detail = self.guard.member_over(peer, group, fd, count)
        if detail is None:
            return False
        self.carry_out(self.registry.violation(peer, detail, self.clock()))
        return True

    def bad_frame(self, peer: bytes, why: str, frame: zmq.Frame | None = None) -> bool:
        """A frame that did not decode: from a member over its connection, a protocol
        violation that fails its group's round at once naming it (and counts toward its
        share, so junk floods are cut off); from anyone else, a stranger's message. True if
        a member was cut off."""
        cut = False
        if frame is not None:
            srcfd = frame.get(_SRCFD)
            group = self.registry.member(peer, srcfd)
            if group is None:
                self.guard.stranger_sent(peer, srcfd)
            else:
                self.carry_out(self.registry.undecodable(peer, srcfd, why, self.clock()))
                counts = self.admission.member_counts
                count = counts[peer] = counts.get(peer, 0) + 1
                if not count & MEMBER_MASK:
                    cut = self.member_over(peer, group, srcfd, count)
        self.stats.bad_frames += 1
        # One line each only at --log-level debug (the chaos checker counts them); the
        # warning is aggregated: a flood costs a few lines.
        label = peer_label(peer)
        log.debug("dropped a bad frame from %s: %s", label, why)
        self.bad_frame_log(peer=label, why=why, total=self.stats.bad_frames)
        return cut

    def hello(self, peer: bytes, hello: Hello, frame: zmq.Frame) -> None:
        """Route a Hello to the group it names (`coordd.core._registry.Registry.hello`), with
        the monitor read first: a closed connection's descriptor may be this one's now."""
        self.catch_up()
        fd = frame.get(_SRCFD)
        if not self.descriptors.claim(peer, fd):
            log.debug("dropped a Hello an older connection on fd %d queued: %s", fd, hello)
            return
        if self.relays.holds(hello.group):
            self.outbox.send_one(peer, reject_message(self.relays.flat_refusal(hello.group)))
            return
        registry = self.registry
        key = ""
        if registry.key_refusal is not None:
            try:
                key = str(frame.get("User-Id"))
            except zmq.ZMQError:
                key = ""
        address = frame_address(frame)
        now, wall = self.clock(), self.wall()
        self.carry_out(registry.hello(peer, hello, fd, now, wall, address=address, key=key))
        if registry.peer_on(fd) == peer:
            self.descriptors.note(peer, fd)
        gate = self.gate
        if gate is not None and address and registry.member(peer, fd) is not None:
            # its process (ipc) or address (tcp) registered a rank: quiet is earned
            gate.earned.append(address.encode())
