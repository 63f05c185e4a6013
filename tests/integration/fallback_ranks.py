"""Rank processes for the fallback tests: a real gloo group, a `FallbackClient` each, seeded rounds.

Each rank runs the same rounds (`report_for`/`kind_for` over the run's seed; every 7th round a
gather) until it has run `rounds` and returned to coordd `returns` times, or `max_rounds`: both
are agreed (a return happens at one round on every rank), so every rank stops at the same
round. Progress goes to shared arrays the test reads to time its faults; the log comes back as
msgpack.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import time
from typing import Any

import msgspec

from coordd.proto.errors import CoordError
from coordd.proto.messages import StepDecision, StepKind, StepReport
from coordd.proto.policy import decide
from coordd.tools.chaos.seeded_reports import kind_for, report_for

GATHER_SITE = "it.fallback"
WAIT_S = 15.0


class Plan(msgspec.Struct, frozen=True):
    world: int
    store: str
    address: str
    seed: int
    rounds: int
    work_s: float = 0.01
    returns: int = 0
    max_rounds: int = 4000
    #: The last rank reports the wrong kind at this round (a rank's own fault).
    mismatch_at: int = -1
    #: The last rank exits this many rounds after the group left coordd (lost on the device path).
    exit_after: int = -1
    heartbeat_timeout: float = 1.0
    #: The last rank's config fingerprint differs from the others' (coordd refuses one side).
    other_fingerprint: bool = False
    #: Where each rank finds coordd, if not all at `address` (a rank behind a proxy).
    addresses: list[str] = []


class RoundLog(msgspec.Struct, array_like=True):
    index: int
    path: str
    decision: StepDecision | None
    rows: list[list[int]] | None
    error: str | None


class RankLog(msgspec.Struct):
    rank: int
    rounds: list[RoundLog]
    switches: list[tuple[int, str, str, float]]
    error: str | None = None
    error_type: str | None = None
    #: What a start() after the error raised.
    then: str | None = None


def is_gather(index: int) -> bool:
    return index % 7 == 3


def values_for(rank: int, index: int) -> list[int]:
    return [index, rank, index * rank + 1]


def reference(plan: Plan, index: int) -> StepDecision | list[list[int]]:
    """What coordd decides for round `index` of the run: the policy over the seeded reports."""
    if is_gather(index):
        return [values_for(rank, index) for rank in range(plan.world)]
    reports = [report_for(plan.seed, rank, index) for rank in range(plan.world)]
    return decide(reports, kind=kind_for(plan.seed, index))


def same_decision(got: StepDecision, want: StepDecision) -> bool:
    """Equal but for the path's own seq and epoch."""
    strip = {"seq": 0, "epoch": 0}
    return msgspec.structs.replace(got, **strip) == msgspec.structs.replace(want, **strip)


def run_rank(rank: int, data: bytes, progress: Any, paths: Any, out: mp.Queue) -> None:
    import torch.distributed as dist

    from coordd.client.fallback import DEVICE, FallbackClient

    plan = msgspec.msgpack.decode(data, type=Plan)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{plan.store}", rank=rank,
                            world_size=plan.world, timeout=datetime.timedelta(seconds=60))
    log = RankLog(rank, [], [])
    address = plan.addresses[rank] if plan.addresses else plan.address
    client = FallbackClient(address, dp_rank=rank, dp_size=plan.world, wait_timeout=WAIT_S,
                            switch_timeout=WAIT_S, heartbeat_interval=0.2,
                            heartbeat_timeout=plan.heartbeat_timeout,
                            config_fingerprint=str(plan.other_fingerprint and rank > 0))
    try:
        client.connect(timeout=10)
        index = 0
        while index < plan.max_rounds:
            back = sum(1 for switch in client.switches if switch[1] != DEVICE)
            if index >= plan.rounds and back >= plan.returns:
                break
            if (plan.exit_after >= 0 and rank == plan.world - 1 and client.path == DEVICE
                    and index == client.switched_at + plan.exit_after):
                os._exit(3)
            _round(plan, rank, index, client, log)
            progress[rank] = index + 1
            paths[rank] = int(client.path == DEVICE) + 2 * back
            index += 1
    except CoordError as exc:
        log.error, log.error_type = f"{exc}", type(exc).__name__
        try:  # a failed client stays failed: the next round raises at once
            client.start(report_for(plan.seed, rank, 0))
            log.then = "nothing"
        except CoordError as again:
            log.then = type(again).__name__
    except Exception as exc:
        log.error, log.error_type = f"{exc!r}", "unexpected"
    finally:
        log.switches = list(client.switches)
        client.close()
    out.put(msgspec.msgpack.encode(log))
    dist.destroy_process_group()


def _round(plan: Plan, rank: int, index: int, client: Any, log: RankLog) -> None:
    pending: Any
    if is_gather(index):
        pending = client.start_gather(GATHER_SITE, values_for(rank, index))
    else:
        report: StepReport = report_for(plan.seed, rank, index)
        kind = kind_for(plan.seed, index)
        if index == plan.mismatch_at and rank == plan.world - 1:
            kind = StepKind.DRAFT if kind is not StepKind.DRAFT else StepKind.FORWARD
        pending = client.start(report, kind)
    time.sleep(plan.work_s)  # the round is open while the rank works
    try:
        answer = pending.wait(WAIT_S)
    except CoordError as exc:
        log.rounds.append(RoundLog(index, pending.path, None, None, f"{type(exc).__name__}"))
        raise
    if is_gather(index):
        log.rounds.append(RoundLog(index, pending.path, None, answer, None))
    else:
        log.rounds.append(RoundLog(index, pending.path, answer, None, None))
