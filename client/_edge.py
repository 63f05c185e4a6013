"""The one rule for reading a ZeroMQ socket that an event loop watches through its descriptor.

A ZeroMQ socket's file descriptor (ZMQ_FD) is edge-triggered: it turns readable when the
socket's state changes, and any operation on the socket (a recv, a send, reading ZMQ_EVENTS)
can take that edge. Taken, it does not fire again while frames stay queued: a frame that came
during a send waits unread until some later frame happens to wake the loop (or for ever). So:

- a reader drains until ZMQ_EVENTS says nothing more is queued: reading EVENTS is what re-arms
  the descriptor (`drain`);
- after a send, the sender looks (EVENTS) and drains what it finds: the send may have taken the
  edge of an answer that came meanwhile (`send_and_look`);
- a reader that stops early (a budget per wakeup) resumes by itself at the loop's next turn:
  `drain` returns True then, and the descriptor will not remind it.

Only pyzmq is used here, never the rest of the client: the daemon's ROUTER follows the same rule
(coordd.io._server's drain and its resume at the next turn).
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

# Plain ints: pyzmq's constants are enum.Flag members, slow to combine in Python.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
#: pyzmq's own socket class: its methods called unbound skip `AttributeSetter.__getattr__`'s
#: hook, which makes every attribute read of a socket a Python-level call (~900 instructions).
_Socket = zmq.Socket
_recv = zmq.backend.Socket.recv
_send = zmq.backend.Socket.send
#: zmq_poll with no wait reads ZMQ_EVENTS as getsockopt does (libzmq reads it for each socket
#: item; it re-arms the descriptor alike), without pyzmq's getsockopt building a
#: `SocketOption` enum member in Python on every call: ~2.8k instructions against ~9.4k
#: (cachegrind, coordd.tools.round_counts' issue 37 notes in docs/bench.md).
zmq_poll = zmq.backend.zmq_poll


def queued(sock: zmq.Socket) -> bool:
    """True if a frame is queued on `sock` (ZMQ_EVENTS has POLLIN); reads EVENTS, so it
    re-arms the descriptor as `drain`'s check does."""
    if type(sock) is _Socket:
        return bool(zmq_poll([(sock, _POLLIN)], 0))
    return bool(int(sock.getsockopt(_EVENTS)) & _POLLIN)


def drain(
    sock: zmq.Socket,
    on_frame: Callable[[bytes], object],
    *,
    expect: bool = True,
    limit: int | None = None,
) -> bool:
    """Hand every queued frame to `on_frame`, ending on a ZMQ_EVENTS check (which re-arms the
    descriptor). `expect`: a frame is likely queued (the descriptor fired), so the first recv
    is tried straight away (a cold getsockopt costs more than the recv); False right after a
    send, when one rarely is. `limit`: at most this many frames; True if it stopped there with
    more queued (the caller must resume on its own: the descriptor will not fire for them).
    A closed socket has nothing to drain."""
    if sock.closed:
        return False
    if type(sock) is not _Socket:  # another class (a test's fake): its own methods
        return _drain_any(sock, on_frame, expect, limit)
    look = [(sock, _POLLIN)]
    taken = 0
    if expect:
        try:
            frame = _recv(sock, _NOBLOCK)
        except zmq.Again:
            pass
        else:
            on_frame(frame)
            taken = 1
    # EVENTS rather than recv-until-Again: raising zmq.Again costs several times the look
    if limit is None:
        while zmq_poll(look, 0):
            on_frame(_recv(sock, _NOBLOCK))
        return False
    while zmq_poll(look, 0):
        if taken >= limit:
            return True
        on_frame(_recv(sock, _NOBLOCK))
        taken += 1
    return False


def _drain_any(
    sock: zmq.Socket, on_frame: Callable[[bytes], object], expect: bool, limit: int | None
) -> bool:
    """`drain` through the socket's own methods (the same rule, for any socket class)."""
    taken = 0
    if expect:
        try:
            frame = sock.recv(_NOBLOCK)
        except zmq.Again:
            pass
        else:
            on_frame(frame)
            taken = 1
    while int(sock.getsockopt(_EVENTS)) & _POLLIN:
        if limit is not None and taken >= limit:
            return True
        on_frame(sock.recv(_NOBLOCK))
        taken += 1
    return False


def send_and_look(sock: zmq.Socket, data: bytes, on_frame: Callable[[bytes], object]) -> bool:
    """Queue `data` without blocking (False if there is no pipe to queue it on), then `drain`
    what came meanwhile: the send may have taken the descriptor's edge."""
    try:
        # pyzmq's Socket.send without its Python layer (routing_id/group/Frame checks a plain
        # bytes send never needs), for pyzmq's own socket class
        if type(sock) is _Socket:
            _send(sock, data, _NOBLOCK)
        else:
            sock.send(data, _NOBLOCK)
    except zmq.Again:
        sent = False
    else:
        sent = True
    drain(sock, on_frame, expect=False)
    return sent
