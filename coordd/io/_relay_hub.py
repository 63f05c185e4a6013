"""The root's side of relays, in the shell: relay messages that arrive on coordd's ROUTER go to
one `TreeCoordinator` per relayed group, and its answers go back, encoded once per round.

A relay is a connection, as a rank is: its registration (`RelayHello`) binds its routing id
to the descriptor it came over, and only messages over that descriptor count for it; the
monitor's close of that descriptor is the relay's loss (`RankLost` naming all its ranks). With
CURVE keys bound to ranks (`coordd keygen`, `--curve-client-keys`), a relay's key must be bound
to every rank it claims (`key_refusal`): one node's key cannot speak for another node's ranks.

A group is served flat (ranks connect to this coordd) or through relays, never both: a Hello
for a relayed group, or a relay's registration for a flat group, is refused.

Only a coordd started as a root (`--relay-root`) takes relays. Any other answers the relay
wire as junk: nothing is kept, the frame is a stranger's bad frame (flood-counted, the
aggregated log line), and a `RelayHello` gets one `Rejected(not_root)` naming the option, so
a relay pointed at the wrong coordd says why at once instead of waiting for a root.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence

import zmq

from coordd.core._group_names import GroupRules, group_name_problem, shown
from coordd.core._group_slots import limit_refusal, to_drop
from coordd.core._logs import Aggregated
from coordd.io._descriptors import Descriptors
from coordd.io._identity import frame_address
from coordd.ops.view import RelayedGroup, RelayRow
from coordd.proto.errors import ProtocolError, Rejected
from coordd.proto.messages import RejectReason, encode, reject_message
from coordd.proto.relay_messages import (
    RelayAnswer,
    RelayHello,
    RelayUp,
    decode_from_relay,
)
from coordd.proto.snapshot import OnRankLoss
from coordd.proto.tree import RelaySend, TreeCoordinator

log = logging.getLogger("coordd")

_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_SRCFD = int(zmq.SRCFD)
_send_frame = zmq.backend.Socket.send


class RelayHub:
    """Every relayed group of one coordd (the root), its relays' connections and the timer."""

    def __init__(
        self,
        sock: zmq.Socket,
        *,
        descriptors: Descriptors,
        dp_size: int,
        step_timeout: float,
        max_groups: int,
        rules: GroupRules,
        flat_groups: Mapping[str, object],
        clock: Callable[[], float],
        wall: Callable[[], float],
        key_refusal: Callable[[str, str, int], str | None] | None = None,
        on_rank_loss: OnRankLoss = OnRankLoss.FAIL,
        root: bool = False,
    ) -> None:
        self._sock = sock
        #: Started with --relay-root: relays may register (else `from_stranger` takes none).
        self.root = root
        #: Not a root: whether a RelayHello may be answered now (the server gives admission's
        #: budget for strangers' answers).
        self.may_answer: Callable[[float], bool] = lambda now: True
        self._descriptors = descriptors
        self.dp_size = dp_size
        self.step_timeout = step_timeout
        #: The root's --on-rank-loss: every relayed group's, which relays learn from Welcome.
        self.on_rank_loss = on_rank_loss
        self.max_groups = max_groups
        self.rules = rules
        self._flat = flat_groups
        self.clock = clock
        self.wall = wall
        self.trees: dict[str, TreeCoordinator] = {}
        self.peer_fd: dict[bytes, int] = {}
        self.fd_peer: dict[int, bytes] = {}
        #: Each registered relay's connection address (shown in /status)
        self.addresses: dict[bytes, str] = {}
        #: With CURVE keys bound to ranks: why key (z85) may not speak for these ranks of this
        #: group, or None (`coordd.io._curve.CurveGate.key_refusal`, asked for every rank).
        self.key_refusal = key_refusal
        self.loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._last_epoch = 0
        #: Messages from relays handled, and refused (undecodable as a relay's, or not over
        #: the connection that registered).
        self.messages = 0
        self.refused = 0
        #: A refused registration is a line a peer can cause once per message: aggregated.
        self.refused_log = Aggregated(log, "relay refused", clock=clock)

    # -- input ------------------------------------------------------------------------------

    def from_stranger(self, peer: bytes, fd: int, frame: zmq.Frame) -> bool:
        """A frame the rank wire did not decode from a peer in no group over `fd`: True if it
        is a relay's message (handled here). Not if an older connection on `fd` queued it
        (`Descriptors.claim`); a relay that registers is bound to its connection's socket. Not
        a root: always False (a RelayHello is answered `Rejected(not_root)` first)."""
        if not self.root:
            self._not_root(peer, frame)
            return False
        if not (self._descriptors.claim(peer, fd) and self.handle(peer, frame)):
            return False
        if self.peer_fd.get(peer) == fd:
            self._descriptors.note(peer, fd)
        return True

    def _not_root(self, peer: bytes, frame: zmq.Frame) -> None:
        """Answer a RelayHello to a coordd that takes no relays with why (once per message,
        as a refused Hello is; the caller counts the frame toward the flood cut-off)."""
        try:
            message = decode_from_relay(frame.buffer)
        except ProtocolError:
            return
        if type(message) is not RelayHello or peer[:1] == b"\x00":
            return
        self.refused += 1
        if not self.may_answer(self.clock()):
            return
        error = Rejected(
            RejectReason.NOT_ROOT.value,
            "this coordd serves its groups flat and takes no relays: start the root relays "
            "connect to with --relay-root (COORDD_RELAY_ROOT=1)",
            expected="a coordd started with --relay-root",
            got="a coordd without it",
        )
        answer = RelayAnswer(group=shown(message.group)[:256], message=reject_message(error))
        self.send((RelaySend((peer,), answer),))

    def handle(self, peer: bytes, frame: zmq.Frame) -> bool:
        """A frame the rank wire did not decode from a peer that holds no rank: True if it is
        a relay's message (handled here), False if not (a bad frame, as before)."""
        try:
            message = decode_from_relay(frame.buffer)
        except ProtocolError:
            return False
        self.messages += 1
        fd = frame.get(_SRCFD)
        now = self.clock()
        if type(message) is RelayHello:
            key = ""
            if self.key_refusal is not None:
                try:
                    key = str(frame.get("User-Id"))
                except zmq.ZMQError:
                    key = ""
            self.send(self._hello(peer, message, fd, key, now))
            if self.peer_fd.get(peer) == fd:
                self.addresses[peer] = frame_address(frame)
        else:
            registered = self.peer_fd.get(peer)
            tree = self.trees.get(message.group)
            if registered != fd or tree is None:
                self.refused += 1
                return True
            self.send(tree.receive(peer, message, now))
        self.arm()
        return True

    def _hello(
        self, peer: bytes, hello: RelayHello, fd: int, key: str, now: float
    ) -> Sequence[RelaySend]:
        registered = self.peer_fd.get(peer)
        if peer[:1] == b"\x00" or (registered is not None and registered != fd):
            self.refused += 1
            return ()
        error = self._refusal(hello, key)
        if error is not None:
            return self._refuse(peer, hello, error)
        tree = self.trees.get(hello.group)
        if tree is None:
            return self._create(peer, hello, fd, now)
        sends = tree.receive(peer, hello, now)
        if peer in tree.holders():
            self._bind(peer, fd)
        return sends

    def _create(self, peer: bytes, hello: RelayHello, fd: int, now: float) -> Sequence[RelaySend]:
        """A new relayed group, kept only if its first registration stands and it gets a
        slot (`coordd.core._group_slots`, as a flat group's): a registration that no group
        would admit keeps none, and makes no idle group give its slot up."""
        epoch = max(int(self.wall() * 1000), self._last_epoch + 1)
        tree = TreeCoordinator(
            self.dp_size,
            group=hello.group,
            epoch=epoch,
            step_timeout=self.step_timeout,
            on_rank_loss=self.on_rank_loss,
        )
        sends = tree.receive(peer, hello, now)
        if peer not in tree.holders():
            return sends  # refused by the group's own rules
        if len(self.trees) >= self.max_groups:
            dropped = to_drop(self.trees, self.rules, _idle)
            if dropped is not None:
                old = self.trees.pop(dropped)
                log.info(
                    "relayed group %s dropped (epoch %d): no relay holds it", dropped, old.epoch
                )
        limit = limit_refusal(hello.group, self.trees, self.rules, self.max_groups, "relayed ")
        if limit is not None:
            return self._refuse(peer, hello, limit)
        self._last_epoch = epoch
        self.trees[hello.group] = tree
        self._bind(peer, fd)
        log.info("relayed group %s created (epoch %d)", hello.group, epoch)
        return sends

    def _bind(self, peer: bytes, fd: int) -> None:
        self.peer_fd[peer] = fd
        self.fd_peer[fd] = peer

    def _refuse(self, peer: bytes, hello: RelayHello, error: Rejected) -> Sequence[RelaySend]:
        self.refused_log(relay=shown(hello.relay), group=shown(hello.group), detail=error.detail)
        answer = RelayAnswer(group=shown(hello.group)[:256], message=reject_message(error))
        return (RelaySend((peer,), answer),)

    def _refusal(self, hello: RelayHello, key: str) -> Rejected | None:
        name = hello.group
        problem = group_name_problem(name)
        if problem is not None:
            return Rejected(
                RejectReason.GROUP.value, f"{shown(name)} cannot name a group ({problem})"
            )
        if name not in self.trees and not self.rules.admits(name):
            return Rejected(
                RejectReason.GROUP_UNEXPECTED.value,
                f"group {name!r} is not one this deployment expects (coordd --groups {self.rules})",
                expected=str(self.rules),
                got=name,
            )
        if name in self._flat:
            return Rejected(
                RejectReason.GROUP.value,
                f"group {name!r} is served flat by this coordd (its ranks connect here): a "
                "group is served flat or through relays, not both",
                expected="a group served through relays",
                got=name,
            )
        if self.key_refusal is not None:
            for rank in hello.ranks:
                why = self.key_refusal(key, name, rank)
                if why is not None:
                    return Rejected(
                        RejectReason.CURVE_KEY.value,
                        f"relay {shown(hello.relay)} may not speak for dp_rank {rank} of group "
                        f"{name} (it claims ranks {hello.ranks}): {why}",
                        expected="ranks its CURVE key is bound to",
                        got=f"ranks {hello.ranks} of group {name}",
                    )
        return None

    def closed(self, fd: int) -> None:
        """The connection on `fd` closed: if a relay registered over it, its groups lose it."""
        peer = self.fd_peer.pop(fd, None)
        if peer is None or self.peer_fd.get(peer) != fd:
            return
        del self.peer_fd[peer]
        self.addresses.pop(peer, None)
        now = self.clock()
        for tree in self.trees.values():
            self.send(tree.relay_lost(peer, now, "connection closed"))
        self.arm()

    def views(self) -> dict[str, RelayedGroup]:
        """Every relayed group as ops reads it (built when asked: probes and scrapes)."""
        return {
            name: RelayedGroup(
                tree.snapshot(),
                tuple(
                    RelayRow(member.name, member.ranks, self.addresses.get(peer, ""))
                    for peer, member in sorted(
                        tree.relays().items(), key=lambda item: item[1].ranks
                    )
                ),
            )
            for name, tree in self.trees.items()
        }

    def fds(self) -> set[int]:
        """The descriptors of relays that hold ranks of a group (never shut by admission); a
        relay only waiting to re-form a group holds nothing yet."""
        holding = {peer for tree in self.trees.values() for peer in tree.relays()}
        return {fd for peer, fd in self.peer_fd.items() if peer in holding}

    def _release(self) -> None:
        """Forget the connections of relays no group counts any more (a wait refused): they
        are strangers again, under the grace and the flood cut-off."""
        holders = {peer for tree in self.trees.values() for peer in tree.holders()}
        for peer in [p for p in self.peer_fd if p not in holders]:
            fd = self.peer_fd.pop(peer)
            if self.fd_peer.get(fd) == peer:
                del self.fd_peer[fd]
            self.addresses.pop(peer, None)

    def holds(self, group: str) -> bool:
        return group in self.trees

    def flat_refusal(self, group: str) -> Rejected:
        """Why a rank's own Hello for relayed `group` is refused."""
        return Rejected(
            RejectReason.GROUP.value,
            f"group {group!r} is served through relays: register with your node's relay",
            expected="your node's relay (coordd serve --relay-to)",
            got=group,
        )

    # -- output and the timer ---------------------------------------------------------------

    def send(self, sends: Sequence[RelaySend]) -> None:
        sock = self._sock
        for peers, message in sends:
            payload = encode(message)
            for peer in peers:
                try:
                    _send_frame(sock, peer, _SNDMORE_NOBLOCK)
                    _send_frame(sock, payload, _NOBLOCK)
                except zmq.ZMQError as exc:
                    log.debug("dropped a frame to a relay: %s", exc)

    def arm(self) -> None:
        """Arm the timer for the earliest relayed round's deadline (a few groups: a scan)."""
        deadlines = [d for t in self.trees.values() if (d := t.next_deadline()) is not None]
        at = min(deadlines) if deadlines else None
        if at == self._timer_at or self.loop is None:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None:
            self._timer = self.loop.call_later(max(0.0, at - self.clock()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        now = self.clock()
        for tree in self.trees.values():
            self.send(tree.on_deadline(now))
        self._release()
        self.arm()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _idle(tree: TreeCoordinator) -> bool:
    """No relay holds or waits for the group and no round is open: its slot may go."""
    return not tree.holders() and tree.snapshot().round is None


def relay_message(message: RelayUp) -> bytes:
    """A relay's message as it goes on the wire (tests and tools)."""
    return encode(message)
