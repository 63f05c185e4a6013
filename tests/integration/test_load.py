"""coordd under hostile load (issue 11, part B): a real coordd process, real sockets, the load
generators of `coordd.tools.load` (each a child process, bounded in count and time).

These are soak tests (marked slow, still run by CI), each a few seconds. They assert that
coordd survives, stays responsive and bounded, and that honest ranks keep their rounds; the
latency figures under each load are measured by `python -m coordd.tools.load measure`, not
asserted here (the machine is shared).
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordd.io._curve import write_keypair
from coordd.proto.errors import StepTimeout
from coordd.proto.messages import StepReport
from coordd.testing import CoorddProcess
from coordd.tools.load import HonestRounds, ProcessGauge, start_load, wait_load
from tests.integration.scrape import free_port

#: How long a load may take to send (`wait_load`): only a bound for a load that hangs, so it is
#: wide. The garbage burst of 3M messages from Python overran 120 s (and the test's timeout)
#: beside 6 busy loops on 2 cores (load ~20); the file's timeout matches.
LOAD_BOUND = 300.0
#: Slowest /livez answer under a load: a liveness probe's window (the Containerfile's
#: HEALTHCHECK waits 3 s, then retries), with room for load 10 on 2 cores.
LIVEZ_BOUND = 5.0
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def limited(proc: CoorddProcess, nofile: int) -> CoorddProcess:
    """Run `proc` with soft and hard NOFILE `nofile` (as a small container or a default
    systemd unit would)."""
    proc.argv = [
        "sh",
        "-c",
        f'ulimit -Sn {nofile}; ulimit -Hn {nofile}; exec "$@"',
        "sh",
        *proc.argv,
    ]
    return proc


def livez(url: str, timeout: float = 5.0) -> float:
    """Seconds /livez took to answer 200."""
    t0 = time.monotonic()
    with urllib.request.urlopen(url + "/livez", timeout=timeout) as response:
        assert response.status == 200
    return time.monotonic() - t0


@pytest.fixture
def coordd(tmp_path: Path) -> Iterator[list[CoorddProcess]]:
    started: list[CoorddProcess] = []
    yield started
    for proc in started:
        proc.stop()


def settled_rss(gauge: ProcessGauge, limit: float = 3.0) -> float:
    """coordd's RSS once it has dropped what a load queued and given it back (at most `limit`
    seconds), in MB."""
    deadline = time.monotonic() + limit
    rss = gauge.rss_mb()
    while rss >= 80 and time.monotonic() < deadline:
        time.sleep(0.1)
        rss = gauge.rss_mb()
    return rss


def start(started: list[CoorddProcess], proc: CoorddProcess) -> CoorddProcess:
    started.append(proc)
    return proc.start()


def test_garbage_from_50_peers_then_their_disconnects_never_aborts_coordd(
    coordd, tmp_path: Path
) -> None:
    """libzmq 4.3.5 aborted (`!_io_error`, stream_engine_base.cpp:310) when a peer whose
    input was stopped at the receive HWM disconnected and a heartbeat came next."""
    proc = start(
        coordd,
        CoorddProcess(
            4,
            f"ipc://{tmp_path}/c.sock",
            ["--log-level", "error", "--heartbeat-interval", "0.1", "--heartbeat-timeout", "5"],
        ),
    )
    with HonestRounds(proc.address, 4) as ranks, ProcessGauge(proc.pid, 0.02) as gauge:
        ranks.run(3)
        load = start_load(
            "garbage", proc.address, "--peers", "50", "--messages", "20000", "--repeat", "3"
        )
        wait_load(load, LOAD_BOUND)
        assert proc.proc is not None and proc.proc.poll() is None, "coordd died"
        assert len(ranks.run(5)) == 5
        after = settled_rss(gauge)
    # the memory budget (--max-rss-mb, default 64) closes the strangers, refuses their
    # reconnects in the handshake and gives the memory back: without it 380-590 MB at the
    # peak, and all of it kept. The peak is 65-82 MB (30 runs, 2-3 CPU hogs on 2 cores);
    # 120-190 MB when the RSS of queued messages was taken as coordd's own level (see
    # coordd.io._memory.RssBudget.check). Room left for the loop being preempted: a drain of
    # 512 messages costs ~3 ms of CPU, but was seen 0.1-0.24 s long, +20 MB meanwhile.
    print(f"peak RSS {gauge.peak_rss_mb:.0f} MB, {after:.0f} MB after the load")
    assert after < 80, f"coordd kept {after:.0f} MB after the burst"
    assert gauge.peak_rss_mb < 200, f"peak RSS {gauge.peak_rss_mb:.0f} MB"


def test_one_fast_peer_does_not_hold_the_loop(coordd, tmp_path: Path) -> None:
    """While one peer sends as fast as it can, a 0.5 s step timeout still fires on time and
    /livez still answers (the drain yields to the loop every DRAIN_BUDGET messages), and
    the peer is cut off before it costs coordd much memory."""
    port = free_port()
    proc = start(
        coordd,
        CoorddProcess(
            2,
            f"ipc://{tmp_path}/c.sock",
            ["--log-level", "error", "--step-timeout", "0.5", "--metrics-port", str(port)],
        ),
    )
    url = f"http://127.0.0.1:{port}"
    ranks = HonestRounds(proc.address, 2)
    with ranks, ProcessGauge(proc.pid) as gauge:
        base = gauge.rss_mb()
        ranks.run(2)
        load = start_load("fast", proc.address, "--seconds", "6")
        try:
            time.sleep(1.0)  # the flood is on
            assert load.poll() is None
            t0 = time.monotonic()
            pending = ranks.clients[0].start(StepReport(num_tokens=1, num_tokens_padded=1))
            with pytest.raises(StepTimeout):
                pending.wait(timeout=10)
            fired = time.monotonic() - t0
            answered = livez(url)
            assert load.poll() is None, "the flood ended before the checks: no evidence"
        finally:
            wait_load(load, LOAD_BOUND)
    print(f"step timeout 0.5 s fired after {fired:.2f} s; /livez in {answered:.3f} s")
    # a loop held by the flood fires the timeout only once the 6 s flood is over (load 10 on 2
    # cores stretches an honest 0.5 s to ~1-2 s: the bound is the flood's length, not a speed)
    assert fired < 5.0, f"the 0.5 s step timeout fired after {fired:.2f} s (flood held the loop)"
    assert answered < 5.0
    # libzmq's inbound queue is unbounded (RCVHWM 0, against the abort): the flooding
    # stranger is cut off after STRANGER_MESSAGES_PER_S messages (it was +300 MB uncut)
    grew = gauge.peak_rss_mb - base
    print(f"rss {base:.0f} MB -> peak {gauge.peak_rss_mb:.0f} MB (+{grew:.0f})")
    assert grew < 150, f"one fast peer grew coordd by {grew:.0f} MB"


def test_a_two_million_part_message_is_dropped_without_stalling(coordd, tmp_path: Path) -> None:
    port = free_port()
    proc = start(
        coordd,
        CoorddProcess(
            4, f"ipc://{tmp_path}/c.sock", ["--log-level", "error", "--metrics-port", str(port)]
        ),
    )
    url = f"http://127.0.0.1:{port}"
    with HonestRounds(proc.address, 4) as ranks, ProcessGauge(proc.pid) as gauge:
        ranks.run(3)
        base = gauge.rss_mb()
        load = start_load("multipart", proc.address, "--parts", "2000000")
        slowest = 0.0
        while load.poll() is None:
            slowest = max(slowest, livez(url, timeout=10))
            time.sleep(0.05)
        wait_load(load, LOAD_BOUND)
        for _ in range(100):  # until coordd has dropped it all and rounds flow
            if livez(url) < 0.5 and ranks.run(1)[0] < 0.5:
                break
        assert proc.proc is not None and proc.proc.poll() is None
        assert len(ranks.run(5)) == 5
        after = settled_rss(gauge)
    print(
        f"rss {base:.0f} MB -> peak {gauge.peak_rss_mb:.0f} MB, {after:.0f} MB after; slowest "
        f"/livez {slowest:.2f} s"
    )
    assert slowest < LIVEZ_BOUND, "a liveness probe would have failed"
    # over the memory budget (default 64 MB) the sender's connection is shut down before its
    # message is whole, libzmq frees the parts, and the memory is given back (without the
    # guard: 158 MB at the peak, ~100 MB kept)
    assert after < 80, f"coordd kept {after:.0f} MB"
    assert gauge.peak_rss_mb < 300, f"peak RSS {gauge.peak_rss_mb:.0f} MB"


def test_peers_that_never_read_cost_little(coordd, tmp_path: Path) -> None:
    proc = start(coordd, CoorddProcess(4, f"ipc://{tmp_path}/c.sock", ["--log-level", "error"]))
    with HonestRounds(proc.address, 4) as ranks, ProcessGauge(proc.pid) as gauge:
        ranks.run(3)
        base = gauge.rss_mb()
        load = start_load(
            "unread", proc.address, "--peers", "20", "--messages", "10000", "--seconds", "1"
        )
        wait_load(load, LOAD_BOUND)
        assert len(ranks.run(3)) == 3
        time.sleep(1.5)  # coordd may still be answering what was queued
    grew = gauge.peak_rss_mb - base
    print(f"rss {base:.0f} MB -> peak {gauge.peak_rss_mb:.0f} MB (+{grew:.0f})")
    # before: every peer got up to 10,000 queued refusals (~4.4 MB each: ~+88 MB here)
    assert grew < 40, f"20 peers that never read cost {grew:.0f} MB"


def test_half_open_http_connections_cannot_exhaust_descriptors(coordd, tmp_path: Path) -> None:
    """With NOFILE 256, 600 half-open HTTP connections: coordd caps them, a new rank still
    connects over ipc (libzmq aborted on EMFILE in ipc_listener.cpp) and rounds go on."""
    port = free_port()
    proc = limited(
        CoorddProcess(
            2, f"ipc://{tmp_path}/c.sock", ["--log-level", "error", "--metrics-port", str(port)]
        ),
        256,
    )
    start(coordd, proc)
    url = f"http://127.0.0.1:{port}"
    with ProcessGauge(proc.pid) as gauge:
        load = start_load("http", url, "--count", "600", "--seconds", "4")
        time.sleep(2.5)
        try:
            with HonestRounds(proc.address, 2) as ranks:
                assert len(ranks.run(3)) == 3
            assert livez(url) < LIVEZ_BOUND
        finally:
            wait_load(load, LOAD_BOUND)
        assert proc.proc is not None and proc.proc.poll() is None
    assert gauge.peak_fds < 256


def test_connections_that_never_handshake_cannot_lock_ranks_out(
    coordd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tcp+CURVE with NOFILE 512: 1000 key-less connections that never handshake. coordd
    keeps its descriptors under the limit (the oldest strangers are closed over the cap,
    handshakes time out), so it neither spins on EMFILE nor locks a new rank out."""
    keys = tmp_path / "keys"
    write_keypair(str(keys), "coordd")
    write_keypair(str(keys), "rank")
    proc = limited(
        CoorddProcess(
            2,
            "tcp://127.0.0.1:0",
            [
                "--log-level",
                "error",
                "--curve-secret-key",
                str(keys / "coordd.key_secret"),
                "--curve-client-keys",
                str(keys / "rank.key"),
            ],
        ),
        512,
    )
    start(coordd, proc)
    monkeypatch.setenv("COORDD_CURVE_SERVER_KEY", str(keys / "coordd.key"))
    monkeypatch.setenv("COORDD_CURVE_CLIENT_KEY", str(keys / "rank.key_secret"))
    with ProcessGauge(proc.pid) as gauge:
        cpu0 = _cpu_seconds(proc.pid)
        load = start_load("connections", proc.address, "--count", "1000", "--seconds", "4")
        time.sleep(2.0)
        try:
            with HonestRounds(proc.address, 2) as ranks:
                assert len(ranks.run(3)) == 3
        finally:
            wait_load(load, LOAD_BOUND)
        cpu = _cpu_seconds(proc.pid) - cpu0
        assert proc.proc is not None and proc.proc.poll() is None
    # A burst of accepts can touch the 512 limit for a moment before coordd's guard closes the
    # strangers (libzmq's tcp listener survives EMFILE); what a rank depends on is asserted
    # above (it registered and decided during the flood) and below (coordd did not spin).
    print(f"peak fds {gauge.peak_fds} of 512; coordd cpu {cpu:.2f} s over ~4 s")
    assert cpu < 3.5, f"coordd spent {cpu:.1f} s of CPU in ~4 s (spinning)"


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().split(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.timeout(90)
def test_measure_reports_the_spread_over_runs() -> None:
    """A burst's peak and the honest p50 vary from run to run on busy cores (the garbage
    peak was 65-149 MB over 10 runs before the memory budget's own-level fix): `measure
    --runs N` prints each run and the spread, which is what a target is judged on."""
    import sys

    argv = ["measure", "--dp", "2", "--only", "http", "--runs", "2"]
    out = subprocess.run(
        [sys.executable, "-m", "coordd.tools.load", *argv],
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert sum(line.startswith("http ") and line.endswith("alive") for line in lines) == 2
    assert any(line.startswith("http         2 runs: ratio ") for line in lines), out.stdout
