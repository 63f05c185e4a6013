"""coordd is lost and comes back under a running group: the ranks switch paths at one round.

Real rank processes in a real gloo group over 127.0.0.1, each with a `FallbackClient`, and real
coordd processes (or the dying fake) on an ipc socket, with 1 s heartbeat timeouts. Every test
holds: every rank switched at the same rounds (the same list of switches on every rank), every
answer equals the policy over the run's seeded reports (`fallback_ranks.reference`), the ranks'
answers of one round are identical (seq and epoch too), and every wait is bounded.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

pytest.importorskip("torch")

from coordd.testing import CoorddProcess
from coordd.testing.dying_coordd import DyingCoordd
from tests.integration.fallback_ranks import (
    Plan,
    RankLog,
    reference,
    run_rank,
    same_decision,
)

pytestmark = pytest.mark.timeout(180)

COORDD_ARGS = ["--log-level", "error", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1",
               "--step-timeout", "10"]
DEADLINE_S = 60.0


class Group:
    """The rank processes of one run, and their progress as the test sees it."""

    def __init__(self, plan: Plan) -> None:
        ctx = mp.get_context("spawn")
        self.plan = plan
        self.out: mp.Queue = ctx.Queue()
        self.progress = ctx.Array("i", plan.world, lock=False)
        self.paths = ctx.Array("i", plan.world, lock=False)
        data = msgspec.msgpack.encode(plan)
        self.procs = [ctx.Process(target=run_rank, daemon=True,
                                  args=(r, data, self.progress, self.paths, self.out))
                      for r in range(plan.world)]
        for proc in self.procs:
            proc.start()

    def until(self, what: str, check: Callable[[list[int], list[int]], bool]) -> float:
        """Wait (bounded) until `check(progress, paths)`; the time it held."""
        deadline = time.monotonic() + DEADLINE_S
        while not check(list(self.progress), list(self.paths)):
            assert time.monotonic() < deadline, f"not {what} within {DEADLINE_S}s"
            assert all(p.is_alive() or p.exitcode == 0 for p in self.procs), "a rank died"
            time.sleep(0.01)
        return time.monotonic()

    def past(self, rounds: int) -> float:
        return self.until(f"past round {rounds}", lambda done, _: min(done) >= rounds)

    def on_device(self, returns: int = 0) -> float:
        return self.until("on the device path", lambda _, paths: all(
            p & 1 and p >> 1 == returns for p in paths))

    def back(self, returns: int) -> float:
        return self.until(f"back on coordd {returns}x", lambda _, paths: all(
            not p & 1 and p >> 1 == returns for p in paths))

    def logs(self, count: int | None = None) -> list[RankLog]:
        deadline = time.monotonic() + DEADLINE_S
        logs = [msgspec.msgpack.decode(self.out.get(timeout=max(0.1, deadline - time.monotonic())),
                                       type=RankLog) for _ in range(count or self.plan.world)]
        return sorted(logs, key=lambda log: log.rank)

    def close(self) -> None:
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Callable[..., Group]]:
    made: list[Group] = []

    def make(address: str, world: int = 2, **fields: Any) -> Group:
        seed = int(os.environ.get("COORDD_TEST_SEED", random.randrange(2**31)))
        print(f"seed {seed}")
        plan = Plan(world=world, store=str(tmp_path / f"store{len(made)}"), address=address,
                    seed=seed, **fields)
        made.append(Group(plan))
        return made[-1]

    yield make
    for g in made:
        g.close()


@pytest.fixture
def coordd(tmp_path: Path) -> Iterator[Callable[..., CoorddProcess]]:
    started: list[CoorddProcess] = []

    def start(dp: int = 2) -> CoorddProcess:
        proc = CoorddProcess(dp, f"ipc://{tmp_path}/coordd.sock", COORDD_ARGS)
        started.append(proc)
        return proc.start()

    yield start
    for proc in started:
        proc.signal(signal.SIGCONT)
        proc.stop()


def check(plan: Plan, logs: list[RankLog], errors: bool = False) -> list[tuple[int, str]]:
    """Every answer is the reference, the ranks' answers of a round are identical, and every
    rank switched at the same rounds (returned, as (round, path) pairs)."""
    switches = [[(at, path) for at, path, _, _ in log.switches] for log in logs]
    assert all(s == switches[0] for s in switches), f"ranks switched apart: {switches}"
    if not errors:
        for log in logs:
            assert log.error is None, f"rank {log.rank}: {log.error_type}: {log.error}"
        assert len({len(log.rounds) for log in logs}) == 1
    for log in logs:
        for i, rnd in enumerate(log.rounds):
            assert rnd.index == i
            if rnd.error is not None:
                continue
            want = reference(plan, i)
            if isinstance(want, list):
                assert rnd.rows == want, f"rank {log.rank} round {i}: {rnd.rows} != {want}"
            else:
                assert rnd.decision is not None and same_decision(rnd.decision, want), (
                    f"rank {log.rank} round {i}: {rnd.decision} != {want}")
    for rounds in zip(*(log.rounds for log in logs), strict=False):
        assert all(r == rounds[0] for r in rounds if r.error is None), rounds
    return switches[0]


def running(coordd: Any, group: Any, **fields: Any) -> tuple[CoorddProcess, Group]:
    """coordd, and a group on it past its first 20 rounds."""
    proc = coordd()
    g = group(proc.address, **fields)
    g.past(20)
    return proc, g


def paths_of(log: RankLog) -> list[str]:
    return [rnd.path for rnd in log.rounds]


def test_coordd_killed_with_a_round_open(coordd: Any, group: Any) -> None:
    proc, g = running(coordd, group, rounds=150)
    killed = time.monotonic()
    proc.signal(signal.SIGKILL)
    logs = g.logs()
    switches = check(g.plan, logs)
    assert [path for _, path in switches] == ["device"]
    at = switches[0][0]
    for log in logs:
        assert paths_of(log) == ["coordd"] * at + ["device"] * (len(log.rounds) - at)
    last = max(log.switches[0][3] for log in logs)
    print(f"kill -> every rank on the device path: {last - killed:.2f}s")


def test_coordd_restarted_on_the_same_address(coordd: Any, group: Any) -> None:
    first, g = running(coordd, group, rounds=60, returns=1)
    first.signal(signal.SIGKILL)
    g.on_device()
    second = coordd()
    restarted = time.monotonic()
    logs = g.logs()
    switches = check(g.plan, logs)
    assert [path for _, path in switches] == ["device", "coordd"]
    (left, _), (back, _) = switches
    epochs = {rnd.decision.epoch for rnd in logs[0].rounds[back:] if rnd.decision}
    before = {rnd.decision.epoch for rnd in logs[0].rounds[:left] if rnd.decision}
    assert len(epochs) == 1 and epochs.isdisjoint(before | {0})
    assert paths_of(logs[0])[left:back] == ["device"] * (back - left)
    print(f"restart -> every rank back on coordd: {logs[0].switches[1][3] - restarted:.2f}s")
    second.stop()


def test_coordd_paused_then_resumed_never_decides_for_ranks_that_moved_on(
    coordd: Any, group: Any
) -> None:
    proc, g = running(coordd, group, rounds=60, returns=1)
    proc.signal(signal.SIGSTOP)
    stopped = time.monotonic()
    g.on_device()
    proc.signal(signal.SIGCONT)
    logs = g.logs()
    switches = check(g.plan, logs)
    assert [path for _, path in switches] == ["device", "coordd"]
    (left, _), (back, _) = switches
    old = {rnd.decision.epoch for rnd in logs[0].rounds[:left] if rnd.decision}
    new = {rnd.decision.epoch for rnd in logs[0].rounds[back:] if rnd.decision}
    assert len(old) == 1 and len(new) == 1 and min(new) > max(old)  # the epoch fences it
    print(f"SIGSTOP -> every rank on the device path: "
          f"{max(log.switches[0][3] for log in logs) - stopped:.2f}s")


def test_a_rank_coordd_refuses_at_connect_fails_every_rank_at_once(
    coordd: Any, group: Any
) -> None:
    proc = coordd()
    g = group(proc.address, rounds=10, other_fingerprint=True)
    logs = g.logs()
    types = sorted(str(log.error_type) for log in logs)
    assert types == ["CoordinatorUnavailable", "Rejected"], logs
    refused = next(log.rank for log in logs if log.error_type == "Rejected")
    other = next(log for log in logs if log.error_type == "CoordinatorUnavailable")
    assert other.error == f"coordd refused rank {refused}" and other.rounds == []
    assert all(log.then == log.error_type for log in logs)  # and stays so until connect()


def test_a_group_that_starts_without_coordd_joins_it_when_it_appears(
    tmp_path: Path, group: Any
) -> None:
    address = f"ipc://{tmp_path}/coordd.sock"
    g = group(address, rounds=30, returns=1)
    g.on_device()
    proc = CoorddProcess(2, address, COORDD_ARGS).start()
    try:
        logs = g.logs()
    finally:
        proc.stop()
    switches = check(g.plan, logs)
    assert switches[0] == (0, "device") and [path for _, path in switches] == ["device", "coordd"]
    assert paths_of(logs[0])[: switches[1][0]] == ["device"] * switches[1][0]


@pytest.mark.parametrize(("world", "answered"), [(2, [0]), (3, [0, 2]), (3, [1])])
def test_coordd_died_after_answering_some_ranks(
    tmp_path: Path, group: Any, world: int, answered: list[int]
) -> None:
    fake = DyingCoordd(world, f"ipc://{tmp_path}/fake.sock", die_at=12, answer_to=answered)
    fake.start()
    try:
        g = group(fake.address, world=world, rounds=40)
        logs = g.logs()
    finally:
        fake.stop()
    switches = check(g.plan, logs)
    assert switches == [(13, "device")]  # round 12 was answered: the group lacks 13
    twelve = [log.rounds[12] for log in logs]
    assert all(r.path == "coordd" for r in twelve) and twelve[0].decision is not None
    assert twelve[0].decision.epoch != 0  # coordd's decision, taken by the ranks behind
    assert all(r == twelve[0] for r in twelve)


def test_flapping_coordd_returns_at_a_bounded_rate(coordd: Any, group: Any) -> None:
    proc, g = running(coordd, group, rounds=40, returns=3)
    for flap in range(3):
        proc.signal(signal.SIGKILL)
        g.on_device(returns=flap)
        proc = coordd()
        if flap < 2:
            g.back(flap + 1)
    logs = g.logs()
    switches = check(g.plan, logs)
    assert [path for _, path in switches] == ["device", "coordd"] * 3
    times = [t for _, _, _, t in logs[0].switches]
    away = [back - left for left, back in zip(times[::2], times[1::2], strict=True)]
    # the rejoin back-off doubles while coordd flaps: at least 1, 2, 4 s away
    assert all(a >= wait for a, wait in zip(away, [1.0, 2.0, 4.0], strict=True)), away


def test_rank_lost_on_the_device_path_is_an_error_not_a_decision(
    coordd: Any, group: Any
) -> None:
    proc, g = running(coordd, group, rounds=4000, exit_after=10)
    proc.signal(signal.SIGKILL)
    logs = g.logs(count=1)
    (log,) = logs
    assert log.rank == 0 and log.error_type in ("RankLost", "StepTimeout"), log.error
    check(g.plan, logs, errors=True)
    assert log.rounds[-1].error is not None and log.rounds[-1].path == "device"


def test_a_ranks_own_fault_is_its_typed_error_not_a_switch(coordd: Any, group: Any) -> None:
    proc = coordd()
    g = group(proc.address, rounds=40, mismatch_at=15)
    logs = g.logs()
    check(g.plan, logs, errors=True)
    for log in logs:
        assert log.switches == [] and log.error_type == "StepMismatch", log.error
        assert log.then == "StepMismatch"
        assert "rank 1 reported" in (log.error or "") and len(log.rounds) == 16


class CutProxy:
    """A unix-socket forwarder in front of coordd for one rank; `cut()` closes its link for
    good (the rank loses coordd, the others still reach it)."""

    def __init__(self, listen: str, upstream: str) -> None:
        self.upstream = upstream
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(listen)
        self.listener.listen()
        self.links: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            up.connect(self.upstream)
            self.links += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def cut(self) -> None:
        self.listener.close()
        for link in self.links:
            with contextlib.suppress(OSError):
                link.shutdown(socket.SHUT_RDWR)
            link.close()


def test_a_rank_cut_from_a_coordd_the_others_reach_ends_in_typed_errors(
    tmp_path: Path, coordd: Any, group: Any
) -> None:
    """No safe switch exists (the others still decide on coordd): coordd names the cut rank
    lost to the others, the cut rank's settlement finds no group; no rank goes on alone."""
    proc = coordd()
    upstream = proc.address.removeprefix("ipc://")
    proxy = CutProxy(str(tmp_path / "proxy.sock"), upstream)
    g = group(proc.address, rounds=4000, addresses=[proc.address, f"ipc://{tmp_path}/proxy.sock"])
    g.past(20)
    proxy.cut()
    logs = g.logs()
    check(g.plan, logs, errors=True)
    assert [log.error_type for log in logs] == ["RankLost", "CoordinatorUnavailable"], logs
    assert [log.then for log in logs] == ["RankLost", "CoordinatorUnavailable"]
    assert "rank(s) [1] lost" in (logs[0].error or "")
    for log in logs:
        assert log.switches == [] and set(paths_of(log)) == {"coordd"}
