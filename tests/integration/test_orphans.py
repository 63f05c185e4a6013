"""A test run killed from outside (SIGKILL: no finally, no fixture teardown) leaves no coordd
or rank process behind: `coordd.testing` ties its children's lives to their parent.

Before: the coordd a `CoorddProcess` started, and the ranks of a chaos run, lived on (in their
own sessions) after the test process was killed, holding their sockets and CPU.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from coordd.testing.process import die_with_parent

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux"),
]

PARENT = textwrap.dedent(
    """
    import subprocess, sys, threading, time
    from coordd.testing.process import CoorddProcess, die_with_parent

    coordd = CoorddProcess(1, sys.argv[1]).start()
    print(coordd.pid, flush=True)
    # a rank started from a worker thread that outlives it, as the chaos runner does
    def start_rank() -> None:
        rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                start_new_session=True,
                                preexec_fn=die_with_parent(any_thread=True))
        print(rank.pid, flush=True)
        time.sleep(120)
    threading.Thread(target=start_rank, daemon=True).start()
    time.sleep(120)
    """
)


def gone(pid: int) -> bool:
    """No such process, or a zombie (dead, waiting for whoever inherited it to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.02)
    return gone(pid)


def test_coordd_and_ranks_die_with_a_test_process_killed_from_outside(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, f"ipc://{tmp_path}/c.sock"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    children: list[int] = []
    try:
        assert parent.stdout is not None
        for _ in range(2):
            line = parent.stdout.readline()
            assert line.strip().isdigit(), f"the parent did not start its children: {line!r}"
            children.append(int(line))
        assert not any(gone(pid) for pid in children)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        left = [pid for pid in children if not wait_gone(pid, 5.0)]
        assert not left, f"children outlived their SIGKILLed parent: {left}"
    finally:
        for pid in children:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
        if parent.stdout is not None:
            parent.stdout.close()


def test_a_child_started_from_a_passing_thread_is_not_tied_to_it_by_default() -> None:
    """The kernel signals the child when the *thread* that forked it ends: from a thread
    other than the main one, only a caller that says its thread outlives the child gets it."""
    seen: list[object] = []
    thread = threading.Thread(
        target=lambda: seen.extend([die_with_parent(), die_with_parent(any_thread=True)])
    )
    thread.start()
    thread.join(10)
    assert seen[0] is None and callable(seen[1])
    assert callable(die_with_parent())
