"""What the server sends: a group's answers (each message encoded once, the same bytes to
every peer) and coordd's own answers outside any group."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import zmq

from coordd.core._peers import peer_label
from coordd.io._stats import ServerStats
from coordd.ops.observer import Observer
from coordd.proto.coordinator import Send
from coordd.proto.messages import Heartbeat, Reject, StepFailed, encode

log = logging.getLogger("coordd")

_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
#: The socket's send without pyzmq's Python wrapper (which checks DRAFT arguments in Python
#: first): a round sends 2 * dp frames.
_send_frame = zmq.backend.Socket.send


class Outbox:
    """Send on the ROUTER `sock`, never blocking (a peer whose queue is full misses the
    frame: logged at debug level), counting in `stats`."""

    def __init__(self, sock: zmq.Socket, stats: ServerStats) -> None:
        self.sock = sock
        self._stats = stats

    def send(self, sends: Sequence[Send], observer: Observer) -> None:
        """A coordinator's answers, each told to its group's `observer`."""
        sock = self.sock
        for peers, message in sends:
            observer.sent(peers, message)
            payload = encode(message)
            sent = 0
            for peer in peers:
                try:
                    _send_frame(sock, peer, _SNDMORE_NOBLOCK)
                    _send_frame(sock, payload, _NOBLOCK)
                except zmq.ZMQError as exc:
                    log.debug("dropped a frame to %s: %s", peer_label(peer), exc)
                    continue
                sent += 1
            self._stats.frames_out += sent

    def send_one(self, peer: bytes, message: Reject | StepFailed | Heartbeat) -> None:
        """An answer from coordd itself, outside any group."""
        try:
            self.sock.send(peer, _SNDMORE_NOBLOCK)
            self.sock.send(encode(message), _NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("dropped a frame to %s: %s", peer_label(peer), exc)
            return
        self._stats.frames_out += 1
