"""`coordd bench` end to end with a handful of rounds: every method completes every round.

No timing assertion (the machines are shared and noisy): only that the run is complete, the
decisions were right, and the figures are positive and ordered.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from coordd.tools.bench.methods import ALL_METHODS

ROUNDS = 20
OVERLAP_ROUNDS = 10
SCALE_ROUNDS = 10


def _positive_ordered(row: dict, *keys: str) -> None:
    values = [row[k] for k in keys]
    assert all(v is not None and v > 0 for v in values), (keys, row)
    assert values == sorted(values), (keys, row)


@pytest.mark.timeout(420)
def test_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    argv = [
        sys.executable,
        "-m",
        "coordd",
        "bench",
        "--dp",
        "2",
        "--rounds",
        str(ROUNDS),
        "--blocks",
        "2",
        "--warmup",
        "2",
        "--overlap-rounds",
        str(OVERLAP_ROUNDS),
        "--work",
        "2",
        "--scale-dp",
        "4",
        "--scale-procs",
        "2",
        "--scale-rounds",
        str(SCALE_ROUNDS),
        "--json",
        str(out),
        *(["--plot", str(plot)] if has_matplotlib else []),
    ]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "\nTargets\n" in run.stdout
    assert "issue" not in run.stdout.lower()  # no tracker references in what users read

    results = json.loads(out.read_text())
    methods = results["methods"]
    assert set(methods) | set(results["skipped"]) == set(ALL_METHODS)
    assert {"coordd-ipc", "coordd-tcp", "floor"} <= set(methods)
    if importlib.util.find_spec("torch") is not None:
        assert "gloo" in methods

    latency = {row["method"]: row for row in results["latency"]}
    assert set(latency) == set(methods)
    for row in latency.values():
        assert row["dp"] == 2
        assert row["completed"] == row["rounds"] == ROUNDS, row
        assert row["checked"] > 0 and row["mismatches"] == 0, row
        _positive_ordered(row, "p50_us", "p90_us", "p99_us", "max_us")
        assert row["mean_us"] > 0 and row["cpu_us_per_round"] > 0, row

    overlap = results["overlap"]
    cases = {(r["method"], r["variant"]) for r in overlap}
    assert cases == {(m, v) for m in methods for v in ("sleep", "spin")}
    for row in overlap:
        assert row["completed"] == row["rounds"] == OVERLAP_ROUNDS, row
        assert row["mismatches"] == 0, row
        assert row["work_multiple"] == 2 and row["work_us"] > 0, row
        _positive_ordered(row, "exposed_p50_us", "exposed_p99_us")
        _positive_ordered(row, "p50_us", "p99_us")
        assert row["sync_p50_us"] == latency[row["method"]]["p50_us"]

    assert sorted(r["client"] for r in results["scale"]) == ["aio", "lean"]
    for scale in results["scale"]:
        assert scale["dp"] == 4 and scale["procs"] == 2
        assert scale["completed"] == scale["rounds"] == SCALE_ROUNDS, scale
        assert scale["checked"] > 0 and scale["mismatches"] == 0, scale
        _positive_ordered(scale, "p50_us", "p90_us", "p99_us")
        assert scale["coordd_cpu_us_per_round"] > 0 and scale["coordd_rss_mb"] > 0, scale

    assert len(results["targets"]) >= 6
    assert all(t["met"] in (True, False, None) for t in results["targets"])
    if has_matplotlib:
        assert plot.stat().st_size > 10_000
