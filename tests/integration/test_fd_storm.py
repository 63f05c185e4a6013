"""Issue 21, 6: no libzmq abort on descriptor exhaustion. At a hard NOFILE limit, a reconnect
storm (processes of DEALERs that send nothing; libzmq reconnects each 100 ms after coordd
closes it) made coordd's I/O thread accept until EMFILE, and libzmq 4.3.5 aborts there
(`Too many open files (src/ipc_listener.cpp:297)`): SIGABRT after 1.2-6.4 s at 1024. Now
coordd refuses at the listener before the descriptors run out (`DescriptorWatch`), and a
rank connects once the storm is over."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordd.client import CoordClient
from coordd.testing.process import READY
from coordd.tools.load import start_load

pytestmark = pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit")


def test_a_reconnect_storm_at_a_low_nofile_does_not_abort_coordd(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/c.sock"
    proc = subprocess.Popen(
        ["prlimit", "--nofile=256:256", sys.executable, "-m", "coordd", "serve", "--dp", "1",
         "--bind", address, "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
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
        assert proc.poll() is None, f"coordd exited with {proc.returncode}"
        with CoordClient(address, dp_rank=0, dp_size=1) as client:
            client.connect(timeout=15)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "Too many open files" not in err, err[-500:]
    assert "new connections refused at the listener" in err, err[-500:]
