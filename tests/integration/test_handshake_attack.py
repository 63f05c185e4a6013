"""Issue 21, 5 with real processes: attackers that keep handshakes in flight do not keep an
honest rank out. A real `coordd serve` with a low --max-handshake-rate, attacker processes
(`coordd.tools.load`), and a rank whose `connect(timeout=10)` must succeed meanwhile. The full
attack (16 processes, 10 tries) is `python -m coordd.tools.load.honest_admission`."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from coordd.client.sync import CoordClient
from coordd.io._curve import write_keypair
from coordd.testing import CoorddProcess
from coordd.tools.load import start_load, wait_load
from tests.integration.scrape import free_port, metric_value

pytestmark = pytest.mark.timeout(60)

RATE = ["--max-handshake-rate", "8", "--max-connections", "64", "--log-level", "error"]
ATTACKERS = 3
#: The attackers stop by themselves after this (the test kills them once the rank is in).
SECONDS = 30.0
#: Handshakes refused over the rate within the second before the rank connects (5x the rate
#: the attackers get in): the attack is on.
REFUSED = 40


def _connect_during(
    address: str, port: int, loads: list, env: dict[str, str] | None = None
) -> float:
    """Once the attackers are held by the rate (REFUSED handshakes refused over it within one
    second, waited for at most 10 s), a rank connects: the seconds it took."""
    deadline = time.monotonic() + 10
    seen: list[float] = []
    while len(seen) < 5 or seen[-1] - seen[-5] < REFUSED:
        assert time.monotonic() < deadline, f"the attack never reached the rate: {seen}"
        seen.append(metric_value(port, "coordd_handshakes_rate_refused_total"))
        time.sleep(0.25)
    old = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        for load in loads:
            assert load.poll() is None, "an attacker ended early"
        t0 = time.monotonic()
        with CoordClient(address, dp_rank=0, dp_size=1) as rank:
            rank.connect(timeout=10)
            return time.monotonic() - t0
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for load in loads:
            load.kill()
            wait_load(load, 10)


def test_attackers_over_ipc_do_not_keep_a_rank_out(tmp_path: Path) -> None:
    """3 processes (3 sources) keep 20 raw handshakes in flight each."""
    port = free_port()
    args = [*RATE, "--metrics-port", str(port)]
    with CoorddProcess(1, f"ipc://{tmp_path}/c.sock", args) as coordd:
        loads = [
            start_load(
                "claims", coordd.address, "--count", "0", "--peers", "20", "--seconds", str(SECONDS)
            )
            for _ in range(ATTACKERS)
        ]
        took = _connect_during(coordd.address, port, loads)
        refused = metric_value(port, "coordd_handshakes_rate_refused_total")
        assert coordd.proc is not None and coordd.proc.poll() is None
    print(f"ipc: connected in {took:.2f} s; {refused:.0f} handshakes refused over the rate")


def test_a_leaked_key_from_many_loopback_addresses_does_not_keep_a_rank_out(
    tmp_path: Path,
) -> None:
    """tcp+CURVE: 3 processes with a leaked key keep 20 handshakes in flight each, every one
    from the next of 200 addresses of 127.0.0.0/8. Before sources were grouped each address
    was its own fresh (quiet) source, which took the shared rate and its reserve: the rank's
    connect() ran out its 10 s in 6 of 7 runs. Now the key is one group, held to half the
    rate, and the rank's own key is a quiet group of its own."""
    keys = tmp_path / "keys"
    for name in ("coordd", "leaked", "rank"):
        write_keypair(str(keys), name)
    port = free_port()
    curve = [
        "--curve-secret-key",
        str(keys / "coordd.key_secret"),
        "--curve-client-keys",
        f"{keys / 'leaked.key'},{keys / 'rank.key'}",
    ]
    args = [*RATE, *curve, "--metrics-port", str(port)]
    leaked = {
        "COORDD_CURVE_SERVER_KEY": str(keys / "coordd.key"),
        "COORDD_CURVE_CLIENT_KEY": str(keys / "leaked.key_secret"),
    }
    honest = {
        "COORDD_CURVE_SERVER_KEY": str(keys / "coordd.key"),
        "COORDD_CURVE_CLIENT_KEY": str(keys / "rank.key_secret"),
    }
    with CoorddProcess(1, "tcp://127.0.0.1:0", args) as coordd:
        attackers = {**os.environ, **leaked}
        loads = [
            start_load(
                "handshakes",
                coordd.address,
                "--peers",
                "20",
                "--count",
                "200",
                "--seconds",
                str(SECONDS),
                env=attackers,
            )
            for _ in range(ATTACKERS)
        ]
        took = _connect_during(coordd.address, port, loads, honest)
        refused = metric_value(port, "coordd_handshakes_rate_refused_total")
        assert coordd.proc is not None and coordd.proc.poll() is None
    print(f"tcp: connected in {took:.2f} s; {refused:.0f} handshakes refused over the rate")


def _raw_handshakes(path: str, count: int) -> None:
    """`count` raw ZMTP handshakes over a unix socket (NULL, DEALER), each closed after at
    most 0.2 s: a freshly forked process's (the child)."""
    import socket
    import struct

    body = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(0.2)
            sock.connect(path)
            sock.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00")
                         + bytes(32) + b"\x04" + bytes([len(body)]) + body)
            sock.recv(4096)
        except OSError:
            pass
        finally:
            sock.close()


@pytest.mark.timeout(90)
def test_fork_churn_does_not_keep_a_rank_out(tmp_path: Path) -> None:
    """Issue 28, defect 3: fresh processes counted as quiet: a stream of forks (~295 a second,
    2 raw handshakes each) took the reserve and the front of the gate's queue, and an honest
    connect(timeout=10) failed 3 of 3 (with --max-handshake-rate 0: ~0.01 s). Quiet is earned
    now: the rank (a fresh process too) gets in at its retry. Here ~100 forks a second against
    --max-handshake-rate 8 (a burst of 64); the rank starts once the gate refuses the churn
    (30 refused), however long a loaded machine takes to fork that far, and the churn goes on
    while it connects."""
    port = free_port()
    coordd = CoorddProcess(1, f"ipc://{tmp_path}/c.sock",
                           ["--metrics-port", str(port), *RATE]).start()
    path = str(tmp_path / "c.sock")
    kids: list[int] = []
    forks = 0
    rank_pid = 0
    rank_status: int | None = None
    refused = refused_at_rank = 0.0
    try:
        began = scraped = time.monotonic()
        while rank_status is None and time.monotonic() - began < 40:
            if forks < (time.monotonic() - began) * 100:
                pid = os.fork()
                if pid == 0:  # pragma: no cover - the child
                    try:
                        _raw_handshakes(path, 2)
                    finally:
                        os._exit(0)
                kids.append(pid)
                forks += 1
            if not rank_pid and time.monotonic() - scraped > 0.5:
                scraped = time.monotonic()
                refused_at_rank = metric_value(port, "coordd_handshakes_rate_refused_total")
            if not rank_pid and refused_at_rank >= 30:
                rank_pid = os.fork()
                if rank_pid == 0:  # pragma: no cover - the rank, a fresh process
                    code = 1
                    try:
                        t0 = time.monotonic()
                        with CoordClient(f"ipc://{path}", dp_rank=0, dp_size=1) as rank:
                            rank.connect(timeout=10)
                        print(f"rank connected in {time.monotonic() - t0:.2f} s", flush=True)
                        code = 0
                    finally:
                        os._exit(code)
            time.sleep(0.002)
            kids = [k for k in kids if os.waitpid(k, os.WNOHANG)[0] == 0]
            if rank_pid:
                done, status = os.waitpid(rank_pid, os.WNOHANG)
                if done:
                    rank_status = status
        refused = metric_value(port, "coordd_handshakes_rate_refused_total")
    finally:
        if rank_pid and rank_status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank_pid, signal.SIGKILL)
            os.waitpid(rank_pid, 0)
        for kid in kids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(kid, 0)
        coordd.stop()
    print(f"forks {forks}, handshakes refused over the rate {refused_at_rank:.0f} when the "
          f"rank started, {refused:.0f} in all")
    assert rank_pid, f"the churn never reached the rate ({refused_at_rank:.0f} refused)"
    assert refused > refused_at_rank, "the churn stopped before the rank connected"
    assert rank_status == 0, "the rank's connect(timeout=10) failed during the churn"
