"""The vLLM plugin's exit paths, without vLLM: two rank processes use the plugin's Exchange (the
object every patched sync goes through) against a real coordd, then end. A normal exit (a
plain interpreter exit: atexit; a multiprocessing child: its exit finalizers, as vLLM's engine
cores and workers end) says Goodbye, and the group is stopped, not failed; a killed rank is
lost, and the group failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("torch")

from coordd.testing import CoorddProcess
from tests.integration.scrape import free_port, metric_value

RANK = r"""
import multiprocessing, os, sys, time
import torch
from coordd.vllm.enable import PluginSettings
from coordd.vllm.exchange import Exchange
import rank_sync
from coordd.vllm.groups import GroupIdentity

EXCHANGES = []  # the plugin holds its Exchange for the process's life (patches._state)

def run(rank, address, how):
    ex = Exchange(PluginSettings(address, connect_timeout=60, sync_timeout=60, fallback=False))
    EXCHANGES.append(ex)
    ident = GroupIdentity("dp-tp0-pp0", rank, 2, "fp")
    for _ in range(3):
        t = torch.zeros(2, 2, dtype=torch.int32)
        t[:, rank] = rank + 1
        rank_sync.sync(ex, t, ident)
    assert t.tolist() == [[1, 2], [1, 2]], t
    print("synced", flush=True)
    if how == "kill":
        time.sleep(0.5)
        os._exit(9)  # no Goodbye: what a SIGKILL leaves

if __name__ == "__main__":
    rank, address, how = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if how == "child":  # the work in a multiprocessing child, which skips atexit
        p = multiprocessing.get_context("spawn").Process(target=run, args=(rank, address, how))
        p.start()
        p.join(60)
        sys.exit(p.exitcode)
    run(rank, address, how)
"""


RANK_SYNC = """
from coordd.vllm.exchange import ReduceOp


def sync(ex, t, ident):
    assert ex.sync_(t, ReduceOp.SUM, ident, True)
"""


def _groups(port: int) -> list[dict[str, object]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as response:
        return json.loads(response.read().decode())["groups"]  # type: ignore[no-any-return]


def _states(port: int) -> dict[str, str]:
    return {str(g["name"]): str(g["state"]) for g in _groups(port)}


def _failure(port: int) -> object:
    """The group's failure as /status gives it (why, which ranks), for an assertion's text."""
    return [g.get("failure") for g in _groups(port)]


def _until(port: int, want: str, timeout: float = 15.0) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    states = _states(port)
    while states.get("dp-tp0-pp0") != want and time.monotonic() < deadline:
        time.sleep(0.1)
        states = _states(port)
    return states


@pytest.mark.parametrize("how", ["exit", "child", "kill"])
def test_a_normal_exit_says_goodbye_and_a_kill_is_lost(tmp_path: Path, how: str) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    # the sync's caller in a module of its own: its label is the same in a multiprocessing
    # child (whose main script is __mp_main__) as in a plain process (__main__)
    (tmp_path / "rank_sync.py").write_text(RANK_SYNC)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    with CoorddProcess(2, f"ipc://{tmp_path}/c.sock", ["--metrics-port", str(port),
                                                      "--log-level", "error"]) as coordd:
        ranks = [
            subprocess.Popen([sys.executable, str(script), str(r), coordd.address,
                              how if r == 1 else "exit"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for r in range(2)
        ]
        try:
            outs = [p.communicate(timeout=150) for p in ranks]
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        for out, err in outs:
            assert "synced" in out, err[-2000:]
        if how == "kill":
            # rank 0 said Goodbye first or rank 1 vanished first: either way a fault
            states = _until(port, "failed")
            assert states == {"dp-tp0-pp0": "failed"}, states
            assert metric_value(port, 'coordd_group_stops_total{group="dp-tp0-pp0"}') == 0
        else:
            states = _until(port, "stopped")
            assert states == {"dp-tp0-pp0": "stopped"}, (states, _failure(port), outs)
            assert metric_value(port, 'coordd_departures_total{group="dp-tp0-pp0"}') == 2
            assert metric_value(port, 'coordd_group_failed{group="dp-tp0-pp0"}') == 0
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
                assert 'coordd_faults_total{group="dp-tp0-pp0"' not in page.read().decode()
