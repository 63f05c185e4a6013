"""Loads that flood coordd with connections: a reconnect storm, handshakes kept in flight,
raw connections that never handshake, half-open HTTP requests."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import time
from collections.abc import Callable

import zmq

from coordd.client._config import curve_keys_from_env
from coordd.tools.load._zmq import term_soon


def storm(address: str, processes: int = 10, sockets: int = 192, seconds: float = 5.0) -> int:
    """A reconnect storm: `processes` processes of `sockets` DEALERs each that send nothing
    (libzmq reconnects each 100 ms after coordd closes it), for `seconds`: coordd must
    outlive running out of descriptors in its accept. Returns sockets."""
    import signal

    kids = []
    for _ in range(processes):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            context = zmq.Context()
            context.setsockopt(zmq.MAX_SOCKETS, sockets + 64)
            socks = []
            for i in range(sockets):
                sock = context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.ROUTING_ID, f"storm-{os.getpid()}-{i}".encode())
                sock.connect(address)
                socks.append(sock)
            time.sleep(seconds)
            os._exit(0)
        kids.append(pid)

    def end(*_: object) -> None:
        for kid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(kid, signal.SIGKILL)
        os._exit(0)

    signal.signal(signal.SIGTERM, end)
    for kid in kids:
        os.waitpid(kid, 0)
    return processes * sockets


def handshakes(address: str, in_flight: int = 20, seconds: float = 5.0, sources: int = 0) -> int:
    """Keep `in_flight` handshakes going for `seconds` (libzmq DEALERs; a CURVE client with a
    leaked rank key if $COORDD_CURVE_* say so, see `dealer`): each is closed once admitted,
    or 0.5 s after it began if not (a CURVE handshake takes several round trips), and another
    begins. Over tcp with `sources`, each comes
    from the next of that many loopback addresses (127.x.y.z: each its own source to
    coordd's rate before sources were grouped). Returns handshakes admitted."""
    context = zmq.Context()
    context.setsockopt(zmq.MAX_SOCKETS, 4 * in_flight + 64)
    rng = random.Random(os.getpid())
    base = rng.randrange(1, 200)
    flying: list[tuple[zmq.Socket, zmq.Socket, float]] = []
    admitted = made = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            while len(flying) < in_flight:
                target = address
                if sources and address.startswith("tcp://"):
                    n = made % sources
                    source = f"127.{base}.{n // 250 % 250}.{n % 250 + 1}"
                    target = f"tcp://{source}:0;{address.removeprefix('tcp://')}"
                made += 1
                sock = context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                curve = curve_keys_from_env()
                if curve is not None:
                    sock.curve_serverkey = curve.server_public
                    sock.curve_publickey = curve.public
                    sock.curve_secretkey = curve.secret
                monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
                sock.connect(target)
                flying.append((sock, monitor, time.monotonic()))
            time.sleep(0.005)
            now = time.monotonic()
            kept = []
            for sock, monitor, began in flying:
                done = bool(monitor.poll(0))
                admitted += done
                if done or now - began > 0.5:
                    sock.disable_monitor()
                    monitor.close(linger=0)
                    sock.close(linger=0)
                else:
                    kept.append((sock, monitor, began))
            flying = kept
    finally:
        for sock, monitor, _ in flying:
            monitor.close(linger=0)
            sock.close(linger=0)
        term_soon(context)
    return admitted


def connections(address: str, count: int = 1000, seconds: float = 5.0) -> int:
    """`count` raw connections to coordd's ZeroMQ port that never handshake (a key-less
    client of tcp+CURVE, a port scanner), held `seconds`. Returns how many connected."""
    return _hold(lambda: _raw_connect(address), count, seconds)


def _raw_connect(address: str) -> socket.socket:
    if address.startswith("ipc://"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(1.0)
        sock.connect(address[len("ipc://") :])
        return sock
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=1.0)
    return sock


def http(hostport: str, count: int = 1000, seconds: float = 5.0) -> int:
    """`count` half-open HTTP connections (a request line, never its end), held `seconds`."""
    host, port = hostport.removeprefix("http://").rsplit(":", 1)

    def half_open() -> socket.socket:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=1.0)
        try:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        except OSError:
            sock.close()
            raise
        return sock

    return _hold(half_open, count, seconds)


def _hold(open_one: Callable[[], socket.socket], count: int, seconds: float) -> int:
    """Open up to `count` connections with `open_one` (a refused one is retried after 10 ms)
    and hold them until `seconds` have passed; how many were held."""
    held: list[socket.socket] = []
    end = time.monotonic() + seconds
    try:
        for _ in range(count):
            if time.monotonic() >= end:
                break
            try:
                held.append(open_one())
            except OSError:
                time.sleep(0.01)
        time.sleep(max(0.0, end - time.monotonic()))
    finally:
        for sock in held:
            sock.close()
    return len(held)
