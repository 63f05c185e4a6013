"""coordd.io.limits: NOFILE, fitted caps, the connection guard, the stranger token bucket."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
from collections.abc import Callable

from coordd.core import defaults
from coordd.io import limits


def recorder(shut: list[int]) -> Callable[[int, int | None], bool]:
    """A shutdown that records the descriptors it was asked to shut down."""

    def shutdown(fd: int, ident: int | None) -> bool:
        shut.append(fd)
        return True

    return shutdown


def test_raise_nofile_lifts_the_soft_limit_to_the_hard_one() -> None:
    # In a child, so this process's limit is left alone.
    code = (
        "import resource; from coordd.io.limits import raise_nofile\n"
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


def test_the_guard_closes_the_oldest_strangers_never_a_rank() -> None:
    shut: list[int] = []
    ranks = {10, 11}
    guard = limits.ConnectionGuard(4, lambda: ranks, shutdown=recorder(shut), ident=lambda fd: fd)
    for fd in (10, 20, 11, 21, 22, 23):
        guard.accepted(fd)
    assert guard.over() == 2
    assert guard.enforce() == 2
    assert shut == [20, 21]  # the oldest that hold no rank
    assert set(guard.open) == {10, 11, 22, 23}
    guard.closed(22)
    guard.accepted(24)
    assert guard.enforce() == 0
    assert guard.evicted == 2 and guard.peak == 6


def test_shutdown_fd_ends_the_connection_but_keeps_the_descriptor() -> None:
    a, b = socket.socketpair()
    with a, b:
        assert limits.shutdown_fd(a.fileno())
        assert b.recv(1) == b""  # the peer sees end-of-file
        a.getsockname()  # a's descriptor is still open (not closed under its owner)
    assert not limits.shutdown_fd(a.fileno() if a.fileno() >= 0 else 10**6)


def test_the_token_bucket() -> None:
    now = [0.0]
    bucket = limits.TokenBucket(10.0, 5.0, lambda: now[0])
    assert sum(bucket.take() for _ in range(100)) == 5
    now[0] = 1.0
    assert sum(bucket.take() for _ in range(100)) == 5  # refilled up to the burst only
    assert bucket.denied == 190


def test_a_process_cut_off_for_flooding_is_refused_for_a_while() -> None:
    import os

    shut: list[int] = []
    guard = limits.ConnectionGuard(100, set, shutdown=recorder(shut))
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    with a, b, c, d:
        assert limits.peer_pid(a.fileno()) == os.getpid()
        guard.accepted(a.fileno(), now=0.0)
        assert guard.cut(a.fileno(), now=1.0)
        guard.accepted(c.fileno(), now=2.0)  # the same process again: refused at once
        assert shut == [a.fileno(), c.fileno()] and guard.refused == 1
        guard.accepted(c.fileno(), now=1.0 + defaults.BAN_SECONDS + 0.1)  # the ban is over
        assert c.fileno() in guard.open and guard.refused == 1


def test_the_memory_guard_sheds_every_stranger_newest_first_never_a_rank() -> None:
    shut: list[int] = []
    ranks = {10}
    guard = limits.ConnectionGuard(100, lambda: ranks, shutdown=recorder(shut), ident=lambda fd: fd)
    for fd in (20, 10, 21, 22):
        guard.accepted(fd)
    assert guard.strangers() == 3
    assert guard.shed() == 3
    assert shut == [22, 21, 20] and list(guard.open) == [10]
    guard.refusing = True  # under memory pressure a new connection is shut at once
    guard.accepted(23)
    assert shut[-1] == 23 and 23 not in guard.open and guard.refused_memory == 1


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
        guard = limits.ConnectionGuard(1, set)
        guard.accepted(number)  # A, with its socket's identity
        os.dup2(b.fileno(), number)  # A is gone; its number now names B's socket
        assert not limits.shutdown_fd(number, guard.open[number])
        assert limits.peer_pid(number, guard.open[number]) is None
        assert guard.shed() == 0  # nothing shut: the number is B's now
        assert still_open(b_peer)  # no end-of-file: B is untouched
        # the connection the guard did record is shut down through the same path
        guard.accepted(number)  # B's ACCEPTED, identity B
        assert guard.shed() == 1
        assert b_peer.recv(1) == b""


def test_shutting_down_one_open_connection_checks_its_identity() -> None:
    a, a_peer = socket.socketpair()
    b, b_peer = socket.socketpair()
    with a, a_peer, b, b_peer:
        number = a.fileno()
        guard = limits.ConnectionGuard(10, set)
        guard.accepted(number)
        assert not guard.shutdown(number + 10_000)  # not open
        os.dup2(b.fileno(), number)
        assert not guard.shutdown(number) and still_open(b_peer)
        guard.open[number] = None  # identity unknown at ACCEPTED: never shut
        assert not guard.shutdown(number) and still_open(b_peer)


def test_the_cap_and_the_flood_cut_off_check_the_identity_too() -> None:
    a, a_peer = socket.socketpair()
    b, b_peer = socket.socketpair()
    with a, a_peer, b, b_peer:
        number = a.fileno()
        guard = limits.ConnectionGuard(0, set)
        guard.accepted(number)
        os.dup2(b.fileno(), number)
        assert guard.enforce() == 1 and guard.evicted == 0  # chosen, but not shut: not A
        guard.accepted(number)
        assert not guard.cut(number + 10_000, now=0.0)  # no such descriptor
        assert still_open(b_peer)


def test_what_a_shut_connection_still_has_queued_is_recognised_by_its_socket() -> None:
    """After a shed, a flood's queued messages are dropped undecoded (`from_shut`, asked with
    each message's SRCFD). A new connection that got the shut one's descriptor number before
    coordd read its ACCEPTED names another socket: its messages (a rank's Hello) are read."""
    a, a_peer = socket.socketpair()
    b, b_peer = socket.socketpair()
    with a, a_peer, b, b_peer:
        number = a.fileno()
        guard = limits.ConnectionGuard(10, set)
        guard.accepted(number)
        assert not guard.from_shut(number) and not guard.from_shut(None)  # open: read
        assert guard.shed() == 1
        assert guard.from_shut(number) and guard.dropped_shut == 1  # the same socket: drop
        os.dup2(b.fileno(), number)  # libzmq closed it and gave the number to B
        assert not guard.from_shut(number)  # B's: read, before B's ACCEPTED too
        guard.accepted(number)  # B's ACCEPTED: the number is B's from now on
        assert number not in guard.shut and not guard.from_shut(number)
    # a shut connection whose descriptor libzmq already closed (no socket under it): drop
    fake = limits.ConnectionGuard(10, set, shutdown=recorder([]), ident=lambda fd: 7)
    fake.accepted(40)
    fake.shed()
    fake._ident = lambda fd: None
    assert fake.from_shut(40)


def test_a_connection_that_says_no_hello_within_the_grace_is_shut_down() -> None:
    shut: list[int] = []
    guard = limits.ConnectionGuard(100, set, shutdown=recorder(shut), ident=lambda fd: fd)
    for fd, at in ((10, 0.0), (11, 1.0), (12, 2.0), (13, 9.5)):
        guard.accepted(fd, at)
    introduced = {11}  # it said Hello (a rank, or a peer refused by name)
    assert guard.expire(before=5.0, introduced=introduced) == 2
    assert shut == [10, 12]
    assert set(guard.open) == {11, 13}
    assert guard.expire(before=5.0, introduced=introduced) == 0  # nothing twice
    assert guard.expire(before=10.0, introduced=introduced) == 1
    assert shut == [10, 12, 13] and guard.expired == 3
    guard.closed(13)
    assert 13 not in guard.accepted_at
