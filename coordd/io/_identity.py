"""A rank is the connection that registered it: how coordd tells connections apart, what it shows
of them, and what it does with a message that claims a rank over another connection.

The binding, over ipc and tcp (+CURVE) alike:

- **One live connection per routing id.** The ROUTER runs with `ROUTER_HANDOVER` off: while a
  connection holds routing id X, libzmq itself drops a second connection that presents X (its
  frames never reach coordd); with handover on, the newcomer would take the rank's decisions.
- **The registering connection, by descriptor.** A Hello records the file descriptor its frame
  came in on (the message's `SRCFD`); every later message from that routing id must come in on
  the same descriptor while coordd knows the connection open (the socket monitor reports its
  close). A message over another descriptor is refused (answered as a stranger's), counted and
  logged: it cannot count as the rank's report, heartbeat or Goodbye.
- **Unguessable routing ids, never shown.** A client picks a fresh random routing id (128 bits)
  for each connection (`RankSession.identity`); it is not derived from the rank or the
  incarnation, and coordd never echoes it: Rejects name no holder, logs and /status show
  `peer_label(peer)` (a keyed hash, stable for the process's life, that cannot be turned back
  into the id) and the connection's address.

What is left: after rank r's connection closes, and before coordd has read the monitor's
report of it (one loop turn), a new connection that presents r's routing id *and* got the same
descriptor number would pass; it would have to know a 128-bit id that only the rank and coordd
hold.

**libzmq's own routing ids** (`new_router`). A peer that presents no routing id gets `\\x00` + a
32-bit counter from libzmq, and libzmq asserts (aborting coordd: `Assertion failed: ok
(src/socket_base.cpp:2113)`) if that name is already held by a peer that chose it. The counter
starts at `generate_random()`, two calls of the C library's `rand()`, which the libzmq that pyzmq
bundles (4.3.5) never seeds, so every process's counter would start at the same value. coordd seeds
`rand()` from the OS just before it creates its ROUTER, and checks at start (an id-less peer over
inproc) that libzmq's first automatic id is the one that seed gives; if not (another libzmq build),
it says so in a warning. coordd cannot refuse such peers earlier: libzmq settles a connection's
routing id when it attaches the connection, before coordd reads anything from it, a peer that only
holds an id never sends, and neither ZAP nor the monitor sees routing ids (ROUTER_NOTIFY is a draft
API, absent from the bundled build). What remains: a peer holding C ids of the form `\\x00`+4 bytes
(C is bounded by the connection cap) hits the counter, which moves by one per id-less connection,
with probability (C + n) / 2**32 after n id-less connections.

**Duplicate routing ids.** With ROUTER_HANDOVER off, a second connection that presents a live
routing id (a peer's own id twice, or a leaked one) is kept by libzmq as an "anonymous pipe" that
coordd never reads; what it sends is queued there, unbounded (RCVHWM 0, see `coordd.io._server`),
until the connection closes. The two libzmq settings that would avoid it let a peer abort coordd
instead (libzmq 4.3.5, `stream_engine_base.cpp:310`; tests/integration/test_routing_ids.py):

- ROUTER_HANDOVER on: the old connection's engine outlives its pipe; once its peer sends and
  hangs up, coordd's next heartbeat PING aborts (without heartbeats, a descriptor leaks).
- A finite RCVHWM: a peer that fills its pipe and hangs up makes the engine abort the same way
  on the peer's own PING, which no coordd-side setting avoids.

So coordd keeps handover off and RCVHWM 0, and an anonymous pipe is bounded only by closing its
connection (coordd cannot read it, and never learns its routing id):

- An honest client could make one too: when its side of a connection dies first (a path that
  failed one way), libzmq reconnects it at once under the same routing id while coordd's side is
  still open, and the reconnect stays unread for good, even after coordd's heartbeat timeout
  closes the old connection. So the client never registers over a reconnect: connect() after a
  dropped connection opens a new one under a fresh routing id (`ClientShell.reopen_if_dropped`),
  which coordd reads at once; until its heartbeat timeout closes the old connection, the Hello
  is refused `rank_taken`. (coordd does not shut the unread connections of a host whose
  registered one closed: that would also cut honest clients whose Hello is in flight.)
- A peer's own id twice, or a leaked one, from elsewhere: the connection cap closes the oldest
  connections that hold no rank (`coordd.io._limits`); a guard on coordd's memory is the other
  lever.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets

import zmq

log = logging.getLogger("coordd")


def frame_address(frame: object) -> str:
    """The connection's address as libzmq gives it (tcp: the IP; ipc: the peer's credentials),
    or "" if it has none."""
    try:
        return str(frame.get("Peer-Address"))  # type: ignore[attr-defined]
    except (zmq.ZMQError, KeyError, TypeError, ValueError):  # the transport set none
        return ""


#: How long the start-up check waits for its own id-less peer over inproc.
_CHECK_TIMEOUT_MS = 2000


def _c_library() -> ctypes.CDLL | None:
    """The process's C library (the `rand()` libzmq calls), or None where it cannot be had."""
    try:
        libc = ctypes.CDLL(None)
        libc.srand.argtypes = [ctypes.c_uint]
        libc.rand.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def _seed_rand(libc: ctypes.CDLL) -> int:
    """Seed `rand()` from the OS; returns the counter libzmq's `generate_random()` (two `rand()`
    calls: the first, OR the second shifted left by 31) will draw from it next."""
    seed = int.from_bytes(os.urandom(4), "little")
    libc.srand(seed)
    low, high = libc.rand(), libc.rand()
    libc.srand(seed)
    return (low | (high << 31)) & 0xFFFFFFFF


def _first_automatic_id(context: zmq.Context, sock: zmq.Socket) -> bytes | None:
    """The routing id libzmq gives an id-less peer of `sock` (one over inproc), or None."""
    endpoint = f"inproc://coordd-routing-id-check-{secrets.token_hex(8)}"
    sock.bind(endpoint)
    probe = context.socket(zmq.DEALER)
    try:
        probe.setsockopt(zmq.LINGER, 0)
        probe.connect(endpoint)
        probe.send(b"")
        if not sock.poll(_CHECK_TIMEOUT_MS):
            return None
        return bytes(sock.recv_multipart()[0])
    finally:
        probe.close(linger=0)
        sock.unbind(endpoint)


def new_router(context: zmq.Context) -> zmq.Socket:
    """coordd's ROUTER, with libzmq's automatic routing ids started from a secret value.

    libzmq names an id-less peer `\\x00` + a 32-bit counter and aborts if a peer already chose
    that name; the bundled libzmq starts the counter from an unseeded `rand()`, the same value
    in every process. So `rand()` is seeded from the OS just before the socket is made, and one
    id-less peer over inproc checks that libzmq drew from that seed (a warning if not: another
    libzmq build, whose counter coordd cannot vouch for). The value is never shown."""
    libc = _c_library()
    expected = _seed_rand(libc) if libc is not None else None
    sock = context.socket(zmq.ROUTER)
    try:
        got = _first_automatic_id(context, sock)
    except zmq.ZMQError:
        got = None
    if expected is None or got != b"\x00" + expected.to_bytes(4, "big"):
        log.warning(
            "libzmq's automatic routing ids do not start from coordd's seed (%s): a peer that "
            "predicts the next one can make libzmq abort coordd (see coordd.io._identity)",
            "no C library rand()" if expected is None else "this libzmq draws them otherwise",
        )
    return sock
