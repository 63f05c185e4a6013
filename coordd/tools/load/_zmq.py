"""The loads' own ZeroMQ sockets: a DEALER to coordd (with a leaked rank key where the
environment has one), and a context ended without waiting on it."""

from __future__ import annotations

import threading

import zmq

from coordd.client._config import curve_keys_from_env


def dealer(
    context: zmq.Context, address: str, *, ping_ms: int = 100, routing_id: bytes = b""
) -> zmq.Socket:
    """A DEALER to coordd; a CURVE client with the keys a rank would use
    ($COORDD_CURVE_SERVER_KEY, $COORDD_CURVE_CLIENT_KEY: a flood from a leaked rank key)."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    curve = curve_keys_from_env()
    if curve is not None:
        sock.curve_serverkey = curve.server_public
        sock.curve_publickey = curve.public
        sock.curve_secretkey = curve.secret
    sock.setsockopt(zmq.SNDHWM, 0)
    if ping_ms:
        sock.setsockopt(zmq.HEARTBEAT_IVL, ping_ms)
    sock.connect(address)
    return sock


def term_soon(context: zmq.Context) -> None:
    """End `context` without waiting on it: libzmq 4.3.5's zmq_ctx_term can hang for good
    after coordd refused the context's connections in their handshake (its memory gate),
    even with every socket closed at linger 0; the load's process exits regardless."""
    threading.Thread(target=context.term, daemon=True).start()
