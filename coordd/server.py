"""The daemon's I/O shell: moves bytes between one ZeroMQ ROUTER socket and the `Coordinator`.

The loop watches the socket's file descriptor and drains every queued frame in one callback,
with no asyncio future per message; a round's decision is encoded once and the same bytes go
to every rank. The only timer is the coordinator's next deadline.

Liveness comes from libzmq: ZMTP heartbeats (PING/PONG, answered by each rank's ZeroMQ I/O
thread) on every connection, so a rank that stops answering has its connection closed; a socket
monitor reports the closed connection's file descriptor, and the descriptor a rank registered
from (the SRCFD of its Hello) names the rank, which becomes `Coordinator.peer_lost`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from coordd.metrics import Observer
from coordd.proto.address import runtime_dir
from coordd.proto.coordinator import Coordinator, Send
from coordd.proto.errors import ProtocolError
from coordd.proto.messages import (
    MAX_MESSAGE_BYTES,
    Hello,
    decode_to_coordinator,
    encode,
)

log = logging.getLogger("coordd")

# Plain ints for the hot path: pyzmq's constants are enum.Flag members, and `int & Flag`
# builds a new Flag through enum's Python code (it was a third of coordd's Python time).
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_RCVMORE = int(zmq.RCVMORE)


@dataclass
class ServerStats:
    """Counters the metrics endpoint and the benchmark read."""

    frames_in: int = 0
    bad_frames: int = 0
    frames_out: int = 0
    disconnects: int = 0


def prepare_ipc_path(address: str) -> str | None:
    """For ipc://, create the socket's directory private (0700); return the path to unlink.

    A directory that exists is left as the operator made it (a pod's shared emptyDir), except
    the default runtime directory, which must be ours and private: made looser, it is made
    0700 again; owned by another user (who could swap the socket), it is refused."""
    if not address.startswith("ipc://"):
        return None
    path = address[len("ipc://") :]
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)  # makedirs applies the umask
    elif os.path.realpath(directory) == os.path.realpath(runtime_dir()):
        info = os.stat(directory)
        if info.st_uid != os.getuid():
            raise PermissionError(
                f"runtime directory {directory} belongs to uid {info.st_uid}, not to coordd's "
                f"uid {os.getuid()}: remove it or bind elsewhere"
            )
        if info.st_mode & 0o077:
            log.warning(
                "runtime directory %s had mode %o: made 0700", directory, info.st_mode & 0o777
            )
            os.chmod(directory, 0o700)
    if os.path.exists(path):
        os.unlink(path)
    return path


class CoordServer:
    """Serve one `Coordinator` on a ROUTER socket bound to `address`."""

    def __init__(
        self,
        coordinator: Coordinator,
        address: str,
        *,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        context: zmq.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
        configure_socket: Callable[[zmq.Socket], None] | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.address = address
        self.stats = ServerStats()
        self.observer = observer or Observer(coordinator.snapshot)
        self.clock = clock
        self._context = context or zmq.Context()
        self._ipc_path = prepare_ipc_path(address)
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_interval * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(heartbeat_timeout * 1000))
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        if configure_socket is not None:
            configure_socket(sock)
        sock.bind(address)
        self.bound_address: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._fd_peer: dict[int, bytes] = {}
        self._peer_fd: dict[bytes, int] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then say goodbye to every rank and close."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.fileno(), self._on_frames)
        self._loop.add_reader(self._monitor.fileno(), self._drain)
        self._drain()
        log.info("coordd serving dp=%d on %s", self.coordinator.dp_size, self.bound_address)
        try:
            await stop.wait()
        finally:
            self._loop.remove_reader(self._sock.fileno())
            self._loop.remove_reader(self._monitor.fileno())
            if self._timer is not None:
                self._timer.cancel()
            self._send(self.coordinator.shutdown())
            self.close(linger=0.5)

    def close(self, linger: float = 0.0) -> None:
        if self._sock.closed:
            return
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=int(linger * 1000))
        if self._ipc_path and os.path.exists(self._ipc_path):
            os.unlink(self._ipc_path)

    # -- the hot path -----------------------------------------------------------------------

    def _drain(self) -> None:
        """Handle every queued frame, then closed connections, until both are empty.

        The FDs are edge-triggered, and a send can swallow the edge: so both are re-checked
        after any work. Frames go first, so that what a rank sent before its connection
        closed (a last report, a Goodbye) counts before the loss does.
        """
        self._drain_frames()
        while self._drain_monitor():
            self._drain_frames()
        self._drained()

    def _on_frames(self) -> None:
        """The ROUTER's FD fired: frames only. The monitor's own FD brings closed connections
        (to `_drain`), and only work on the monitor socket can swallow its edge; checking it
        here too cost a syscall and an enum lookup on every wakeup (~4.6 per round at dp=8)."""
        self._drain_frames()
        self._drained()

    def _drained(self) -> None:
        """Once per drain: a group failure nobody was sent (a rank lost between rounds) shows
        only in the failure counter, so the observer is told from there."""
        coordinator = self.coordinator
        if coordinator.failures != self.observer.failures_seen:
            self.observer.group_failed(coordinator.snapshot())
        self._schedule_deadline()

    def _drain_frames(self) -> None:
        sock = self._sock
        coordinator = self.coordinator
        stats = self.stats
        clock = self.clock
        while True:
            # Until Again, not EVENTS per frame: getsockopt is a syscall plus an enum lookup
            # in pyzmq each time, Again one exception per drain; `head.more` saves RCVMORE.
            try:
                head = sock.recv(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            peer = head.bytes
            stats.frames_in += 1
            if not head.more:
                self._bad_frame(peer, "no payload frame")
                continue
            frame = sock.recv(_NOBLOCK, copy=False)
            if frame.more:
                while sock.getsockopt(_RCVMORE):
                    sock.recv(_NOBLOCK)
                self._bad_frame(peer, "more than one payload frame")
                continue
            try:
                message = decode_to_coordinator(frame.buffer)
            except ProtocolError as exc:
                self._bad_frame(peer, str(exc))
                continue
            if type(message) is Hello:
                self._drain_monitor()
                self._track_connection(peer, frame.get(zmq.SRCFD))
                self.observer.registering(peer, message, frame.get("Peer-Address"))
            self._send(coordinator.receive(peer, message, clock()))

    def _track_connection(self, peer: bytes, fd: int) -> None:
        old = self._peer_fd.get(peer)
        if old is not None and old != fd:
            self._fd_peer.pop(old, None)
        self._peer_fd[peer] = fd
        self._fd_peer[fd] = peer

    def _drain_monitor(self) -> bool:
        """Closed connections: the rank that registered over one is lost. True if any event."""
        monitor = self._monitor
        seen = False
        while int(monitor.getsockopt(_EVENTS)) & _POLLIN:
            seen = True
            frames = monitor.recv_multipart(_NOBLOCK)
            event, fd = struct.unpack("=HI", frames[0][:6])
            if event != zmq.EVENT_DISCONNECTED:
                continue
            peer = self._fd_peer.pop(fd, None)
            if peer is None or self._peer_fd.get(peer) != fd:
                continue
            del self._peer_fd[peer]
            self.stats.disconnects += 1
            rank = self.coordinator.snapshot().rank_of(peer)
            self._send(self.coordinator.peer_lost(peer, self.clock(), "connection closed"))
            self.observer.lost(rank, peer, "connection closed")
        return seen

    def _send(self, sends: Sequence[Send]) -> None:
        sock = self._sock
        for peers, message in sends:
            self.observer.sent(peers, message)
            payload = encode(message)
            for peer in peers:
                try:
                    sock.send(peer, _SNDMORE_NOBLOCK)
                    sock.send(payload, _NOBLOCK)
                except zmq.ZMQError as exc:
                    log.debug("dropped a frame to %r: %s", peer, exc)
                    continue
                self.stats.frames_out += 1

    def _bad_frame(self, peer: bytes, why: str) -> None:
        self.stats.bad_frames += 1
        log.debug("dropped a bad frame from %r: %s", peer, why)

    # -- the one timer ----------------------------------------------------------------------

    def _schedule_deadline(self) -> None:
        deadline = self.coordinator.next_deadline()
        if deadline == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = deadline
        if deadline is not None and self._loop is not None:
            delay = max(0.0, deadline - self.clock())
            self._timer = self._loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self._send(self.coordinator.on_deadline(self.clock()))
        self._drain()
