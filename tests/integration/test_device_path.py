"""The device path and the coordd path, side by side in one run, give the same answers.

A real gloo group of spawned rank processes and a real coordd process: every rank sends each
random report through both paths (`connect_coordinator` builds both clients); the decisions
must be equal per seq across ranks and across paths (the epoch aside) and equal to the policy.
Injected faults (skipped seq, wrong kind reported last and first, invalid report, other
fingerprint or num_ubatches) must raise the same error type with the same culprit and values
on both paths.

The run's seed is random (printed on failure); `COORDD_TEST_SEED=N` repeats one.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.synchronize
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

torch = pytest.importorskip("torch")

from coordd.client._factory import DEVICE_PATH_ENV, connect_coordinator  # noqa: E402
from coordd.proto.errors import CoordError, InvalidReport, Rejected, StepMismatch, StepTimeout  # noqa: E402
from coordd.proto.messages import StepDecision, StepKind, StepReport  # noqa: E402
from coordd.proto.policy import decide  # noqa: E402
from coordd.testing import CoorddProcess  # noqa: E402
from coordd.tools.chaos.seeded_reports import kind_for, random_report  # noqa: E402

FINGERPRINT = "device-it"
WAIT_S = 30.0


class ErrorLog(msgspec.Struct, array_like=True):
    type: str
    attrs: dict[str, str]


def error_log(error: BaseException | None) -> ErrorLog | None:
    if error is None:
        return None
    return ErrorLog(type(error).__name__, {k: repr(v) for k, v in sorted(vars(error).items())})


class PathRound(msgspec.Struct, array_like=True):
    seq: int
    kind: StepKind
    report: StepReport
    device: StepDecision
    coordd: StepDecision


class FaultLog(msgspec.Struct, array_like=True):
    name: str
    seq: int
    kind: StepKind
    device: ErrorLog | None
    coordd: ErrorLog | None
    device_next_seq: int = -1
    coordd_next_seq: int = -1


class RankLog(msgspec.Struct):
    rank: int
    client_types: list[str] = []
    rounds: list[PathRound] = []
    faults: list[FaultLog] = []
    error: str | None = None


class Plan(msgspec.Struct, frozen=True):
    """What every rank of one run does; travels to the spawned ranks as msgpack."""

    world: int
    backend: str
    store: str
    address: str
    config_addresses: list[str]
    seed: int
    num_ubatches: int
    rounds: int
    between: int
    faulty: int
    faults: list[str]


# -- the rank process --------------------------------------------------------------------------


def _init_group(rank: int, plan: Plan) -> None:
    import datetime

    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["NCCL_SOCKET_IFNAME"] = "lo"
    if plan.backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        plan.backend,
        init_method=f"file://{plan.store}",
        rank=rank,
        world_size=plan.world,
        timeout=datetime.timedelta(seconds=60),
    )


def _clients(rank: int, plan: Plan, address: str, **config: object):  # type: ignore[no-untyped-def]
    """Both clients from the one factory: the env var picks the device path, the default coordd."""
    common = dict(dp_rank=rank, dp_size=plan.world, config_fingerprint=FINGERPRINT,
                  num_ubatches=plan.num_ubatches, wait_timeout=WAIT_S)
    common.update(config)
    os.environ[DEVICE_PATH_ENV] = "1"
    device = connect_coordinator(**common)  # type: ignore[arg-type]
    os.environ[DEVICE_PATH_ENV] = "0"
    coordd = connect_coordinator(address, **common)  # type: ignore[arg-type]
    return device, coordd


def _both(device, coordd, report: StepReport, kind: StepKind):  # type: ignore[no-untyped-def]
    """One round through both paths, overlapped: start both, then wait for both."""
    pd, pc = device.start(report, kind), coordd.start(report, kind)
    outcomes: list[object] = []
    for pending in (pd, pc):
        try:
            outcomes.append(pending.wait(timeout=WAIT_S))
        except CoordError as exc:
            outcomes.append(exc)
    return pd.seq, outcomes[0], outcomes[1]


def _random_rounds(device, coordd, rng: random.Random, plan: Plan, n: int,  # type: ignore[no-untyped-def]
                   log: RankLog) -> None:
    for _ in range(n):
        seq = device.session.next_seq
        report = random_report(rng)
        kind = kind_for(plan.seed, seq)
        got_seq, d, c = _both(device, coordd, report, kind)
        if isinstance(d, BaseException) or isinstance(c, BaseException):
            raise AssertionError(f"seq {got_seq}: device={d!r} coordd={c!r}")
        log.rounds.append(PathRound(got_seq, kind, report, d, c))


def _fault_round(rank: int, name: str, device, coordd, rng: random.Random, plan: Plan,  # type: ignore[no-untyped-def]
                 barrier: mp.synchronize.Barrier, log: RankLog) -> None:
    """The faulty rank reports last (so coordd's round already has its kind), with the fault;
    for `wrong_kind_first` it reports first (so its report opens coordd's round): coordd must
    still name it, by the round's evidence, as the device path does."""
    seq = device.session.next_seq
    kind = kind_for(plan.seed, seq)
    report = random_report(rng)
    faulty = rank == plan.faulty
    first = name == "wrong_kind_first"
    if faulty:
        barrier.wait(timeout=60)
        if not first:
            time.sleep(0.3)  # the others' reports reach coordd first
        if name == "skip_seq":
            device.session.next_seq += 1
            coordd.session.next_seq += 1
        elif name in ("wrong_kind", "wrong_kind_first"):
            kind = StepKind.DRAFT if kind is not StepKind.DRAFT else StepKind.FORWARD
        elif name == "invalid":
            report = msgspec.structs.replace(report, cudagraph_mode=7)
    if not faulty:
        barrier.wait(timeout=60)
        if first:
            time.sleep(0.3)  # the faulty rank's report reaches coordd first
    pd, pc = device.start(report, kind), coordd.start(report, kind)
    errors: list[CoordError | None] = []
    for pending in (pd, pc):
        try:
            pending.wait(timeout=WAIT_S)
            errors.append(None)
        except CoordError as exc:
            errors.append(exc)
    fault = FaultLog(name, seq, kind_for(plan.seed, seq), error_log(errors[0]),
                     error_log(errors[1]))
    fault.device_next_seq = device.connect(timeout=WAIT_S).next_seq
    fault.coordd_next_seq = coordd.connect(timeout=WAIT_S).next_seq
    log.faults.append(fault)


def _config_fault(rank: int, name: str, address: str, plan: Plan,
                  barrier: mp.synchronize.Barrier, log: RankLog) -> None:
    """The faulty rank has another fingerprint or num_ubatches; it registers last on coordd."""
    config: dict[str, object] = {}
    if rank == plan.faulty:
        config = ({"config_fingerprint": "other"} if name == "fingerprint"
                  else {"num_ubatches": plan.num_ubatches + 1})
    device, coordd = _clients(rank, plan, address, **config)
    errors: list[CoordError | None] = []
    with device, coordd:
        try:
            device.connect(timeout=WAIT_S)
            errors.append(None)
        except CoordError as exc:
            errors.append(exc)
        if rank == plan.faulty:
            barrier.wait(timeout=60)
        try:
            coordd.connect(timeout=WAIT_S)
            errors.append(None)
        except CoordError as exc:
            errors.append(exc)
        if rank != plan.faulty:
            barrier.wait(timeout=60)
        barrier.wait(timeout=60)  # nobody leaves (failing coordd's group) before it is checked
    log.faults.append(FaultLog(name, -1, StepKind.FORWARD, error_log(errors[0]),
                               error_log(errors[1])))


def run_rank(rank: int, plan_bytes: bytes, barrier: mp.synchronize.Barrier, out: mp.Queue) -> None:
    plan = msgspec.msgpack.decode(plan_bytes, type=Plan)
    log = RankLog(rank)
    try:
        import torch.distributed as dist

        _init_group(rank, plan)
        rng = random.Random(plan.seed * 7919 + rank)
        device, coordd = _clients(rank, plan, plan.address)
        log.client_types = [type(device).__name__, type(coordd).__name__]
        with device, coordd:
            log.client_types.append(str(device.device))
            device.connect(timeout=WAIT_S)
            coordd.connect(timeout=WAIT_S)
            _random_rounds(device, coordd, rng, plan, plan.rounds, log)
            for name in plan.faults:
                if name in ("fingerprint", "num_ubatches"):
                    continue
                _fault_round(rank, name, device, coordd, rng, plan, barrier, log)
                _random_rounds(device, coordd, rng, plan, plan.between, log)
        for name, address in zip(
            [f for f in plan.faults if f in ("fingerprint", "num_ubatches")],
            plan.config_addresses, strict=True,
        ):
            _config_fault(rank, name, address, plan, barrier, log)
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the test, which fails with it
        log.error = f"{type(exc).__name__}: {exc}"
    out.put(msgspec.msgpack.encode(log))


# -- the test side -----------------------------------------------------------------------------


@pytest.fixture
def coordd_procs(tmp_path: Path) -> Iterator[list[CoorddProcess]]:
    """Real coordd processes on ipc:// sockets in tmp_path; all stopped at teardown."""
    procs: list[CoorddProcess] = []
    yield procs
    for proc in procs:
        proc.stop()


def start_coordd(procs: list[CoorddProcess], tmp_path: Path, dp: int, name: str) -> str:
    proc = CoorddProcess(dp, f"ipc://{tmp_path}/{name}.sock", ["--log-level", "warning"])
    procs.append(proc)
    return proc.start().address


def run_group(plan: Plan, timeout: float = 150.0) -> list[RankLog]:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    barrier = ctx.Barrier(plan.world)
    data = msgspec.msgpack.encode(plan)
    procs = [ctx.Process(target=run_rank, args=(r, data, barrier, out), daemon=True)
             for r in range(plan.world)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout
        logs = [msgspec.msgpack.decode(out.get(timeout=max(0.1, deadline - time.monotonic())),
                                       type=RankLog) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return sorted(logs, key=lambda log: log.rank)


def expected_errors(plan: Plan, fault: FaultLog) -> CoordError:
    f, seq, kind = plan.faulty, fault.seq, fault.kind.value
    if fault.name == "skip_seq":
        return StepMismatch(f, seq, kind, seq + 1, kind)
    if fault.name in ("wrong_kind", "wrong_kind_first"):
        other = "draft" if kind != "draft" else "forward"
        return StepMismatch(f, seq, kind, seq, other)
    if fault.name == "invalid":
        return InvalidReport(f, "cudagraph_mode", 7, "0, 1 or 2")
    if fault.name == "fingerprint":
        return Rejected("fingerprint", f"rank {f} has config_fingerprint='other', the group "
                        f"(rank 0) has {FINGERPRINT!r}", expected=FINGERPRINT, got="other")
    nu = plan.num_ubatches
    return Rejected("num_ubatches", f"rank {f} has num_ubatches={nu + 1}, the group (rank 0) "
                    f"has {nu}", expected=str(nu), got=str(nu + 1))


def check_run(plan: Plan, logs: list[RankLog]) -> None:
    where = f"(seed {plan.seed}, dp {plan.world}, {plan.backend})"
    for log in logs:
        assert log.error is None, f"rank {log.rank}: {log.error} {where}"
        assert log.client_types[:2] == ["DeviceCoordClient", "CoordClient"], log.client_types
    # Every random round: same seq and decisions on every rank, on both paths, = the policy.
    total = plan.rounds + plan.between * sum(f not in ("fingerprint", "num_ubatches")
                                             for f in plan.faults)
    assert all(len(log.rounds) == total for log in logs), where
    for i in range(total):
        entries = [log.rounds[i] for log in logs]
        seq, kind = entries[0].seq, entries[0].kind
        assert all(e.seq == seq and e.kind is kind for e in entries), f"round {i} {where}"
        policy = decide([e.report for e in entries], plan.num_ubatches, epoch=0, seq=seq,
                        kind=kind)
        for e in entries:
            assert e.device == policy, f"seq {seq} device {e.device} != {policy} {where}"
            coordd = msgspec.structs.replace(e.coordd, epoch=0)
            assert coordd == policy, f"seq {seq} coordd {e.coordd} != {policy} {where}"
        assert len({e.coordd.epoch for e in entries}) == 1, where
    # Every fault: the same error, naming the same rank, on every rank and both paths.
    assert all(len(log.faults) == len(plan.faults) for log in logs), where
    for i, name in enumerate(plan.faults):
        faults = [log.faults[i] for log in logs]
        want = error_log(expected_errors(plan, faults[0]))
        for rank, fault in enumerate(faults):
            assert fault.name == name
            assert fault.device == want, f"{name} rank {rank} device {fault.device} {where}"
            if name in ("fingerprint", "num_ubatches") and rank != plan.faulty:
                # coordd tells only the rank it refuses; the device path tells every rank.
                assert fault.coordd is None, f"{name} rank {rank} coordd {fault.coordd} {where}"
            else:
                assert fault.coordd == want, f"{name} rank {rank} coordd {fault.coordd} {where}"
            if name not in ("fingerprint", "num_ubatches"):
                assert fault.device_next_seq == fault.coordd_next_seq == fault.seq + 1, where


def make_plan(tmp_path: Path, procs: list[CoorddProcess], world: int, backend: str,
              faults: list[str], rounds: int) -> Plan:
    seed = int(os.environ.get("COORDD_TEST_SEED") or random.randrange(2**31))
    config_faults = [f for f in faults if f in ("fingerprint", "num_ubatches")]
    return Plan(
        world=world,
        backend=backend,
        store=str(tmp_path / "store"),
        address=start_coordd(procs, tmp_path, world, "coordd"),
        config_addresses=[start_coordd(procs, tmp_path, world, f"coordd-{f}")
                          for f in config_faults],
        seed=seed,
        num_ubatches=random.Random(seed).choice([2, 2, 3, 4]),
        rounds=rounds,
        between=20,
        faulty=world // 2,
        faults=faults,
    )


ALL_FAULTS = ["skip_seq", "wrong_kind", "wrong_kind_first", "invalid", "fingerprint",
              "num_ubatches"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_device_path_equals_coordd_path(tmp_path: Path, coordd_procs, world: int) -> None:
    plan = make_plan(tmp_path, coordd_procs, world, "gloo", ALL_FAULTS, 300 if world == 2 else 200)
    check_run(plan, run_group(plan))


def _cuda_ready() -> str | None:
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return "no CUDA device here"
    if not dist.is_nccl_available():
        return "this torch has no NCCL"
    return None


@pytest.mark.timeout(240)
@pytest.mark.skipif(_cuda_ready() is not None, reason=str(_cuda_ready()))
def test_nccl_device_path_equals_coordd_path(tmp_path: Path, coordd_procs) -> None:
    world = min(2, torch.cuda.device_count())
    faults = ["skip_seq", "invalid"] + (["wrong_kind", "fingerprint"] if world > 1 else [])
    plan = make_plan(tmp_path, coordd_procs, world, "nccl", faults, 200)
    logs = run_group(plan)
    check_run(plan, logs)
    assert all(log.client_types[2].startswith("cuda") for log in logs), logs[0].client_types


# -- no hang: a late rank, a late handshake, a crashed rank ------------------------------------


class LivenessLog(msgspec.Struct):
    rank: int
    connect_error: ErrorLog | None = None
    late_errors: list[ErrorLog | None] = []
    late_decisions: list[StepDecision] = []
    crash_errors: list[ErrorLog | None] = []
    error: str | None = None


def liveness_rank(rank: int, plan_bytes: bytes, events: list[mp.synchronize.Event],
                  out: mp.Queue) -> None:
    """Rank 1 is late (it waits for rank 0 to have timed out), then crashes."""
    plan = msgspec.msgpack.decode(plan_bytes, type=Plan)
    connect_timed_out, round_timed_out = events
    log = LivenessLog(rank)
    try:
        _init_group(rank, plan)
        device, coordd = _clients(rank, plan, plan.address)
        report = random_report(random.Random(rank))
        if rank == 0:
            try:
                device.connect(timeout=0.5)
            except CoordError as exc:
                log.connect_error = error_log(exc)
            connect_timed_out.set()
            device.connect(timeout=WAIT_S)  # the same handshake, now complete
            coordd.connect(timeout=WAIT_S)
            pending = [device.start(report), coordd.start(report)]
            for p in pending:
                try:
                    p.wait(timeout=0.5)
                    log.late_errors.append(None)
                except CoordError as exc:
                    log.late_errors.append(error_log(exc))
            round_timed_out.set()
            log.late_decisions = [p.wait(timeout=WAIT_S) for p in pending]
            pending = [device.start(report), coordd.start(report)]
            for p in pending:  # rank 1 dies instead of reporting
                try:
                    p.wait(timeout=WAIT_S)
                    log.crash_errors.append(None)
                except CoordError as exc:
                    log.crash_errors.append(error_log(exc))
        else:
            assert connect_timed_out.wait(timeout=60)
            device.connect(timeout=WAIT_S)
            coordd.connect(timeout=WAIT_S)
            assert round_timed_out.wait(timeout=60)
            pending = [device.start(report), coordd.start(report)]
            log.late_decisions = [p.wait(timeout=WAIT_S) for p in pending]
            time.sleep(0.5)
            out.put(msgspec.msgpack.encode(log))
            out.close()
            out.join_thread()
            os._exit(0)  # a crash: no goodbye, sockets closed by the kernel
        device.close()
        coordd.close()
    except BaseException as exc:
        log.error = f"{type(exc).__name__}: {exc}"
    out.put(msgspec.msgpack.encode(log))


@pytest.mark.timeout(180)
def test_no_hang_late_rank_late_handshake_crashed_rank(tmp_path: Path, coordd_procs) -> None:
    plan = make_plan(tmp_path, coordd_procs, 2, "gloo", [], 0)
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    events = [ctx.Event(), ctx.Event()]
    data = msgspec.msgpack.encode(plan)
    procs = [ctx.Process(target=liveness_rank, args=(r, data, events, out), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        logs = sorted((msgspec.msgpack.decode(out.get(timeout=120), type=LivenessLog)
                       for _ in procs), key=lambda log: log.rank)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    for log in logs:
        assert log.error is None, f"rank {log.rank}: {log.error}"
    zero, one = logs
    # a handshake that not every rank joined in time: unavailable, and calling again completes it
    assert zero.connect_error is not None
    assert zero.connect_error.type == "CoordinatorUnavailable", zero.connect_error
    # a late rank: the same StepTimeout on both paths, and waiting again gets the decision
    timeout = error_log(StepTimeout((), 0.5))
    assert zero.late_errors == [timeout, timeout]
    device, coordd = zero.late_decisions
    assert device == msgspec.structs.replace(coordd, epoch=0) == one.late_decisions[0]
    # a crashed rank: the round fails at once with RankLost (device: no rank named; coordd: 1)
    crash_device, crash_coordd = zero.crash_errors
    assert crash_device is not None and crash_device.type == "RankLost", crash_device
    assert crash_device.attrs["ranks"] == "()"
    assert crash_coordd is not None and crash_coordd.type == "RankLost", crash_coordd
    assert crash_coordd.attrs["ranks"] == "(1,)"
