"""A rank's connection cut while it registers (its Hello sent, no answer yet), against a real
coordd through a tcp relay that cuts it deterministically.

coordd shuts a connection on its own (a flood cut-off, the memory guard, the stranger grace) or
the network drops it; either way the Hello, or coordd's Welcome, is lost with it. libzmq
reconnects the DEALER but sends nothing again, so connect() waited out its whole timeout ("no
answer") although a new Hello is answered at once. Both clients now send the Hello again over a
new connection (a few times at most, within connect()'s own deadline).
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from coordd.proto.errors import CoordinatorUnavailable
from coordd.proto.messages import StepReport
from coordd.testing import CoorddProcess
from tests.integration.clients import CLIENT_KINDS, ClientMaker, client_maker

pytestmark = pytest.mark.timeout(60)


class CuttingRelay:
    """A tcp relay to coordd that cuts connections mid-registration, at the client's Hello
    (recognised by `marker`, the rank's incarnation): `cut="hello"` drops the Hello itself,
    `cut="welcome"` passes it and drops coordd's answer. Both sides of the connection are
    closed, coordd's first (as when coordd shuts a connection, it knows before the rank).
    `times` connections are cut; later ones are relayed whole."""

    def __init__(self, upstream: str, marker: bytes, cut: str, times: int = 1) -> None:
        host, port = upstream[len("tcp://") :].rsplit(":", 1)
        self.upstream = (host, int(port))
        self.marker = marker
        self.cut = cut
        self.left = times
        #: How many connections carried a Hello, and how many were cut.
        self.hellos = 0
        self.cuts = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self._spawn(self._accept)

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            server = socket.create_connection(self.upstream, timeout=5)
            server.settimeout(None)
            with self._lock:
                self._sockets += [client, server]
            hello_passed = threading.Event()
            self._spawn(self._to_coordd, client, server, hello_passed)
            self._spawn(self._to_client, server, client, hello_passed)

    def _to_coordd(
        self, client: socket.socket, server: socket.socket, hello_passed: threading.Event
    ) -> None:
        seen: bytes | None = b""  # until the Hello passed
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                return
            if not data:
                return
            if seen is not None:
                seen += data
                if self.marker in seen:
                    seen = None
                    with self._lock:
                        self.hellos += 1
                        cutting = self.left > 0
                        self.left -= cutting
                    if cutting and self.cut == "hello":
                        self._cut(client, server)
                        return
                    if cutting:  # set before the Hello goes on: coordd's answer comes after
                        hello_passed.set()
            try:
                server.sendall(data)
            except OSError:
                return

    def _to_client(
        self, server: socket.socket, client: socket.socket, hello_passed: threading.Event
    ) -> None:
        while True:
            try:
                data = server.recv(65536)
            except OSError:
                return
            if not data:
                return
            if hello_passed.is_set():  # coordd's answer to a Hello being cut: dropped
                self._cut(client, server)
                return
            try:
                client.sendall(data)
            except OSError:
                return

    def _cut(self, client: socket.socket, server: socket.socket) -> None:
        with self._lock:
            self.cuts += 1
        _shut(server)
        time.sleep(0.2)  # coordd learns of it first (it closed it, or it reads the close)
        _shut(client)

    def drop_all(self) -> None:
        """Close both sides of every connection relayed so far."""
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)
        for thread in self._threads:
            thread.join(timeout=5)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


@pytest.fixture(params=CLIENT_KINDS)
def make_client(request: pytest.FixtureRequest) -> Iterator[ClientMaker]:
    yield from client_maker(request.param)


@pytest.fixture
def relay(start_coordd: Callable[..., CoorddProcess]) -> Iterator[Callable[..., CuttingRelay]]:
    """Start a coordd of `dp` ranks and a relay to it (`.upstream`: coordd's own address)."""
    made: list[CuttingRelay] = []

    def make(marker: bytes, cut: str, times: int = 1, dp: int = 1) -> CuttingRelay:
        made.append(CuttingRelay(start_coordd(dp, "tcp").address, marker, cut, times))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.mark.parametrize("cut", ["hello", "welcome"])
def test_a_registration_cut_mid_way_sends_the_hello_again(
    relay: Callable[..., CuttingRelay], make_client: ClientMaker, cut: str
) -> None:
    """The first connection is cut after its handshake, with the Hello (or with coordd's
    Welcome): connect() registers over a new connection at once. Before: it waited out its
    whole timeout, 'no answer from coordd within 10s' (sync and aio alike)."""
    incarnation = f"cut-{secrets.token_hex(6)}"
    r = relay(incarnation.encode(), cut)
    client = make_client(
        r.address, dp_rank=0, dp_size=1, config_fingerprint="fp", incarnation=incarnation
    )
    began = time.monotonic()
    welcome = client.connect(timeout=10)
    took = time.monotonic() - began
    assert took < 5, f"registered {took:.2f}s after connect(), through a cut"
    assert r.cuts == 1 and r.hellos == 2, (r.cuts, r.hellos)
    assert client.epoch == welcome.epoch
    decision = client.coordinate(StepReport(num_tokens=3, num_tokens_padded=3), timeout=10)
    assert decision.num_tokens_across_dp == [3]


def test_the_hello_is_sent_again_a_few_times_only(
    relay: Callable[..., CuttingRelay], make_client: ClientMaker
) -> None:
    """A connection cut at every Hello: connect() sends it 1 + 3 times, then waits out its
    deadline and says the connection dropped while it registered."""
    incarnation = f"cut-{secrets.token_hex(6)}"
    r = relay(incarnation.encode(), "hello", times=100)
    client = make_client(
        r.address, dp_rank=0, dp_size=1, config_fingerprint="fp", incarnation=incarnation
    )
    began = time.monotonic()
    with pytest.raises(CoordinatorUnavailable, match="no answer from coordd within 3s") as info:
        client.connect(timeout=3)
    took = time.monotonic() - began
    assert 2.9 < took < 4.5, took
    assert "the Hello went 4 times" in str(info.value), info.value
    assert r.hellos == 4, r.hellos


def test_a_round_over_the_new_connection_hears_of_its_drop(
    relay: Callable[..., CuttingRelay], make_client: ClientMaker
) -> None:
    """The connection opened to send the Hello again is watched like the first: when it drops
    while a round waits, the wait fails at once. (The asyncio client did not read a reopened
    connection's monitor, so its descriptor never fired: the round waited out its timeout.)"""
    incarnation = f"cut-{secrets.token_hex(6)}"
    r = relay(incarnation.encode(), "hello", dp=2)
    upstream = "tcp://{}:{}".format(*r.upstream)
    rank0 = make_client(
        r.address, dp_rank=0, dp_size=2, config_fingerprint="fp", incarnation=incarnation
    )
    rank1 = make_client(upstream, dp_rank=1, dp_size=2, config_fingerprint="fp")
    rank0.connect(timeout=10)
    rank1.connect(timeout=10)
    assert r.cuts == 1
    pending = rank0.start(StepReport(num_tokens=1, num_tokens_padded=1))  # rank 1 never reports
    r.drop_all()
    began = time.monotonic()
    with pytest.raises(CoordinatorUnavailable, match="dropped"):
        pending.wait(timeout=10)
    assert time.monotonic() - began < 3
