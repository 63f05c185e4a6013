"""Rank processes for the integration tests: real clients in real processes, logging what they saw.

Results travel back to the test as msgpack bytes (msgspec), never pickled protocol objects.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

import msgspec

from coordd.client import AsyncCoordClient, CoordClient
from coordd.proto.errors import CoordError
from coordd.proto.messages import StepDecision, StepKind, StepReport
from coordd.tools.chaos.seeded_reports import kind_for, report_for


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
    client: str = "sync",
) -> None:
    """Run `rounds` rounds with the blocking ("sync") or the asyncio ("aio") client."""
    logs: list[RoundLog] = []
    error = None
    try:
        if client == "aio":
            asyncio.run(_aio_rounds(address, rank, dp, rounds, seed, work_s, logs))
        else:
            _sync_rounds(address, rank, dp, rounds, seed, work_s, logs)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    out.put(msgspec.msgpack.encode(RankLog(rank, logs, error)))


def _sync_rounds(address: str, rank: int, dp: int, rounds: int, seed: int, work_s: float,
                 logs: list[RoundLog]) -> None:
    with CoordClient(address, dp_rank=rank, dp_size=dp, config_fingerprint="it") as client:
        welcome = client.connect(timeout=20)
        for seq in range(welcome.next_seq, welcome.next_seq + rounds):
            report, kind = report_for(seed, rank, seq), kind_for(seed, seq)
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


async def _aio_rounds(address: str, rank: int, dp: int, rounds: int, seed: int, work_s: float,
                      logs: list[RoundLog]) -> None:
    """The same rounds; the 'GPU work' blocks the loop, as an engine's step does."""
    async with AsyncCoordClient(address, dp_rank=rank, dp_size=dp,
                                config_fingerprint="it") as client:
        welcome = await client.connect(timeout=20)
        for seq in range(welcome.next_seq, welcome.next_seq + rounds):
            report, kind = report_for(seed, rank, seq), kind_for(seed, seq)
            t0 = time.perf_counter()
            future = client.start(report, kind)
            if work_s:
                time.sleep(work_s)
            t1 = time.perf_counter()
            try:
                decision, err = await client.wait(future, timeout=30), None
            except CoordError as exc:
                decision, err = None, f"{type(exc).__name__}: {exc}"
            t2 = time.perf_counter()
            logs.append(RoundLog(seq, kind, report, decision, err, t2 - t0, t2 - t1))
            if err:
                break


def run_ranks(
    address: str, dp: int, rounds: int, *, seed: int = 0, work_s: float = 0.0,
    timeout: float = 120.0, client: str = "sync",
) -> list[RankLog]:
    """Run `dp` rank processes (each with the `client` kind: "sync" or "aio") to completion;
    every process is ended before this returns."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [
        ctx.Process(target=run_rank, args=(address, r, dp, rounds, seed, work_s, out, client),
                    daemon=True)
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
