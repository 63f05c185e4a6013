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
    taken = 0
    if expect:
        try:
            frame = sock.recv(_NOBLOCK)
        except zmq.Again:
            pass
        else:
            on_frame(frame)
            taken = 1
    # EVENTS rather than recv-until-Again: raising zmq.Again costs several times a getsockopt
    if limit is None:
        while int(sock.getsockopt(_EVENTS)) & _POLLIN:
            on_frame(sock.recv(_NOBLOCK))
        return False
    while int(sock.getsockopt(_EVENTS)) & _POLLIN:
        if taken >= limit:
            return True
        on_frame(sock.recv(_NOBLOCK))
        taken += 1
    return False


def send_and_look(sock: zmq.Socket, data: bytes, on_frame: Callable[[bytes], object]) -> bool:
    """Queue `data` without blocking (False if there is no pipe to queue it on), then `drain`
    what came meanwhile: the send may have taken the descriptor's edge."""
    try:
        sock.send(data, _NOBLOCK)
    except zmq.Again:
        sent = False
    else:
        sent = True
    drain(sock, on_frame, expect=False)
    return sent
