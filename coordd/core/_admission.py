"""Admission of the peers that hold no rank, pure: the time and what only the OS knows (a
descriptor's socket identity, the pid at the other end of a unix socket) are passed in.
Decisions come back as `Shut`s that the shell carries out (`shutdown(2)`, only if the
descriptor still names socket `ident`) and reports back with `done`.

The rules (`coordd.io._limits` says why each exists):

- Over `cap`, the oldest connection that holds no registered rank is shut (`enforce`). The cap
  is sized from the deployment (`connections_needed`); if members crowd the room it keeps for
  newcomers anyway, members of groups only a pattern admitted (`evictable`) go first, newest
  group first, so that a named group's newcomer is not the one shut. A member of a named
  group is never chosen by any rule here.
- Under memory pressure (`pressure`) a new connection is shut as soon as it is accepted and
  `shed` shuts every stranger, except, over ipc, a quiet process's connection (QUIET_PROCESS),
  spared for its handshake and Hello (SPARED, HELLO_GRACE): a rank can still connect while
  a flood holds coordd over its budget.
- A connection that said no Hello within the stranger grace is shut (`expire`).
- A stranger over `flood` messages in a one-second window is cut off (`stranger_message`,
  `cut`), over ipc with its process's other stranger connections and its new ones for
  BAN_SECONDS; only if its first message of the window came over the socket now under that
  descriptor, as numbers are reused at once and the count may be a closed socket's backlog.
- A stranger's message is answered at a bounded rate (`answer`).
- A member that sends more than MEMBER_SLACK messages in a window beyond two per round of its
  group breaks the protocol (`member_over`): its connection alone is shut (`member_shut`).

Every decision that names descriptors assumes the monitor was read up to now (every
descriptor in `open` is then one libzmq holds): the shell makes sure of it where it acts.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

from coordd.core._bounds import BoundedMap, TokenBucket
from coordd.core._daemon_defaults import BAN_SECONDS, HANDSHAKE_TIMEOUT
from coordd.proto.errors import CoordError, CoordinatorUnavailable, ProtocolError
from coordd.proto.messages import (
    Goodbye,
    Heartbeat,
    Hello,
    StepFailed,
    ToCoordinator,
    failure_message,
)

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
#: Messages a member may send in a window beyond two per round its group had in it (Hello,
#: pings, Goodbye, a resend after a reconnect: a few), and how often (in messages) the drain
#: checks a member's count against that share: a power of two (the check is a mask).
MEMBER_SLACK = 1024
MEMBER_CHECK = 1024
#: Most entries of each table a peer can grow here (first sockets, cut connections).
MAX_TRACKED = 4096
#: Under memory pressure, an ipc process none of whose connections was accepted for this long
#: is quiet (a rank connecting, or retrying after the gate's 1 s-late refusal; a flooder that
#: keeps reconnecting is not): its new connection is kept, and spared by `shed` until its
#: handshake must be over (libzmq closes it at HANDSHAKE_TIMEOUT) and its Hello in.
QUIET_PROCESS = 1.0
SPARED = HANDSHAKE_TIMEOUT + 2.0
#: A spared connection's spare after the ZAP gate admitted its process's handshake: a client
#: sends its Hello as its handshake ends.
HELLO_GRACE = 1.0
#: How much earlier than its ACCEPTED event was read a connection's handshake may be admitted
#: (libzmq accepts, the gate answers, the loop reads the event late).
MONITOR_LAG = 1.0
#: Most processes banned at once (the expired ones are dropped first).
MAX_BANNED = 1024
#: Connections kept free, beyond every rank of every group, for peers on their way to
#: registering (a quarter of the cap at most, when a cap is set smaller than the deployment).
STRANGER_ROOM = 64


def connections_needed(dp_size: int, max_groups: int, named_groups: int) -> int:
    """The connections a deployment's ranks may hold, and STRANGER_ROOM more: `dp_size` ranks
    in each of `max_groups` groups (what patterns admit share that limit) and in each of the
    `named_groups` (the exact names of --groups and --expect-groups each always get a slot
    beyond it)."""
    return dp_size * (max_groups + named_groups) + STRANGER_ROOM


# why a connection is shut (`Shut.reason`)
CAP = "cap"  # over the connection cap: the oldest stranger
PRESSURE = "pressure"  # accepted under memory pressure
SHED = "shed"  # a stranger, under memory pressure
BANNED = "banned"  # accepted from a process cut off for flooding
FLOOD = "flood"  # a stranger over `flood` messages in a second
FLOOD_PROCESS = "flood_process"  # another stranger connection of that peer's process
SILENT = "silent"  # no Hello within the stranger grace
VIOLATION = "violation"  # a member over its share of messages (or flooding junk)


@dataclass(frozen=True, slots=True)
class Shut:
    """Shut down the connection on descriptor `fd` if it still names socket `ident`."""

    fd: int
    ident: int
    reason: str
    #: the flooding peer (FLOOD only), for the log line
    peer: bytes = b""


class Pressure:
    """The one "over the memory budget" flag: admission and the ZAP gate read it."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False


class Admission:
    """The connections that hold no rank: counts, grace, cap and pressure, as `Shut`s.

    `registered()` gives the descriptors of registered ranks (never shut). What only the OS
    knows comes in from the shell: a descriptor's socket identity (`ident`: None, no socket)
    and the process at the other end of a unix socket (`pid`: None, tcp)."""

    def __init__(
        self,
        cap: int,
        registered: Callable[[], Collection[int]],
        *,
        flood: int = STRANGER_MESSAGES_PER_S,
        answers_per_s: float = STRANGER_ANSWERS_PER_S,
        now: float = float("-inf"),
        evictable: Callable[[], list[int]] = list,
    ) -> None:
        self.cap = cap
        self.flood = flood
        self._registered = registered
        #: members' descriptors that may go when members crowd the strangers' room, in the
        #: order they go (the registry's `evictable_fds`: pattern groups' members, newest first)
        self._evictable = evictable
        #: members shut over the cap (`evictable`)
        self.evicted_members = 0
        self.pressure = Pressure()
        #: open descriptor -> its socket's identity (insertion order = accept order)
        self.open: OrderedDict[int, int | None] = OrderedDict()
        #: open descriptor -> the process at its other end (ipc), as accepted
        self._pids: dict[int, int | None] = {}
        #: when each open connection's ACCEPTED event was read
        self.accepted_at: dict[int, float] = {}
        self.peak = 0
        #: ipc peers' process ids cut off for flooding -> until when
        self.banned: dict[int, float] = {}
        #: connections refused as they were accepted: a banned process, memory pressure
        self.refused = 0
        self.refused_memory = 0
        #: connections shut down and carried out, by reason (`done`)
        self.closed: Counter[str] = Counter()
        #: Connections shut down (descriptor -> socket identity), until the number is
        #: accepted again: what is still queued from them is dropped undecoded (`from_shut`).
        self.shut: dict[int, int] = {}
        self.dropped_shut = 0
        #: messages from peers that hold no rank in the current one-second window
        self.counts: dict[bytes, int] = {}
        #: messages from members in the current window (the drain counts them)
        self.member_counts: dict[bytes, int] = {}
        self.window_end = float("-inf")
        #: the socket each stranger's first message came over (its identity then), and when
        self._first_socket: BoundedMap[bytes, tuple[int | None, float]] = BoundedMap(MAX_TRACKED)
        #: (peer, descriptor) pairs already cut (never twice: what is left is their backlog)
        self._cut: BoundedMap[tuple[bytes, int], None] = BoundedMap(MAX_TRACKED)
        self._answers = TokenBucket(answers_per_s, answers_per_s, now)
        self.answers_dropped = 0
        #: when each ipc process last had a connection accepted
        self._process_seen: BoundedMap[int, tuple[int | None, float]] = BoundedMap(MAX_TRACKED)
        #: connections of quiet processes -> (until when `shed` spares them, their process)
        self.spared: dict[int, tuple[float, int]] = {}
        #: (process id, when): handshakes the ZAP gate admitted over ipc (its thread appends;
        #: `shed` reads): a spared connection's spare ends HELLO_GRACE after its handshake
        self.handshakes: deque[tuple[int, float]] = deque(maxlen=MAX_TRACKED)
        self.kept_quiet = 0

    # -- the connections ----------------------------------------------------------------------

    def accepted(self, fd: int, now: float, *, ident: int | None, pid: int | None) -> list[Shut]:
        """A connection was accepted (its ACCEPTED event) on `fd`, which names socket `ident`
        from process `pid` now; one under memory pressure, or from a process cut off for
        flooding within BAN_SECONDS, is shut at once."""
        if ident is not None and self.open.get(fd) == ident:
            # this socket was taken already (a late duplicate event): deciding twice would
            # count its process as busy
            return []
        # a new connection under this number: its messages are read again
        self.shut.pop(fd, None)
        # every accept counts toward quiet, under pressure or not, so that a rank accepted
        # just before the pressure came on is still quiet at its retry
        quiet = self._quiet_process(fd, ident, pid, now)
        if self.pressure.on:
            if not quiet:
                self.refused_memory += 1
                return _shut(fd, ident, PRESSURE)
            self.kept_quiet += 1
        if self.banned:
            until = self.banned.get(pid) if pid is not None else None
            if until is not None and now < until:
                self.refused += 1
                return _shut(fd, ident, BANNED)
            if pid is not None and until is not None:
                del self.banned[pid]
        self.open.pop(fd, None)
        self.open[fd] = ident
        self._pids[fd] = pid
        self.accepted_at[fd] = now
        self.peak = max(self.peak, len(self.open))
        return []

    def _quiet_process(self, fd: int, ident: int | None, pid: int | None, now: float) -> bool:
        """Whether `fd` is an ipc connection of a process (`pid`) that had none accepted for
        QUIET_PROCESS seconds (then `shed` spares it a while, and under pressure it is kept).
        Quiet is earned: a process never seen is not (else fresh processes, each spared, hold
        coordd over its budget); a rank's process is quiet from its retry (the ZAP gate
        refuses a fresh process's handshake under pressure too)."""
        if pid is None:
            return False
        last = self._process_seen.get(pid)
        self._process_seen.put(pid, (ident, now))
        if last is None:
            return False
        # the same socket again is no second connection (its events may be read late)
        if last is not None and last[0] != ident and now - last[1] < QUIET_PROCESS:
            return False
        self.spared[fd] = (now + SPARED, pid)
        return True

    def closed_fd(self, fd: int) -> None:
        """The connection on `fd` was closed (its DISCONNECTED event)."""
        self.open.pop(fd, None)
        self._pids.pop(fd, None)
        self.accepted_at.pop(fd, None)
        self.spared.pop(fd, None)

    def done(self, shut: Shut) -> None:
        """`shut` was carried out: the connection is down."""
        self.shut[shut.fd] = shut.ident
        self.closed[shut.reason] += 1

    def from_shut(self, fd: int | None, ident: int | None) -> bool:
        """Whether a message over descriptor `fd` (its SRCFD), which names socket `ident` now
        (None: no socket), was queued by a connection shut down here: `fd` names that socket
        still, or none (a new connection under the number names another)."""
        shut = self.shut.get(fd) if fd is not None else None
        if shut is None:
            return False
        if ident is not None and ident != shut:
            return False
        self.dropped_shut += 1
        return True

    def over(self) -> int:
        """How many connections beyond the cap."""
        return max(0, len(self.open) - self.cap)

    def strangers(self) -> int:
        """How many open connections hold no registered rank."""
        keep = self._registered()
        return sum(1 for fd in self.open if fd not in keep)

    def enforce(self) -> list[Shut]:
        """The oldest connections that hold no rank beyond the cap."""
        excess = self.over()
        if not excess:
            return []
        keep = set(self._registered())
        victims: list[int] = []
        # members crowding the newcomers' room: the evictable ones go first, so that the
        # newcomer (an expected group's rank, maybe) stays
        members = sum(1 for fd in self.open if fd in keep)
        crowd = members - (self.cap - min(STRANGER_ROOM, self.cap // 4))
        if crowd > 0:
            for fd in self._evictable():
                if len(victims) >= min(excess, crowd):
                    break
                if fd in self.open and fd in keep:
                    victims.append(fd)
            self.evicted_members += len(victims)
        if len(victims) < excess:
            victims += [fd for fd in self.open if fd not in keep][: excess - len(victims)]
        return [s for fd in victims for s in _shut(fd, self.open.pop(fd), CAP)]

    def shed(self, now: float = float("inf")) -> list[Shut]:
        """Every connection that holds no rank, newest first (memory pressure), but a quiet
        process's spared one (`accepted`) until its time is up."""
        keep = set(self._registered())
        self._handshakes_done()
        for fd, (until, _) in list(self.spared.items()):
            if until > now and fd in self.open:
                keep.add(fd)
            else:
                del self.spared[fd]
        victims = [fd for fd in reversed(self.open) if fd not in keep]
        return [s for fd in victims for s in _shut(fd, self.open.pop(fd), SHED)]

    def _handshakes_done(self) -> None:
        """A spared connection whose process's handshake the gate admitted is spared only
        HELLO_GRACE more: time for its Hello, not for what a flood sends after it."""
        done = self.handshakes
        if not done:
            return
        admitted: dict[int, float] = {}
        while done:
            pid, when = done.popleft()
            admitted[pid] = max(when, admitted.get(pid, when))
        for fd, (until, pid) in self.spared.items():
            through = admitted.get(pid)
            # not an earlier connection's handshake (its ACCEPTED may be read a little late)
            if through is None or through < self.accepted_at.get(fd, float("inf")) - MONITOR_LAG:
                continue
            self.spared[fd] = (min(until, through + HELLO_GRACE), pid)

    def expire(self, before: float, introduced: Collection[int]) -> list[Shut]:
        """The connections accepted before `before` that are not in `introduced` (they said no
        Hello)."""
        victims = []
        for fd in self.open:
            if self.accepted_at.get(fd, before) >= before:
                break  # accept order: the rest are younger
            if fd not in introduced:
                victims.append(fd)
        shuts = []
        for fd in victims:
            self.accepted_at.pop(fd, None)
            shuts += _shut(fd, self.open.pop(fd), SILENT)
        return shuts

    # -- flooding strangers -------------------------------------------------------------------

    def new_window(self, now: float) -> None:
        """A new one-second window of message counts (the shell asks when `window_end` is
        past, once per drain)."""
        self.counts.clear()
        self.member_counts.clear()
        self.window_end = now + 1.0

    @staticmethod
    def member_over(count: int, rounds: int) -> bool:
        """Whether `count` messages in this window from one member are over its share, when
        its group had `rounds` rounds (decided or failed) in the window."""
        return count > MEMBER_SLACK + 2 * rounds

    def member_shut(self, fd: int, peer: bytes) -> list[Shut]:
        """End member `peer`'s connection on `fd` (its registering one) for a violation."""
        ident = self.open.get(fd)
        if ident is None:
            return []
        # a stranger from here on, counted afresh: what was kept of it before it registered
        # (its Hello's socket) would keep its next connection from being cut
        self.counts.pop(peer, None)
        self._first_socket.pop(peer, None)
        return [Shut(fd, ident, VIOLATION, peer)]

    def stranger_message(self, peer: bytes, fd: int, now: float) -> bool:
        """Count one message from `peer`, which holds no rank, over descriptor `fd`; True when
        the count reaches `flood` (then `cut`, with the monitor read). When `wants_socket`,
        the shell tells `first_socket` which socket `fd` names."""
        # spared for its handshake and Hello, not for what follows
        if self.spared:
            self.spared.pop(fd, None)
        count = self.counts.get(peer, 0) + 1
        self.counts[peer] = count
        return count == self.flood

    def wants_socket(self, peer: bytes, now: float) -> bool:
        """Whether the socket of `peer`'s message just counted is to be kept (`first_socket`):
        its first of the window, with none kept or the kept one STRANGER_SOCKET_TTL old."""
        if self.counts.get(peer) != 1:
            return False
        seen = self._first_socket.get(peer)
        return seen is None or now - seen[1] > STRANGER_SOCKET_TTL

    def first_socket(self, peer: bytes, ident: int | None, now: float) -> None:
        """`peer`'s first message of the window came over socket `ident`."""
        self._first_socket.put(peer, (ident, now))

    def cut(self, peer: bytes, fd: int, now: float) -> list[Shut]:
        """Cut off flooding `peer` on `fd`: its connection (once; never a registered rank's;
        only if its first message came over the socket now under `fd`) and, over ipc, its
        process's other connections that hold no rank, and its new ones for BAN_SECONDS."""
        if (peer, fd) in self._cut or fd not in self.open or fd in self._registered():
            return []
        ident = self.open[fd]
        seen = self._first_socket.get(peer)
        if seen is None or seen[0] != ident:
            # its first message came over another socket under this number: what is counted
            # is that one's backlog (numbers are reused at once), and a cut bans the process
            return []
        self._cut.put((peer, fd), None)
        if ident is None:
            return []
        shuts = [Shut(fd, ident, FLOOD, peer)]
        pid = self._pids.get(fd)
        if pid is None:
            return shuts
        if len(self.banned) >= MAX_BANNED:
            self.banned = {p: t for p, t in self.banned.items() if t > now}
        self.banned[pid] = now + BAN_SECONDS
        # and the same process's other connections that hold no rank (one flood, many sockets)
        keep = set(self._registered())
        for other, other_ident in [(f, i) for f, i in self.open.items() if f != fd]:
            if other not in keep and self._pids.get(other) == pid:
                del self.open[other]
                shuts += _shut(other, other_ident, FLOOD_PROCESS)
        return shuts

    def may_answer(self, now: float) -> bool:
        """Whether a stranger may be answered now: at most STRANGER_ANSWERS_PER_S a second in
        all (a relay's message to a coordd that is no root takes from the same budget)."""
        if self._answers.take(now):
            return True
        self.answers_dropped += 1
        return False

    def answer(
        self, message: ToCoordinator, now: float, known_epoch: Callable[[int], bool]
    ) -> Heartbeat | StepFailed | None:
        """What a message from a peer that registered with no group is answered: nothing for a
        Hello or a Goodbye, an echo for a Heartbeat, a failure for a report (`known_epoch`: it
        names some group's current epoch); at most STRANGER_ANSWERS_PER_S a second in all, so
        that a flood gets little back and queues little."""
        if isinstance(message, (Goodbye, Hello)) or not self.may_answer(now):
            return None
        if isinstance(message, Heartbeat):
            return message
        report = message  # a StepReport or a GatherReport
        error: CoordError
        if known_epoch(report.epoch):
            error = ProtocolError("report from a peer that has not registered", rank=report.dp_rank)
        else:
            error = CoordinatorUnavailable(
                f"epoch {report.epoch} is the current epoch of no group coordd serves "
                "(coordd restarted or the group re-formed): register again"
            )
        return failure_message(error, epoch=report.epoch, seq=report.seq, kind=report.kind)

    # -- counts -------------------------------------------------------------------------------

    @property
    def evicted(self) -> int:
        return self.closed[CAP]

    @property
    def expired(self) -> int:
        return self.closed[SILENT]

    @property
    def cut_off(self) -> int:
        return self.closed[FLOOD]

    @property
    def violations(self) -> int:
        return self.closed[VIOLATION]


def _shut(fd: int, ident: int | None, reason: str) -> list[Shut]:
    """A shutdown of `fd`, unless its identity is unknown (it named no socket when its
    ACCEPTED event was read: never shut blind)."""
    return [] if ident is None else [Shut(fd, ident, reason)]
