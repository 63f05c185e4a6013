"""The rank's ZeroMQ DEALER to coordd: socket options, the disconnect monitor, the CURVE handshake.

Liveness is left to libzmq: ZMTP heartbeats (PING/PONG) are sent and answered by ZeroMQ's
I/O thread, so a rank blocked on the GPU, or idle between steps, stays alive without any
Python running; a socket monitor tells the client when the connection to coordd drops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import zmq

from coordd.client.config import (
    CLIENT_KEY_ENV,
    SERVER_KEY_ENV,
    ClientConfig,
    CurveKeys,
    curve_keys_from_env,
)
from coordd.proto.messages import MAX_MESSAGE_BYTES

# Plain ints: pyzmq's constants are enum.Flag members, slow to combine in Python.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
_HANDSHAKE_FAILED = int(
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)

__all__ = [
    "CLIENT_KEY_ENV",
    "SERVER_KEY_ENV",
    "CurveKeys",
    "RankConnection",
    "close_dealer",
    "curve_keys_from_env",
    "open_dealer",
]


class RankConnection:
    """One DEALER connected to coordd, the monitor that reports its disconnects, and why its
    last security handshake failed (so an unreachable coordd is explained, not just timed out).

    Without `curve`, the keys named by $COORDD_CURVE_SERVER_KEY/$COORDD_CURVE_CLIENT_KEY are
    used if set (the deploy files set them), else the connection is unauthenticated."""

    def __init__(
        self,
        context: zmq.Context,
        address: str,
        identity: bytes,
        *,
        heartbeat_interval: float,
        heartbeat_timeout: float,
        curve: CurveKeys | None = None,
    ) -> None:
        if curve is None:
            curve = curve_keys_from_env()
        self.address = address
        self.uses_curve = curve is not None
        self.handshake_failure: str | None = None
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        # Not IMMEDIATE: with it, libzmq drops what coordd sent and the rank has not read yet
        # when the connection closes (a decision, then the Goodbye of a coordd that shuts down).
        sock.setsockopt(zmq.IMMEDIATE, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_interval * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(heartbeat_timeout * 1000))
        if curve is not None:
            sock.curve_serverkey = curve.server_public
            sock.curve_publickey = curve.public
            sock.curve_secretkey = curve.secret
        self.socket = sock
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED)
        sock.connect(address)

    @classmethod
    def open(
        cls, config: ClientConfig, identity: bytes, context: zmq.Context | None = None
    ) -> RankConnection:
        """The connection `config` describes (its address resolved), under routing id `identity`."""
        return cls(
            context or zmq.Context.instance(),
            config.resolved().address or "",
            identity,
            heartbeat_interval=config.heartbeat_interval,
            heartbeat_timeout=config.heartbeat_timeout,
            curve=config.curve,
        )

    def writable(self) -> bool:
        """True if a send would be queued now (the pipe to coordd exists)."""
        return bool(int(self.socket.getsockopt(_EVENTS)) & _POLLOUT)

    def send(self, data: bytes) -> bool:
        """Queue `data` without blocking; False if there is no pipe to queue it on."""
        try:
            self.socket.send(data, _NOBLOCK)
        except zmq.Again:
            return False
        return True

    def drain(self, on_frame: Callable[[bytes], object]) -> None:
        """Hand every queued frame to `on_frame`; ends on a ZMQ_EVENTS check, which is what
        re-arms the socket's edge-triggered file descriptor for an event loop."""
        sock = self.socket
        if sock.closed:
            return
        # Try the first frame straight away: a wait mostly finds the decision queued, and a
        # cold getsockopt costs more than the recv. After it, EVENTS rather than recv-until-
        # Again: raising zmq.Again costs several times that.
        try:
            frame = sock.recv(_NOBLOCK)
        except zmq.Again:
            pass
        else:
            on_frame(frame)
        while int(sock.getsockopt(_EVENTS)) & _POLLIN:
            on_frame(sock.recv(_NOBLOCK))

    def disconnected(self) -> bool:
        """Read every pending monitor event; True if any was a disconnect (a failed handshake
        is remembered in `handshake_failure`)."""
        seen = False
        while True:
            try:
                frames = self.monitor.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return seen
            event = int.from_bytes(frames[0][:2], "little")
            seen = seen or event == _DISCONNECTED
            if event & _HANDSHAKE_FAILED:
                value = int.from_bytes(frames[0][2:6], "little")
                self.handshake_failure = _explain_handshake(event, value, self.uses_curve)

    def why_unreachable(self) -> str:
        """': <reason>' if the last security handshake failed, else ''."""
        self.disconnected()
        return f": {self.handshake_failure}" if self.handshake_failure else ""

    def close(self, final: bytes | None = None) -> None:
        """Send `final` if the pipe is up (best effort, never blocks), then close both sockets."""
        close_dealer(self.socket, self.monitor, final)


def open_dealer(
    context: zmq.Context,
    address: str,
    identity: bytes,
    *,
    heartbeat_interval: float,
    heartbeat_timeout: float,
    curve: CurveKeys | None = None,
) -> tuple[zmq.Socket, zmq.Socket]:
    """A bare (DEALER, monitor) pair set up as a rank's, for tools that drive the sockets."""
    conn = RankConnection(
        context,
        address,
        identity,
        heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout,
        curve=curve,
    )
    return conn.socket, conn.monitor


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


def _explain_handshake(event: int, value: int, curve: bool) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"coordd refused this rank's CURVE key (ZAP status {value}): it is not among "
            "coordd's --curve-client-keys"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return (
            "the security handshake failed (ZMTP protocol error): one side uses CURVE and the "
            f"other does not, or they disagree (code {value:#x})"
        )
    if not curve:
        return (
            "the security handshake failed: coordd may require CURVE (set "
            f"{SERVER_KEY_ENV} and {CLIENT_KEY_ENV}, or pass curve=)"
        )
    return (
        "the CURVE handshake failed: is COORDD_CURVE_SERVER_KEY (curve.server_public) "
        "coordd's public key?"
    )
