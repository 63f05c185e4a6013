"""The rank's ZeroMQ DEALER to coordd: socket options, the disconnect monitor, the CURVE handshake.

Liveness is left to libzmq: ZMTP heartbeats (PING/PONG) are sent and answered by ZeroMQ's
I/O thread, so a rank blocked on the GPU, or idle between steps, stays alive without any
Python running; a socket monitor tells the client when the connection to coordd drops.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import time

import zmq

from coordd.client._config import (
    CLIENT_KEY_ENV,
    SERVER_KEY_ENV,
    ClientConfig,
    CurveKeys,
    curve_keys_from_env,
)
from coordd.proto.address import (
    FROM_ARGUMENT,
    FROM_DEFAULT,
    FROM_ENV,
    AddressError,
    Endpoint,
    check_address,
    resolve_address,
    runtime_dir_problem,
)
from coordd.proto.errors import UNAVAILABLE_HINTS, CoordinatorUnavailable
from coordd.proto.messages import MAX_MESSAGE_BYTES

# Plain ints: pyzmq's constants are enum.Flag members, slow to combine in Python.
_EVENTS = int(zmq.EVENTS)
_POLLOUT = int(zmq.POLLOUT)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
_HANDSHAKE_FAILED = int(
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_HANDSHAKE_DEFINITE = int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_HANDSHAKE_SUCCEEDED = int(zmq.EVENT_HANDSHAKE_SUCCEEDED)
_CONNECTED = int(zmq.EVENT_CONNECTED)
#: Fast handshakes failed without detail in a row, over tcp, after which connect() gives up: a
#: wrong server key, or a rank without CURVE at a coordd with it, fails every retry the same way.
_NO_DETAIL_LIMIT = 2
#: A handshake that fails without detail this long (s) or more after its connection was made
#: stalled (coordd's ZAP check refused it for the moment and closed it at its HANDSHAKE_IVL), so
#: it does not count toward _NO_DETAIL_LIMIT: a real mismatch fails within milliseconds, far
#: under this, even with the monitor read only every 50 ms while connect() waits.
_STALL_AFTER = 0.5

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
        source: str = FROM_ARGUMENT,
    ) -> None:
        self.address = address
        #: Where the address came from: FROM_ARGUMENT, FROM_ENV or FROM_DEFAULT.
        self.source = source
        try:
            self.endpoint: Endpoint = check_address(address)
        except AddressError as exc:
            raise CoordinatorUnavailable(
                f"cannot use coordd's address ({self.where()}): {exc}",
                hint=UNAVAILABLE_HINTS["address"],
            ) from None
        if source == FROM_DEFAULT and self.endpoint.scheme == "ipc":
            problem = runtime_dir_problem(os.path.dirname(self.endpoint.path))
            if problem is not None:
                hint = UNAVAILABLE_HINTS["runtime_dir"]
                raise CoordinatorUnavailable(f"refusing the default address: {problem}", hint=hint)
        if curve is None:
            curve = curve_keys_from_env()
        self.uses_curve = curve is not None
        self.handshake_failure: str | None = None
        #: What to do about `handshake_failure` (the error's hint).
        self.handshake_hint = ""
        #: Set when a failed handshake will fail again the same way (connect() stops waiting).
        self.handshake_refused = False
        #: Set once a disconnect was read: libzmq would reconnect under the same routing id,
        #: which coordd may still hold for the old connection (see ClientShell.reopen_if_dropped).
        self.dropped = False
        #: Set once a connection whose handshake had succeeded dropped: what the DEALER had
        #: handed it (a Hello) is lost, and so is what coordd sent back over it. (What was
        #: queued before a handshake stays queued across a failed one: IMMEDIATE is off.)
        self.lost_after_handshake = False
        self._handshaken = False
        self._no_detail = 0
        #: When the monitor's last CONNECTED event was read (a handshake began), or None.
        self._connected_at: float | None = None
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
        if self.endpoint.ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        self.socket = sock
        #: zmq_poll's item list for "is a frame queued" (`coordd.client._edge.queued`), made
        #: once: the blocking client looks before every report.
        self.look_in = [(sock, _POLLIN)]
        self.monitor = sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED
            | _HANDSHAKE_FAILED
            | zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_CONNECTED
        )
        try:
            sock.connect(address)
        except zmq.ZMQError as exc:
            close_dealer(sock, self.monitor)
            raise CoordinatorUnavailable(
                f"cannot connect to coordd ({self.where()}): {exc.strerror}"
            ) from None

    @classmethod
    def open(
        cls, config: ClientConfig, identity: bytes, context: zmq.Context | None = None
    ) -> RankConnection:
        """The connection `config` describes (its address resolved), under routing id `identity`."""
        address, source = resolve_address(config.address)
        return cls(
            context or zmq.Context.instance(),
            address,
            identity,
            heartbeat_interval=config.heartbeat_interval,
            heartbeat_timeout=config.heartbeat_timeout,
            curve=config.curve,
            source=source,
        )

    def where(self) -> str:
        """The address and where it came from, as errors say it."""
        if self.source == FROM_ENV:
            return f"{self.address}, from $COORDD_ADDRESS"
        if self.source == FROM_DEFAULT:
            return (
                f"{self.address}, the default: no address given and $COORDD_ADDRESS unset "
                "(coordd's default --bind when it runs as this user, with the same "
                "$XDG_RUNTIME_DIR)"
            )
        return f"{self.address}, as given"

    def writable(self) -> bool:
        """True if a send would be queued now (the pipe to coordd exists)."""
        return bool(int(self.socket.getsockopt(_EVENTS)) & _POLLOUT)

    def send(self, data: bytes) -> bool:
        """Queue `data` without blocking; False if there is no pipe to queue it on. (A shell
        that watches the descriptor reads through `coordd.client._edge` instead.)"""
        try:
            self.socket.send(data, _NOBLOCK)
        except zmq.Again:
            return False
        return True

    def disconnected(self) -> bool:
        """Read every pending monitor event; True if any was a disconnect (a failed handshake
        is remembered in `handshake_failure`).

        Events are timed as they are read: connect() reads them within 50 ms, so a failure
        read in the same batch as its CONNECTED counts as fast (a mismatch), which is the
        safe side; one read later than _STALL_AFTER after it is a stall (see there)."""
        seen = False
        while True:
            try:
                frames = self.monitor.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return seen
            event = int.from_bytes(frames[0][:2], "little")
            if event == _DISCONNECTED:
                seen = self.dropped = True
                self.lost_after_handshake |= self._handshaken
                self._handshaken = False
            elif event == _CONNECTED:
                self._connected_at = time.monotonic()
            elif event == _HANDSHAKE_SUCCEEDED:
                self._handshaken = True
                self._no_detail = 0
                self.handshake_failure = None
                self.handshake_refused = False
            elif event & _HANDSHAKE_FAILED:
                self._handshake_failed(event, int.from_bytes(frames[0][2:6], "little"))

    def _handshake_failed(self, event: int, value: int) -> None:
        tcp = self.endpoint.scheme == "tcp"
        began, self._connected_at = self._connected_at, None
        took = None if began is None else time.monotonic() - began
        if event & _HANDSHAKE_DEFINITE:
            self.handshake_failure = _explain_handshake(event, value, self.uses_curve, tcp)
            self.handshake_hint = _handshake_hint(event, self.uses_curve, tcp)
            self.handshake_refused = True
        elif took is not None and took >= _STALL_AFTER:
            # coordd admits it later: connect() tries again until its own deadline
            self.handshake_failure = _explain_stall(took)
            self._no_detail = 0
        else:
            self.handshake_failure = _explain_handshake(event, value, self.uses_curve, tcp)
            self.handshake_hint = _handshake_hint(event, self.uses_curve, tcp)
            if tcp:
                self._no_detail += 1
                self.handshake_refused = self._no_detail >= _NO_DETAIL_LIMIT

    def why_unreachable(self) -> str:
        """': <reason>': why coordd did not answer, as far as this side can tell (a failed
        handshake; for ipc whether the socket file exists and anything listens on it; for
        tcp whether the port refuses connections), and the address with where it came from."""
        self.disconnected()
        if self.handshake_failure:
            return f" ({self.where()}): {self.handshake_failure}"
        return f" ({self.where()}): {_diagnose(self.endpoint)}"

    def no_socket_file(self) -> str | None:
        """`why_unreachable()` if the address is an ipc path with no file there (nothing will
        answer until a coordd binds it), else None: a look at the path, no wait."""
        endpoint = self.endpoint
        if endpoint.scheme != "ipc" or endpoint.abstract:
            return None
        path = endpoint.path
        # A coordd is there, or on its way, if its lock file is (taken before it binds), or
        # its socket is set aside (`.paused`: it refuses new connections for now; a client
        # retries until its deadline): then the registration waits.
        if any(os.path.lexists(path + suffix) for suffix in ("", ".lock", ".paused")):
            return None
        return self.why_unreachable()

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


#: How long libzmq's I/O thread may still send a closed DEALER's last frame (a Goodbye): a rank
#: whose I/O thread waits longer for a core (2 loaded cores) has it dropped, and coordd counts
#: a clean leave as a loss. Nothing waits for it but a context's termination.
GOODBYE_LINGER_MS = 1000


def close_dealer(sock: zmq.Socket, monitor: zmq.Socket, final: bytes | None = None) -> None:
    """Send `final` if the pipe is up (best effort, never blocks), then close both sockets."""
    if final is not None:
        try:
            sock.send(final, zmq.NOBLOCK)
            sock.setsockopt(zmq.LINGER, GOODBYE_LINGER_MS)
        except zmq.ZMQError:
            pass
    with contextlib.suppress(zmq.ZMQError):
        sock.disable_monitor()
    monitor.close(linger=0)
    sock.close()


def _diagnose(endpoint: Endpoint) -> str:
    """What a look at the address shows when coordd does not answer (only on that path)."""
    if endpoint.scheme == "ipc":
        if endpoint.abstract:
            return "nothing answered on the abstract socket: is coordd running, bound there?"
        path = endpoint.path
        try:
            info = os.stat(path)
        except FileNotFoundError:
            if os.path.exists(path + ".paused"):
                return (
                    f"coordd at {path} is up but paused: it refuses new connections at the "
                    f"listener for now (its socket file is moved aside to {path}.paused while "
                    "its descriptors run short, a reconnect storm) and reopens when the storm "
                    "is over; connect() again, or with a longer timeout"
                )
            directory = os.path.dirname(path) or "."
            where = "" if os.path.isdir(directory) else f" (nor its directory {directory})"
            return (
                f"no socket file at {path}{where}: coordd is not running there; start it "
                "(coordd --dp N, with the same --bind) or give the client coordd's address"
            )
        except OSError as exc:
            return f"cannot look at {path}: {exc.strerror}"
        if not stat.S_ISSOCK(info.st_mode):
            return f"{path} is not a socket: coordd's --bind names another path?"
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(0.5)
        try:
            probe.connect(path)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM):
                return (
                    f"this process (uid {os.getuid()}) may not use the socket {path} (owner "
                    f"uid {info.st_uid}, mode {info.st_mode & 0o777:o}): run as coordd's user, "
                    "or start coordd with --ipc-mode 660 and a shared group"
                )
            return (
                f"the socket file {path} exists but nothing listens on it: coordd is gone "
                "(it stopped without removing it); start coordd again"
            )
        finally:
            probe.close()
        return f"coordd's socket {path} accepts connections but coordd did not answer: is it busy?"
    host, port = endpoint.host.strip("[]"), int(endpoint.port)
    try:
        with socket.create_connection((host, port), timeout=0.5):
            pass
    except ConnectionRefusedError:
        return f"connection refused: nothing listens on {endpoint.host}:{port}; is coordd running?"
    except OSError as exc:
        return (
            f"cannot reach {endpoint.host}:{port} ({exc.strerror or exc}): check the host, the "
            "network and firewalls between this rank and coordd"
        )
    return (
        f"{endpoint.host}:{port} accepts connections but coordd did not answer (a listener "
        "that is not coordd, or coordd busy)"
    )


def _explain_stall(took: float) -> str:
    return (
        "coordd refused the handshake for the moment: it stalled until coordd closed it "
        f"{took:.1f} s after the connection was made, as coordd does while it is over its "
        "memory budget (--max-rss-mb) or its handshake rate (--max-handshake-rate); see its log"
    )


def _handshake_hint(event: int, curve: bool, tcp: bool) -> str:
    """What to do about a failed handshake (`_explain_handshake` says what failed)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"give the rank a key coordd admits ({CLIENT_KEY_ENV}: a key file coordd's "
            "--curve-client-keys lists, for this dp_rank), or add its public key there"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return (
            f"use CURVE on both sides or on neither: with coordd's --curve-secret-key set "
            f"{SERVER_KEY_ENV} and {CLIENT_KEY_ENV} on the rank; without it, unset them"
        )
    if not tcp:
        return "check that what serves the socket is coordd (its log; coordd status)"
    if not curve:
        return (
            f"if coordd runs with --curve-secret-key, set {SERVER_KEY_ENV} and {CLIENT_KEY_ENV};"
            " else see coordd's log for refused handshakes"
        )
    return f"set {SERVER_KEY_ENV} to coordd's public key (the .key file of its key pair)"


def _explain_handshake(event: int, value: int, curve: bool, tcp: bool = True) -> str:
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
    if not tcp:
        return (
            "the connection closed during the ZeroMQ handshake: coordd stopped, or what "
            "listens on the socket is not coordd"
        )
    if not curve:
        return (
            "the security handshake failed or timed out: coordd may require CURVE (set "
            f"{SERVER_KEY_ENV} and {CLIENT_KEY_ENV}, or pass curve=), or it is refusing new "
            "connections for the moment (over its --max-rss-mb memory budget or its "
            "--max-handshake-rate; see its log)"
        )
    return (
        "the CURVE handshake failed: is COORDD_CURVE_SERVER_KEY (curve.server_public) "
        "coordd's public key?"
    )
