"""The edge-trigger rule (`coordd.client._edge`) over a real in-process ZeroMQ pair."""

from __future__ import annotations

import select
from collections.abc import Iterator

import pytest
import zmq

from coordd.client._edge import drain, send_and_look

Pair = tuple[zmq.Socket, zmq.Socket]


@pytest.fixture
def pair() -> Iterator[Pair]:
    context = zmq.Context()
    ours, theirs = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
    ours.bind("inproc://edge")
    theirs.connect("inproc://edge")
    yield ours, theirs
    ours.close(linger=0)
    theirs.close(linger=0)
    context.term()


def queued(sock: zmq.Socket) -> None:
    """Wait (deadline 5 s) until what the peer sent is queued on `sock`, without reading it
    (inproc delivers in order: once one frame is readable, every frame sent before it is)."""
    assert sock.poll(5000, zmq.POLLIN), "nothing came within 5 s"


def fires(sock: zmq.Socket, timeout: float = 5.0) -> bool:
    """Does the socket's descriptor turn readable within `timeout`?"""
    readable, _, _ = select.select([int(sock.getsockopt(zmq.FD))], [], [], timeout)
    return bool(readable)


def test_drain_takes_every_queued_frame_and_rearms_the_descriptor(pair: Pair) -> None:
    ours, theirs = pair
    for k in range(3):
        theirs.send(b"%d" % k)
    queued(ours)
    got: list[bytes] = []
    assert drain(ours, got.append) is False
    assert got == [b"0", b"1", b"2"]
    assert not int(ours.getsockopt(zmq.EVENTS)) & zmq.POLLIN
    theirs.send(b"3")
    assert fires(ours), "drained to an EVENTS check: the next frame wakes the loop"
    assert drain(ours, got.append, expect=False) is False and got[-1] == b"3"


def test_a_limited_drain_says_that_more_is_queued(pair: Pair) -> None:
    ours, theirs = pair
    for k in range(5):
        theirs.send(b"%d" % k)
    queued(ours)
    got: list[bytes] = []
    assert drain(ours, got.append, limit=2) is True, "resume at the next turn"
    assert got == [b"0", b"1"]
    assert drain(ours, got.append, limit=3) is False
    assert got == [b"0", b"1", b"2", b"3", b"4"]


def test_a_send_looks_for_what_came_meanwhile(pair: Pair) -> None:
    ours, theirs = pair
    theirs.send(b"answer")
    queued(ours)
    got: list[bytes] = []
    assert send_and_look(ours, b"report", got.append) is True
    assert got == [b"answer"], "handed over: the send may have taken the edge that announced it"
    assert theirs.recv() == b"report"


def test_a_send_without_a_pipe_is_refused() -> None:
    context = zmq.Context()
    lone = context.socket(zmq.DEALER)  # connected to nothing: no pipe to queue on
    try:
        assert send_and_look(lone, b"report", lambda frame: None) is False
    finally:
        lone.close(linger=0)
        context.term()


def test_a_closed_socket_has_nothing_to_drain(pair: Pair) -> None:
    ours, _ = pair
    ours.close(linger=0)
    assert drain(ours, lambda frame: None) is False
