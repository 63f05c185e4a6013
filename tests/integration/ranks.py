"""Rank processes for the integration tests: real clients in real processes, logging what they saw.

Results travel back to the test as msgpack bytes (msgspec), never pickled protocol objects.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Sequence

import msgspec

from coordd.client.sync import CoordClient
from coordd.proto.errors import CoordError
from coordd.proto.messages import StepDecision, StepKind, StepReport
from coordd.tools.chaos.workload import kind_for, report_for


class RoundLog(msgspec.Struct, array_like=True):
    seq: int
    kind: StepKind
    report: StepReport
    decision: StepDecision | None
    error: str | None
    latency: float
    exposed: float


class RankLog(msgspec.Struct):
    rank: int
    rounds: list[RoundLog]
    error: str | None = None


def run_rank(
    address: str,
    rank: int,
    dp: int,
    rounds: int,
    seed: int,
    work_s: float,
    out: mp.Queue,
    client_args: Sequence[tuple[str, object]] = (),
) -> None:
    logs: list[RoundLog] = []
    error = None
    try:
        with CoordClient(address, dp_rank=rank, dp_size=dp, config_fingerprint="it",
                         **dict(client_args)) as client:  # type: ignore[arg-type]
            welcome = client.connect(timeout=20)
            for seq in range(welcome.next_seq, welcome.next_seq + rounds):
                report = report_for(seed, rank, seq)
                kind = kind_for(seed, seq)
                t0 = time.perf_counter()
                pending = client.start(report, kind)
                if work_s:
                    time.sleep(work_s)
                t1 = time.perf_counter()
                try:
                    decision, err = pending.wait(timeout=30), None
                except CoordError as exc:
                    decision, err = None, f"{type(exc).__name__}: {exc}"
                t2 = time.perf_counter()
                logs.append(RoundLog(pending.seq, kind, report, decision, err, t2 - t0, t2 - t1))
                if err:
                    break
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    out.put(msgspec.msgpack.encode(RankLog(rank, logs, error)))


def run_ranks(
    address: str, dp: int, rounds: int, *, seed: int = 0, work_s: float = 0.0,
    timeout: float = 120.0,
) -> list[RankLog]:
    """Run `dp` rank processes to completion; every process is ended before this returns."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [
        ctx.Process(target=run_rank, args=(address, r, dp, rounds, seed, work_s, out), daemon=True)
        for r in range(dp)
    ]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout
        logs = [
            msgspec.msgpack.decode(out.get(timeout=max(0.1, deadline - time.monotonic())),
                                   type=RankLog)
            for _ in procs
        ]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return sorted(logs, key=lambda log: log.rank)
