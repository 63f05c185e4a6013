"""The rank's ZeroMQ DEALER socket: options shared by the blocking and the asyncio client.

Liveness is left to libzmq: ZMTP heartbeats (PING/PONG) are sent and answered by ZeroMQ's
I/O thread, so a rank blocked on the GPU, or idle between steps, stays alive without any
Python running; a socket monitor tells the client when the connection to coordd drops.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85

from coordd.proto.messages import MAX_MESSAGE_BYTES

#: Environment variables that name the key files a rank uses when `curve` is not given.
SERVER_KEY_ENV = "COORDD_CURVE_SERVER_KEY"
CLIENT_KEY_ENV = "COORDD_CURVE_CLIENT_KEY"


class KeyFileError(ValueError):
    """A CURVE key file is missing, unreadable or malformed; `path` names it."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"CURVE key file {path}: {problem}")
        self.path = path
        self.problem = problem


def _z85_key(path: str, name: str, value: bytes) -> bytes:
    if len(value) != 40:
        raise KeyFileError(path, f"{name} must be 40 z85 characters, got {len(value)}")
    try:
        z85.decode(value)
    except Exception:  # z85 raises KeyError, ValueError or struct.error
        raise KeyFileError(path, f"{name} is not valid z85") from None
    return value


def read_key_file(path: str) -> tuple[bytes, bytes | None]:
    """(public, secret or None) from a ZeroMQ certificate file, as `coordd keygen` writes."""
    try:
        with open(path, "rb") as f:
            lines = f.read(65536).splitlines()
    except OSError as exc:
        raise KeyFileError(path, exc.strerror or str(exc)) from None
    public = secret = None
    for raw in lines:
        line = raw.strip()
        if line.startswith(b"public-key"):
            public = line.split(b"=", 1)[1].strip(b" \t'\"")
        elif line.startswith(b"secret-key"):
            secret = line.split(b"=", 1)[1].strip(b" \t'\"")
    if public is None:
        raise KeyFileError(path, "no public-key line (make key files with `coordd keygen`)")
    public = _z85_key(path, "public-key", public)
    return public, None if secret is None else _z85_key(path, "secret-key", secret)


@dataclass(frozen=True)
class CurveKeys:
    """CURVE credentials for tcp: coordd's public key and this rank's key pair (z85 bytes)."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def from_files(cls, server_public_file: str, client_secret_file: str) -> CurveKeys:
        """coordd's public key file (NAME.key) and this rank's secret one (NAME.key_secret)."""
        server_public, _ = read_key_file(server_public_file)
        public, secret = read_key_file(client_secret_file)
        if secret is None:
            raise KeyFileError(
                client_secret_file, "has no secret-key: give the rank's NAME.key_secret file"
            )
        return cls(server_public, public, secret)


def curve_keys_from_env() -> CurveKeys | None:
    """Keys from $COORDD_CURVE_SERVER_KEY and $COORDD_CURVE_CLIENT_KEY, or None if unset."""
    server, client = os.environ.get(SERVER_KEY_ENV), os.environ.get(CLIENT_KEY_ENV)
    if not server and not client:
        return None
    if not server or not client:
        missing = SERVER_KEY_ENV if not server else CLIENT_KEY_ENV
        raise KeyFileError(missing, "is unset: CURVE needs both key files")
    return CurveKeys.from_files(server, client)


def open_dealer(
    context: zmq.Context,
    address: str,
    identity: bytes,
    *,
    heartbeat_interval: float,
    heartbeat_timeout: float,
    curve: CurveKeys | None = None,
) -> tuple[zmq.Socket, zmq.Socket]:
    """Connect a DEALER to coordd; returns it and a monitor socket that reports disconnects.

    Without `curve`, the keys named by $COORDD_CURVE_SERVER_KEY/$COORDD_CURVE_CLIENT_KEY are
    used if set (the deploy files set them), else the connection is unauthenticated."""
    if curve is None:
        curve = curve_keys_from_env()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    # Not IMMEDIATE: with it, libzmq drops what coordd sent and the rank has not read yet when
    # the connection closes (a decision, then the Goodbye of a coordd that shuts down).
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
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED)
    _handshakes[monitor] = [curve is not None, None]
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


_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
#: Whether each monitor's socket uses CURVE, and the last handshake failure it reported.
_handshakes: weakref.WeakKeyDictionary[zmq.Socket, list[Any]] = weakref.WeakKeyDictionary()


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


def handshake_failure(monitor: zmq.Socket) -> str | None:
    """Why the last connection attempt's security handshake failed, if one did."""
    drain_disconnects(monitor)
    state = _handshakes.get(monitor)
    return None if state is None else state[1]


def drain_disconnects(monitor: zmq.Socket) -> bool:
    """Read every pending monitor event; True if any was a disconnect (a failed handshake is
    remembered for `handshake_failure`)."""
    seen = False
    while True:
        try:
            frames = monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return seen
        event = int.from_bytes(frames[0][:2], "little")
        seen = seen or event == zmq.EVENT_DISCONNECTED
        if event & _HANDSHAKE_FAILED:
            value = int.from_bytes(frames[0][2:6], "little")
            state = _handshakes.setdefault(monitor, [False, None])
            state[1] = _explain_handshake(event, value, state[0])
