"""coordd.io._limits: NOFILE, fitted caps, and what admission asks of the OS (socket identities,
peer pids, shutdown(2)), with `coordd.core._admission` decisions carried out as the shell does."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from coordd.core import _daemon_defaults as defaults
from coordd.core._admission import Admission, Shut
from coordd.io import _limits as limits


def real(cap: int, registered: Callable[[], set[int]] = set) -> Admission:
    """Admission given what the OS says, as the server's guard asks it."""
    from tests.unit.test_admission import Shelled

    return Shelled(cap, registered, ident=limits.socket_ident, pid=limits.peer_pid)


def carry_out(admission: Admission, shuts: list[Shut]) -> int:
    """What `CoordServer._shut` does: shutdown(2) where the descriptor still names the socket."""
    done = 0
    for shut in shuts:
        if limits.shutdown_fd(shut.fd, shut.ident):
            admission.done(shut)
            done += 1
    return done


def test_raise_nofile_lifts_the_soft_limit_to_the_hard_one() -> None:
    # In a child, so this process's limit is left alone.
    code = (
        "import resource; from coordd.io._limits import raise_nofile\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))\n"
        "now = raise_nofile()\n"
        "assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == now[0]\n"
        "print(now[0], hard)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    soft, hard = (int(v) for v in out.stdout.split())
    if hard != resource.RLIM_INFINITY:
        assert soft == hard


def test_caps_fit_the_descriptor_limit() -> None:
    roomy = limits.ConnectionCaps.fit(65536, 1024, 64)
    assert (roomy.zmq, roomy.http) == (1024, 64)
    tight = limits.ConnectionCaps.fit(256, 1024, 64)
    assert 2 * tight.zmq + tight.http + limits.FD_RESERVE <= 256  # room for the lag
    assert tight.zmq >= 64 and tight.http >= 1


def test_shutdown_fd_ends_the_connection_but_keeps_the_descriptor() -> None:
    a, b = socket.socketpair()
    with a, b:
        assert limits.shutdown_fd(a.fileno())
        assert b.recv(1) == b""  # the peer sees end-of-file
        a.getsockname()  # a's descriptor is still open (not closed under its owner)
    assert not limits.shutdown_fd(a.fileno() if a.fileno() >= 0 else 10**6)


def test_a_process_cut_off_for_flooding_is_refused_for_a_while() -> None:
    import os

    guard = real(100)
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    with a, b, c, d:
        assert limits.peer_pid(a.fileno()) == os.getpid()
        guard.accepted(a.fileno(), now=0.0)
        guard.new_window(0.5)
        for _ in range(guard.flood - 1):
            assert not guard.stranger_message(b"rogue", a.fileno(), 0.5)
        assert guard.stranger_message(b"rogue", a.fileno(), 0.5)
        assert carry_out(guard, guard.cut(b"rogue", a.fileno(), now=1.0)) == 1
        assert b.recv(1) == b""  # shut down
        refused = guard.accepted(c.fileno(), now=2.0)  # the same process again: refused
        assert [s.fd for s in refused] == [c.fileno()] and guard.refused == 1
        assert carry_out(guard, refused) == 1 and d.recv(1) == b""
        assert guard.accepted(c.fileno(), now=1.0 + defaults.BAN_SECONDS + 0.1) == []  # over
        assert c.fileno() in guard.open and guard.refused == 1


def test_socket_ident_names_the_socket_not_the_number() -> None:
    a, b = socket.socketpair()
    r, w = os.pipe()
    try:
        with a, b:
            ident = limits.socket_ident(a.fileno())
            assert ident is not None and ident != limits.socket_ident(b.fileno())
        assert limits.socket_ident(r) is None  # not a socket
    finally:
        os.close(r)
        os.close(w)


def still_open(peer: socket.socket) -> bool:
    """True if `peer`'s other end was not shut down (no end-of-file to read)."""
    peer.setblocking(False)
    try:
        return peer.recv(1) != b""
    except BlockingIOError:
        return True


def test_a_descriptor_number_reused_by_a_newer_connection_is_not_shut_down() -> None:
    """coordd read connection A's ACCEPTED, A closed, and libzmq gave A's descriptor number
    to connection B before coordd read A's close: closing 'A' by number would end B."""
    a, a_peer = socket.socketpair()
    b, b_peer = socket.socketpair()
    with a, a_peer, b, b_peer:
        number = a.fileno()
        guard = real(1)
        guard.accepted(number, 0.0)  # A, with its socket's identity
        os.dup2(b.fileno(), number)  # A is gone; its number now names B's socket
        assert not limits.shutdown_fd(number, guard.open[number])
        assert limits.peer_pid(number, guard.open[number]) is None
        assert carry_out(guard, guard.shed()) == 0  # nothing shut: the number is B's now
        assert still_open(b_peer)  # no end-of-file: B is untouched
        # the connection the guard did record is shut down through the same path
        guard.accepted(number, 0.0)  # B's ACCEPTED, identity B
        assert carry_out(guard, guard.shed()) == 1
        assert b_peer.recv(1) == b""


def test_shutting_down_one_open_connection_checks_its_identity() -> None:
    a, a_peer = socket.socketpair()
    b, b_peer = socket.socketpair()
    with a, a_peer, b, b_peer:
        number = a.fileno()
        guard = real(10)
        guard.accepted(number, 0.0)
        ident = guard.open[number]
        assert ident is not None
        os.dup2(b.fileno(), number)
        assert not limits.shutdown_fd(number, ident) and still_open(b_peer)
        guard.open[number] = None  # identity unknown at ACCEPTED: never shut
        assert guard.shed() == [] and still_open(b_peer)


def test_the_cap_and_the_flood_cut_off_check_the_identity_too() -> None:
    a, a_peer = socket.socketpair()
    b, b_peer = socket.socketpair()
    with a, a_peer, b, b_peer:
        number = a.fileno()
        guard = real(0)
        guard.accepted(number, 0.0)
        os.dup2(b.fileno(), number)
        chosen = guard.enforce()
        assert len(chosen) == 1 and carry_out(guard, chosen) == 0  # chosen, but not A: kept
        assert guard.evicted == 0
        guard.accepted(number, 0.0)
        assert guard.cut(b"rogue", number + 10_000, now=0.0) == []  # no such descriptor
        assert still_open(b_peer)


def test_what_a_shut_connection_still_has_queued_is_recognised_by_its_socket() -> None:
    """After a shed, a flood's queued messages are dropped undecoded (`from_shut`, asked with
    each message's SRCFD). A new connection that got the shut one's descriptor number before
    coordd read its ACCEPTED names another socket: its messages (a rank's Hello) are read."""
    a, a_peer = socket.socketpair()
    b, b_peer = socket.socketpair()
    with a, a_peer, b, b_peer:
        number = a.fileno()
        guard = real(10)
        guard.accepted(number, 0.0)
        assert not guard.from_shut(number) and not guard.from_shut(None)  # open: read
        assert carry_out(guard, guard.shed()) == 1
        assert guard.from_shut(number) and guard.dropped_shut == 1  # the same socket: drop
        os.dup2(b.fileno(), number)  # libzmq closed it and gave the number to B
        assert not guard.from_shut(number)  # B's: read, before B's ACCEPTED too
        guard.accepted(number, 0.0)  # B's ACCEPTED: the number is B's from now on
        assert number not in guard.shut and not guard.from_shut(number)


# -- refusing at the listener before the descriptors run out (issue 21, 6) -----------------------


def test_the_descriptor_watch_pauses_past_high_and_resumes_below_low() -> None:
    from coordd.io._limits import DescriptorWatch

    counts = iter([100, 500, 512, 700, 500, 256, 200, 650])
    calls: list[str] = []
    watch = DescriptorWatch(
        1024,
        pause=lambda: calls.append("pause") or True,
        resume=lambda: calls.append("resume") or True,
        count=lambda: next(counts),
    )
    assert (watch.high, watch.low) == (512, 256)
    seen = [(watch.check(), watch.paused) for _ in range(8)]
    assert [paused for _, paused in seen] == [False, False, True, True, True, False, False, True]
    assert calls == ["pause", "resume", "pause"] and watch.pauses == 2 and watch.peak == 700
    assert seen[2][0] == DescriptorWatch.FAST_S and seen[0][0] == DescriptorWatch.SLOW_S
    assert seen[6][0] == DescriptorWatch.FAST_S, "just resumed: a herd of reconnects comes"
    for _ in range(DescriptorWatch.POKE_EVERY - 1):  # the gate's pokes: a look every 4th
        watch.poke()
    with pytest.raises(StopIteration):
        watch.poke()


def test_the_descriptor_watch_looks_fast_as_soon_as_a_storm_begins() -> None:
    """A look every SLOW_S (100 ms) below `low` let a storm's burst of accepts reach NOFILE
    between two looks (libzmq's abort, 4 runs in 10 of the fd-storm test under CPU hogs):
    the looks are FAST_S once descriptors beyond the ranks' grew by more than QUIET_SLACK
    since the last quiet look, and SLOW_S again once that level has held SETTLE_S (what
    coordd keeps open: its HTTP listener, a relay's uplink) or fallen back."""
    from coordd.io._limits import DescriptorWatch

    now = [0.0]
    slack = DescriptorWatch.QUIET_SLACK
    counts = iter([30, 86, 86 + slack + 1, 86 + slack + 5, 86 + slack + 5, 90, 40 + 56 + 20])
    watch = DescriptorWatch(
        256, lambda: True, lambda: True, count=lambda: next(counts), clock=lambda: now[0]
    )
    watch.quiet = 30  # what `start` counts, here without its thread
    assert watch.check() == DescriptorWatch.SLOW_S
    watch.held = 56  # ranks registered: quiet still
    assert watch.check() == DescriptorWatch.SLOW_S
    assert watch.check() == DescriptorWatch.FAST_S, "strangers beyond the ranks: a storm"
    now[0] += 0.5
    assert watch.check() == DescriptorWatch.FAST_S
    now[0] += DescriptorWatch.SETTLE_S
    assert watch.check() == DescriptorWatch.SLOW_S, "a level held: the new quiet one"
    assert watch.check() == DescriptorWatch.SLOW_S and watch.quiet == 90 - 56
    assert watch.check() == DescriptorWatch.FAST_S, "grown again past the new quiet level"
    assert not watch.paused


def test_an_ipc_socket_paused_refuses_new_connections_and_keeps_the_open_ones(
    tmp_path: Path,
) -> None:
    import zmq

    from coordd.io._listen import IpcSocket

    address = f"ipc://{tmp_path}/p.sock"
    ipc = IpcSocket.claim(address)
    assert ipc is not None
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    ipc.bind(router)
    old = ctx.socket(zmq.DEALER)
    old.connect(address)
    old.send(b"before")
    assert router.poll(5000) and router.recv_multipart()[1] == b"before"
    try:
        new = ctx.socket(zmq.DEALER)
        assert ipc.pause() and not ipc.pause()
        assert not Path(ipc.path).exists()
        new.connect(address)
        new.send(b"paused")
        old.send(b"still")
        assert router.poll(5000) and router.recv_multipart()[1] == b"still"
        assert not router.poll(300), "no connection while paused"
        assert ipc.resume() and not ipc.resume()
        assert router.poll(5000) and router.recv_multipart()[1] == b"paused"
        assert ipc.pause()
    finally:
        for sock in (router, old, new):
            sock.close(0)
        ipc.release()  # paused: put back, then removed
        ctx.term()
    assert not Path(ipc.path).exists() and not Path(ipc.paused_path).exists()


def test_a_tcp_listener_paused_completes_no_new_connection_and_keeps_the_open_ones() -> None:
    """Over tcp the watch pauses libzmq's listener with a socket filter (no ZeroMQ call, so
    from any thread): a new connection is not completed while paused (its SYN is dropped and
    sent again after the retransmission timeout), the open one works, and after the resume
    the new one gets in."""
    import zmq

    from coordd.io._listen import TcpListeners

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)
    listeners = TcpListeners.find(int(address.rsplit(":", 1)[1]))
    assert len(listeners.sockets) == 1
    assert TcpListeners.find(1).sockets == []  # nothing of ours listens there
    old = ctx.socket(zmq.DEALER)
    old.connect(address)
    old.send(b"before")
    new = ctx.socket(zmq.DEALER)
    try:
        assert router.poll(5000) and router.recv_multipart()[1] == b"before"
        assert listeners.pause() and not listeners.pause()
        new.connect(address)
        new.send(b"paused")
        old.send(b"still")
        assert router.poll(5000) and router.recv_multipart()[1] == b"still"
        assert not router.poll(500), "no connection while paused"
        assert listeners.resume() and not listeners.resume()
        assert router.poll(15_000) and router.recv_multipart()[1] == b"paused"
    finally:
        for sock in (router, old, new):
            sock.close(0)
        ctx.term()


def test_the_listener_pause_lifts_when_the_storm_ends_while_ranks_hold_descriptors() -> None:
    """Issue 28, defect 2: NOFILE 1024 and ~250 registered ranks: coordd sat at 278
    descriptors, under the pause mark (512) but over the resume mark (256). One reconnect
    burst paused the listener and it never reopened (a new rank's connect(): "coordd is not
    running there"). The marks now move up by what the ranks hold: it lifts at 278."""
    from coordd.io._limits import DescriptorWatch

    counts = iter([278, 640, 700, 500, 300, 278, 290])
    calls: list[str] = []
    watch = DescriptorWatch(
        1024,
        pause=lambda: calls.append("pause") or True,
        resume=lambda: calls.append("resume") or True,
        count=lambda: next(counts),
    )
    watch.held = 250  # the ranks' connections (the server keeps it current)
    assert watch.marks() == ((1024 + 250) // 2, (1024 + 750) // 4) == (637, 443)
    seen = [watch.check() and watch.paused for _ in range(7)]
    assert seen == [False, True, True, True, False, False, False]
    assert calls == ["pause", "resume"], "the pause lifts once the storm's connections go"
    watch.held = 0  # no rank: the marks are the plain half and quarter
    assert watch.marks() == (watch.high, watch.low) == (512, 256)


def test_a_rank_that_connects_while_the_listener_is_paused_is_told_so(tmp_path: Path) -> None:
    """Issue 28, defect 2: the socket file moved aside while paused read as "coordd is not
    running there", sending an operator to start a second coordd."""
    from coordd.client._transport import _diagnose
    from coordd.proto.address import check_address

    endpoint = check_address(f"ipc://{tmp_path}/coordd.sock")
    assert "not running" in _diagnose(endpoint)
    (tmp_path / "coordd.sock.paused").touch()
    said = _diagnose(endpoint)
    assert "up but paused" in said and "not running" not in said
