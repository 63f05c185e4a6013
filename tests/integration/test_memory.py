"""coordd's memory budget with real ZeroMQ: the ZAP gate refuses new connections in their
handshake under pressure (no message of theirs is queued), libzmq frees a closed connection's
unfinished message, and a coordd process under a burst stays near its budget."""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from coordd.core import _daemon_defaults as defaults
from coordd.io import _limits as limits
from coordd.io import _memory as memory
from coordd.io._gate import ZAP_DOMAIN, ZAP_ENDPOINT, HandshakeGate
from coordd.proto.errors import CoordinatorUnavailable
from coordd.testing import CoorddProcess
from coordd.tools.load import HonestRounds, ProcessGauge, start_load, wait_load
from tests.integration.scrape import free_port, metric_value

pytestmark = pytest.mark.timeout(60)
#: How long a garbage burst (50 peers x 20,000 frames, twice: ~2M messages from Python) may take
#: to send: 5-11 s on 2 cores at load 11, over 40 s at load 13 (it failed "did not end within
#: 30s/40s" beside 6 busy loops). Only a bound for a load that hangs, so it is wide; the
#: tests that send one have a timeout to match.
LOAD_BOUND = 150.0
BURST_TIMEOUT = pytest.mark.timeout(300)


def _router(context: zmq.Context, address: str) -> zmq.Socket:
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.bind(address)
    return sock


def test_the_gate_admits_until_pressure_then_refuses_in_the_handshake(tmp_path: Path) -> None:
    context = zmq.Context()
    gate = HandshakeGate.start(context)
    assert gate is not None
    assert HandshakeGate.start(context) is gate  # one ZAP handler per context
    router = _router(context, f"ipc://{tmp_path}/g.sock")
    try:
        admitted = context.socket(zmq.DEALER)
        admitted.setsockopt(zmq.LINGER, 0)
        admitted.connect(f"ipc://{tmp_path}/g.sock")
        admitted.send(b"hello")
        assert router.poll(5000) and router.recv_multipart()[1] == b"hello"
        gate.refusing = True
        events = router.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        refused = context.socket(zmq.DEALER)
        refused.setsockopt(zmq.LINGER, 0)
        refused.connect(f"ipc://{tmp_path}/g.sock")
        refused.send(b"flood", zmq.NOBLOCK)
        assert events.poll(5000), "no handshake failure"
        event, value = struct.unpack("=HI", events.recv_multipart()[0][:6])
        # 300: a temporary failure (the peer sees its connection closed, and retries)
        assert event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and value == 300
        assert not router.poll(300), "a refused connection's message was queued"
        assert gate.refused >= 1
        refused.close(linger=0)
        admitted.send(b"still")  # an admitted connection is not affected
        assert router.poll(5000) and router.recv_multipart()[1] == b"still"
        # the gate also asks the RSS itself (a loop busy with a burst is late to say so)
        gate.refusing = False
        time.sleep(0.2)  # the closed one's retries are over
        gate.over = lambda: True
        before = gate.refused
        late = context.socket(zmq.DEALER)
        late.setsockopt(zmq.LINGER, 0)
        late.connect(f"ipc://{tmp_path}/g.sock")
        late.send(b"late", zmq.NOBLOCK)
        assert events.poll(5000) and not router.poll(300)
        assert gate.refused > before
        late.close(linger=0)
        for sock in (admitted, events):
            sock.close(linger=0)
    finally:
        router.close(linger=0)
        gate.stop()
        context.destroy(linger=0)


@BURST_TIMEOUT
def test_a_closed_connection_s_unfinished_multipart_message_is_freed(tmp_path: Path) -> None:
    """libzmq holds a message's parts until it is whole (2M empty parts: ~130 MB): shutting
    the connection down mid-message frees them (its whole messages it would still hand
    over: those coordd drops)."""
    statm = memory.RssReader()
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, 0)
    address = f"ipc://{tmp_path}/m.sock"
    router.bind(address)
    monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED)
    child = subprocess.Popen(
        [sys.executable, "-m", "coordd.tools.load", "multipart", address, "--parts", "2000000"],
        stdout=subprocess.DEVNULL,
    )
    try:
        assert monitor.poll(10_000)
        _, fd = struct.unpack("=HI", monitor.recv_multipart()[0][:6])
        base = statm()
        deadline = time.monotonic() + 120  # 2M parts from Python: seconds, or a minute at load
        while statm() < base + 40 * MB and time.monotonic() < deadline:
            time.sleep(0.005)
        grown = statm() - base
        assert grown >= 40 * MB, f"the message did not build up ({grown / MB:.0f} MB)"
        assert limits.shutdown_fd(fd, limits.socket_ident(fd))
        deadline = time.monotonic() + 5
        while statm() > base + 20 * MB and time.monotonic() < deadline:
            time.sleep(0.02)
        left = statm() - base
        print(f"grew {grown / MB:.0f} MB, {left / MB:.0f} MB left after the shutdown")
        assert left < 20 * MB
        assert not router.poll(100), "nothing of the unfinished message is handed over"
    finally:
        child.kill()
        child.wait()
        statm.close()
        monitor.close(linger=0)
        router.close(linger=0)
        context.destroy(linger=0)


MB = memory.MB


def assert_guard_acted(peak_mb: float, closed: float, refused: float) -> None:
    """Over its budget (64 MB) coordd closed strangers and refused their reconnects. A burst
    sent slowly (2 cores beside 6 busy loops: peaks of 51-59 MB seen) may never take coordd
    over it, and then there was nothing to do: the memory bounds are the test."""
    if peak_mb >= 64 + 8:
        assert closed >= 1 and refused >= 1, (peak_mb, closed, refused)


def register_within(ranks: HonestRounds, seconds: float) -> None:
    """Register every rank of `ranks`, retrying while coordd refuses handshakes: it does so
    until its memory is back under the budget (measured: at most ~0.5 s after a burst's end,
    also on 2 busy cores). One 10 s connect() that ran out in a fresh-clone CI run was most
    likely this process cut off for the burst's backlog (the test below)."""
    deadline = time.monotonic() + seconds
    for client in ranks.clients:
        while True:
            try:
                client.connect(timeout=5)
                break
            except CoordinatorUnavailable:
                if time.monotonic() >= deadline:
                    raise


@BURST_TIMEOUT
def test_coordd_stays_near_its_budget_under_a_garbage_burst(tmp_path: Path) -> None:
    """50 peers queue 20,000 bad frames each, twice (without the guard: 380-590 MB at the
    peak, all kept). With --max-rss-mb 64 coordd closes the strangers, refuses their
    reconnects in the handshake and gives the memory back; ranks keep deciding. The peak is
    65-82 MB (30 runs with 2-3 CPU hogs); it is bounded with room for the loop being
    preempted (+20 MB per 0.2 s seen), and under the 120-190 MB coordd reached when the RSS
    of queued messages was taken as its own level."""
    port = free_port()
    proc = CoorddProcess(
        4,
        f"ipc://{tmp_path}/c.sock",
        ["--log-level", "warning", "--max-rss-mb", "64", "--metrics-port", str(port),
         "--groups", "default,after"],
    ).start()
    try:
        with HonestRounds(proc.address, 4) as ranks, ProcessGauge(proc.pid, 0.01) as gauge:
            ranks.run(3)
            load = start_load(
                "garbage", proc.address, "--peers", "50", "--messages", "20000", "--repeat", "2"
            )
            wait_load(load, LOAD_BOUND)
            assert len(ranks.run(5)) == 5
            assert gauge.alive
            # new connections take the shut ones' descriptor numbers: they are read (only
            # what a shut connection still had queued is dropped undecoded)
            late = HonestRounds(proc.address, 4, group="after")
            try:
                register_within(late, 40)
                assert len(late.run(3)) == 3
            finally:
                late.close()
            deadline = time.monotonic() + 3
            while gauge.rss_mb() >= 80 and time.monotonic() < deadline:
                time.sleep(0.1)
            after = gauge.rss_mb()
            closed = metric_value(port, "coordd_memory_strangers_closed_total")
            refused = metric_value(port, "coordd_memory_handshakes_refused_total")
        print(
            f"peak RSS {gauge.peak_rss_mb:.0f} MB with --max-rss-mb 64, {after:.0f} MB after; "
            f"{closed:.0f} strangers closed, {refused:.0f} handshakes refused"
        )
        assert after < 80, f"coordd kept {after:.0f} MB"
        assert gauge.peak_rss_mb < 200, f"peak {gauge.peak_rss_mb:.0f} MB"
        assert_guard_acted(gauge.peak_rss_mb, closed, refused)
    finally:
        proc.stop()


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="Linux /proc")
def test_the_budget_option_is_validated(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "coordd", "--dp", "1", "--max-rss-mb", "8"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"coordd: --max-rss-mb must be 0 (off) or {defaults.MIN_RSS_MB}..{defaults.MAX_RSS_MB} MB, "
        "got 8"
    ]


def _curve_dealer(
    context: zmq.Context, address: str, server_public: bytes, pair: tuple[bytes, bytes | None]
) -> tuple[zmq.Socket, zmq.Socket]:
    """A CURVE DEALER with key `pair`, and its own monitor of handshake failures."""
    public, secret = pair
    assert secret is not None
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    events = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    sock.connect(address)
    return sock, events


def _auth_failure(events: zmq.Socket) -> int:
    assert events.poll(5000), "no handshake failure"
    event, value = struct.unpack("=HI", events.recv_multipart()[0][:6])
    assert event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    return value


def test_with_curve_one_zap_handler_checks_the_key_then_the_memory(tmp_path: Path) -> None:
    """With CURVE the key check and the memory budget share coordd's ZAP handler: a known key
    is admitted (its User-Id is its z85 key, which the key-to-rank binding reads), an
    unknown one refused with 400 (libzmq's client does not retry: its key will not change),
    and a known one refused with 300 under memory pressure (it retries later)."""
    from coordd.io._curve import CurveGate, write_keypair
    from coordd.proto.keyfile import read_key_file

    write_keypair(str(tmp_path), "coordd")
    write_keypair(str(tmp_path), "rank")
    write_keypair(str(tmp_path), "other")
    context = zmq.Context()
    gate = CurveGate.start(
        context, str(tmp_path / "coordd.key_secret"), [str(tmp_path / "rank.key")]
    )
    zap = HandshakeGate.start(context)  # what the server's memory budget gets
    assert zap is not None and zap is gate._auth
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    gate.configure(router)
    served = router.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    rank = read_key_file(str(tmp_path / "rank.key_secret"))
    other = read_key_file(str(tmp_path / "other.key_secret"))
    socks: list[zmq.Socket] = []
    try:
        known, _ = _curve_dealer(context, address, gate.public, rank)
        socks += [known, _]
        known.send(b"hello")
        assert router.poll(5000), "a known key was not admitted"
        frames = router.recv_multipart(copy=False)
        assert frames[1].bytes == b"hello"
        assert frames[1].get("User-Id") == rank[0].decode()
        unknown, events = _curve_dealer(context, address, gate.public, other)
        socks += [unknown, events]
        assert _auth_failure(events) == 400  # the client is told (and does not retry)
        assert _auth_failure(served) == 400
        assert gate.refused == 1 and zap.refused == 0
        zap.refusing = True
        pressed, events = _curve_dealer(context, address, gate.public, rank)
        socks += [pressed, events]
        pressed.send(b"flood", zmq.NOBLOCK)
        assert _auth_failure(served) == 300  # the client's handshake stalls; it retries
        assert zap.refused >= 1 and gate.refused == 1
        assert not router.poll(300), "a refused connection's message was queued"
        pressed.close(linger=0)
        time.sleep(0.1)
        while served.poll(0):
            served.recv_multipart()
        unknown2, events = _curve_dealer(context, address, gate.public, other)
        socks += [unknown2, events]
        assert _auth_failure(events) == 400  # a wrong key is told so under pressure too
        known.send(b"still")  # an admitted connection is not affected
        assert router.poll(5000) and router.recv_multipart()[1] == b"still"
    finally:
        for sock in socks:
            sock.close(linger=0)
        served.close(linger=0)
        router.close(linger=0)
        zap.stop()
        gate.stop()  # once more: a no-op
        context.destroy(linger=0)


def test_a_foreign_zap_handler_is_left_alone() -> None:
    context = zmq.Context()
    other = context.socket(zmq.REP)
    other.bind(ZAP_ENDPOINT)
    try:
        assert HandshakeGate.start(context) is None
    finally:
        other.close(linger=0)
        context.destroy(linger=0)


@BURST_TIMEOUT
def test_with_curve_a_burst_from_a_leaked_rank_key_is_refused_in_the_handshake(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tcp+CURVE, 50 peers holding a rank's key queue bad frames: coordd closes them and
    refuses their reconnects in the CURVE handshake (status 300 from its one ZAP handler;
    before, pyzmq's authenticator admitted every known key whatever the memory), and ranks
    keep deciding."""
    from coordd.io._curve import write_keypair

    write_keypair(str(tmp_path), "coordd")
    write_keypair(str(tmp_path), "rank")
    port = free_port()
    proc = CoorddProcess(
        2,
        "tcp://127.0.0.1:0",
        [
            "--log-level",
            "error",
            "--metrics-port",
            str(port),
            "--curve-secret-key",
            str(tmp_path / "coordd.key_secret"),
            "--curve-client-keys",
            str(tmp_path / "rank.key"),
        ],
    ).start()
    # the load's peers and the honest ranks use the rank's key (a leaked one)
    monkeypatch.setenv("COORDD_CURVE_SERVER_KEY", str(tmp_path / "coordd.key"))
    monkeypatch.setenv("COORDD_CURVE_CLIENT_KEY", str(tmp_path / "rank.key_secret"))
    try:
        with HonestRounds(proc.address, 2) as ranks, ProcessGauge(proc.pid, 0.01) as gauge:
            ranks.run(3)
            load = start_load(
                "garbage", proc.address, "--peers", "50", "--messages", "20000", "--repeat", "2"
            )
            wait_load(load, LOAD_BOUND)
            assert len(ranks.run(5)) == 5
            closed = metric_value(port, "coordd_memory_strangers_closed_total")
            refused = metric_value(port, "coordd_memory_handshakes_refused_total")
        print(
            f"CURVE: peak RSS {gauge.peak_rss_mb:.0f} MB with --max-rss-mb 64; "
            f"{closed:.0f} strangers closed, {refused:.0f} handshakes refused"
        )
        assert_guard_acted(gauge.peak_rss_mb, closed, refused)
        assert gauge.peak_rss_mb < 300, f"peak {gauge.peak_rss_mb:.0f} MB"
    finally:
        proc.stop()


def _banned(port: int) -> float:
    return metric_value(port, 'coordd_connections_closed_total{reason="banned"}')


@BURST_TIMEOUT
def test_connections_open_during_a_garbage_burst_are_not_cut_off_for_its_backlog(
    tmp_path: Path,
) -> None:
    """Clients of this process connect during a garbage burst and register only after it
    (their sockets connect at construction). Their connections take descriptor numbers the
    burst's shut connections had, whose queued messages coordd still reads: counted against
    the new connection, they cut it off as a flood and banned this whole process for
    BAN_SECONDS (4 runs in 10 with one such client; its registration waited 10 s). Now a
    peer's messages count against a connection only if its first came over that socket."""
    port = free_port()
    proc = CoorddProcess(
        4,
        f"ipc://{tmp_path}/c.sock",
        ["--log-level", "error", "--max-rss-mb", "64", "--metrics-port", str(port),
         "--groups", "default,idle*"],
    ).start()
    try:
        with HonestRounds(proc.address, 4) as ranks:
            ranks.run(3)
            load = start_load(
                "garbage", proc.address, "--peers", "50", "--messages", "20000", "--repeat", "2"
            )
            # 12 connections, no Hello yet: more numbers to take over (the old code failed
            # this in 4 runs of 6; with 4 of them, in 1 of 6)
            idle = [HonestRounds(proc.address, 4, group=f"idle{i}") for i in range(3)]
            try:
                wait_load(load, LOAD_BOUND)
                # the load's process is gone: a refusal as banned from now on is this one's
                before = _banned(port)
                for group in idle:
                    register_within(group, 15)
                    assert len(group.run(3)) == 3
                after = _banned(port)
            finally:
                for group in idle:
                    group.close()
        assert after == before, f"{after - before:.0f} connections of this process banned"
    finally:
        proc.stop()


def _raw_unfinished_multipart(path: str, seconds: float) -> None:
    """A ZMTP 3.0 peer over a unix socket (NULL mechanism, DEALER) that streams empty parts
    of one multipart message that never completes: libzmq queues them in coordd and no
    message of it ever reaches coordd's loop (no "first message" ends a spare). The child."""
    import socket as socketlib

    sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    try:
        sock.connect(path)
        sock.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32))
        body = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        sock.sendall(b"\x04" + bytes([len(body)]) + body)
        sock.settimeout(3)
        got = b""
        while b"READY" not in got[64:]:
            chunk = sock.recv(4096)
            if not chunk:
                return  # refused in the handshake
            got += chunk
        block = b"\x01\x00" * 65536  # empty parts, each with MORE set
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sock.sendall(block)
    except OSError:
        return
    finally:
        sock.close()


@pytest.mark.timeout(90)
def test_fresh_processes_streaming_unfinished_multipart_stay_within_the_budget(
    tmp_path: Path,
) -> None:
    """Issue 28, defect 4: under --max-rss-mb 64, fresh processes (10 a second, each streaming
    one multipart message that never completes) were let in under pressure and each spared ~1
    s: coordd's RSS median 465-555 MB (this test on main: median 241, peak 309 MB). Quiet is
    earned now, at the gate and at accept: median 55-61 MB, peak 70-74 MB. An honest rank (a
    fresh process too) still connects."""
    address = f"ipc://{tmp_path}/c.sock"
    coordd = CoorddProcess(1, address, ["--max-rss-mb", "64", "--log-level", "error"]).start()
    kids: list[int] = []
    samples: list[float] = []
    try:
        with ProcessGauge(coordd.pid, interval=0.05) as gauge:
            began = time.monotonic()
            forks = 0
            while time.monotonic() - began < 8.0:
                if forks < (time.monotonic() - began) * 10:
                    pid = os.fork()
                    if pid == 0:  # pragma: no cover - the child
                        try:
                            _raw_unfinished_multipart(str(tmp_path / "c.sock"), 2.0)
                        finally:
                            os._exit(0)
                    kids.append(pid)
                    forks += 1
                samples.append(gauge.rss_mb())
                time.sleep(0.05)
                kids = [k for k in kids if os.waitpid(k, os.WNOHANG)[0] == 0]
            from coordd.client import CoordClient

            with CoordClient(address, dp_rank=0, dp_size=1) as rank:
                rank.connect(timeout=10)
            assert gauge.alive
    finally:
        for kid in kids:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(kid, 9)
                os.waitpid(kid, 0)
        coordd.stop()
    samples.sort()
    median = samples[len(samples) // 2]
    print(f"forks {forks}: RSS median {median:.0f} MB, peak {gauge.peak_rss_mb:.0f} MB")
    assert median < 100, f"RSS median {median:.0f} MB under a 64 MB budget"
    assert gauge.peak_rss_mb < 200
