"""`coordd bench`'s device methods: which run where, and the device-path/bare ratio rows
(nothing is measured here; `tests/integration/test_bench_device.py` runs them)."""

from __future__ import annotations

import importlib.util

import pytest

from coordd.tools.bench import methods as bench_methods
from coordd.tools.bench import report, targets
from coordd.tools.bench.methods import (
    DEVICE,
    DEVICE_NCCL,
    GLOO_BARE,
    NCCL_BARE,
    NCCL_METHODS,
    nccl_unavailable,
)
from coordd.tools.bench.rank_phases import available_methods, methods_at
from tests.unit.bench_rows import latency_row

HAS_TORCH = importlib.util.find_spec("torch") is not None


def _cuda() -> bool:
    if not HAS_TORCH:
        return False
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.skipif(_cuda(), reason="this host has CUDA: the NCCL methods may run")
def test_nccl_methods_are_skipped_with_the_reason_where_there_is_no_cuda() -> None:
    chosen, skipped = available_methods([DEVICE, GLOO_BARE, DEVICE_NCCL, NCCL_BARE])
    assert chosen == ([DEVICE, GLOO_BARE] if HAS_TORCH else [])
    why = "no CUDA device here" if HAS_TORCH else "torch is not installed"
    assert set(skipped) >= set(NCCL_METHODS)
    assert all(skipped[m].startswith(why) for m in NCCL_METHODS), skipped
    assert nccl_unavailable(1) == skipped[DEVICE_NCCL]


def test_nccl_methods_need_a_gpu_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 2 GPUs, dp=2 runs them and dp=4 skips them (NCCL: one rank per GPU), saying so."""

    def two_gpus(dp: int | None = None) -> str | None:
        return None if dp is None or dp <= 2 else f"dp={dp} needs {dp} CUDA devices"

    monkeypatch.setattr("coordd.tools.bench.rank_phases.nccl_unavailable", two_gpus)
    asked = ["coordd-ipc", DEVICE_NCCL, NCCL_BARE]
    assert methods_at(2, asked) == (asked, {})
    run, skipped = methods_at(4, asked)
    assert run == ["coordd-ipc"]
    assert skipped == {m: "dp=4 needs 4 CUDA devices" for m in NCCL_METHODS}
    # the other methods never look for a GPU
    monkeypatch.setattr("coordd.tools.bench.rank_phases.nccl_unavailable", None)
    assert methods_at(8, ["coordd-ipc", DEVICE, GLOO_BARE]) == (
        ["coordd-ipc", DEVICE, GLOO_BARE],
        {},
    )


def test_each_device_path_is_printed_against_its_bare_collective() -> None:
    latency = [
        latency_row(DEVICE, 180.0),
        latency_row(GLOO_BARE, 120.0),
        latency_row(DEVICE_NCCL, 60.0, dp=1),
        latency_row(NCCL_BARE, 50.0, dp=1),
    ]
    by_dp = {r["dp"]: r for r in targets.ratios(latency)}
    assert by_dp[2] == {"dp": 2, f"{DEVICE}/{GLOO_BARE}": 1.5}
    assert by_dp[1] == {"dp": 1, f"{DEVICE_NCCL}/{NCCL_BARE}": 1.2}
    asked = {"dp": [1, 2], "methods": [DEVICE, GLOO_BARE, DEVICE_NCCL, NCCL_BARE]}
    results = {"meta": {"asked": asked}, "latency": latency}
    tgts = {t["target"]: t for t in report.targets(results)}
    gloo = tgts["device path p50 / bare gloo all_reduce p50"]
    assert (gloo["value"], gloo["limit"], gloo["met"], gloo["where"]) == (1.5, 1.5, True, "dp=2")
    nccl = tgts["device path p50 / bare NCCL all_reduce + host copy p50"]
    assert (nccl["value"], nccl["met"], nccl["where"]) == (1.2, True, "dp=1")
    text = report.render(results)
    assert "device-gloo/gloo-bare" in text and "device-nccl/nccl-bare" in text


def test_every_device_path_has_its_floor_among_the_methods() -> None:
    for path, bare in bench_methods.DEVICE_FLOORS.items():
        assert {path, bare} <= set(bench_methods.ALL_METHODS)
