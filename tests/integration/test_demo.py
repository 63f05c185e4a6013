"""`coordd demo`: the README's main job runs, ends every process, and verifies the agreement."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_demo(*args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordd", "demo", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.mark.timeout(180)
def test_demo_runs_engine_like_ranks_and_verifies_every_round() -> None:
    done = run_demo("--dp", "3", "--rounds", "120")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "coordd demo: dp=3, 120 steps (239 rounds: forward + drafter)" in out
    assert "every rank got the same decision in all 239 rounds, equal to the policy: yes" in out
    for line in ("round latency", "exposed wait", "padded tokens", "micro-batching"):
        assert line in out
    assert "what it means: a rank sends its report as soon as its batch is known" in out
    assert "\x1b[" not in out  # not a terminal: plain lines, no escape codes


@pytest.mark.timeout(180)
def test_demo_bounded_by_seconds_stops_by_pause_consensus() -> None:
    done = run_demo("--dp", "2", "--seconds", "1", "--step-ms", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "equal to the policy: yes" in done.stdout


def test_demo_needs_two_ranks() -> None:
    done = run_demo("--dp", "1", timeout=60)
    assert done.returncode != 0 and "--dp must be >= 2" in done.stderr
