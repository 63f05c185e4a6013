"""A relay's shell (`coordd serve --relay-to ROOT`): the node's ranks are served by an ordinary
`CoordServer` whose groups are `RelayCoordinator`s, and one DEALER connection to the root
carries every group's registration, bundles and faults up, and the root's answers down.

Liveness of the root comes from libzmq as for ranks: ZMTP heartbeats on the connection, and
its monitor's DISCONNECTED is the root lost (`RelayCoordinator.root_lost`: every rank of the
node gets `CoordinatorUnavailable`). libzmq reconnects by itself; once the handshake succeeds
again, the groups whose ranks wait to register ask the root again (`root_back`).

A coordd not started as a root (`--relay-root`) refuses a registration with
`Rejected(not_root)`: the node's waiting ranks get it, and the relay's log says once per
connection that the coordd at --relay-to is not a root.

The rank-loss mode of a relayed group is the root's --on-rank-loss, which its Welcome carries;
a relay whose own setting differs says so once in its log.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
from collections.abc import Callable

import zmq

from coordd.io._server import CoordServer
from coordd.proto.errors import ProtocolError
from coordd.proto.messages import MAX_MESSAGE_BYTES, Reject, RejectReason, Welcome, encode
from coordd.proto.relay import RelayCoordinator
from coordd.proto.relay_messages import RelayUp, decode_from_root

log = logging.getLogger("coordd")

_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_UP = int(zmq.EVENT_HANDSHAKE_SUCCEEDED)
_DOWN = int(zmq.EVENT_DISCONNECTED)


class Relay:
    """Connect `server` (the node's coordd) to the root at `root`, speaking for `ranks`."""

    def __init__(
        self,
        server: CoordServer,
        root: str,
        ranks: frozenset[int],
        *,
        context: zmq.Context,
        name: str = "",
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 3.0,
        configure_socket: Callable[[zmq.Socket], None] | None = None,
    ) -> None:
        self.server = server
        self.root = root
        self.ranks = ranks
        self.name = name or os.uname().nodename
        server.registry.make_coordinator = self._make
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, b"relay:" + os.urandom(8).hex().encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued for a root that is not there
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_interval * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(heartbeat_timeout * 1000))
        if configure_socket is not None:
            configure_socket(sock)
        self._monitor = sock.get_monitor_socket(_UP | _DOWN)
        sock.connect(root)
        self._sock = sock
        self.connected = False
        #: Messages to the root dropped (no connection), and answers that did not decode.
        self.dropped = 0
        self.bad_answers = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._check_pending = False
        self._told_mode = False
        #: Whether this connection's `not_root` refusal was logged (once per connection).
        self._told_not_root = False

    def _make(self, group: str, epoch: int) -> RelayCoordinator:
        server = self.server
        settings = server.settings
        return RelayCoordinator(
            settings.dp_size,
            group=group,
            ranks=self.ranks,
            uplink=self._up,
            epoch=epoch,
            step_timeout=settings.step_timeout,
            on_rank_loss=settings.on_rank_loss,
            relay=self.name,
        )

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self._sock.getsockopt(zmq.FD), self._on_root)
        loop.add_reader(self._monitor.getsockopt(zmq.FD), self._on_monitor)
        self._on_monitor()
        self._on_root()

    def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._sock.getsockopt(zmq.FD))
            self._loop.remove_reader(self._monitor.getsockopt(zmq.FD))
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    def _up(self, message: RelayUp) -> None:
        try:
            self._sock.send(encode(message), _NOBLOCK)
        except zmq.ZMQError as exc:
            self.dropped += 1
            log.debug("relay: a message to the root dropped (%s)", exc)
        # a send can swallow the read edge of the socket's FD: look once more soon
        if not self._check_pending and self._loop is not None:
            self._check_pending = True
            self._loop.call_soon(self._on_root)

    def _on_root(self) -> None:
        self._check_pending = False
        sock = self._sock
        server = self.server
        touched = False
        while not sock.closed and int(sock.getsockopt(_EVENTS)) & _POLLIN:
            data = sock.recv(_NOBLOCK, copy=False)
            try:
                answer = decode_from_root(data.buffer)
            except ProtocolError as exc:
                self.bad_answers += 1
                log.warning("relay: dropped an answer from the root: %s", exc)
                continue
            group = server.groups.get(answer.group)
            if group is None or not isinstance(group.coordinator, RelayCoordinator):
                continue
            touched = True
            message = answer.message
            if type(message) is Welcome and not self._told_mode:
                self._tell_mode(answer.on_rank_loss.value)
            elif (
                type(message) is Reject
                and message.reason is RejectReason.NOT_ROOT
                and not self._told_not_root
            ):
                self._told_not_root = True
                log.error(
                    "relay %s: the coordd at %s is not started as a root (coordd serve "
                    "--relay-root, or COORDD_RELAY_ROOT=1): it refused group %s, and this "
                    "node's ranks get Rejected(not_root)",
                    self.name,
                    self.root,
                    answer.group,
                )
            server._deadlines.touched.add(group)
            server.send(group.coordinator.from_root(answer, server.clock()), group.observer)
        if touched:
            server._deadlines.after_drain()

    def _tell_mode(self, root: str) -> None:
        own = self.server.settings.on_rank_loss.value
        if root != own:
            self._told_mode = True
            log.warning(
                "relay %s: the root serves relayed groups with --on-rank-loss %s, this relay's "
                "setting is %s: the root's holds (set it on the root)",
                self.name,
                root,
                own,
            )

    def _on_monitor(self) -> None:
        monitor = self._monitor
        server = self.server
        while int(monitor.getsockopt(_EVENTS)) & _POLLIN:
            frames = monitor.recv_multipart(_NOBLOCK)
            event, _fd = struct.unpack("=HI", frames[0][:6])
            now = server.clock()
            for group in list(server.groups.values()):
                coordinator = group.coordinator
                if not isinstance(coordinator, RelayCoordinator):
                    continue
                server._deadlines.touched.add(group)
                if event == _UP:
                    coordinator.root_back()
                elif event == _DOWN:
                    detail = f"connection to {self.root} closed"
                    server.send(coordinator.root_lost(now, detail), group.observer)
            if event == _UP:
                self.connected = True
                self._told_not_root = False
                log.info("relay %s connected to the root at %s", self.name, self.root)
            elif event == _DOWN:
                self.connected = False
                log.warning("relay %s lost the root at %s", self.name, self.root)
        server._deadlines.after_drain()
        self._on_root()
