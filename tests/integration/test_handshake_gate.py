"""What bounds the slow routing-id abort (coordd.io._gate), with real ZeroMQ: id-less
handshakes over the rate are refused before libzmq names the peer, a connection that says no
Hello is closed after the grace (a rank's never), and a zero-led routing id cannot register."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

from coordd.client.sync import CoordClient
from coordd.core._handshake import HandshakeRate
from coordd.core._settings import ServerSettings
from coordd.io._gate import ZAP_DOMAIN, ZAP_ENDPOINT, ZAP_VERSION, HandshakeGate
from coordd.io._server import CoordServer
from coordd.proto.messages import Hello, Reject, decode_from_coordinator, encode
from coordd.testing import CoorddProcess
from tests.integration.scrape import free_port, metric_value
from tests.integration.test_groups import report, run_server

pytestmark = pytest.mark.timeout(60)

#: A child process (its own ipc source) opening `count` id-less connections; prints how many
#: finished their handshake within `seconds`.
_ID_LESS = r"""
import sys, time, zmq
address, count, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ctx = zmq.Context()
socks, monitors = [], []
for _ in range(count):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitors.append(sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED))
    sock.connect(address)
    socks.append(sock)
done = set()
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    for i, monitor in enumerate(monitors):
        if i not in done and monitor.poll(0):
            done.add(i)
    time.sleep(0.01)
print(len(done), flush=True)
for sock in socks + monitors:
    sock.close(linger=0)
ctx.term()
"""


def test_id_less_handshakes_over_the_rate_are_refused_and_a_rank_still_registers(
    tmp_path: Path,
) -> None:
    """--max-handshake-rate 8 with --max-connections 40: a burst of 40, then 1 a second from
    one source. 100 id-less connections from one process: at most ~42 finish their handshake in
    2 s (before: all 100, each moving libzmq's counter); a rank from another process registers
    meanwhile."""
    port = free_port()
    args = ["--log-level", "error", "--metrics-port", str(port)]
    args += ["--max-handshake-rate", "8", "--max-connections", "40"]
    with CoorddProcess(1, f"ipc://{tmp_path}/c.sock", args) as coordd:
        flood = subprocess.Popen(
            [sys.executable, "-c", _ID_LESS, coordd.address, "100", "2.0"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(0.5)
            rank = CoordClient(coordd.address, dp_rank=0, dp_size=1)
            try:
                rank.connect(timeout=10)
                assert rank.coordinate(report(0, 0), timeout=10).seq == 0
            finally:
                rank.close()
            out, _ = flood.communicate(timeout=30)
        finally:
            flood.kill()
            flood.wait(timeout=10)
        admitted = int(out.split()[-1])
        assert 1 <= admitted <= 40 + 2 + 2, f"{admitted} of 100 id-less handshakes admitted"
        assert metric_value(port, "coordd_handshakes_rate_refused_total") >= 100 - 44
        assert coordd.proc is not None and coordd.proc.poll() is None


def test_the_routing_id_attack_gets_the_burst_then_its_share(tmp_path: Path) -> None:
    """The attack itself (coordd.tools.load.claims: names held, id-less connections as fast as
    one process goes) against --max-connections 64, --max-handshake-rate 16: in 4 s, at most
    the burst of 64 plus 4 s x 2/s handshakes are admitted, names and id-less together (with
    the rate off: thousands), and coordd lives."""
    from coordd.tools.load.claims import attack

    args = ["--log-level", "error", "--max-handshake-rate", "16", "--max-connections", "64"]
    with CoorddProcess(1, f"ipc://{tmp_path}/c.sock", args) as coordd:
        result = attack(coordd.address, count=40, seconds=4.0, in_flight=10)
        admitted = result.idless_admitted + result.claims_admitted
        assert admitted <= 64 + 4 * 2 + 4, result.summary()
        assert result.idless_refused > 100, result.summary()
        assert coordd.proc is not None and coordd.proc.poll() is None


def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within 5 s"
        time.sleep(0.01)


def _serve(tmp_path: Path, grace: float) -> tuple[CoordServer, threading.Event, threading.Thread]:
    server = CoordServer(
        ServerSettings(f"ipc://{tmp_path}/s.sock", dp_size=1, stranger_grace=grace)
    )
    stop = threading.Event()
    serving = threading.Thread(target=run_server, args=(server, stop), daemon=True)
    serving.start()
    return server, stop, serving


def test_a_connection_that_says_no_hello_is_closed_after_the_grace_and_a_rank_is_not(
    tmp_path: Path,
) -> None:
    """A claimed automatic id (`\\x00` + 4 bytes) held silently is what can meet libzmq's
    counter: it is shut down after the grace. A rank idle for longer keeps its connection, and
    so does a peer whose Hello was refused (it said Hello from a name of its own)."""
    server, stop, serving = _serve(tmp_path, grace=0.4)
    ctx = zmq.Context()
    rank = CoordClient(server.bound_address, dp_rank=0, dp_size=1)
    try:
        rank.connect(timeout=10)
        claim = ctx.socket(zmq.DEALER)
        claim.setsockopt(zmq.LINGER, 0)
        claim.setsockopt(zmq.ROUTING_ID, b"\x00\x12\x34\x56\x78")
        events = claim.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        claim.connect(server.bound_address)
        refused = ctx.socket(zmq.DEALER)
        refused.setsockopt(zmq.LINGER, 0)
        refused.setsockopt(zmq.ROUTING_ID, b"second-rank-0")
        refused.connect(server.bound_address)
        refused.send(encode(Hello(dp_size=1, dp_rank=0, config_fingerprint="", incarnation="x")))
        assert refused.poll(10_000)
        answer = decode_from_coordinator(refused.recv())
        assert isinstance(answer, Reject) and answer.reason.value == "rank_taken"
        assert events.poll(10_000), "the silent connection was not closed"
        _until(lambda: server.admission.expired >= 1)  # counted just after the shutdown
        time.sleep(1.0)  # more than twice the grace: the claim reconnected, and is closed again
        _until(lambda: server.admission.expired >= 2)
        assert rank.coordinate(report(0, 0), timeout=10).seq == 0
        refused.send(encode(Hello(dp_size=1, dp_rank=0, config_fingerprint="", incarnation="x")))
        assert refused.poll(10_000), "the refused peer's connection was closed"
    finally:
        rank.close()
        ctx.destroy(linger=0)
        stop.set()
        serving.join(timeout=10)


def test_a_hello_from_a_zero_led_routing_id_is_refused_naming_the_fix(tmp_path: Path) -> None:
    """libzmq's own names start with a zero byte: a connection holding one never registers (an
    exempt connection must hold no name the counter can reach)."""
    server, stop, serving = _serve(tmp_path, grace=0)
    ctx = zmq.Context()
    try:
        for routing_id in (None, b"\x00\xff\xff\xff\xff", b"\x00claimed"):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if routing_id is not None:
                sock.setsockopt(zmq.ROUTING_ID, routing_id)
            sock.connect(server.bound_address)
            sock.send(encode(Hello(dp_size=1, dp_rank=0, config_fingerprint="", incarnation="")))
            assert sock.poll(10_000)
            answer = decode_from_coordinator(sock.recv())
            assert isinstance(answer, Reject), answer
            assert answer.reason.value == "routing_id"
            assert "name themselves" in answer.text
        rank = CoordClient(server.bound_address, dp_rank=0, dp_size=1)
        try:
            rank.connect(timeout=10)  # the rank was not taken by any of them
        finally:
            rank.close()
    finally:
        ctx.destroy(linger=0)
        stop.set()
        serving.join(timeout=10)


def test_a_quiet_source_is_answered_ahead_of_the_queue() -> None:
    """The ZAP thread reads what is queued, then answers one request of each quiet source
    first: under the 16-process attack a rank's request waited 2-4 s behind hundreds of the
    attackers' (most from connections already closed), and its connect() failed in 4 of 10
    tries. Here the gate is held inside its first request while 300 of a busy source and one
    of a quiet source queue up; the quiet one is answered next, not 301st."""
    context = zmq.Context()
    gate = HandshakeGate.start(context)
    assert gate is not None
    client = context.socket(zmq.DEALER)
    try:
        gate.clock = lambda: 0.0  # nothing refills: the busy source stays busy
        gate.rate = rate = HandshakeRate(rate=20, burst=1024)
        gate.max_stalled = 0  # every refusal answered at once: the order shows
        gate.handshakes = admitted = deque()  # what admission's spares read
        busy, quiet = b"localhost:0:0:1001", b"localhost:0:0:1002"
        while rate.admit(busy, 0.0):
            pass
        # quiet is earned (issue 28): this process registered a rank before (a fresh one
        # would wait its turn, as the churn of freshly forked processes now does)
        gate.earned.append(quiet)
        entered, release = threading.Event(), threading.Event()

        def hold_the_first() -> None:
            if not entered.is_set():
                entered.set()
                release.wait(10)

        gate.on_handshake = hold_the_first
        client.connect(ZAP_ENDPOINT)

        def ask(address: bytes, request_id: bytes) -> None:
            client.send_multipart(
                [b"", ZAP_VERSION, request_id, ZAP_DOMAIN.encode(), address, b"", b"NULL"]
            )

        ask(busy, b"first")
        assert entered.wait(10), "the gate never read the first request"
        for n in range(300):
            ask(busy, b"busy%d" % n)
        ask(quiet, b"quiet")
        release.set()
        answers = []
        for _ in range(302):
            assert client.poll(10_000), f"the gate answered {len(answers)} of 302"
            _, _, request_id, status, *_ = client.recv_multipart()
            answers.append((request_id, status))
        assert answers[:2] == [(b"first", b"300"), (b"quiet", b"200")], answers[:4]
        assert {status for _, status in answers[2:]} == {b"300"}
        assert list(admitted) == [(1002, 0.0)], "the quiet process's handshake is through"
    finally:
        client.close(linger=0)
        gate.stop()
        context.term()
