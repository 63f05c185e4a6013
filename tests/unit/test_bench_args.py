"""`coordd bench`'s options: what --quick, --dp and --rounds make every phase run, and which
targets a run was not asked for (pure argparse and the report; nothing is measured)."""

from __future__ import annotations

import argparse

import pytest

from coordd.tools.bench import QUICK, add_arguments, report, resolve
from tests.unit.bench_rows import latency_row


def _parse(*argv: str) -> tuple[argparse.Namespace, dict]:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(list(argv))
    return args, resolve(args)


def test_the_full_run_keeps_its_defaults() -> None:
    args, asked = _parse()
    assert args.dp == [2, 4, 8] and args.rounds == 2000 and args.overlap_rounds == 400
    assert args.crosshost_dp == [2, 4, 8] and args.scale_dp == [16, 64, 256]
    assert args.crosshost_rounds == 500 and args.scale_rounds == 300 and args.engine_steps == 200
    assert asked["overlap"] and asked["scale_dp"] == [16, 64, 256]


def test_dp_and_rounds_are_followed_by_every_phase() -> None:
    args, asked = _parse("--dp", "2,4", "--rounds", "200")
    assert args.dp == [2, 4] and args.crosshost_dp == [2, 4]
    assert args.scale_dp == []  # simulated ranks only when asked for with --scale-dp
    assert args.overlap_rounds == args.crosshost_rounds == args.scale_rounds == 200
    assert asked["dp"] == [2, 4] and asked["scale_dp"] == []
    # a phase's own option still wins
    args, _ = _parse("--dp", "2", "--rounds", "200", "--overlap-rounds", "0", "--scale-dp", "16")
    assert args.overlap_rounds == 0 and args.scale_dp == [16] and args.crosshost_rounds == 200


def test_quick_is_small_and_any_option_given_wins() -> None:
    args, asked = _parse("--quick")
    assert args.dp == QUICK["dp"] and args.rounds == QUICK["rounds"]
    assert args.variants == ["sleep"] and args.work == [2.0] and args.crosshost_dp == []
    assert args.scale_dp == [16] and args.scale_clients == ["lean"] and asked["quick"]
    args, _ = _parse("--quick", "--dp", "2,4", "--rounds", "100")
    assert args.dp == [2, 4] and args.rounds == 100 and args.overlap_rounds == 100
    assert args.crosshost_dp == []  # quick: no across-namespace runs unless asked


def test_a_target_the_run_was_not_asked_for_says_so() -> None:
    _, asked = _parse("--dp", "2", "--methods", "coordd-ipc,vllm-cpu-all-reduce,vllm-plugin")
    results = {
        "meta": {"asked": asked},
        "latency": [
            latency_row("coordd-ipc", 200.0),
            latency_row("vllm-cpu-all-reduce", 250.0),
            latency_row("vllm-plugin", 210.0),
        ],
    }
    tgts = report.targets(results)
    by = {(t["target"], t["where"]): t for t in tgts}
    plugin = by[("vLLM plugin sync p50 / vLLM cpu_all_reduce_ p50", "dp=2")]
    assert plugin["met"] is True and abs(plugin["value"] - 0.84) < 1e-9
    reported = by[("vLLM plugin sync p50 / coordd ipc policy round p50", "dp=2")]
    assert reported["met"] is None and abs(reported["value"] - 1.05) < 1e-9
    text = report.render({**results, "targets": tgts})
    # dp=4 and dp=8, the hub, the floor and the scale phase were not asked for: none "not run"
    assert "not run" not in text and "not asked" in text
    # asked for and missing all the same: "not run"
    del results["latency"][2]
    text = report.render({**results, "targets": report.targets(results)})
    assert "not run" in text


def test_the_cpu_and_the_other_sizes_are_also_ratios_to_the_hub() -> None:
    """Issue 37: the CPU targets were microseconds only, which a loaded host moves; each is
    also printed against the hub's same thread in the same run, and the round's ratio to the
    hub at dp 2 and 16 beside dp=8's target."""
    _, asked = _parse("--dp", "2,8,16", "--methods", "coordd-ipc,zmq-hub")
    ipc8, hub8 = latency_row("coordd-ipc", 300.0, 8), latency_row("zmq-hub", 200.0, 8)
    ipc8["cpu_us_per_round_by_thread"] = {"ranks main": 240.0, "server main": 96.0}
    hub8["cpu_us_per_round_by_thread"] = {"ranks main": 120.0, "server main": 64.0}
    results = {
        "meta": {"asked": asked},
        "latency": [
            latency_row("coordd-ipc", 110.0),
            latency_row("zmq-hub", 100.0),
            ipc8,
            hub8,
            latency_row("coordd-ipc", 330.0, 16),
            latency_row("zmq-hub", 300.0, 16),
        ],
    }
    by = {(t["target"], t["where"]): t for t in report.targets(results)}
    assert by[("coordd ipc round p50 / pyzmq hub p50", "dp=8")]["value"] == 1.5
    for dp in (2, 16):
        row = by[("coordd ipc round p50 / pyzmq hub p50", f"dp={dp}")]
        assert row["met"] is None and abs(row["value"] - 1.1) < 1e-9
    rank = by[("rank main thread CPU / the pyzmq hub rank's, per round", "dp=8")]
    server = by[("coordd main thread CPU / the pyzmq hub's, per round", "dp=8")]
    assert rank["value"] == 2.0 and server["value"] == 1.5 and rank["met"] is None
    assert by[("rank main thread CPU per rank per round", "dp=8")]["value"] == 30.0


def test_quick_help_says_what_quick_runs() -> None:
    """Issue 30: `--help` said --quick runs 300 rounds; it ran 200."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    (quick,) = [a for a in p._actions if a.dest == "quick"]
    assert quick.help is not None
    assert f"{QUICK['rounds']} rounds" in quick.help and "300" not in quick.help
    assert f"dp={QUICK['dp'][0]}" in quick.help and f"dp={QUICK['scale_dp'][0]}" in quick.help
    args, _ = _parse("--quick")
    assert args.rounds == QUICK["rounds"]


def test_the_last_line_is_a_verdict() -> None:
    """Issue 30: `coordd bench --quick` ended on a table with no verdict. Its last line now
    says what was compared, which is faster and by how much, and how to measure vLLM."""
    _, asked = _parse("--quick")
    results = {
        "meta": {"asked": asked},
        "latency": [
            latency_row("coordd-ipc", 200.0),
            latency_row("zmq-hub", 160.0),
            latency_row("floor", 50.0),
        ],
        "skipped": {"vllm-cpu-all-reduce": "vLLM is not importable in this Python"},
    }
    last = report.render({**results, "targets": report.targets(results)}).splitlines()[-1]
    assert last.startswith("verdict: dp=2, round p50")
    assert "coordd ipc 200 us is 1.25x slower than the bare pyzmq hub (160 us)" in last
    assert "4.00x slower than the raw-socket floor (50 us)" in last
    assert "against vLLM: not measured (vLLM is not importable in this Python); to measure" in last
    assert "VLLM_TARGET_DEVICE=cpu <vLLM's venv>/bin/python -m coordd bench --quick" in last
    results["latency"] += [latency_row("vllm-cpu-all-reduce", 400.0), latency_row("gloo", 800.0)]
    last = report.render({**results, "targets": report.targets(results)}).splitlines()[-1]
    assert "2.00x faster than vLLM's cpu_all_reduce_ (400 us)" in last
    assert "4.00x faster than gloo all_reduce (800 us)" in last and "not measured" not in last
    engine_only = report.render({"meta": {"asked": asked}, "engine": [], "latency": []})
    assert engine_only.splitlines()[-1].startswith("verdict: no coordd round latency")


def test_torchs_numpy_warning_does_not_open_the_bench() -> None:
    """Issue 30: three "Failed to initialize NumPy" warnings (torch without NumPy) opened
    `coordd bench --quick`: once in the bench and once in each rank process, which all
    import coordd.tools.bench first."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed here: no warning to silence")
    code = "import coordd.tools.bench.rank, torch, torch.distributed"
    done = subprocess.run(
        [sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "NumPy" not in done.stderr, done.stderr


def test_the_vllm_engine_method_says_what_it_needs_where_vllm_is_missing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`coordd bench --vllm-engine SETS` runs real engines through coordd.tools.vllm_e2e; in a
    venv without vLLM it measures nothing and says why (exit 2), in one line."""
    import importlib.util

    from coordd.tools.bench import run

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is here: the method would run real engines")
    args, _ = _parse("--vllm-engine", "1")
    assert run(args) == 2
    assert "vllm is not importable" in capsys.readouterr().err
