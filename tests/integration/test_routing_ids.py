"""libzmq's routing ids against a real coordd (issue 11, part A/B): what a peer can do with the
name it presents, and the libzmq settings coordd must keep (see `coordd.io._identity`).

- An id-less peer is named `\\x00` + libzmq's counter, and libzmq aborts if a peer already holds
  that name. The bundled libzmq started the counter at the same value in every process, so one
  claimed id and one id-less connection killed coordd; coordd now seeds it from the OS.
- A peer presenting its own routing id on a second connection, the first one sending and then
  hanging up, aborted coordd with ROUTER_HANDOVER on (and coordd-side heartbeats), or leaked a
  descriptor per try without them: coordd keeps handover off, and survives it with no leak.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from coordd.client.sync import CoordClient
from coordd.io import _identity as identity
from coordd.io._identity import new_router
from coordd.proto.errors import CoordinatorUnavailable, Rejected
from coordd.proto.messages import Heartbeat, StepReport, encode
from coordd.testing import CoorddProcess
from coordd.tools.load import ProcessGauge
from tests.integration.clients import CLIENT_KINDS, ClientMaker, client_maker

pytestmark = pytest.mark.timeout(120)

#: glibc's first rand() values in a process that never seeded it (what a peer computes).
_UNSEEDED = "import ctypes; r = ctypes.CDLL(None).rand; print(*[r() for _ in range(8)])"


def unseeded_counters(sockets: int = 3) -> list[int]:
    """The counters libzmq's generate_random() gives the first `sockets` sockets of a process
    whose rand() was never seeded: rand() | rand() << 31, two calls a socket."""
    out = subprocess.run(
        [sys.executable, "-c", _UNSEEDED], capture_output=True, text=True, check=True, timeout=30
    )
    r = [int(v) for v in out.stdout.split()]
    return [(r[2 * i] | (r[2 * i + 1] << 31)) & 0xFFFFFFFF for i in range(sockets)]


def automatic_id(counter: int) -> bytes:
    return b"\x00" + counter.to_bytes(4, "big")


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def dealer(ctx: zmq.Context, address: str, routing_id: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.connect(address)
    return sock


def echoed(sock: zmq.Socket, timeout: float = 5.0) -> bool:
    """Send a Heartbeat and wait for coordd's echo: the connection is attached and read."""
    sock.send(encode(Heartbeat(nonce=11)))
    return bool(sock.poll(int(timeout * 1000)))


def serves_a_round(address: str) -> bool:
    with CoordClient(address, dp_rank=0, dp_size=1, config_fingerprint="fp") as client:
        client.connect(timeout=10)
        decision = client.coordinate(StepReport(num_tokens=3, num_tokens_padded=3), timeout=10)
        return decision.num_tokens_across_dp == [3]


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_peer_holding_libzmqs_next_automatic_id_cannot_abort_coordd(
    start_coordd: Callable[..., CoorddProcess], context: zmq.Context, transport: str
) -> None:
    """Peers claim the ids libzmq would give the next id-less peers of an unseeded process, then
    id-less peers connect. Before: `Assertion failed: ok (src/socket_base.cpp:2113)`, coordd
    killed by SIGABRT at the first id-less peer."""
    c = start_coordd(1, transport)
    claimed = [automatic_id(base + k) for base in unseeded_counters() for k in range(4)]
    holders = [dealer(context, c.address, ident) for ident in claimed]
    anonymous: list[zmq.Socket] = []
    try:
        for sock in holders:  # each is attached (libzmq holds its id) before any id-less peer
            assert echoed(sock), "coordd did not answer a peer's heartbeat"
        for _ in range(4):
            sock = dealer(context, c.address)
            anonymous.append(sock)
            echoed(sock)
            assert c.proc is not None and c.proc.poll() is None, (
                f"coordd died (exit {c.proc.poll() if c.proc else None}) when an id-less peer "
                "connected while its automatic routing id was held"
            )
        assert serves_a_round(c.address)
    finally:
        for sock in holders + anonymous:
            sock.close(linger=0)


def test_the_router_draws_automatic_ids_from_a_secret_seed(
    context: zmq.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """`new_router` seeds libzmq's counter from the OS and checks that libzmq drew from it: the
    next id-less peer is not named by the unseeded sequence, and no warning is logged."""
    with caplog.at_level(logging.WARNING, logger="coordd"):
        sock = new_router(context)
    try:
        assert not [r for r in caplog.records if "automatic routing ids" in r.getMessage()]
        sock.bind("inproc://routing-id-test")
        peer = dealer(context, "inproc://routing-id-test")
        peer.send(b"")
        assert sock.poll(5000)
        name = sock.recv_multipart()[0]
        peer.close(linger=0)
        assert name[:1] == b"\x00" and len(name) == 5
        assert name not in {automatic_id(v + k) for v in unseeded_counters() for k in range(8)}
    finally:
        sock.close(linger=0)


def test_a_libzmq_that_does_not_draw_from_the_seed_is_named_in_a_warning(
    context: zmq.Context, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If libzmq's first automatic id is not the one the seed gives (another build), or there is
    no C library rand() to seed, coordd still starts and says why in a warning."""
    monkeypatch.setattr(identity, "_seed_rand", lambda libc: 12345)
    with caplog.at_level(logging.WARNING, logger="coordd"):
        new_router(context).close(linger=0)
    monkeypatch.setattr(identity, "_c_library", lambda: None)
    with caplog.at_level(logging.WARNING, logger="coordd"):
        new_router(context).close(linger=0)
    said = [r.getMessage() for r in caplog.records if "automatic routing ids" in r.getMessage()]
    assert len(said) == 2
    assert "draws them otherwise" in said[0] and "no C library rand()" in said[1]


def test_the_seed_is_the_c_librarys_rand_as_libzmq_uses_it() -> None:
    """The premise of `new_router`: the bundled libzmq draws its counter from rand() (seeded
    with 1, the counter is glibc's first rand() value), so a fixed seed fixes the counter."""
    libc = ctypes.CDLL(None)
    libc.srand.argtypes = [ctypes.c_uint]
    with zmq.Context() as ctx:
        libc.srand(1)
        sock = ctx.socket(zmq.ROUTER)
        try:
            sock.bind("inproc://premise")
            peer = dealer(ctx, "inproc://premise")
            peer.send(b"")
            assert sock.poll(5000)
            name = sock.recv_multipart()[0]
            peer.close(linger=0)
        finally:
            sock.close(linger=0)
    libc.srand(int.from_bytes(os.urandom(4), "little"))
    assert name == automatic_id(unseeded_counters(1)[0])


def test_a_routing_id_presented_twice_cannot_abort_coordd_or_leak_descriptors(
    start_coordd: Callable[..., CoorddProcess], context: zmq.Context
) -> None:
    """A peer presents its own routing id on a second connection while the first one sends,
    then the first hangs up; 12 times. With ROUTER_HANDOVER on this aborted coordd (`!_io_error`,
    stream_engine_base.cpp:310) by the third try; without coordd-side heartbeats it leaked one
    descriptor a try. coordd keeps handover off: it lives, and its descriptors come back."""
    c = start_coordd(1, "ipc")
    with ProcessGauge(c.pid) as gauge:
        before = gauge.fds()
        for _ in range(12):
            ident = os.urandom(16)
            first = dealer(context, c.address, ident)
            assert echoed(first)
            second = dealer(context, c.address, ident)
            second.send(encode(Heartbeat(nonce=1)))
            deadline = time.monotonic() + 0.3
            while time.monotonic() < deadline:
                first.send(b"\xc1" * 64)
                time.sleep(0.002)
            first.close(linger=0)
            time.sleep(0.05)
            second.close(linger=0)
            assert c.proc is not None and c.proc.poll() is None, "coordd died"
        time.sleep(1.5)  # more than a heartbeat interval: a pending PING would have fired
        assert c.proc is not None and c.proc.poll() is None, "coordd died"
        deadline = time.monotonic() + 10
        while gauge.fds() > before + 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gauge.fds() <= before + 2, f"descriptors {before} -> {gauge.fds()}"
    assert serves_a_round(c.address)


class HalfOpeningProxy:
    """A tcp proxy between a client and coordd that can drop the client's side of every
    connection while coordd's side stays open and silent (a network path that died one way:
    coordd learns of it only from its heartbeat timeout)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream[len("tcp://") :].rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.pairs: list[tuple[socket.socket, socket.socket, threading.Event]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                return
            server.settimeout(None)
            frozen = threading.Event()
            self.pairs.append((client, server, frozen))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b, frozen), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket, frozen: threading.Event) -> None:
        while True:
            try:
                data = a.recv(65536)
                if not data:
                    return
                if not frozen.is_set():
                    b.sendall(data)
            except OSError:
                return

    def drop_client_sides(self) -> None:
        for client, _server, frozen in self.pairs:
            frozen.set()
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)
            client.close()

    def close(self) -> None:
        self.listener.close()
        for client, server, _ in self.pairs:
            client.close()
            server.close()


@pytest.fixture(params=CLIENT_KINDS)
def make_client(request: pytest.FixtureRequest) -> Iterator[ClientMaker]:
    yield from client_maker(request.param)


def test_a_rank_whose_connection_went_half_open_registers_again(
    start_coordd: Callable[..., CoorddProcess], make_client: ClientMaker
) -> None:
    """The rank's side of its connection drops while coordd's side stays open; libzmq
    reconnects it at once, under the same routing id, and coordd's libzmq would keep that
    connection as an unread duplicate for good. connect() opens a new connection under a fresh
    id instead: refused rank_taken until coordd's heartbeat timeout closes the old connection,
    then the rank registers again. Before: every connect() went unanswered (8 tries, 40 s)."""
    c = start_coordd(1, "tcp", "--heartbeat-interval", "0.25", "--heartbeat-timeout", "1")
    proxy = HalfOpeningProxy(c.address)
    client = make_client(proxy.address, dp_rank=0, dp_size=1, config_fingerprint="fp")
    try:
        client.connect(timeout=10)
        client.coordinate(StepReport(num_tokens=1, num_tokens_padded=1), timeout=10)
        proxy.drop_client_sides()
        deadline = time.monotonic() + 20
        while True:
            try:
                client.connect(timeout=2)
                break
            except (CoordinatorUnavailable, Rejected) as error:
                if isinstance(error, Rejected):
                    assert error.reason == "rank_taken", error
                assert time.monotonic() < deadline, "the rank could not register again in 20 s"
        decision = client.coordinate(StepReport(num_tokens=2, num_tokens_padded=2), timeout=10)
        assert decision.num_tokens_across_dp == [2]
    finally:
        proxy.close()


def memory_guard_options() -> str:
    """`coordd serve --help`, where the memory guard's option would be."""
    argv = [sys.executable, "-m", "coordd", "serve", "--help"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout


def test_a_duplicate_routing_ids_unread_flood_is_bounded(
    start_coordd: Callable[..., CoorddProcess], context: zmq.Context
) -> None:
    """A peer presents its own live routing id on a second connection and floods it: libzmq
    queues that connection's messages where coordd never reads them (an anonymous pipe), and
    only closing the connection bounds it; the memory guard does (it closes connections that
    hold no rank). A registered rank keeps its rounds. Without the guard: 659 MB in 1.2 s
    (this test stops the flood at 400 MB). Skipped where coordd has no memory guard."""
    if "--max-rss-mb" not in memory_guard_options():
        pytest.skip("this coordd has no memory guard (--max-rss-mb)")
    c = start_coordd(1, "ipc", "--max-rss-mb", "80")
    ident = os.urandom(16)
    first = dealer(context, c.address, ident)
    assert echoed(first)
    second = dealer(context, c.address, ident)
    payload = b"\xc1" * 65536
    with CoordClient(c.address, dp_rank=0, dp_size=1, config_fingerprint="fp") as rank:
        rank.connect(timeout=10)
        with ProcessGauge(c.pid, interval=0.02) as gauge:
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and gauge.peak_rss_mb < 400 and gauge.alive:
                try:
                    second.send(payload, zmq.NOBLOCK)
                except zmq.Again:
                    time.sleep(0.001)
            rounds = rank.coordinate(StepReport(num_tokens=1, num_tokens_padded=1), timeout=10)
        assert gauge.alive, "coordd died"
        assert gauge.peak_rss_mb < 150, f"coordd grew to {gauge.peak_rss_mb:.0f} MB"
        assert rounds.num_tokens_across_dp == [1]
    first.close(linger=0)
    second.close(linger=0)
