"""The vLLM plugin's fallback, without vLLM: two rank processes sync through the plugin's
Exchange (what every patched sync calls) with a real gloo group beside it, as a patched vLLM
sync does (`sync_` False: vLLM's own collective, here `all_reduce` on the same group), against a
real coordd that is killed, restarted, stopped and resumed under them.

Every rank checks each round's tensor against the sum it must be, and reports when it left
coordd and came back; the test asserts that no round was lost or wrong, that every rank switched
at the same round both ways, and prints the times for the closing note."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from coordd.client.switch import REJOIN_FIRST
from coordd.testing import CoorddProcess
from coordd.testing.dying_coordd import DyingCoordd
from tests.integration.scrape import free_port, metric_value

#: The coordd round (seq) the dying coordd answers to rank 0 only before it exits.
PARTIAL_AT = 20
#: How many coordds the flapping test starts after the first (each killed once the ranks are
#: back on it, but the last).
FLAPS = 3

RANK = r"""
import json, logging, os, sys, time
import torch
import torch.distributed as dist
from coordd.vllm.enable import PluginSettings
from coordd.vllm.exchange import Exchange, ReduceOp
from coordd.vllm.groups import GroupIdentity

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
rank, address, store, rounds, progress, fallback, early = sys.argv[1:8]
rank, rounds = int(rank), int(rounds)
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
group = dist.new_group([0, 1], backend="gloo")
ex = Exchange(PluginSettings(address, connect_timeout=10, sync_timeout=40,
                             fallback=fallback == "1"))
ident = GroupIdentity("dp-tp0-pp0", rank, 2, "fp")
events, wrong, paths = [], [], []
n = 0


def column(n, r):
    return [(n * 7 + r * 3 + i) % 1000 for i in range(4)]


def on_coordd():
    link = ex._links.get(ident.name)
    return bool(link is not None and link.client is not None)


while True:
    t = torch.zeros(4, 2, dtype=torch.int32)
    t[:, rank] = torch.tensor(column(n, rank), dtype=torch.int32)
    try:
        if early == "1":  # the V1 runner's overlap: the round starts, then work, then the sync
            ex.start_(t, ReduceOp.SUM, ident, True)
            time.sleep(0.002)
        if not ex.sync_(t, ReduceOp.SUM, ident, True, group=group):
            dist.all_reduce(t, group=group)
    except Exception as error:
        events.append(("error", n, time.time(), f"{type(error).__name__}: {error}"))
        break
    want = [[column(n, 0)[i], column(n, 1)[i]] for i in range(4)]
    if t.tolist() != want:
        wrong.append((n, t.tolist(), want))
    path = on_coordd()
    if not paths or paths[-1][1] != path:
        paths.append((n, path, time.time()))
    n += 1
    if rank == 0 and n % 10 == 0:
        with open(progress + ".tmp", "w") as f:
            f.write(str(n))
        os.replace(progress + ".tmp", progress)
    if n >= rounds and n % 8 == 0:
        # past the planned rounds: go on until every rank is on coordd again and the test has
        # no more faults to make (or a cap)
        done = torch.tensor([int(on_coordd() and not os.path.exists(progress + ".hold"))])
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=group)
        if done.item() or n >= 40 * rounds:
            break
    time.sleep(0.01)
link = ex._links.get(ident.name)
out = dict(rank=rank, rounds=n, wrong=wrong[:5], nwrong=len(wrong), events=events,
           paths=paths, coordd_rounds=ex.rounds().get(ident.name, 0),
           switches=link.path.switches if link and link.path else None,
           fallbacks=link.path.fallbacks if link and link.path else None,
           returns=link.path.returns if link and link.path else None)
print("RESULT " + json.dumps(out), flush=True)
ex.close()
"""


def _metric_or_zero(port: int, sample: str) -> float:
    """`sample`'s value, 0 while coordd has no such group yet."""
    try:
        return metric_value(port, sample)
    except AssertionError:
        return 0.0


def _progress(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def _wait_progress(path: Path, at_least: int, ranks: list[subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + 120
    while _progress(path) < at_least:
        assert time.monotonic() < deadline, f"the ranks did not reach round {at_least}"
        assert all(p.poll() is None for p in ranks), "a rank exited early"
        time.sleep(0.02)


def _run(
    tmp_path: Path, rounds: int, fault: str, fallback: bool = True, early: bool = False
) -> tuple[list[dict[str, Any]], list[str], dict[str, Any]]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    address = f"ipc://{tmp_path}/c.sock"
    progress = tmp_path / "progress"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    args = ["--log-level", "error"]
    coordd = CoorddProcess(2, address, args)
    if fault == "partial":
        coordd = DyingCoordd(2, address, die_at=PARTIAL_AT, answer_to=[0])
    if fault != "absent_at_start":
        coordd.start()
    marks: dict[str, Any] = {}
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(r),
                address,
                str(tmp_path / "store"),
                str(rounds),
                str(progress),
                "1" if fallback else "0",
                "1" if early else "0",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    second: CoorddProcess | None = None
    try:
        if fault == "partial":  # it dies by itself at round PARTIAL_AT; a real one comes next
            assert coordd.proc is not None
            coordd.proc.wait(120)
            marks["killed"] = time.time()
            time.sleep(1.5)
            second = CoorddProcess(2, address, args)
            second.start()
            marks["started"] = time.time()
        else:
            _wait_progress(progress, 30, ranks)
        if fault in ("absent_at_start", "partial"):
            if fault == "absent_at_start":
                marks["started"] = time.time()
                coordd.start()
        elif fault in ("kill_restart", "kill"):
            marks["killed"] = time.time()
            coordd.signal(signal.SIGKILL)
            coordd.stop()
            if fault == "kill_restart":
                time.sleep(1.5)
                port = free_port()
                second = CoorddProcess(2, address, [*args, "--metrics-port", str(port)])
                second.start()
                marks["started"] = time.time()
                marks["port"] = port
        elif fault == "flap":
            # killed as soon as both ranks are back on it, three times; the fourth one stays
            hold = Path(str(progress) + ".hold")
            hold.touch()
            marks["killed"] = time.time()
            coordd.signal(signal.SIGKILL)
            coordd.stop()
            for i in range(FLAPS):
                port = free_port()
                second = CoorddProcess(2, address, [*args, "--metrics-port", str(port)])
                second.start()
                marks["started"] = time.time()
                sample = 'coordd_returns_total{group="dp-tp0-pp0"}'
                deadline = time.monotonic() + 120
                while _metric_or_zero(port, sample) < 2:
                    assert time.monotonic() < deadline, "the ranks did not come back"
                    assert all(p.poll() is None for p in ranks), "a rank exited early"
                    time.sleep(0.02)
                if i < FLAPS - 1:
                    second.signal(signal.SIGKILL)
                    second.stop()
            hold.unlink()
        elif fault == "stop_cont":
            marks["killed"] = time.time()
            coordd.signal(signal.SIGSTOP)
            time.sleep(7.0)  # past the clients' 5 s heartbeat timeout
            coordd.signal(signal.SIGCONT)
            marks["started"] = time.time()
        outs = [p.communicate(timeout=240) for p in ranks]
        if "port" in marks:  # what the coordd the ranks came back to says of their return
            port = int(marks["port"])
            sample = '{group="dp-tp0-pp0"}'
            marks["returns"] = metric_value(port, "coordd_returns_total" + sample)
            marks["away_s"] = metric_value(port, "coordd_away_seconds" + sample)
            status = subprocess.run(
                [sys.executable, "-m", "coordd", "status", "--url", f"http://127.0.0.1:{port}"],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
                env=env,
            )
            marks["status"] = status.stdout
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        coordd.signal(signal.SIGCONT)
        coordd.stop()
        if second is not None:
            second.stop()
    results, logs = [], []
    for out, err in outs:
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert lines, err[-3000:]
        results.append(json.loads(lines[-1][len("RESULT ") :]))
        logs.append(err)
    return results, logs, marks


def _report(name: str, results: list[dict[str, Any]], marks: dict[str, Any]) -> None:
    """The figures of the closing note (pytest -s shows them)."""
    for result in results:
        times = {str(path): when for _, path, when in result["paths"]}
        parts = [
            f"rank {result['rank']}: {result['rounds']} rounds, "
            f"{result['coordd_rounds']} on coordd, switches {result['switches']}"
        ]
        if "killed" in marks and "False" in times:
            parts.append(f"fault -> own path {times['False'] - marks['killed']:.2f} s")
        if "started" in marks and "True" in times:
            parts.append(f"coordd back -> on coordd {times['True'] - marks['started']:.2f} s")
        print(f"[fallback {name}] " + "; ".join(parts))


@pytest.mark.timeout(300)
def test_coordd_killed_and_restarted_costs_no_round(tmp_path: Path) -> None:
    results, logs, marks = _run(tmp_path, 200, "kill_restart")
    _report("kill_restart", results, marks)
    for result, log in zip(results, logs, strict=True):
        assert result["events"] == [], (result, log[-3000:])
        assert result["nwrong"] == 0, result["wrong"]
        assert (result["fallbacks"], result["returns"]) == (1, 1), (result, log[-3000:])
        assert log.count("falls back to vLLM's own collective") == 1, log[-3000:]
        assert log.count("is back on coordd") == 1, log[-3000:]
    # one switch round for all: the same rounds, on the same path, on every rank
    assert results[0]["switches"] == results[1]["switches"]
    assert results[0]["rounds"] == results[1]["rounds"]
    assert [way for way, _ in results[0]["switches"]] == ["own", "coordd"]
    # both ranks told the new coordd how long they ran without it: /metrics counts 2 returns
    assert marks["returns"] == 2 and 0 < marks["away_s"] < 60, marks
    assert "back from their own collective (coordd lost or absent): 2 rank" in str(marks["status"])


@pytest.mark.timeout(300)
def test_a_round_started_early_and_in_flight_is_settled_like_any(tmp_path: Path) -> None:
    """Every round starts early (`start_`, the V1 runner's overlap) and is collected at its
    sync; coordd killed and restarted: the same one switch round for all, no round wrong."""
    results, logs, marks = _run(tmp_path, 200, "kill_restart", early=True)
    _report("kill_restart early", results, marks)
    for result, log in zip(results, logs, strict=True):
        assert result["events"] == [], (result, log[-3000:])
        assert result["nwrong"] == 0, result["wrong"]
        assert (result["fallbacks"], result["returns"]) == (1, 1), (result, log[-3000:])
    assert results[0]["switches"] == results[1]["switches"]


@pytest.mark.timeout(300)
def test_a_flapping_coordd_is_followed_no_faster_than_the_back_off(tmp_path: Path) -> None:
    """coordd killed as soon as the ranks are back on it, three times: every fall back and
    return at one round for all ranks, no round wrong, and each spell on vLLM's path at least
    as long as the back-off allows (1, 2, 4 s): the group does not flap as fast as coordd."""
    results, logs, marks = _run(tmp_path, 100, "flap")
    _report("flap", results, marks)
    for result, log in zip(results, logs, strict=True):
        assert result["events"] == [], (result, log[-3000:])
        assert result["nwrong"] == 0, result["wrong"]
        assert (result["fallbacks"], result["returns"]) == (FLAPS, FLAPS), (result, log[-3000:])
        away = [float(s) for s in re.findall(r"after ([\d.]+) s on vLLM's own collective", log)]
        assert len(away) == FLAPS, log[-3000:]
        for spell, seconds in enumerate(away):
            assert seconds >= REJOIN_FIRST * 2**spell - 0.1, away  # the log rounds to 0.1 s
    assert results[0]["switches"] == results[1]["switches"]


@pytest.mark.timeout(300)
def test_a_stopped_coordd_is_left_and_its_resumption_decides_nothing_old(
    tmp_path: Path,
) -> None:
    results, logs, marks = _run(tmp_path, 200, "stop_cont")
    _report("stop_cont", results, marks)
    for result, log in zip(results, logs, strict=True):
        assert result["events"] == [], (result, log[-3000:])
        assert result["nwrong"] == 0, result["wrong"]
        assert result["fallbacks"] >= 1 and result["returns"] >= 1, (result, log[-3000:])
    assert results[0]["switches"] == results[1]["switches"]


@pytest.mark.timeout(300)
def test_a_round_answered_to_one_rank_only_is_taken_from_it(tmp_path: Path) -> None:
    """The dying coordd answers round PARTIAL_AT to rank 0 and exits before rank 1's answer
    leaves: rank 1 takes that round's result from rank 0 over the gloo group, and both run the
    next round on the own path; no round lost, doubled or different."""
    results, logs, marks = _run(tmp_path, 100, "partial")
    _report("partial", results, marks)
    for result, log in zip(results, logs, strict=True):
        assert result["events"] == [], (result, log[-3000:])
        assert result["nwrong"] == 0, result["wrong"]
        assert (result["fallbacks"], result["returns"]) == (1, 1), (result, log[-3000:])
        assert "rank(s) [1] took round" in log and "answer from rank 0" in log, log[-3000:]
    assert results[0]["switches"] == results[1]["switches"]
    assert results[0]["rounds"] == results[1]["rounds"]


@pytest.mark.timeout(300)
def test_a_coordd_absent_at_start_is_joined_when_it_comes(tmp_path: Path) -> None:
    results, logs, marks = _run(tmp_path, 100, "absent_at_start")
    _report("absent_at_start", results, marks)
    for result, log in zip(results, logs, strict=True):
        assert result["events"] == [], (result, log[-3000:])
        assert result["nwrong"] == 0, result["wrong"]
        assert (result["fallbacks"], result["returns"]) == (0, 1), (result, log[-3000:])
        assert log.count("starts on vLLM's own collective") == 1, log[-3000:]
    assert results[0]["switches"] == results[1]["switches"]
    assert [way for way, _ in results[0]["switches"]] == ["own", "coordd"]
    assert results[0]["switches"][0] == ["own", 0]


@pytest.mark.timeout(300)
def test_with_the_fallback_off_coordd_lost_is_still_an_error(tmp_path: Path) -> None:
    results, logs, _ = _run(tmp_path, 10**6, "kill", fallback=False)
    for result, log in zip(results, logs, strict=True):
        assert [e[0] for e in result["events"]] == ["error"], (result, log[-3000:])
        assert result["events"][0][3].startswith("CoordinatorUnavailable"), result
        assert result["nwrong"] == 0
