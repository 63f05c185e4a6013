"""Rank processes for the integration tests: real clients in real processes, logging what they saw.

Results travel back to the test as msgpack bytes (msgspec), never pickled protocol objects.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from collections.abc import Sequence

import msgspec

from client.sync import CoordClient
from proto.errors import CoordError
from proto.messages import StepDecision, StepKind, StepReport


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


def random_report(rng: random.Random) -> StepReport:
    tokens = rng.choice([0, rng.randint(1, 16), rng.randint(1, 300), rng.randint(256, 8192)])
    padded = tokens + rng.choice([0, 0, rng.randint(0, 64)])
    return StepReport(
        num_tokens=tokens,
        num_tokens_padded=padded,
        want_ubatch=rng.random() < 0.7,
        cudagraph_mode=rng.choice([0, 1, 2]),
        has_unfinished=rng.random() < 0.8,
        want_pause=rng.random() < 0.1,
    )


def kind_for(seq: int, seed: int) -> StepKind:
    """All ranks derive each round's kind from the shared seed, as an engine's step loop does."""
    return random.Random(seed * 1_000_003 + seq).choice(
        [StepKind.FORWARD, StepKind.FORWARD, StepKind.DRAFT, StepKind.STATE]
    )


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
    rng = random.Random(seed * 7919 + rank)
    logs: list[RoundLog] = []
    error = None
    try:
        with CoordClient(address, dp_rank=rank, dp_size=dp, config_fingerprint="it",
                         **dict(client_args)) as client:  # type: ignore[arg-type]
            welcome = client.connect(timeout=20)
            for seq in range(welcome.next_seq, welcome.next_seq + rounds):
                report = random_report(rng)
                kind = kind_for(seq, seed)
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
