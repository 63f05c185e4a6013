"""CoordServer's drain with a fake socket under it: what the shell itself decides per message.

The drain asks the registry how each message stands (`Registry.standing`, whose rule is
`speaks_for`: a message counts only over the connection that said its Hello); libzmq drops
the frames of a second connection presenting a live routing id before coordd reads them, so
no test over real sockets reaches that check. Here the frames carry the descriptors (SRCFD)
the test chooses."""

from __future__ import annotations

import struct
from collections import deque
from pathlib import Path
from typing import Any

import pytest
import zmq

from coordd.core._peers import Takeovers
from coordd.core._settings import ServerSettings
from coordd.io import _outbox as outbox_module
from coordd.io._server import CoordServer
from coordd.proto.group_state import GroupState
from coordd.proto.messages import (
    FromCoordinator,
    Goodbye,
    Hello,
    StepDecision,
    StepFailed,
    StepKind,
    StepReport,
    Welcome,
    decode_from_coordinator,
    encode,
)


class Frame:
    def __init__(self, payload: bytes, fd: int) -> None:
        self.buffer = memoryview(payload)
        self.more = False
        self._fd = fd

    def get(self, option: object) -> object:
        if option == zmq.SRCFD:
            return self._fd
        if option == "Peer-Address":
            return "10.0.0.1"
        raise zmq.ZMQError(zmq.EINVAL)


class FakeSocket:
    """Frames queued by the test; what the server sends, recorded by peer."""

    closed = False

    def __init__(self) -> None:
        self.queue: deque[tuple[bytes, Frame]] = deque()
        self.pending: bytes | None = None
        self.out: dict[bytes, list[FromCoordinator]] = {}
        self._to: bytes | None = None

    def put(self, peer: bytes, message: object, fd: int) -> None:
        self.queue.append((peer, Frame(encode(message), fd)))  # type: ignore[arg-type]

    def getsockopt(self, option: int) -> int:
        return int(zmq.POLLIN) if self.queue else 0

    def recv(self, flags: int = 0, copy: bool = True) -> object:
        if self.pending is None:
            if not self.queue:
                raise zmq.Again()
            peer = self.queue[0][0]
            self.pending = peer
            return peer
        self.pending = None
        return self.queue.popleft()[1]

    def send(self, data: bytes, flags: int = 0) -> None:
        if self._to is None:
            self._to = bytes(data)
            return
        self.out.setdefault(self._to, []).append(decode_from_coordinator(bytes(data)))
        self._to = None


#: The socket each descriptor the tests name holds now.
SOCKETS: dict[int, int] = {}


@pytest.fixture
def shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A flat coordd (no --relay-root) over a fake socket."""
    yield from _shell(tmp_path, monkeypatch, relay_root=False)


@pytest.fixture
def root_shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A root (--relay-root) over a fake socket."""
    yield from _shell(tmp_path, monkeypatch, relay_root=True)


def _shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, relay_root: bool):  # type: ignore[no-untyped-def]
    server = CoordServer(
        ServerSettings(f"ipc://{tmp_path}/c.sock", dp_size=1, relay_root=relay_root)
    )
    fake = FakeSocket()
    real = server._sock
    monkeypatch.setattr(server, "_sock", fake)
    monkeypatch.setattr(server._outbox, "sock", fake)
    monkeypatch.setattr(outbox_module, "_send_frame", lambda sock, data, flags: sock.send(data))
    # the socket each test descriptor names (an inode): a reused number gets a new one
    monkeypatch.setattr(server.descriptors, "socket_ident", SOCKETS.get)
    SOCKETS.clear()
    yield server, fake
    server._sock = real
    server.close()


def report(welcome: Welcome) -> StepReport:
    return StepReport(num_tokens=4, num_tokens_padded=4, dp_rank=0, epoch=welcome.epoch,
                      seq=welcome.next_seq, kind=StepKind.FORWARD)


def test_a_report_counts_only_over_the_connection_that_registered_its_rank(shell) -> None:  # type: ignore[no-untyped-def]
    server, sock = shell
    sock.put(b"rank0", Hello(dp_size=1, dp_rank=0, config_fingerprint="", incarnation="x"), 5)
    server._drain_frames()
    (welcome,) = sock.out.pop(b"rank0")
    assert isinstance(welcome, Welcome)
    # the same routing id over another descriptor: refused, not counted for the rank
    sock.put(b"rank0", report(welcome), 6)
    server._drain_frames()
    assert server.takeovers_refused()[("default", Takeovers.OTHER_CONNECTION)] == 1
    assert server.groups["default"].coordinator.snapshot().round is None
    assert all(not isinstance(m, StepDecision) for m in sock.out.get(b"rank0", []))
    sock.out.clear()
    # over the registering connection: the round completes (dp=1)
    sock.put(b"rank0", report(welcome), 5)
    server._drain_frames()
    (decision,) = sock.out.pop(b"rank0")
    assert isinstance(decision, StepDecision) and decision.seq == welcome.next_seq
    assert server.takeovers_refused()[("default", Takeovers.OTHER_CONNECTION)] == 1


def test_a_strangers_report_is_answered_not_counted(shell) -> None:  # type: ignore[no-untyped-def]
    server, sock = shell
    sock.put(b"nobody", StepReport(num_tokens=1, num_tokens_padded=1, dp_rank=0, epoch=1, seq=0,
                                   kind=StepKind.FORWARD), 9)
    server._drain_frames()
    (failed,) = sock.out[b"nobody"]
    assert isinstance(failed, StepFailed) and "epoch 1" in failed.text
    assert server.admission.counts == {b"nobody": 1}


class FakeMonitor:
    """Monitor events queued by the test (the DISCONNECTED of a descriptor)."""

    def __init__(self) -> None:
        self.events: deque[list[bytes]] = deque()

    def closed(self, fd: int) -> None:
        self.events.append([struct.pack("=HI", zmq.EVENT_DISCONNECTED, fd), b"ipc://c.sock"])

    def accepted(self, fd: int) -> None:
        self.events.append([struct.pack("=HI", zmq.EVENT_ACCEPTED, fd), b"ipc://c.sock"])

    def getsockopt(self, option: int) -> int:
        return int(zmq.POLLIN) if self.events else 0

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        if not self.events:
            raise zmq.Again()
        return self.events.popleft()


def test_a_goodbye_queued_with_its_close_counts_before_the_close(shell) -> None:  # type: ignore[no-untyped-def]
    """A rank's Goodbye and its connection's close both came after the frames' drain and
    before the monitor's: the close was read first, and a clean exit counted as a lost rank
    (here the group went back to empty, not stopped; CI flaked on test_misuse's clean stop
    and test_vllm_exit's)."""
    server, sock = shell
    monitor, real = FakeMonitor(), server._monitor
    server._monitor = monitor
    try:
        sock.put(b"rank0", Hello(dp_size=1, dp_rank=0, config_fingerprint="", incarnation="x"), 5)
        server._drain_frames()
        (welcome,) = sock.out.pop(b"rank0")
        assert isinstance(welcome, Welcome)
        sock.put(b"rank0", Goodbye(), 5)
        monitor.closed(5)
        assert server._drain_monitor()
        coordinator = server.groups["default"].coordinator
        assert coordinator.state is GroupState.STOPPED, coordinator.state
        assert not sock.queue
    finally:
        server._monitor = real


def test_a_new_connection_on_a_reused_descriptor_is_heard_after_the_old_ones_close(shell) -> None:  # type: ignore[no-untyped-def]
    """Issue 29's relay_paused (1 seed in 6-10): a rank reconnected while coordd was stopped;
    on SIGCONT its old connection closed and the new one got the same descriptor, and the
    new one's Hello was read in the drain before that close was carried out. The Hello was
    tracked on the descriptor, the old close then ended it, and the old routing id held the
    rank for good: every later Hello got rank_taken. The old close now counts first."""
    server, sock = shell
    monitor, real = FakeMonitor(), server._monitor
    server._monitor = monitor
    try:
        hello = Hello(dp_size=1, dp_rank=0, config_fingerprint="", incarnation="x")
        SOCKETS[5] = 100
        sock.put(b"old", hello, 5)
        server._drain_frames()
        assert isinstance(sock.out.pop(b"old")[0], Welcome)
        monitor.closed(5)
        monitor.accepted(5)
        SOCKETS[5] = 101
        sock.put(b"new", hello, 5)
        assert server._drain_monitor()
        assert not monitor.events and not sock.queue
        (answer,) = sock.out.pop(b"new")
        assert isinstance(answer, Welcome), answer
        snapshot = server.groups["default"].coordinator.snapshot()
        assert snapshot.rank_of(b"new") == 0 and snapshot.rank_of(b"old") is None
        assert server.registry.peer_on(5) == b"new"
        # the new connection's own close ends it in turn
        monitor.closed(5)
        assert server._drain_monitor()
        assert server.registry.peer_on(5) is None
    finally:
        server._monitor = real


def test_a_new_relay_on_a_reused_descriptor_is_heard_after_the_old_ones_close(
    root_shell, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    """The same race at a root: frames are drained before the monitor, so a new relay's
    registration over a descriptor whose old relay's close is not read yet was tracked on
    it, and that close then ended the new relay while the old one kept its ranks."""
    from coordd.io import _relay_hub
    from coordd.proto.relay_messages import RelayHello

    server, sock = root_shell
    monitor, real = FakeMonitor(), server._monitor
    server._monitor = monitor
    monkeypatch.setattr(_relay_hub, "_send_frame", lambda sock, data, flags: None)
    try:
        hello = RelayHello(group="default", dp_size=1, ranks=[0], config_fingerprint="",
                           incarnation="x", relay="node0")
        SOCKETS[7] = 200
        sock.put(b"old", hello, 7)
        server._drain_frames()
        assert server.relays.fd_peer == {7: b"old"}
        monitor.closed(7)  # not read yet: the new relay's frame is drained first
        monitor.accepted(7)
        SOCKETS[7] = 201
        sock.put(b"new", hello, 7)
        server._drain_frames()
        assert server.relays.fd_peer == {7: b"new"}
        assert list(server.relays.trees["default"].relays()) == [b"new"]
        assert server._drain_monitor()  # the old close, read now, is skipped
        assert server.relays.fd_peer == {7: b"new"}
        assert list(server.relays.trees["default"].relays()) == [b"new"]
    finally:
        server._monitor = real


def test_frames_an_older_connection_queued_on_a_reused_descriptor_leave_its_rank(shell) -> None:  # type: ignore[no-untyped-def]
    """A garbage burst's backlog is read long after its connections closed, under the numbers
    they had; a rank that registered over one of those numbers since was taken for closed
    (`Descriptors.claim`) and lost at a stale frame (test_memory's late groups, 1 run in 4).
    While the rank's socket still holds the descriptor, such a frame is an older connection's."""
    server, sock = shell
    monitor, real = FakeMonitor(), server._monitor
    server._monitor = monitor
    try:
        SOCKETS[5] = 100
        hello = Hello(dp_size=1, dp_rank=0, config_fingerprint="", incarnation="x")
        sock.put(b"rank0", hello, 5)
        server._drain_frames()
        (welcome,) = sock.out.pop(b"rank0")
        assert isinstance(welcome, Welcome)
        sock.queue.append((b"gone", Frame(b"\xc1 not msgpack", 5)))
        sock.put(b"gone", hello, 5)
        server._drain_frames()
        assert server.registry.peer_on(5) == b"rank0"
        assert b"gone" not in sock.out  # its connection is gone: nothing is answered
        sock.put(b"rank0", report(welcome), 5)
        server._drain_frames()
        (decision,) = sock.out.pop(b"rank0")
        assert isinstance(decision, StepDecision) and decision.seq == welcome.next_seq
        # its own close, read now, still ends it
        monitor.closed(5)
        assert server._drain_monitor()
        assert server.registry.peer_on(5) is None
    finally:
        server._monitor = real


@pytest.mark.timeout(60)
def test_a_first_connect_to_no_socket_file_fails_at_once(tmp_path: Path) -> None:
    """Issue 30: a client with no coordd waited its whole timeout (5 s in the README) before
    saying "no socket file", which a look at the path tells at once. (A connect() that waited
    would run into this test's 60 s timeout.)"""
    from coordd.client.sync import CoordClient
    from coordd.proto.errors import CoordinatorUnavailable

    path = tmp_path / "coordd.sock"
    for timeout in (3600.0, 0.5):
        with (CoordClient(f"ipc://{path}", dp_rank=0, dp_size=2) as c,
              pytest.raises(CoordinatorUnavailable) as caught):
            c.connect(timeout=timeout)
        assert f"no socket file at {path}" in str(caught.value)
        assert "as given" in str(caught.value)


@pytest.mark.timeout(60)
def test_a_first_async_connect_to_no_socket_file_fails_at_once(tmp_path: Path) -> None:
    import asyncio

    from coordd.client.aio import AsyncCoordClient
    from coordd.proto.errors import CoordinatorUnavailable

    path = tmp_path / "coordd.sock"

    async def connect() -> str:
        c = AsyncCoordClient(f"ipc://{path}", dp_rank=0, dp_size=2)
        try:
            with pytest.raises(CoordinatorUnavailable) as caught:
                await c.connect(timeout=3600.0)
        finally:
            await c.close()
        return str(caught.value)

    assert f"no socket file at {path}" in asyncio.run(connect())


@pytest.mark.timeout(60)
def test_a_first_connect_waits_where_a_coordd_holds_the_path(tmp_path: Path) -> None:
    """coordd's lock file (taken before it binds) or its set-aside socket (`.paused`, while it
    refuses new connections) says a coordd is there: the connect waits until its deadline."""
    from coordd.client.sync import CoordClient
    from coordd.proto.errors import CoordinatorUnavailable

    path = tmp_path / "coordd.sock"
    for suffix in (".lock", ".paused"):
        marker = Path(f"{path}{suffix}")
        marker.write_text("")
        with (CoordClient(f"ipc://{path}", dp_rank=0, dp_size=2) as c,
              pytest.raises(CoordinatorUnavailable) as caught):
            c.connect(timeout=0.3)
        assert "no answer from coordd within 0.3s" in str(caught.value)  # it waited
        marker.unlink()


@pytest.fixture
def relay_out(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """What the relay hub answers, by peer (decoded as a relay reads it)."""
    from coordd.io import _relay_hub
    from coordd.proto.relay_messages import decode_from_root

    out: dict[bytes, list[object]] = {}
    to: list[bytes] = []

    def send(sock: object, data: bytes, flags: int) -> None:
        if not to:
            to.append(bytes(data))
            return
        out.setdefault(to.pop(), []).append(decode_from_root(bytes(data)).message)

    monkeypatch.setattr(_relay_hub, "_send_frame", send)
    return out


def _fake_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **settings: object):  # type: ignore[no-untyped-def]
    server = CoordServer(ServerSettings(f"ipc://{tmp_path}/c.sock", **settings))  # type: ignore[arg-type]
    fake = FakeSocket()
    monkeypatch.setattr(server, "_sock", fake)
    monkeypatch.setattr(server.descriptors, "socket_ident", SOCKETS.get)
    SOCKETS.clear()
    return server, fake


def _relay_hello(group: str, dp: int, ranks: list[int], relay: str = "node"):  # type: ignore[no-untyped-def]
    from coordd.proto.relay_messages import RelayHello

    return RelayHello(group=group, dp_size=dp, ranks=ranks, config_fingerprint="",
                      incarnation="x", relay=relay)


def test_a_refused_relay_hello_leaves_no_relayed_group(root_shell, relay_out) -> None:  # type: ignore[no-untyped-def]
    """Issue 36 #1: a RelayHello refused by the group's own rules (dp_size 0) kept the relayed
    group it created, and every rank's own Hello for that group was then refused as "served
    through relays" until coordd restarted."""
    from coordd.proto.messages import Reject

    server, sock = root_shell
    sock.put(b"junk", _relay_hello("default", 0, [0]), 7)
    server._drain_frames()
    (refused,) = relay_out[b"junk"]
    assert isinstance(refused, Reject) and refused.reason.value == "dp_size"
    assert server.relays.trees == {} and server.relays.fd_peer == {}
    sock.put(b"rank0", Hello(dp_size=1, dp_rank=0, config_fingerprint="", incarnation="x"), 5)
    server._drain_frames()
    (welcome,) = sock.out[b"rank0"]
    assert isinstance(welcome, Welcome)


def test_relayed_groups_no_relay_holds_give_their_slots_up_and_exact_names_keep_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, relay_out  # type: ignore[no-untyped-def]
) -> None:
    """Issue 36 #2: relayed groups were never dropped and exact names got no reserved slot:
    two pattern groups whose relays left filled --max-groups 2 for good, and a relay for
    `enginecore` (a name --groups gives exactly) was refused group_limit."""
    server, fake = _fake_server(tmp_path, monkeypatch, relay_root=True, dp_size=1, max_groups=2)
    try:
        for fd, group in ((7, "dp-tp1-pp0"), (8, "dp-tp2-pp0")):
            peer = b"gone%d" % fd
            fake.put(peer, _relay_hello(group, 1, [0]), fd)
            server._drain_frames()
            assert isinstance(relay_out[peer][-1], Welcome)
            server.relays.closed(fd)  # its relay left: nobody holds the group
        assert len(server.relays.trees) == 2
        for fd, peer, group in ((9, b"new", "dp-tp3-pp0"), (10, b"engine", "enginecore")):
            fake.put(peer, _relay_hello(group, 1, [0]), fd)
            server._drain_frames()
            assert isinstance(relay_out[peer][-1], Welcome), relay_out[peer]
        assert set(server.relays.trees) == {"dp-tp3-pp0", "enginecore"}
    finally:
        server.close()


def test_a_relay_waiting_to_resize_is_not_protected_from_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, relay_out  # type: ignore[no-untyped-def]
) -> None:
    """Issue 36 #3: a RelayHello waiting to re-form a group at another size counted as a
    holder, so its connection was exempt from the connection cap, and stayed so after the
    wait was refused."""
    from coordd.proto.messages import Reject

    server, fake = _fake_server(tmp_path, monkeypatch, relay_root=True, dp_size=2, step_timeout=1.0)
    try:
        fake.put(b"holder", _relay_hello("default", 2, [0, 1]), 7)
        fake.put(b"waiter", _relay_hello("default", 1, [0]), 8)
        server._drain_frames()
        assert isinstance(relay_out[b"holder"][-1], Welcome) and b"waiter" not in relay_out
        assert 7 in server._held_fds() and 8 not in server._held_fds()
        later = server.clock() + 10.0
        monkeypatch.setattr(server.relays, "clock", lambda: later)
        server.relays._on_timer()
        (refused,) = relay_out[b"waiter"]
        assert isinstance(refused, Reject) and refused.reason.value == "dp_size"
        assert 8 not in server.introduced_fds() and 7 in server.introduced_fds()
    finally:
        server.close()


def test_refused_relay_hellos_are_flood_counted_and_logged_once(
    root_shell, relay_out, caplog: pytest.LogCaptureFixture  # type: ignore[no-untyped-def]
) -> None:
    """Issue 36 #5: relay-wire frames skipped the stranger flood cut-off, and every refused
    RelayHello logged a WARNING of its own."""
    server, sock = root_shell
    caplog.set_level("WARNING", logger="coordd")
    for _ in range(50):
        sock.put(b"junk", _relay_hello("no such group", 1, [0]), 7)
    server._drain_frames()
    assert len(relay_out[b"junk"]) == 50  # each answered
    assert server.admission.counts[b"junk"] == 50  # as many as a stranger's Hellos count
    lines = [r for r in caplog.records if "relay" in r.getMessage() and "refused" in r.getMessage()]
    assert 1 <= len(lines) <= 2, len(lines)


def test_a_flat_coordd_takes_no_relay_and_counts_its_frames_as_a_strangers_junk(
    shell, relay_out, caplog: pytest.LogCaptureFixture  # type: ignore[no-untyped-def]
) -> None:
    """Issue 36 item 1: every coordd answered the relay wire, root or not. A coordd started
    without --relay-root keeps nothing a relay sends, counts each frame as a stranger's bad
    frame toward the flood cut-off (one aggregated line), and answers a RelayHello with
    Rejected(not_root) naming the option; a rank's own Hello for the group is then welcome."""
    from coordd.proto.messages import Reject, RejectReason
    from coordd.proto.relay_messages import RelayLeave

    server, sock = shell
    caplog.set_level("WARNING", logger="coordd")
    for _ in range(50):
        sock.put(b"relay", _relay_hello("default", 1, [0]), 7)
    sock.put(b"relay", RelayLeave(group="default", epoch=1, lost=True), 7)
    server._drain_frames()
    answers = relay_out[b"relay"]
    assert len(answers) == 50  # the RelayHellos; the leave is junk, unanswered
    assert all(isinstance(a, Reject) and a.reason is RejectReason.NOT_ROOT for a in answers)
    assert "--relay-root" in answers[0].text  # type: ignore[attr-defined]
    assert server.relays.trees == {} and server.relays.fd_peer == {}
    assert server.relays.peer_fd == {} and server.relays.messages == 0
    assert server.admission.counts[b"relay"] == 51 and server.stats.bad_frames == 51
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) <= 2
    sock.put(b"rank0", Hello(dp_size=1, dp_rank=0, config_fingerprint="", incarnation="x"), 5)
    server._drain_frames()
    (welcome,) = sock.out[b"rank0"]
    assert isinstance(welcome, Welcome)


def test_a_flat_coordd_cuts_a_relay_flood_off_and_answers_within_the_strangers_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, relay_out  # type: ignore[no-untyped-def]
) -> None:
    """Past the flood cut-off the sender's connection is shut, as for any stranger's junk,
    and the RelayHellos answered take from the budget strangers' answers share."""
    from coordd.core._admission import STRANGER_ANSWERS_PER_S, STRANGER_MESSAGES_PER_S

    server, fake = _fake_server(tmp_path, monkeypatch, dp_size=1)
    shut: list[tuple[bytes, int]] = []
    monkeypatch.setattr(server.guard, "act", lambda decide: shut.append((b"cut", 0)) or 1)
    start = server.clock()
    monkeypatch.setattr(server.relays, "clock", lambda: start)  # no refill meanwhile
    try:
        for _ in range(STRANGER_MESSAGES_PER_S):
            fake.put(b"relay", _relay_hello("default", 1, [0]), 7)
        while server._drain_frames():
            pass
        assert shut, "the flood cut-off asked to shut the sender"
        assert server.admission.counts[b"relay"] == STRANGER_MESSAGES_PER_S
        assert len(relay_out[b"relay"]) <= STRANGER_ANSWERS_PER_S
        assert server.admission.answers_dropped > 0
        assert server.relays.trees == {} and server.relays.fd_peer == {}
    finally:
        server.close()


def test_a_root_takes_the_relay_a_flat_coordd_refuses(root_shell, relay_out) -> None:  # type: ignore[no-untyped-def]
    """The same RelayHello at a root (--relay-root) registers its relay."""
    server, sock = root_shell
    sock.put(b"relay", _relay_hello("default", 1, [0]), 7)
    server._drain_frames()
    (welcome,) = relay_out[b"relay"]
    assert isinstance(welcome, Welcome)
    assert set(server.relays.trees) == {"default"} and server.relays.fd_peer == {7: b"relay"}
    assert server.admission.counts[b"relay"] == 1  # counted as a stranger's Hello is


def test_a_relayed_group_with_a_round_open_is_never_idle() -> None:
    """The slot rule's idle test (a relayed group no relay holds may give its slot up) also
    needs no round open, as a flat group's does. Today's machine clears the round when its
    last relay goes, so no drain reaches that state; the rule must not rest on that."""
    from types import SimpleNamespace

    from coordd.io._relay_hub import _idle

    def tree(holders: list[bytes], round_open: bool) -> Any:
        snap = SimpleNamespace(round=object() if round_open else None)
        return SimpleNamespace(holders=lambda: holders, snapshot=lambda: snap)

    assert _idle(tree([], round_open=False))
    assert not _idle(tree([], round_open=True))
    assert not _idle(tree([b"relay"], round_open=False))


def test_a_flat_coordd_answers_no_relay_hello_from_an_unnamed_peer(
    shell, relay_out  # type: ignore[no-untyped-def]
) -> None:
    """A peer with no routing id of its own (libzmq's zero-byte names) is answered nothing,
    as a root answers it nothing: its frame is still a stranger's bad frame."""
    server, sock = shell
    sock.put(b"\x00\x00\x00\x00\x07", _relay_hello("default", 1, [0]), 7)
    server._drain_frames()
    assert relay_out == {} and server.stats.bad_frames == 1
    assert server.admission.counts[b"\x00\x00\x00\x00\x07"] == 1


def test_a_wait_counts_only_under_the_rank_that_sent_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    """Issue 36: `waited_us` was counted under the rank a report claims, before coordd checked
    it against the rank that sent it: rank 0 could fill rank 1's wait (once per rank and
    round), and rank 1's own was then dropped."""
    server, fake = _fake_server(tmp_path, monkeypatch, dp_size=2)
    monkeypatch.setattr(server._outbox, "sock", fake)
    monkeypatch.setattr(outbox_module, "_send_frame", lambda sock, data, flags: sock.send(data))
    try:
        for rank, fd in ((0, 5), (1, 6)):
            fake.put(b"rank%d" % rank, Hello(dp_size=2, dp_rank=rank, config_fingerprint="",
                                             incarnation="x"), fd)
        server._drain_frames()
        welcome = fake.out[b"rank0"][-1]
        assert isinstance(welcome, Welcome)

        def step(rank: int, seq: int, waited: int = -1, claim: int | None = None) -> StepReport:
            return StepReport(num_tokens=4, num_tokens_padded=4, seq=seq, epoch=welcome.epoch,
                              dp_rank=rank if claim is None else claim, waited_us=waited)

        for rank, fd in ((0, 5), (1, 6)):
            fake.put(b"rank%d" % rank, step(rank, welcome.next_seq), fd)
        server._drain_frames()
        seq = welcome.next_seq + 1
        fake.put(b"rank0", step(0, seq, waited=900_000, claim=1), 5)  # refused: not its rank
        fake.put(b"rank1", step(1, seq, waited=1_000), 6)
        server._drain_frames()
        waits = server.groups["default"].observer.waits
        assert sum(h.count for h in waits.values()) == 1
        assert sum(h.sum for h in waits.values()) == pytest.approx(0.001)
    finally:
        server.close()


def test_a_relays_bundle_counts_only_over_the_connection_that_registered_it(
    root_shell, relay_out  # type: ignore[no-untyped-def]
) -> None:
    """Planted (issue 36, item 5): a registered relay's bundle from another descriptor than
    its registration's was accepted."""
    from coordd.proto.relay_messages import RelayBundle

    server, sock = root_shell
    sock.put(b"relay", _relay_hello("default", 1, [0]), 7)
    server._drain_frames()
    (welcome,) = relay_out[b"relay"]
    assert isinstance(welcome, Welcome)
    bundle = RelayBundle(group="default", epoch=welcome.epoch, seq=welcome.next_seq,
                         kind=StepKind.FORWARD, ranks=[0], padded=[4], max_padded=4,
                         min_tokens=4)
    sock.put(b"relay", bundle, 8)  # another connection presenting the relay's routing id
    server._drain_frames()
    assert server.relays.refused == 1 and relay_out[b"relay"] == [welcome]
    assert server.relays.trees["default"].decisions == 0
    sock.put(b"relay", bundle, 7)
    server._drain_frames()
    assert isinstance(relay_out[b"relay"][-1], StepDecision)


def test_a_refused_relay_hello_makes_no_idle_group_give_its_slot_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, relay_out  # type: ignore[no-untyped-def]
) -> None:
    """As for a flat Hello: only a registration the new group admits may take an idle group's
    slot; one refused (here dp_size 0) leaves the idle group where it is."""
    from coordd.proto.messages import Reject

    server, fake = _fake_server(tmp_path, monkeypatch, relay_root=True, dp_size=1, max_groups=1)
    try:
        fake.put(b"gone", _relay_hello("dp-tp1-pp0", 1, [0]), 7)
        server._drain_frames()
        server.relays.closed(7)
        fake.put(b"junk", _relay_hello("dp-tp2-pp0", 0, [0]), 8)
        server._drain_frames()
        assert isinstance(relay_out[b"junk"][-1], Reject)
        assert list(server.relays.trees) == ["dp-tp1-pp0"]
        fake.put(b"real", _relay_hello("dp-tp2-pp0", 1, [0]), 9)
        server._drain_frames()
        assert isinstance(relay_out[b"real"][-1], Welcome)
        assert list(server.relays.trees) == ["dp-tp2-pp0"]
    finally:
        server.close()
