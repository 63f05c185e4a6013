"""The group registry, pure (no sockets; the time is passed in): which group a `Hello` goes
to, creating groups up to `max_groups` (dropping one without members to make room), refusing
what no group may admit, and which group and connection each peer (routing id) belongs to.

It returns actions (`coordd.core._registry_actions`) that the shell carries out (`Deliver` a
group's sends, `Refuse` a Hello, tell a group's observer, answer a peer as a stranger, log a
`LogEvent`); the groups' state machines (`coordd.proto.coordinator.Coordinator`) are driven
here, so their sends come back inside `Deliver`.

The rules:
- a group name is 1..MAX_GROUP_NAME printable characters without whitespace, and names a
  group the deployment expects (`GroupRules`: `--groups` names and fnmatch patterns); a Hello
  for another is refused before anything is kept of it (no group, no peer entry, no takeover
  record under its name): the peer stays a stranger, under the flood cut-off and the grace;
- a refused Hello leaves nothing behind: only a peer that holds a rank (or waits to rejoin)
  is in the peer -> group map and the descriptor maps (which exempt it from the grace);
- `--max-groups` bounds the groups admitted by a pattern; an exactly named group always gets
  a slot (a group without members is dropped first to make room);
- a routing id that starts with a zero byte (libzmq's own names, or a peer imitating one)
  never registers (`coordd.io._gate` says why);
- a message from a routing id counts only if it came over the descriptor its Hello came in
  on, while that connection is open (`speaks_for`; a rank is the connection that registered
  it);
- with CURVE keys bound to ranks or groups, a connection may register only as a rank of a
  group its key is bound to (`key_refusal`; `coordd.core._grants`);
- a client belongs to one group: a member of one cannot register with another;
- the peer map is bounded: a peer that left (and holds no rank, and no round of its group is
  open) is forgotten past 2 * dp * groups + 256 entries.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Generic

from coordd.core._group_names import MAX_GROUP_NAME, GroupRules, group_name_problem, shown
from coordd.core._group_slots import limit_refusal, to_drop
from coordd.core._logs import LogEvent
from coordd.core._peers import Takeovers
from coordd.core._registry_actions import (
    Action,
    AsStranger,
    Deliver,
    G,
    GroupCreated,
    GroupDropped,
    GroupLike,
    Lost,
    Refuse,
    Registering,
)
from coordd.proto.coordinator import Coordinator
from coordd.proto.errors import Rejected
from coordd.proto.membership import check_basics
from coordd.proto.messages import Hello, Reject, RejectReason, ToCoordinator
from coordd.proto.snapshot import OnRankLoss

# How a message stands with the registry (`Registry.standing`).
STRANGER = 0  # its peer belongs to no group: a stranger's message
MEMBER = 1  # over the connection that registered its peer
DETACHED = 2  # its peer's registering connection closed: it counts, and as a stranger's too
OTHER_CONNECTION = 3  # over another connection while the registering one is open: refused


def _speaks(registered: int | None, fd: int | None) -> bool:
    """The rule: a message speaks for a peer over the connection that said its Hello, or
    once that connection (`registered`; None: closed) is gone."""
    return registered is None or registered == fd


class Registry(Generic[G]):
    """The groups by name (in the order they were created) and the peers' groups and
    connections. `make_group(name, coordinator)` builds the shell's group object."""

    def __init__(
        self,
        dp_size: int,
        make_group: Callable[[str, Coordinator], G],
        *,
        max_groups: int,
        step_timeout: float,
        on_rank_loss: OnRankLoss,
        takeovers: Takeovers | None = None,
        rules: GroupRules | None = None,
        key_refusal: Callable[[str, str, int], str | None] | None = None,
        make_coordinator: Callable[[str, int], Coordinator] | None = None,
    ) -> None:
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        self.dp_size = dp_size
        self.max_groups = max_groups
        self.step_timeout = step_timeout
        self.on_rank_loss = on_rank_loss
        self._make_group = make_group
        #: The groups the deployment expects.
        self.rules = rules or GroupRules()
        #: Attempts to speak for a rank over a connection that did not register it.
        self.takeovers = takeovers or Takeovers()
        #: With CURVE keys bound to ranks or groups: why a connection's key may not register as
        #: a rank of a group, or None (`coordd.io._curve.CurveGate.key_refusal`).
        self.key_refusal = key_refusal
        #: Builds a new group's state machine from its name and epoch (a relay's:
        #: `coordd.proto.relay.RelayCoordinator`); None: a `Coordinator` with the settings above.
        self.make_coordinator = make_coordinator
        self.groups: dict[str, G] = {}
        # The shell reads the maps below only through the methods under "where a message goes".
        #: The group each peer registered with (its reports go there).
        self.peer_group: dict[bytes, G] = {}
        #: The descriptor each peer's Hello came over, while that connection is open, and back.
        self.peer_fd: dict[bytes, int] = {}
        self.fd_peer: dict[int, bytes] = {}
        self._last_epoch = 0

    # -- where a message goes -----------------------------------------------------------------

    def speaks_for(self, peer: bytes, fd: int) -> bool:
        """Whether a message from `peer` over descriptor `fd` may speak for it: it came over
        the connection that said the peer's Hello, or that connection is closed. A message
        that may not goes to `other_connection`."""
        return _speaks(self.peer_fd.get(peer), fd)

    def standing(self, peer: bytes, fd: int) -> tuple[G | None, int]:
        """Where a message from `peer` over descriptor `fd` goes, for the shell's drain: its
        group (None: a stranger's message) and how it stands there (MEMBER, DETACHED or
        OTHER_CONNECTION; `speaks_for` is the rule)."""
        group = self.peer_group.get(peer)
        if group is None:
            return None, STRANGER
        registered = self.peer_fd.get(peer)
        if registered is None:
            return group, DETACHED
        return group, MEMBER if _speaks(registered, fd) else OTHER_CONNECTION

    def group_of(self, peer: bytes) -> G | None:
        """The group `peer` registered with, or None."""
        return self.peer_group.get(peer)

    def introduced_fds(self) -> Collection[int]:
        """The descriptors of open connections that registered a peer (a live view)."""
        return self.fd_peer.keys()

    def peer_on(self, fd: int) -> bytes | None:
        """The peer whose open connection on `fd` registered it, or None."""
        return self.fd_peer.get(fd)

    def holds_fd(self, fd: int) -> bool:
        """Whether the connection on `fd` registered a peer."""
        return fd in self.fd_peer

    def connections_held(self) -> int:
        """How many open connections registered a peer."""
        return len(self.peer_fd)

    def other_connection(
        self, peer: bytes, message: ToCoordinator, address: str, now: float
    ) -> list[Action[G]]:
        """`message` came from routing id `peer` over another connection than the one that
        said its Hello, which is open: it does not count for the rank (refused, counted and
        logged with the address), and is answered as a stranger's."""
        group = self.peer_group.get(peer)
        rank = group.coordinator.snapshot().rank_of(peer) if group is not None else None
        line = self.takeovers.refuse(
            group.name if group is not None else "-",
            Takeovers.OTHER_CONNECTION,
            rank=rank,
            address=address,
            peer=peer,
            detail=f"a {type(message).__name__} over another connection than the one that "
            "registered: not counted",
            now=now,
        )
        return [*_logged(line), AsStranger(peer, message)]

    def member(self, peer: bytes, fd: int | None) -> G | None:
        """The group of `peer` if it holds a rank there and `fd` is the descriptor of the
        connection that registered it (open): the one connection a member's violation may
        end (a message queued by a closed connection may carry a number reused since)."""
        registered = self.peer_fd.get(peer)
        if registered is None or registered != fd:
            return None
        group = self.peer_group.get(peer)
        if group is None or group.coordinator.snapshot().rank_of(peer) is None:
            return None
        return group

    def undecodable(self, peer: bytes, fd: int | None, detail: str, now: float) -> list[Action[G]]:
        """A message from `peer` over `fd` did not decode: from a member over its connection,
        a protocol violation that fails its group's round at once, naming it."""
        group = self.member(peer, fd)
        if group is None:
            return []
        return [Deliver(group, group.coordinator.undecodable(peer, detail, now))]

    def violation(self, peer: bytes, detail: str, now: float) -> list[Action[G]]:
        """Member `peer` broke the input bound (the shell ends its connection): its rank is
        lost now, with `detail`, and from here on it is a stranger (no peer entry)."""
        group = self.peer_group.pop(peer, None)
        self._untrack(peer)  # its close is then no second loss
        if group is None:
            return []
        rank = group.coordinator.snapshot().rank_of(peer)
        sends = group.coordinator.peer_lost(peer, now, detail)
        return [Deliver(group, sends), Lost(group, peer, rank, detail)]

    # -- Hello -> group -----------------------------------------------------------------------

    def hello(
        self,
        peer: bytes,
        hello: Hello,
        fd: int,
        now: float,
        wall: float,
        *,
        address: str = "",
        key: str = "",
    ) -> list[Action[G]]:
        """Route a Hello from `peer` over descriptor `fd` to the group it names (created here
        on the first one). `wall` (seconds) seeds a new group's epoch; `address` is shown in
        takeover lines; `key` is the connection's CURVE key (z85) when keys are bound to
        ranks."""
        if peer[:1] == b"\x00":
            # libzmq's name for a peer that set none, or a peer imitating one: never a rank,
            # and never exempt from the stranger grace (coordd.io._gate says why)
            error = Rejected(
                RejectReason.ROUTING_ID.value,
                "this connection set no routing id of its own (or one that starts with a zero "
                "byte, as ZeroMQ's own names do): coordd registers only connections that name "
                "themselves",
            )
            return [_refuse(peer, hello, error)]
        if not self.speaks_for(peer, fd):
            # This routing id's registering connection is open (its close is not reported,
            # and libzmq admits one live connection per id): the Hello came over another one.
            return self.other_connection(peer, hello, address, now)
        # The name first: nothing is kept, logged or counted under a name not validated.
        refused = self._name_refused(peer, hello)
        if refused is not None:
            return [refused]
        if self.key_refusal is not None:
            why = self.key_refusal(key, hello.group, hello.dp_rank)
            if why is not None:
                return self._key_refused(peer, hello, why, address, now)
        actions: list[Action[G]] = []
        bound = self.peer_group.get(peer)
        if bound is not None and bound.name != hello.group:
            held = bound.coordinator.snapshot().rank_of(peer)
            if held is not None:
                error = Rejected(
                    RejectReason.GROUP.value,
                    f"this connection is registered as rank {held} of group {bound.name!r}, "
                    f"not {shown(hello.group)}: a client belongs to one group",
                    expected=bound.name,
                    got=shown(hello.group),
                )
                return [_refuse(peer, hello, error)]
        group = self.groups.get(hello.group)
        if group is None:
            group = self._create(peer, hello, wall, actions)
            if group is None:
                return actions
        if bound is not None and bound is not group:
            # No member of its old group (checked above): a rejoin it queued there is void.
            actions.append(
                Deliver(bound, bound.coordinator.peer_lost(peer, now, "joined another group"))
            )
            del self.peer_group[peer]
        actions.append(Registering(group, peer, hello, address))
        sends = group.coordinator.receive(peer, hello, now)
        refused_here = False
        for peers, answer in sends:
            if type(answer) is Reject and peer in peers:
                refused_here = True
                if answer.reason is RejectReason.RANK_TAKEN:
                    line = self.takeovers.refuse(
                        group.name,
                        Takeovers.RANK_HELD,
                        rank=hello.dp_rank,
                        address=address,
                        peer=peer,
                        detail=answer.text,
                        now=now,
                    )
                    actions += _logged(line)
        if refused_here and peer not in group.coordinator.holders():
            # Refused, and holds no rank: it stays a stranger (no peer entry, no descriptor
            # entry: the flood cut-off and the grace apply to it).
            if self.peer_group.get(peer) is group:
                del self.peer_group[peer]
            self._untrack(peer)
        else:
            self._track(peer, fd)
            self.peer_group[peer] = group
        actions.append(Deliver(group, sends))
        if len(self.peer_group) > 2 * self.dp_size * len(self.groups) + 256:
            self._forget_departed()
        return actions

    def _name_refused(self, peer: bytes, hello: Hello) -> Refuse | None:
        """A Hello whose group name is not valid, or not one the deployment expects (the
        group itself, once it exists, is expected: it was admitted)."""
        name = hello.group
        if name in self.groups:
            return None
        problem = group_name_problem(name)
        if problem is not None:
            error = Rejected(
                RejectReason.GROUP.value,
                f"field group: {shown(name)} cannot name a group ({problem}); a group name is "
                f"1..{MAX_GROUP_NAME} printable characters without whitespace",
                expected=f"1..{MAX_GROUP_NAME} printable characters, no whitespace",
                got=shown(name),
            )
            return _refuse(peer, hello, error)
        if not self.rules.admits(name):
            error = Rejected(
                RejectReason.GROUP_UNEXPECTED.value,
                f"group {name!r} is not one this deployment expects (coordd --groups {self.rules})",
                expected=str(self.rules),
                got=name,
            )
            return _refuse(peer, hello, error)
        return None

    def _key_refused(
        self, peer: bytes, hello: Hello, why: str, address: str, now: float
    ) -> list[Action[G]]:
        """A Hello over a connection whose CURVE key is bound to other ranks or groups: refused
        (one leaked key cannot speak for another rank, or create groups), counted and logged."""
        error = Rejected(
            RejectReason.CURVE_KEY.value,
            f"this connection may not register as dp_rank {hello.dp_rank} of group "
            f"{hello.group}: {why}",
            expected="a dp_rank and group its CURVE key is bound to",
            got=f"dp_rank {hello.dp_rank} of group {hello.group}",
        )
        # counted under the group only once it exists (bounded by --max-groups): a name
        # per Hello would be a record, a log line and a metric series per name
        line = self.takeovers.refuse(
            hello.group if hello.group in self.groups else "-",
            Takeovers.KEY_BOUND,
            rank=hello.dp_rank,
            address=address,
            peer=peer,
            detail=error.detail,
            now=now,
        )
        return [*_logged(line), _refuse(peer, hello, error)]

    def _create(self, peer: bytes, hello: Hello, wall: float, actions: list[Action[G]]) -> G | None:
        """A new group for `hello`, or None if it was refused (its name, its settings, the
        limit): a Hello that no group would admit creates none. Appends what to carry out."""
        name = hello.group
        try:
            check_basics(hello, self.dp_size)
        except Rejected as refused:
            actions.append(_refuse(peer, hello, refused))
            return None
        if len(self.groups) >= self.max_groups:
            self._evict_one(actions)
        error = limit_refusal(name, self.groups, self.rules, self.max_groups)
        if error is not None:
            actions.append(_refuse(peer, hello, error))
            return None
        # Epochs grow across the groups too: a report's epoch names one group's epoch at most.
        epoch = self._last_epoch = max(int(wall * 1000), self._last_epoch + 1)
        if self.make_coordinator is not None:
            coordinator = self.make_coordinator(name, epoch)
        else:
            coordinator = Coordinator(
                self.dp_size,
                epoch=epoch,
                step_timeout=self.step_timeout,
                on_rank_loss=self.on_rank_loss,
            )
        group = self._make_group(name, coordinator)
        self.groups[name] = group
        actions.append(GroupCreated(group, epoch, len(self.groups)))
        return group

    def _evict_one(self, actions: list[Action[G]]) -> None:
        """Make room at the limit (`coordd.core._group_slots.to_drop`): a group with no
        members and no open round is idle."""
        name = to_drop(self.groups, self.rules, _idle)
        if name is None:
            return
        group = self.groups.pop(name)
        for p in [p for p, g in self.peer_group.items() if g is group]:
            del self.peer_group[p]
        self.takeovers.forget(name)  # what is kept under its name goes with it
        actions.append(GroupDropped(group, group.coordinator.snapshot().epoch))

    def _forget_departed(self) -> None:
        """Bound the peer map: keep the peers that are members of their group, and every peer
        of a group with an open round (one may be queued to rejoin at its end); a peer that
        left is answered as a stranger from then on."""
        live = {peer for group in self.groups.values() for peer in group.coordinator.holders()}
        for p in [
            p
            for p, g in self.peer_group.items()
            if p not in live and g.coordinator.snapshot().round is None
        ]:
            del self.peer_group[p]

    # -- connections --------------------------------------------------------------------------

    def _track(self, peer: bytes, fd: int) -> None:
        old = self.peer_fd.get(peer)
        if old is not None and old != fd:
            self.fd_peer.pop(old, None)
        self.peer_fd[peer] = fd
        self.fd_peer[fd] = peer

    def _untrack(self, peer: bytes) -> None:
        fd = self.peer_fd.pop(peer, None)
        if fd is not None and self.fd_peer.get(fd) == peer:
            del self.fd_peer[fd]

    def closed(self, fd: int, now: float) -> list[Action[G]]:
        """The connection on descriptor `fd` closed: the rank that registered over it is lost
        (in its own group only)."""
        peer = self.fd_peer.pop(fd, None)
        if peer is None or self.peer_fd.get(peer) != fd:
            return []
        del self.peer_fd[peer]
        group = self.peer_group.get(peer)
        if group is None:
            return [Lost(None, peer, None)]
        coordinator = group.coordinator
        rank = coordinator.snapshot().rank_of(peer)
        return [
            Deliver(group, coordinator.peer_lost(peer, now, "connection closed")),
            Lost(group, peer, rank),
        ]

    def registered_fds(self) -> set[int]:
        """The descriptors of connections that registered a rank now a member of its group
        (never shut by admission)."""
        members = {
            member.peer
            for group in self.groups.values()
            for member in group.coordinator.snapshot().members.values()
        }
        return {fd for peer, fd in self.peer_fd.items() if peer in members}

    def evictable_fds(self) -> list[int]:
        """The descriptors of members of groups that only a pattern admitted (no exact name in
        --groups or --expect-groups), newest group first: what goes first when members crowd
        the connection cap (`coordd.core._admission.Admission.enforce`)."""
        exact = self.rules.exact
        fds: list[int] = []
        for group in reversed(list(self.groups.values())):
            if group.name in exact:
                continue
            for member in group.coordinator.snapshot().members.values():
                fd = self.peer_fd.get(member.peer)
                if fd is not None:
                    fds.append(fd)
        return fds

    def known_epoch(self, epoch: int) -> bool:
        """Whether `epoch` is some group's current epoch."""
        return any(g.coordinator.snapshot().epoch == epoch for g in self.groups.values())


def _idle(group: GroupLike) -> bool:
    snap = group.coordinator.snapshot()
    return not snap.members and snap.round is None


def _logged(line: LogEvent | None) -> list[LogEvent]:
    return [] if line is None else [line]


def _refuse(peer: bytes, hello: Hello, error: Rejected) -> Refuse:
    return Refuse(peer, hello, error, shown(hello.group))
