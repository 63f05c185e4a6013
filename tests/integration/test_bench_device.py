"""`coordd bench` with the device methods: the device path and its bare collective in one run,
their ratio printed; the NCCL pair runs where there is a GPU per rank, else is skipped with
the reason (no timing assertion)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from coordd.tools.bench.methods import nccl_unavailable


@pytest.mark.timeout(240)
def test_a_bench_run_prints_the_device_path_against_its_bare_collective(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "coordd", "bench", "--dp", "2", "--rounds", "40",
            "--blocks", "2", "--warmup", "2", "--overlap-rounds", "0", "--engine-steps", "0",
            "--crosshost-dp", "none", "--methods", "device-gloo,gloo-bare,device-nccl,nccl-bare",
            "--json", str(out)]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(out.read_text())
    rows = {r["method"]: r for r in results["latency"]}
    for name in ("device-gloo", "gloo-bare"):
        assert rows[name]["completed"] == rows[name]["rounds"] == 40, rows[name]
        assert rows[name]["checked"] > 0 and rows[name]["mismatches"] == 0, rows[name]
    ratios = run.stdout.split("Ratios of p50 (same run)")[1]
    assert "device-gloo/gloo-bare" in ratios.splitlines()[1], ratios
    assert "device path p50 / bare gloo all_reduce p50" in run.stdout
    why = nccl_unavailable(2)
    if why is not None:
        assert f"skipping device-nccl: {why}" in run.stderr
        assert "device-nccl" not in rows
    else:
        assert "device-nccl/nccl-bare" in ratios
