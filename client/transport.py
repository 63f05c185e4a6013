"""The rank's ZeroMQ DEALER socket: options shared by the blocking and the asyncio client.

Liveness is left to libzmq: ZMTP heartbeats (PING/PONG) are sent and answered by ZeroMQ's
I/O thread, so a rank blocked on the GPU, or idle between steps, stays alive without any
Python running; a socket monitor tells the client when the connection to coordd drops.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import zmq

from proto.messages import MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class CurveKeys:
    """CURVE credentials for tcp: coordd's public key and this rank's key pair (z85 bytes)."""

    server_public: bytes
    public: bytes
    secret: bytes


def open_dealer(
    context: zmq.Context,
    address: str,
    identity: bytes,
    *,
    heartbeat_interval: float,
    heartbeat_timeout: float,
    curve: CurveKeys | None = None,
) -> tuple[zmq.Socket, zmq.Socket]:
    """Connect a DEALER to coordd; returns it and a monitor socket that reports disconnects."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_interval * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(heartbeat_timeout * 1000))
    if curve is not None:
        sock.curve_serverkey = curve.server_public
        sock.curve_publickey = curve.public
        sock.curve_secretkey = curve.secret
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(address)
    return sock, monitor


def close_dealer(sock: zmq.Socket, monitor: zmq.Socket, final: bytes | None = None) -> None:
    """Send `final` if the pipe is up (best effort, never blocks), then close both sockets."""
    if final is not None:
        try:
            sock.send(final, zmq.NOBLOCK)
            sock.setsockopt(zmq.LINGER, 100)
        except zmq.ZMQError:
            pass
    with contextlib.suppress(zmq.ZMQError):
        sock.disable_monitor()
    monitor.close(linger=0)
    sock.close()


def drain_disconnects(monitor: zmq.Socket) -> bool:
    """Read every pending monitor event; True if any was a disconnect."""
    seen = False
    while True:
        try:
            frames = monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return seen
        event = int.from_bytes(frames[0][:2], "little")
        seen = seen or event == zmq.EVENT_DISCONNECTED
