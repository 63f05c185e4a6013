"""Issue 21, 6: no libzmq abort on descriptor exhaustion. At a hard NOFILE limit, a reconnect
storm (processes of DEALERs that send nothing; libzmq reconnects each 100 ms after coordd
closes it) made coordd's I/O thread accept until EMFILE, and libzmq 4.3.5 aborts there
(`Too many open files (src/ipc_listener.cpp:297)`): SIGABRT after 1.2-6.4 s at 1024. Now
coordd refuses at the listener before the descriptors run out (`DescriptorWatch`), and a
rank connects once the storm is over."""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from coordd.client import CoordClient
from coordd.testing.process import READY
from coordd.tools.load import start_load

needs_prlimit = pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit")


@needs_prlimit
def test_a_reconnect_storm_at_a_low_nofile_does_not_abort_coordd(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/c.sock"
    proc = subprocess.Popen(
        ["prlimit", "--nofile=256:256", sys.executable, "-m", "coordd", "serve", "--dp", "1",
         "--bind", address, "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    err = storm_then_connect(proc, address)
    assert "Too many open files" not in err, err[-500:]
    assert "new connections refused at the listener" in err, err[-500:]


def storm_then_connect(proc: subprocess.Popen[str], address: str) -> str:
    """Once coordd `proc` is ready: 3 x 120 reconnecting DEALERs for 5 s, then coordd must be
    alive and a rank connect. Ends coordd either way; its stderr."""
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(READY), line
        storm = start_load("storm", address, "--peers", "3", "--count", "120", "--seconds", "5")
        deadline = time.monotonic() + 7
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        storm.terminate()
        storm.wait(10)
        assert proc.poll() is None, died(proc)
        with CoordClient(address, dp_rank=0, dp_size=1) as client:
            client.connect(timeout=15)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    return err


def died(proc: subprocess.Popen[str]) -> str:
    """What a coordd that exited said last."""
    _, err = proc.communicate(timeout=10)
    return f"coordd exited with {proc.returncode}: {err[-1500:]}"


def _nofile(limit: int) -> Callable[[], None]:
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return preexec


@pytest.mark.timeout(60)
def test_a_reconnect_storm_over_tcp_at_a_low_nofile_pauses_the_listener() -> None:
    """Over tcp libzmq's listener accepted until EMFILE too (then spins on it, and what else
    coordd opens fails): before, at NOFILE 256, 3 x 120 DEALERs took coordd to the limit.
    Now the watch filters the listener past 1/2 (no new connection completes) until below
    1/4; coordd lives and a rank connects after."""
    from coordd.tools.load import ProcessGauge
    from tests.integration.scrape import free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "coordd", "serve", "--dp", "1", "--bind", address, "--insecure",
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_nofile(256),
    )
    with ProcessGauge(proc.pid, interval=0.005) as gauge:
        err = storm_then_connect(proc, address)
    # The listener was paused (the old code has no pause: this fails there), coordd lived
    # and a rank connected after. The peak is not asserted: the watch decides from a Python
    # thread, and the kernel's accept queue (100) still comes in after it, so at NOFILE 256
    # it is 143-195 on a quiet box and touched 256 once in a fresh-clone CI run (libzmq's
    # tcp listener lives through EMFILE; the ipc storm test above is the abort's)
    print(f"peak {gauge.peak_fds} descriptors of 256")
    assert "new connections refused at the listener" in err, err[-500:]


@needs_prlimit
@pytest.mark.timeout(90)
def test_the_pause_lifts_after_a_storm_while_ranks_hold_descriptors(tmp_path: Path) -> None:
    """Issue 28, defect 2, scaled to NOFILE 256 (pause past 128, resume below 64 with no rank):
    56 registered ranks keep coordd over 64 descriptors. Before, one reconnect storm paused
    the listener for good: the 57th rank's connect() failed ("no socket file ... coordd is not
    running there") while coordd was up and deciding. Now the marks move up by what the ranks
    hold, and the rank connects once the storm is over. The storm (2 x 80) fits in the ~170
    descriptors left above the ranks': 3 x 120 could reach the limit before a starved watch
    looked (libzmq's abort, 1 run in 10 under three CPU hogs); the first test is the abort's."""
    dp = 57
    address = f"ipc://{tmp_path}/c.sock"
    proc = subprocess.Popen(
        ["prlimit", "--nofile=256:256", sys.executable, "-m", "coordd", "serve", "--dp",
         str(dp), "--bind", address, "--log-level", "info"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    ranks: list[CoordClient] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(READY), line
        for r in range(dp - 1):
            ranks.append(CoordClient(address, dp_rank=r, dp_size=dp))
            ranks[-1].connect(timeout=15)
        storm = start_load("storm", address, "--peers", "2", "--count", "80", "--seconds", "4")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        storm.terminate()
        storm.wait(10)
        assert proc.poll() is None, died(proc)
        with CoordClient(address, dp_rank=dp - 1, dp_size=dp) as last:
            last.connect(timeout=15)
    finally:
        for client in ranks:
            client.close()
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "new connections refused at the listener" in err, err[-800:]
    assert "new connections accepted again" in err, err[-800:]
