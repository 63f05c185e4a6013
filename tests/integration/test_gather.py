"""Gather rounds end to end: a real coordd process and real rank processes with either client.

Every rank gathers a short int vector per sync (as the vLLM plugin gathers each rank's column of
vLLM's sync tensor), interleaved with policy rounds in one seq sequence; every rank must get
exactly the rows all ranks sent. A rank that skips a gather must get every rank the same
`StepMismatch` naming it, at once (no rank waits for the step timeout).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import time
from typing import Any

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordd.cli.status import fetch
from coordd.client import AsyncCoordClient, CoordClient
from coordd.proto.errors import CoordError, StepMismatch
from coordd.proto.messages import (
    INT64_MAX,
    INT64_MIN,
    GatherReport,
    StepDecision,
    StepFailed,
    StepKind,
    StepReport,
    error_from_failure,
    failure_message,
)
from coordd.testing import RawRank
from tests.integration.clients import CLIENT_KINDS
from tests.integration.scrape import free_port

SITES = ("vllm.gpu.dp_utils", "vllm.v1.dp_utils", "vllm.parallel.sync_dp_state")
ROUNDS = 60
#: Far above the time a mismatch takes to reach every rank: a rank that waited this long hung.
WAIT_S = 20.0


class Sync(msgspec.Struct, array_like=True):
    """One sync of a rank's script and what came back (rows or a decision, or the error)."""

    seq: int
    site: str  # "" for a policy round
    rows: list[list[int]] | None = None
    decision: StepDecision | None = None
    failure: StepFailed | None = None


class RankRun(msgspec.Struct):
    rank: int
    syncs: list[Sync]
    error: str | None = None


def is_gather(seed: int, i: int) -> bool:
    """Every rank's script: mostly gathers, with a policy round now and then."""
    return random.Random(f"{seed}:{i}:kind").random() < 0.75


def site_for(seed: int, i: int) -> str:
    return random.Random(f"{seed}:{i}:site").choice(SITES)


def values_for(seed: int, rank: int, i: int) -> list[int]:
    """Rank `rank`'s values at sync `i`: the same length on every rank, any int64."""
    length = random.Random(f"{seed}:{i}:len").choice([0, 1, 2, 7, 7, 7, 30])
    rng = random.Random(f"{seed}:{rank}:{i}:values")
    pool = [0, 1, -1, INT64_MIN, INT64_MAX, rank]
    return [rng.choice(pool) if rng.random() < 0.3 else rng.randrange(-(2**40), 2**40)
            for _ in range(length)]


def report_for(rank: int, i: int) -> StepReport:
    tokens = 8 * (rank + 1) + i
    return StepReport(num_tokens=tokens, num_tokens_padded=tokens + rank, has_unfinished=True)


def _failure(error: CoordError, seq: int) -> StepFailed:
    return failure_message(error, epoch=0, seq=seq, kind=StepKind.GATHER)


# -- the rank processes ---------------------------------------------------------------------------


def _script_sync(client: CoordClient, rank: int, dp: int, seed: int) -> list[Sync]:
    syncs: list[Sync] = []
    for i in range(ROUNDS):
        seq = client.session.next_seq
        try:
            if is_gather(seed, i):
                site = site_for(seed, i)
                pending = client.start_gather(site, values_for(seed, rank, i))
                syncs.append(Sync(seq, site, rows=pending.wait(WAIT_S)))
            else:
                decision = client.start(report_for(rank, i)).wait(WAIT_S)
                syncs.append(Sync(seq, "", decision=decision))
        except CoordError as error:
            syncs.append(Sync(seq, "", failure=_failure(error, seq)))
            break
    return syncs


async def _script_aio(client: AsyncCoordClient, rank: int, dp: int, seed: int) -> list[Sync]:
    syncs: list[Sync] = []
    for i in range(ROUNDS):
        seq = client.session.next_seq
        try:
            if is_gather(seed, i):
                site = site_for(seed, i)
                rows = await client.gather(site, values_for(seed, rank, i), timeout=WAIT_S)
                syncs.append(Sync(seq, site, rows=rows))
            else:
                decision = await client.coordinate(report_for(rank, i), timeout=WAIT_S)
                syncs.append(Sync(seq, "", decision=decision))
        except CoordError as error:
            syncs.append(Sync(seq, "", failure=_failure(error, seq)))
            break
    return syncs


def _skip_sync(client: CoordClient, rank: int, dp: int, next_sync: str, sent: Any) -> list[Sync]:
    """Sync 0 is a gather at SITES[0]; the last rank skips it and runs its next sync instead,
    after every other rank's report reached coordd (a ping after the report proves it: one
    connection's frames are handled in order)."""
    seq = client.session.next_seq
    try:
        if rank < dp - 1:
            pending = client.start_gather(SITES[0], [rank, 1, 2])
            client.ping(timeout=WAIT_S)
            sent.release()
            return [Sync(seq, SITES[0], rows=pending.wait(WAIT_S))]
        for _ in range(dp - 1):
            if not sent.acquire(timeout=WAIT_S):
                raise TimeoutError("the other ranks never reported")
        if next_sync == "gather":
            return [Sync(seq, SITES[1], rows=client.gather(SITES[1], [rank, 1, 2], WAIT_S))]
        return [Sync(seq, "", decision=client.start(report_for(rank, 0)).wait(WAIT_S))]
    except CoordError as error:
        return [Sync(seq, "", failure=_failure(error, seq))]


async def _skip_aio(client: AsyncCoordClient, rank: int, dp: int, next_sync: str,
                    sent: Any) -> list[Sync]:
    seq = client.session.next_seq
    try:
        if rank < dp - 1:
            future = client.start_gather(SITES[0], [rank, 1, 2])
            await client.ping(timeout=WAIT_S)
            sent.release()
            return [Sync(seq, SITES[0], rows=await client.wait(future, WAIT_S))]
        for _ in range(dp - 1):
            if not await asyncio.to_thread(sent.acquire, True, WAIT_S):
                raise TimeoutError("the other ranks never reported")
        if next_sync == "gather":
            return [Sync(seq, SITES[1], rows=await client.gather(SITES[1], [rank, 1, 2], WAIT_S))]
        return [Sync(seq, "", decision=await client.coordinate(report_for(rank, 0),
                                                               timeout=WAIT_S))]
    except CoordError as error:
        return [Sync(seq, "", failure=_failure(error, seq))]


def run_rank(address: str, rank: int, dp: int, client: str, scenario: str, seed: int,
             sent: Any, out: mp.Queue) -> None:
    syncs: list[Sync] = []
    error = None
    options = dict(dp_rank=rank, dp_size=dp, config_fingerprint="gather")
    try:
        if client == "aio":
            async def main() -> list[Sync]:
                async with AsyncCoordClient(address, **options) as c:
                    await c.connect(timeout=20)
                    if scenario == "script":
                        return await _script_aio(c, rank, dp, seed)
                    return await _skip_aio(c, rank, dp, scenario, sent)

            syncs = asyncio.run(main())
        else:
            with CoordClient(address, **options) as c:
                c.connect(timeout=20)
                if scenario == "script":
                    syncs = _script_sync(c, rank, dp, seed)
                else:
                    syncs = _skip_sync(c, rank, dp, scenario, sent)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    out.put(msgspec.msgpack.encode(RankRun(rank, syncs, error)))


def run_ranks(address: str, dp: int, client: str, scenario: str, seed: int = 0,
              timeout: float = 90.0) -> list[RankRun]:
    """`dp` rank processes to completion; every process is ended before this returns."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    sent = ctx.Semaphore(0)
    procs = [ctx.Process(target=run_rank, daemon=True,
                         args=(address, r, dp, client, scenario, seed, sent, out))
             for r in range(dp)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout
        runs = [msgspec.msgpack.decode(out.get(timeout=max(0.1, deadline - time.monotonic())),
                                       type=RankRun) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return sorted(runs, key=lambda run: run.rank)


# -- the tests ------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("client", CLIENT_KINDS)
@pytest.mark.parametrize("dp", [2, 4])
def test_every_rank_gets_every_ranks_values(start_coordd, dp: int, client: str) -> None:
    coordd = start_coordd(dp, "ipc")
    runs = run_ranks(coordd.address, dp, client, "script", seed=dp)
    for run in runs:
        assert run.error is None, f"rank {run.rank}: {run.error}"
        assert len(run.syncs) == ROUNDS, f"rank {run.rank} ran {len(run.syncs)} syncs"
        failed = [s.failure for s in run.syncs if s.failure is not None]
        assert not failed, f"rank {run.rank}: {failed}"
    gathers = 0
    for i in range(ROUNDS):
        syncs = [run.syncs[i] for run in runs]
        assert len({s.seq for s in syncs}) == 1, f"sync {i}: ranks disagree on seq"
        if is_gather(dp, i):
            gathers += 1
            expected = [values_for(dp, r, i) for r in range(dp)]
            for rank, sync in enumerate(syncs):
                assert sync.rows == expected, f"sync {i}, rank {rank}: rows differ"
        else:
            assert all(s.decision == syncs[0].decision for s in syncs), f"sync {i}"
    assert 0 < gathers < ROUNDS  # both round families ran in the one seq sequence


@pytest.mark.timeout(120)
@pytest.mark.parametrize("next_sync", ["gather", "forward"])
@pytest.mark.parametrize("client", CLIENT_KINDS)
@pytest.mark.parametrize("dp", [2, 4])
def test_a_rank_that_skips_a_gather_is_named_to_every_rank(start_coordd, dp: int, client: str,
                                                           next_sync: str) -> None:
    coordd = start_coordd(dp, "ipc", "--step-timeout", "60")
    began = time.monotonic()
    runs = run_ranks(coordd.address, dp, client, next_sync)
    elapsed = time.monotonic() - began
    got_kind = f"gather:{SITES[1]}" if next_sync == "gather" else "forward"
    expected = StepMismatch(dp - 1, 0, f"gather:{SITES[0]}", 0, got_kind)
    for run in runs:
        assert run.error is None, f"rank {run.rank}: {run.error}"
        [sync] = run.syncs
        assert sync.failure is not None, f"rank {run.rank} got {sync}"
        assert error_from_failure(sync.failure) == expected, f"rank {run.rank}"
    assert elapsed < 45, f"the mismatch took {elapsed:.1f}s to reach every rank"


def rounds_counted(url: str, kind: str, outcome: str) -> float:
    """coordd_rounds_total for `kind` and `outcome`, over every group."""
    code, body = fetch(url + "/metrics", 5)
    assert code == 200
    return sum(sample.value
               for family in text_string_to_metric_families(body.decode())
               for sample in family.samples
               if sample.name == "coordd_rounds_total" and sample.labels.get("kind") == kind
               and sample.labels.get("outcome") == outcome)


@pytest.mark.timeout(120)
def test_metrics_count_gather_rounds(start_coordd) -> None:
    port = free_port()
    coordd = start_coordd(2, "ipc", "--metrics-port", str(port))
    runs = run_ranks(coordd.address, 2, "sync", "script", seed=2)
    assert all(run.error is None and len(run.syncs) == ROUNDS for run in runs)
    gathers = sum(is_gather(2, i) for i in range(ROUNDS))
    url = f"http://127.0.0.1:{port}"
    assert rounds_counted(url, "gather", "decided") == gathers
    assert rounds_counted(url, "forward", "decided") == ROUNDS - gathers


@pytest.mark.timeout(60)
def test_a_raw_rank_gathers_and_skips_as_the_kit_lets_it(start_coordd) -> None:
    """coordd.testing's RawRank sends gather reports by hand: a round, then a skipped seq."""
    coordd = start_coordd(2, "ipc")
    ranks = [RawRank(coordd.address, dp_rank=r, dp_size=2) for r in range(2)]
    try:
        for rank in ranks:
            rank.register(timeout=10)
        for rank in ranks:
            rank.send(rank.stamp(GatherReport(site=SITES[0], values=[rank.dp_rank]),
                                 StepKind.GATHER))
            rank.advance()
        assert [rank.wait_gather(0, timeout=10).rows for rank in ranks] == [[[0], [1]]] * 2
        ranks[0].send(ranks[0].stamp(GatherReport(site=SITES[0], values=[5]), StepKind.GATHER))
        ranks[1].send(ranks[1].stamp(GatherReport(site=SITES[0], values=[5]), StepKind.GATHER,
                                     seq=2))
        expected = StepMismatch(1, 1, f"gather:{SITES[0]}", 2, f"gather:{SITES[0]}")
        for rank in ranks:
            with pytest.raises(StepMismatch) as info:
                rank.wait_gather(1, timeout=10)
            assert info.value == expected
    finally:
        for rank in ranks:
            rank.close()
