"""coordd's ROUTER socket, set up and bound: every option and why, the ZAP gates, the ipc path.

`open_router` returns the bound socket and what to release with it; `CoordServer` serves it.
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from coordd.core import _daemon_defaults as defaults
from coordd.core._handshake import IPV4_PREFIX, HandshakeRate
from coordd.io import _limits as limits
from coordd.io._gate import ZAP_DOMAIN, HandshakeGate
from coordd.io._identity import new_router
from coordd.io._listen import (
    BindError,
    IpcSocket,
    TcpListeners,
    check_bind,
    explain_bind_failure,
)
from coordd.proto.messages import MAX_MESSAGE_BYTES

_NOBLOCK_INT = int(zmq.NOBLOCK)


def prepare_ipc_path(address: str, mode: int = 0o600) -> IpcSocket | None:
    """For ipc://, claim the path (`coordd.io._listen.IpcSocket`: the directory, the lock beside
    the socket, a stale socket removed); None for tcp. `BindError` if coordd may not."""
    return IpcSocket.claim(address, mode)


@dataclass
class Router:
    """A bound ROUTER socket, its monitor, the ZAP gate it asks (or None) and its ipc path's
    claim (or None)."""

    sock: zmq.Socket
    monitor: zmq.Socket
    bound_address: str
    gate: HandshakeGate | None
    ipc: IpcSocket | None
    #: Over ipc: refuses new connections at the listener before descriptors run out.
    watch: limits.DescriptorWatch | None = None

    def close(self, linger: float = 0.0) -> None:
        if self.sock.closed:
            return
        if self.watch is not None:
            self.watch.stop()
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=int(linger * 1000))
        if self.gate is not None:
            self.gate.stop()
        if self.ipc is not None:
            self.ipc.release()  # the socket only if it is still the one we bound


def open_router(
    context: zmq.Context,
    address: str,
    *,
    heartbeat_interval: float,
    heartbeat_timeout: float,
    max_connections: int,
    ipc_mode: int = 0o600,
    gated: bool = False,
    max_handshake_rate: float = 0,
    handshake_ipv4_prefix: int = IPV4_PREFIX,
    configure_socket: Callable[[zmq.Socket], None] | None = None,
) -> Router:
    """coordd's ROUTER bound to `address` with its monitor (ACCEPTED and DISCONNECTED), and
    with `gated` (memory budget or handshake rate) the ZAP gate. `BindError` if it cannot."""
    endpoint = check_bind(address)
    ipc = prepare_ipc_path(address, ipc_mode)
    # Its automatic routing ids start from a secret (a peer that held the next one could
    # make libzmq abort coordd; see coordd.io._identity.new_router).
    sock = new_router(context)
    if endpoint.ipv6:
        sock.setsockopt(zmq.IPV6, 1)
    # Off: a rank is the connection that registered it, so a second connection presenting a
    # live routing id must not take it over (and on, any peer can abort coordd with its own
    # id twice, libzmq #4841; see coordd.io._identity).
    sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_interval * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(heartbeat_timeout * 1000))
    # A peer that never reads its answers holds at most SEND_QUEUE of them here (then
    # the ROUTER drops what is sent to it); a rank reads its decision every round.
    sock.setsockopt(zmq.SNDHWM, defaults.SEND_QUEUE)
    # No inbound queue limit, on purpose: a peer that fills a bounded pipe and then hangs up
    # can make libzmq 4.3.5 abort coordd at a later heartbeat (libzmq #4841, unfixed);
    # unbounded, that path is never taken, and coordd reads every peer in turn.
    sock.setsockopt(zmq.RCVHWM, 0)
    # A connection that never finishes its handshake (a key-less tcp+CURVE client, a
    # socket that sends nothing) is closed after this, freeing its descriptor.
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(defaults.HANDSHAKE_TIMEOUT * 1000))
    # Under memory pressure or over the handshake rate, new connections are refused in
    # their handshake (see coordd.io._gate).
    gate = HandshakeGate.start(context) if gated else None
    if gate is not None:
        # refusals held at once: each holds a descriptor (see coordd.io._gate.MAX_STALLED)
        gate.max_stalled = max(16, max_connections // 4)
        sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        if max_handshake_rate:
            # burst: as many as may connect at once (a whole engine starts together)
            gate.rate = HandshakeRate(
                max_handshake_rate, max(1, max_connections), ipv4_prefix=handshake_ipv4_prefix
            )
    if configure_socket is not None:
        configure_socket(sock)
    try:
        if ipc is not None:
            ipc.bind(sock)
        else:
            sock.bind(address)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        if gate is not None:
            gate.stop()
        if ipc is not None:
            ipc.release()
        raise BindError(
            explain_bind_failure(address, endpoint, exc.errno or 0, exc.strerror)
        ) from None
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED)
    watch = None
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limits.open_descriptors() is not None and nofile != resource.RLIM_INFINITY:
        # past 1/2 of NOFILE new connections are refused at the listener: the ipc socket's
        # file moved aside, or a filter on the tcp listener (libzmq aborts on EMFILE in its
        # ipc accept, and its tcp listener spins on it)
        pause: Callable[[], bool] | None = None
        if ipc is not None:
            pause, resume = ipc.pause, ipc.resume
        elif endpoint.scheme == "tcp":
            listeners = TcpListeners.find(int(bound.rsplit(":", 1)[1]))
            if listeners.sockets:
                pause, resume = listeners.pause, listeners.resume
        if pause is not None:
            watch = limits.DescriptorWatch(nofile, pause, resume).start()
            if gate is not None:
                gate.on_handshake = watch.poke
    return Router(sock, monitor, bound, gate, ipc, watch)


def drop_parts(sock: zmq.Socket, budget: int) -> tuple[bool, int]:
    """Drop parts of the multipart message being read from `sock`, up to `budget`: (whether
    its last part is gone, parts dropped). libzmq hands a message over only whole, so every
    part is there: no wait."""
    dropped = 0
    try:
        while dropped < budget:
            dropped += 1
            if not sock.recv(_NOBLOCK_INT, copy=False).more:
                return True, dropped
    except zmq.Again:  # pragma: no cover - a message is delivered whole
        return True, dropped - 1
    return False, dropped
