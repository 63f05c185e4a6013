"""coordd.core._admission, pure: the connections that hold no rank (cap, grace, memory
pressure, the flood cut-off and its socket rule, answers to strangers). No sockets: socket
identities and peer pids are fakes, and the time is passed in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from coordd.core import _daemon_defaults as defaults
from coordd.core._admission import (
    BANNED,
    CAP,
    FLOOD,
    FLOOD_PROCESS,
    HELLO_GRACE,
    MEMBER_SLACK,
    PRESSURE,
    QUIET_PROCESS,
    SHED,
    SILENT,
    SPARED,
    STRANGER_ANSWERS_PER_S,
    STRANGER_SOCKET_TTL,
    VIOLATION,
    Admission,
    Shut,
)
from coordd.proto.messages import (
    FailReason,
    Goodbye,
    Heartbeat,
    Hello,
    StepFailed,
    StepKind,
    StepReport,
)

_ASK = object()


class Shelled(Admission):
    """Admission as the shell drives it (`coordd.io._guard.Guard`): what only the OS knows (a
    descriptor's socket identity, the pid at its other end) is asked of `ident` and `pid` and
    passed in, unless a test passes it itself."""

    def __init__(
        self,
        *args: Any,
        ident: Callable[[int], int | None],
        pid: Callable[[int, int | None], int | None],
        **kw: Any,
    ) -> None:
        super().__init__(*args, **kw)
        self.ident_of = ident
        self.pid_of = pid

    def accepted(self, fd: int, now: float, *, ident: Any = _ASK, pid: Any = _ASK) -> list[Shut]:
        if ident is _ASK:
            ident = self.ident_of(fd)
        if pid is _ASK:
            pid = self.pid_of(fd, ident)
        return super().accepted(fd, now, ident=ident, pid=pid)

    def stranger_message(self, peer: bytes, fd: int, now: float) -> bool:
        flood = super().stranger_message(peer, fd, now)
        if self.wants_socket(peer, now):
            self.first_socket(peer, self.ident_of(fd), now)
        return flood

    def from_shut(self, fd: int | None, ident: Any = _ASK) -> bool:
        if ident is _ASK:
            ident = None if fd is None else self.ident_of(fd)
        return super().from_shut(fd, ident)


class Host:
    """The OS as admission sees it: which socket (identity) each descriptor names now, and
    which process is at its other end."""

    def __init__(self) -> None:
        self.idents: dict[int, int | None] = {}
        self.pids: dict[int, int] = {}
        self.ranks: set[int] = set()

    def ident(self, fd: int) -> int | None:
        return self.idents.get(fd, fd)

    def pid(self, fd: int, ident: int | None) -> int | None:
        if ident is not None and self.ident(fd) != ident:
            return None  # not that socket any more
        return self.pids.get(fd)

    def admission(self, cap: int = 100, flood: int = 10) -> Admission:
        return Shelled(
            cap, lambda: self.ranks, ident=self.ident, pid=self.pid, flood=flood, now=0.0
        )


def seen_before(host: Host, admission: Admission, *pids: int, at: float = -10.0) -> None:
    """Each of `pids` had a connection accepted (and closed) at `at`: not a fresh process
    (issue 28: quiet is earned; a process never seen is not quiet)."""
    for n, pid in enumerate(pids):
        fd = 10_000 + n
        host.pids[fd] = pid
        assert admission.accepted(fd, at) in ([], [Shut(fd, fd, PRESSURE)])
        admission.closed_fd(fd)


def carried(admission: Admission, shuts: list[Shut]) -> list[int]:
    """Carry `shuts` out (every shutdown succeeds); the descriptors shut."""
    for shut in shuts:
        admission.done(shut)
    return [s.fd for s in shuts]


def flood(admission: Admission, peer: bytes, fd: int, now: float) -> bool:
    """`admission.flood` messages from `peer` over `fd` in one window; True if the last one
    reached the cut-off."""
    admission.new_window(now)
    due = [admission.stranger_message(peer, fd, now) for _ in range(admission.flood)]
    assert not any(due[:-1])
    return due[-1]


def test_over_the_cap_the_oldest_strangers_are_shut_never_a_rank() -> None:
    host = Host()
    host.ranks = {10, 11}
    guard = host.admission(cap=4)
    for fd in (10, 20, 11, 21, 22, 23):
        assert guard.accepted(fd, 0.0) == []
    assert guard.over() == 2
    shuts = guard.enforce()
    assert {s.reason for s in shuts} == {CAP}
    assert carried(guard, shuts) == [20, 21]  # the oldest that hold no rank
    assert set(guard.open) == {10, 11, 22, 23}
    guard.closed_fd(22)
    guard.accepted(24, 0.0)
    assert guard.enforce() == []
    assert guard.evicted == 2 and guard.peak == 6


def test_a_descriptor_whose_socket_was_unknown_is_never_shut() -> None:
    host = Host()
    host.idents[30] = None  # it named no socket when its ACCEPTED was read
    guard = host.admission(cap=0)
    guard.accepted(30, 0.0)
    assert guard.enforce() == [] and guard.shed() == []


def test_under_memory_pressure_strangers_are_shed_newest_first_and_new_ones_shut() -> None:
    host = Host()
    host.ranks = {10}
    guard = host.admission()
    for fd in (20, 10, 21, 22):
        guard.accepted(fd, 0.0)
    assert guard.strangers() == 3
    shuts = guard.shed()
    assert {s.reason for s in shuts} == {SHED}
    assert carried(guard, shuts) == [22, 21, 20] and list(guard.open) == [10]
    guard.pressure.on = True  # the one flag (the ZAP gate reads the same object)
    assert guard.accepted(23, 0.0) == [Shut(23, 23, PRESSURE)]
    assert 23 not in guard.open and guard.refused_memory == 1
    guard.pressure.on = False
    assert guard.accepted(24, 0.0) == [] and 24 in guard.open


def test_under_pressure_a_quiet_processs_connection_is_kept_for_its_hello() -> None:
    """Issue 21, 5: the attack's handshakes in flight held coordd over its budget with no
    stranger to close, and a rank's connection was shut as accepted (connect() failed 5 in
    10). Over ipc a process with no connection accepted for QUIET_PROCESS seconds is kept, and
    spared by `shed` for SPARED; an attacker's process, reconnecting, is shut."""
    host = Host()
    guard = host.admission()
    seen_before(host, guard, 500, 900, 700)
    guard.pressure.on = True
    host.pids.update({30: 500, 31: 500, 32: 500, 40: 900, 41: 700, 43: 999})
    assert guard.accepted(43, 0.0) == [Shut(43, 43, PRESSURE)], "a fresh process: not quiet"
    assert guard.accepted(30, 0.0) == [], "the attacker's first: its process was quiet"
    assert guard.accepted(31, 0.1) == [Shut(31, 31, PRESSURE)], "then it is busy"
    assert guard.accepted(32, 0.1 + QUIET_PROCESS - 0.01) == [Shut(32, 32, PRESSURE)]
    assert guard.accepted(40, 3.0) == [], "a rank's process: kept"
    assert carried(guard, guard.shed(SPARED + 0.5)) == [30], "spared while its Hello may come"
    host.ranks.add(40)  # it said Hello: a rank now
    assert carried(guard, guard.shed(3.0 + SPARED + 0.1)) == []
    host.ranks.clear()
    assert guard.accepted(41, 4.0) == []
    assert carried(guard, guard.shed(4.0 + SPARED + 0.1)) == [41, 40], "no Hello: shed"
    seen_before(host, guard, 800, at=2.0)
    host.pids[42] = 800  # a closed connection's late ACCEPTED, read once 42 named the
    assert guard.accepted(42, 8.0) == []  # rank's new socket: kept for it...
    assert guard.accepted(42, 8.01) == [], "...and its own event is the same socket's"
    guard.closed_fd(42)  # the old connection's late DISCONNECTED drops the record
    assert guard.accepted(42, 8.02) == [], "its own ACCEPTED: the same socket, still quiet"
    host.idents[42] = 4242  # a second socket of that process: busy
    assert guard.accepted(42, 8.03) == [Shut(42, 4242, PRESSURE)]
    # tcp: no process to tell
    assert guard.accepted(50, 20.0) == [Shut(50, 50, PRESSURE)]
    assert guard.kept_quiet == 5


def test_a_quiet_processs_connection_is_spared_for_its_handshake_and_hello_only() -> None:
    """Traced under the 16-process attack: a rank's connection accepted just before the
    pressure came on was shed 70 ms later, before its handshake was answered, and its process
    was busy from then on: its connect() ran out its 10 s. Every accept counts, and one from
    a quiet process is spared either way; but only for its handshake and Hello: HELLO_GRACE
    after the gate admitted its handshake, or until its first message. The one connection of a
    multipart flood, spared 7 s, grew coordd to 160 MB (65 MB when shed)."""
    host = Host()
    guard = host.admission()
    seen_before(host, guard, 500, 900, 700, 800)
    host.pids.update({30: 500, 31: 500, 32: 500, 40: 900, 41: 700, 42: 800})
    assert guard.accepted(30, 0.0) == [] and guard.accepted(31, 0.05) == []  # an attacker
    assert guard.accepted(40, 0.1) == []  # a rank, a moment before the pressure
    guard.pressure.on = True
    assert guard.accepted(32, 0.2) == [Shut(32, 32, PRESSURE)], "counted before: busy"
    # the rank's and the attacker's first (its process was quiet then) are spared
    assert carried(guard, guard.shed(0.3)) == [31]
    assert guard.accepted(41, 0.4) == [] and guard.accepted(42, 0.4) == []  # kept: quiet
    guard.handshakes.append((700, 0.3))  # the gate let 41's process in before 41 was read,
    guard.handshakes.append((800, 0.45))  # and 42's after
    guard.handshakes.append((500, -5.0))  # an earlier connection's: not 30's
    assert carried(guard, guard.shed(0.3 + HELLO_GRACE - 0.01)) == []
    assert carried(guard, guard.shed(0.3 + HELLO_GRACE + 0.01)) == [41], "no Hello in time"
    assert carried(guard, guard.shed(0.45 + HELLO_GRACE + 0.01)) == [42]
    guard.new_window(1.5)
    guard.stranger_message(b"flooder", 40, 1.5)  # spared for its Hello, not for a flood
    assert carried(guard, guard.shed(1.6)) == [40]
    assert carried(guard, guard.shed(SPARED - 0.01)) == []  # 30: handshake still pending
    assert carried(guard, guard.shed(SPARED + 0.01)) == [30]
    assert guard.kept_quiet == 2


def test_a_connection_that_says_no_hello_within_the_grace_is_shut() -> None:
    guard = Host().admission()
    for fd, at in ((10, 0.0), (11, 1.0), (12, 2.0), (13, 9.5)):
        guard.accepted(fd, at)
    introduced = {11}  # it said Hello (a rank, or a peer refused by name)
    shuts = guard.expire(before=5.0, introduced=introduced)
    assert {s.reason for s in shuts} == {SILENT}
    assert carried(guard, shuts) == [10, 12]
    assert set(guard.open) == {11, 13}
    assert guard.expire(before=5.0, introduced=introduced) == []  # nothing twice
    assert carried(guard, guard.expire(before=10.0, introduced=introduced)) == [13]
    assert guard.expired == 3
    guard.closed_fd(13)
    assert 13 not in guard.accepted_at


def test_a_flooding_stranger_is_cut_off_once_with_its_process_but_never_a_rank() -> None:
    """One process (pid 1) holds a registered rank on fd 3 and two stranger connections; the
    stranger on fd 4 floods. Its connection and its process's other stranger connection are
    shut, the rank is not, and the process's new connections are refused for BAN_SECONDS."""
    host = Host()
    host.ranks = {3}
    host.pids = {3: 1, 4: 1, 5: 1, 6: 1, 7: 2}
    guard = host.admission(flood=10)
    for fd in (3, 4, 5, 7):
        guard.accepted(fd, 0.0)
    assert flood(guard, b"rogue", 4, now=1.0)
    shuts = guard.cut(b"rogue", 4, now=1.0)
    assert shuts == [Shut(4, 4, FLOOD, b"rogue"), Shut(5, 5, FLOOD_PROCESS)]
    carried(guard, shuts)
    assert 3 in guard.open and 7 in guard.open  # the rank, and another process
    assert guard.cut_off == 1
    assert guard.cut(b"rogue", 4, now=1.1) == []  # once: what is left is its backlog
    # the same process connects again: refused at once, until the ban is over
    assert guard.accepted(6, now=2.0) == [Shut(6, 6, BANNED)] and guard.refused == 1
    assert guard.accepted(6, now=1.0 + defaults.BAN_SECONDS + 0.1) == []
    assert 6 in guard.open and guard.refused == 1


def test_a_registered_ranks_connection_is_never_cut_off() -> None:
    host = Host()
    host.ranks = {3}
    guard = host.admission(flood=10)
    guard.accepted(3, 0.0)
    assert flood(guard, b"peer", 3, now=1.0)  # e.g. another routing id over a rank's socket
    assert guard.cut(b"peer", 3, now=1.0) == []


def test_messages_count_only_if_the_first_came_over_the_socket_now_under_the_number() -> None:
    """acfddde: a burst's shut connection left its backlog queued; libzmq gave its number to a
    new (honest) connection before coordd read the close. The backlog's messages, counted
    under that number, must not cut (and ban) the new connection's process."""
    host = Host()
    host.pids = {7: 1}
    guard = host.admission(flood=10)
    host.idents[7] = 100
    guard.accepted(7, 0.0)  # the flooder's connection, socket 100
    guard.new_window(1.0)
    assert not guard.stranger_message(b"burst", 7, 1.0)  # its first message: socket 100
    guard.closed_fd(7)
    host.idents[7] = 200  # the number now names another socket
    guard.accepted(7, 1.1)
    for _ in range(guard.flood - 2):
        guard.stranger_message(b"burst", 7, 1.2)
    assert guard.stranger_message(b"burst", 7, 1.2)  # the cut-off is reached...
    assert guard.cut(b"burst", 7, now=1.2) == []  # ...but over another socket: no cut
    assert guard.banned == {}
    # the same peer's messages over the socket now under the number do count (after the TTL
    # its first socket is taken again)
    later = 1.2 + STRANGER_SOCKET_TTL + 1
    assert flood(guard, b"burst", 7, now=later)
    assert guard.cut(b"burst", 7, now=later) == [Shut(7, 200, FLOOD, b"burst")]


def test_counts_start_again_each_window() -> None:
    guard = Host().admission(flood=10)
    guard.accepted(4, 0.0)
    guard.new_window(0.0)
    assert not any(guard.stranger_message(b"p", 4, 0.5) for _ in range(9))
    guard.new_window(1.0)
    assert guard.counts == {} and guard.window_end == 2.0
    assert not any(guard.stranger_message(b"p", 4, 1.5) for _ in range(9))


def test_what_a_shut_connection_still_has_queued_is_recognised_by_its_socket() -> None:
    host = Host()
    guard = host.admission()
    guard.accepted(40, 0.0)
    assert not guard.from_shut(40) and not guard.from_shut(None)  # open: read
    carried(guard, guard.shed())
    assert guard.from_shut(40) and guard.dropped_shut == 1  # the same socket: dropped
    host.idents[40] = 41  # the number names another socket (its ACCEPTED not read yet)
    assert not guard.from_shut(40)
    host.idents[40] = None  # libzmq closed it: no socket under it, still the shut one's
    assert guard.from_shut(40)
    guard.accepted(40, 0.0)  # a new connection's ACCEPTED: read again
    assert not guard.from_shut(40)


def report(epoch: int) -> StepReport:
    return StepReport(num_tokens=1, num_tokens_padded=1, dp_rank=3, epoch=epoch, seq=5,
                      kind=StepKind.FORWARD)


def test_strangers_are_answered_at_a_bounded_rate() -> None:
    guard = Host().admission()
    hello = Hello(dp_size=1, dp_rank=0, config_fingerprint="", incarnation="x")
    assert guard.answer(hello, 0.0, lambda e: True) is None
    assert guard.answer(Goodbye(), 0.0, lambda e: True) is None
    beat = Heartbeat()
    assert guard.answer(beat, 0.0, lambda e: True) is beat
    known = guard.answer(report(9), 0.0, lambda e: e == 9)
    assert isinstance(known, StepFailed) and known.reason is FailReason.PROTOCOL
    assert "not registered" in known.text and known.culprits == [3]
    unknown = guard.answer(report(8), 0.0, lambda e: e == 9)
    assert isinstance(unknown, StepFailed) and "epoch 8 is the current epoch of no group" in (
        unknown.text
    )
    answered = sum(guard.answer(beat, 0.0, lambda e: True) is not None for _ in range(1000))
    assert answered == STRANGER_ANSWERS_PER_S - 3 and guard.answers_dropped == 1000 - answered
    assert guard.answer(beat, 0.1, lambda e: True) is beat  # 20 more after 0.1 s


def test_a_members_share_is_one_report_a_round_and_some_slack() -> None:
    """Issue 21: a member's input is bounded too: over MEMBER_SLACK messages in a window
    beyond two per round of its group is a violation; its own connection is shut (even
    though it holds a rank) and nothing else; the counts start again each window."""
    host = Host()
    host.ranks = {5}
    admission = host.admission()
    assert admission.accepted(5, 0.0) == [] and admission.accepted(6, 0.0) == []
    assert not admission.member_over(MEMBER_SLACK, rounds=0)
    assert admission.member_over(MEMBER_SLACK + 1, rounds=0)
    assert not admission.member_over(MEMBER_SLACK + 2 * 3000, rounds=3000)  # a busy group
    assert admission.member_shut(5, b"m") == [Shut(5, 5, VIOLATION, b"m")]
    assert admission.member_shut(7, b"m") == []  # no such connection: nothing blind
    assert carried(admission, admission.member_shut(5, b"m")) == [5]
    assert admission.violations == 1 and 6 in admission.open
    admission.member_counts[b"m"] = 10
    admission.new_window(1.0)
    assert admission.member_counts == {}


def test_a_members_share_counts_its_groups_rounds_in_this_window_only() -> None:
    """Issue 28, planted bug: the guard counted a member's rounds in the window with the wrong
    sign (`+ group.window_rounds`) and every test passed: each flood test used a fresh group
    (0 rounds before the window). A group that decided 50,000 rounds before this window, and
    2 in it, allows MEMBER_SLACK + 4 messages, not 100,000 more."""
    from types import SimpleNamespace

    from coordd.io._group import Group
    from coordd.io._guard import Guard

    host = Host()
    host.ranks = {5}
    admission = host.admission()
    admission.accepted(5, 0.0)
    shut: list[int] = []

    def shutdown(fd: int, ident: int | None) -> bool:
        shut.append(fd)
        return True

    class Server:
        """The server as the guard calls it: its monitor caught up, nothing queued."""

        def catch_up_monitor(self) -> bool:
            return True

        def messages_queued(self) -> bool:
            return False

        def introduced_fds(self) -> tuple[int, ...]:
            return ()

    guard = Guard(admission, Server(), clock=lambda: 1.0, stranger_grace=0, max_rss_mb=0,
                  gate=None, shutdown=shutdown)
    busy = SimpleNamespace(decisions=50_000, failures=3)
    group = Group("g", busy, None)  # type: ignore[arg-type]
    guard.new_window(1.0, [group])
    busy.decisions += 2  # two rounds decided in this window
    assert guard.member_over(b"m", group, 5, MEMBER_SLACK + 4) is None and shut == []
    detail = guard.member_over(b"m", group, 5, MEMBER_SLACK + 5)
    assert detail is not None and "its group had 2 rounds" in detail
    assert shut == [5] and admission.violations == 1


def test_members_crowding_the_cap_go_pattern_groups_first_never_the_newcomer() -> None:
    """Issue 28, defect 1: --dp 16, one process registered 1008 members in 63 groups the
    default dp-tp*-pp* pattern admits; with the real group's 16 that was the cap of 1024, and
    each newcomer (an `enginecore` rank on its way to its Hello) was the only connection that
    held no rank: shut, ~100 of them, CoordinatorUnavailable after 10 s. Now the members of
    the pattern groups go first (newest group first) while members crowd the room the cap
    keeps for newcomers; a named group's member never."""
    host = Host()
    real = set(range(16))  # dp-tp0-pp0's 16 ranks
    junk_groups = [list(range(100 + 16 * g, 116 + 16 * g)) for g in range(63)]
    junk = {fd for group in junk_groups for fd in group}
    host.ranks = real | junk
    newest_first = [fd for group in reversed(junk_groups) for fd in group]
    admission = Shelled(1024, lambda: host.ranks, ident=host.ident, pid=host.pid, now=0.0,
                          evictable=lambda: [fd for fd in newest_first if fd in host.ranks])
    for fd in sorted(real | junk):
        assert admission.accepted(fd, 0.0) == []
    assert admission.enforce() == []  # at the cap, not over it
    for n, newcomer in enumerate(range(5000, 5016)):  # enginecore's 16 ranks connect
        assert admission.accepted(newcomer, 1.0 + n) == []
        shuts = admission.enforce()
        assert [s.fd for s in shuts] == [newest_first[n]], "a junk member, not the newcomer"
        host.ranks.discard(carried(admission, shuts)[0])
        assert newcomer in admission.open
        host.ranks.add(newcomer)  # its Hello: a member of a named group
    assert real <= set(admission.open) and admission.evicted_members == 16
    # a newcomer that says nothing has the room the cap keeps: 64 of them, then the oldest go
    for n, newcomer in enumerate(range(6000, 6080)):
        admission.accepted(newcomer, 20.0 + n)
        carried(admission, admission.enforce())
    assert admission.evicted_members == 16 + 64 and 6000 not in admission.open
    assert set(range(6016, 6080)) <= set(admission.open)
    # strangers (no member crowding) go oldest first, as ever
    host.ranks = set()
    small = Shelled(4, lambda: host.ranks, ident=host.ident, pid=host.pid, now=0.0,
                      evictable=lambda: [1, 2])
    for fd in (1, 2, 3, 4, 5):
        small.accepted(fd, 0.0)
    assert [s.fd for s in small.enforce()] == [1] and small.evicted_members == 0


def test_the_cap_is_sized_from_the_deployment() -> None:
    """Issue 28, defect 1: the default cap of 1024 held exactly --dp 16 x 64 groups, leaving
    newcomers no room; DP=256 (1280 ranks of vLLM's groups) was over it before any attacker.
    `connections_needed`: every rank of every group coordd may serve, and 64 more."""
    from coordd.core._admission import STRANGER_ROOM, connections_needed

    assert connections_needed(16, 64, 3) == 16 * 67 + STRANGER_ROOM == 1136
    assert connections_needed(256, 64, 3) == 256 * 67 + 64


def test_under_pressure_a_rank_retrying_after_its_refused_first_try_is_kept() -> None:
    """Issue 28: quiet is earned at the gate (a fresh process's first handshake is refused
    under pressure; its retry, 1.1 s or more later, is let in). Admission must agree: with a
    5 s gap that retry was shut at accept as busy, and the rank never got in while the
    pressure lasted. One reconnecting every 100 ms is still busy."""
    host = Host()
    guard = host.admission()
    guard.pressure.on = True
    host.pids.update({50: 600, 51: 600, 60: 700, 61: 700})
    assert guard.accepted(50, 0.0) == [Shut(50, 50, PRESSURE)], "fresh: not quiet"
    assert guard.accepted(51, 1.1) == [], "its retry, having waited: kept for its Hello"
    assert 51 in guard.spared
    seen_before(host, guard, 700)
    assert guard.accepted(60, 2.0) == []
    assert guard.accepted(61, 2.1) == [Shut(61, 61, PRESSURE)], "100 ms later: busy"
