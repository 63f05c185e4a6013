"""One chaos process: a rank (real client, or a raw one that injects a fault), a bad joiner, an
impostor, or the rogue that sends garbage. `python -m coordd.tools.chaos.worker SPEC.json`.

A rank runs rounds until the group's seq reaches `end_seq`, logging every sync (see
`coordd.testing.history`). After a typed error it registers again and goes on where coordd says
(the new epoch's next seq), as an engine that survives a failed step would.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from coordd.client.config import ClientConfig
from coordd.client.sync import CoordClient
from coordd.proto.errors import CoordError, CoordinatorUnavailable, Rejected, StepTimeout
from coordd.proto.messages import StepDecision, StepKind, StepReport, Welcome
from coordd.testing.history import (
    Begin,
    Done,
    End,
    HistoryWriter,
    Inject,
    Note,
    Refused,
    Registered,
    decision_dict,
    error_info,
    report_dict,
    wait_for_round,
)
from coordd.testing.rawrank import RawRank
from coordd.testing.rogue import RoguePeer
from coordd.tools.chaos.spec import Fault, WorkerSpec
from coordd.tools.chaos.workload import kind_for, other_report, report_for

now = time.monotonic


class Driver(Protocol):
    @property
    def epoch(self) -> int | None: ...

    @property
    def next_seq(self) -> int: ...

    def register(self, timeout: float) -> Welcome: ...

    def close(self) -> None: ...


def client_config(spec: WorkerSpec, **overrides: Any) -> ClientConfig:
    """The settings every client of this worker (real or raw) is made with."""
    spec_config = ClientConfig(
        address=spec.address,
        dp_rank=spec.dp_rank,
        dp_size=spec.dp_size,
        config_fingerprint=spec.fingerprint,
        wait_timeout=spec.wait_timeout,
        heartbeat_interval=spec.heartbeat_interval,
        heartbeat_timeout=spec.heartbeat_timeout,
    )
    return ClientConfig.of(spec_config, **overrides)


class ClientDriver:
    """The real client, used as an engine uses it: `start` now, `wait` later."""

    def __init__(self, spec: WorkerSpec, **overrides: Any) -> None:
        self.client = CoordClient(config=client_config(spec, **overrides))

    @property
    def epoch(self) -> int | None:
        return self.client.epoch

    @property
    def next_seq(self) -> int:
        return self.client.session.next_seq

    def register(self, timeout: float) -> Welcome:
        return self.client.connect(timeout=timeout)

    def stamped(self, report: StepReport, kind: StepKind) -> StepReport:
        """What `start` will send: the client stamps exactly these fields."""
        return msgspec.structs.replace(
            report,
            dp_rank=self.client.dp_rank,
            epoch=self.epoch or 0,
            seq=self.next_seq,
            kind=kind,
        )

    def close(self) -> None:
        self.client.close()


class Worker:
    """The round loop shared by honest and misbehaving ranks."""

    def __init__(self, spec: WorkerSpec, log: HistoryWriter) -> None:
        self.spec = spec
        self.log = log
        self.rng = random.Random(f"work:{spec.seed}:{spec.dp_rank}:{spec.name}")
        self.injected = False

    # -- registration ---------------------------------------------------------------------------

    def register(self, driver: Driver) -> bool:
        """Register, retrying while coordd is away or still holds this rank's old connection."""
        spec = self.spec
        while now() < spec.deadline:
            try:
                welcome = driver.register(timeout=min(1.0, max(0.05, spec.deadline - now())))
            except Rejected as error:
                if error.reason == "rank_taken":
                    time.sleep(0.05)  # the old holder is not yet known to be gone
                    continue
                self.log.write(Refused(t=now(), error=error_info(error), what="hello"))
                return False
            except CoordinatorUnavailable:
                time.sleep(0.05)
                continue
            self.log.write(Registered(t=now(), epoch=welcome.epoch, next_seq=welcome.next_seq))
            return True
        return False

    # -- the round loop -------------------------------------------------------------------------

    def run(self, driver: ClientDriver | RawRank) -> int:
        spec = self.spec
        if not self.register(driver):
            self.log.write(Done(t=now(), next_seq=driver.next_seq, reason="not registered"))
            return 0
        wait_for_go(spec)
        while True:
            seq = driver.next_seq
            if seq >= spec.end_seq:
                self.log.write(Done(t=now(), next_seq=seq))
                return 0
            if now() >= spec.deadline:
                self.log.write(Done(t=now(), next_seq=seq, reason="deadline"))
                return 0
            epoch = driver.epoch or 0
            try:
                if isinstance(driver, RawRank) and self._fault_due(seq):
                    self._misbehave(driver, seq)
                else:
                    self._round(driver, seq)
            except CoordError as error:
                if isinstance(error, StepTimeout) and not error.ranks:
                    self.log.write(End(t=now(), epoch=epoch, seq=seq, no_answer=True))
                    self.log.write(Done(t=now(), next_seq=seq, reason="no answer"))
                    return 0
                self.log.write(End(t=now(), epoch=epoch, seq=seq, error=error_info(error)))
                if not spec.recover or not self.register(driver):
                    self.log.write(Done(t=now(), next_seq=driver.next_seq, reason="failed"))
                    return 0

    def _round(self, driver: ClientDriver | RawRank, seq: int) -> None:
        spec = self.spec
        kind = kind_for(spec.seed, seq)
        report = report_for(spec.seed, spec.dp_rank, seq)
        if spec.rogue_first and seq == spec.fault_seq:
            time.sleep(min(0.1, spec.step_timeout / 10))  # the rogue's report opens the round
        if seq in spec.straggle_seqs:
            if not self.injected:
                self.injected = True
                self.log.write(Inject(t=now(), fault=spec.fault, rank=spec.dp_rank))
            time.sleep(spec.straggle_delay)
        epoch = driver.epoch or 0
        if isinstance(driver, RawRank):
            message = driver.stamp(report, kind)
            self._begin(epoch, seq, kind, [message])
            driver.send(message)
            driver.advance()
            self._work()
            decision = driver.wait(seq, spec.wait_timeout)
        else:
            self._begin(epoch, seq, kind, [driver.stamped(report, kind)])
            pending = driver.client.start(report, kind)
            self._work()
            decision = pending.wait(spec.wait_timeout)
        self._end(epoch, seq, decision)

    def _work(self) -> None:
        """The step's GPU work that the exchange overlaps (a few milliseconds)."""
        time.sleep(self.rng.uniform(0.001, 0.008))

    def _begin(self, epoch: int, seq: int, kind: StepKind, sent: list[StepReport]) -> None:
        self.log.write(
            Begin(
                t=now(), epoch=epoch, seq=seq, kind=kind.value, sent=[report_dict(m) for m in sent]
            )
        )

    def _end(self, epoch: int, seq: int, decision: StepDecision) -> None:
        self.log.write(End(t=now(), epoch=epoch, seq=seq, decision=decision_dict(decision)))

    # -- the injected misbehaviour --------------------------------------------------------------

    def _fault_due(self, seq: int) -> bool:
        return not self.injected and seq >= self.spec.fault_seq >= 0

    def _misbehave(self, rank: RawRank, seq: int) -> None:
        """Report round `seq` the way the fault says; the outcome is logged like any round's."""
        spec = self.spec
        fault = Fault(spec.fault)
        kind = kind_for(spec.seed, seq)
        report = report_for(spec.seed, spec.dp_rank, seq)
        epoch = rank.epoch or 0
        if fault is Fault.WRONG_KIND:
            if not spec.rogue_first:
                time.sleep(min(0.1, spec.step_timeout / 10))  # the honest ranks report first
            kind = StepKind.FORWARD if kind is not StepKind.FORWARD else StepKind.DRAFT
        sent: list[StepReport]
        if fault is Fault.SKIPPED_SEQ:
            sent = [rank.stamp(report, kind, seq=seq + 1)]
        elif fault is Fault.REPEATED_SEQ:
            earlier = report_for(spec.seed, spec.dp_rank, seq - 1)
            sent = [rank.stamp(other_report(earlier), kind_for(spec.seed, seq - 1), seq=seq - 1)]
        elif fault is Fault.CONFLICTING_DUPLICATE:
            first = rank.stamp(report, kind)
            sent = [first, rank.stamp(other_report(report), kind)]
        elif fault is Fault.SPOOFED_RANK:
            self._spoof(rank, seq, report, kind)
            return
        else:
            sent = [rank.stamp(report, kind)]
        self.injected = True
        self.log.write(Inject(t=now(), fault=fault.value, rank=spec.dp_rank, detail=repr(sent)))
        self._begin(epoch, seq, kind, sent)
        for message in sent:
            rank.send(message)
        rank.advance()
        self._end(epoch, seq, rank.wait(seq, spec.wait_timeout))

    def _spoof(self, rank: RawRank, seq: int, report: StepReport, kind: StepKind) -> None:
        """Report as another rank first (coordd must refuse it), then as itself."""
        spec = self.spec
        victim = (spec.dp_rank + 1) % spec.dp_size
        spoofed = rank.stamp(report, kind, dp_rank=victim)
        self.injected = True
        self.log.write(Inject(t=now(), fault=spec.fault, rank=spec.dp_rank, detail=repr(spoofed)))
        rank.send(spoofed)
        epoch = rank.epoch or 0
        try:
            answer = rank.wait(seq, spec.step_timeout)
        except CoordError as error:
            if isinstance(error, StepTimeout) and not error.ranks:
                self.log.write(End(t=now(), epoch=epoch, seq=seq, no_answer=True))
            else:
                self.log.write(Refused(t=now(), error=error_info(error), what="spoofed report"))
        else:
            # coordd took the spoofed report as a decision for this rank: record it for the checker
            self._begin(epoch, seq, kind, [spoofed])
            self._end(epoch, seq, answer)
            rank.advance()
            return
        legit = rank.stamp(report, kind)
        self._begin(epoch, seq, kind, [legit])
        rank.send(legit)
        rank.advance()
        self._end(epoch, seq, rank.wait(seq, spec.wait_timeout))


# -- processes that only try to join ----------------------------------------------------------


def run_joiner(spec: WorkerSpec, log: HistoryWriter) -> int:
    """A rank whose Hello disagrees with the group (dp_size, fingerprint or protocol version)."""
    field, value = spec.hello_field, spec.hello_value
    timeout = min(5.0, max(0.1, spec.deadline - now()))
    if field == "protocol_version":
        rank = RawRank(config=client_config(spec))
        hello = msgspec.structs.replace(rank.session.hello_message, protocol_version=int(value))
        wait_for_go(spec)
        return _try_join(log, spec, lambda: rank.register(timeout, hello), rank.close)
    overrides: dict[str, Any] = {"dp_size": int(value)} if field == "dp_size" else {}
    if field == "config_fingerprint":
        overrides["config_fingerprint"] = value
    driver = ClientDriver(spec, **overrides)
    wait_for_go(spec)
    return _try_join(log, spec, lambda: driver.register(timeout), driver.close)


def run_impostor(spec: WorkerSpec, log: HistoryWriter) -> int:
    """A second real client that claims a rank the group already has."""
    driver = ClientDriver(spec)  # connected before the trigger: the Hello goes out at once
    wait_for_trigger(spec)
    return _try_join(log, spec, lambda: driver.register(min(5.0, spec.wait_timeout)), driver.close)


def _try_join(
    log: HistoryWriter, spec: WorkerSpec, join: Callable[[], Welcome], close: Callable[[], None]
) -> int:
    log.write(Inject(t=now(), fault=spec.fault, rank=spec.dp_rank))
    try:
        welcome = join()
    except CoordError as error:
        log.write(Refused(t=now(), error=error_info(error), what="hello"))
    else:
        log.write(Registered(t=now(), epoch=welcome.epoch, next_seq=welcome.next_seq))
    finally:
        close()
    log.write(Done(t=now(), next_seq=0, reason="joiner"))
    return 0


def wait_for_go(spec: WorkerSpec) -> None:
    """The runner's startup barrier (see `WorkerSpec.go_file`)."""
    while spec.go_file and not os.path.exists(spec.go_file) and now() < spec.deadline:
        time.sleep(0.002)


def wait_for_trigger(spec: WorkerSpec) -> None:
    """Until the trigger process has begun round `trigger_seq` (or ended, or the deadline)."""
    if spec.trigger_log:
        wait_for_round(spec.trigger_log, spec.trigger_seq, spec.deadline)


def run_rogue(spec: WorkerSpec, log: HistoryWriter) -> int:
    """The garbage scenario's culprit: a flood of bad frames once the group runs, then a probe."""
    with RoguePeer(
        spec.address,
        spec.dp_size,
        seed=spec.seed,
        heartbeat_interval=spec.heartbeat_interval,
        heartbeat_timeout=spec.heartbeat_timeout,
    ) as rogue:
        if not rogue.connected(timeout=5.0):
            log.write(Note(t=now(), what="rogue could not connect"))
            return 0
        wait_for_round(spec.trigger_log, spec.trigger_seq, spec.deadline)
        log.write(Inject(t=now(), fault=spec.fault, detail=f"{spec.frames} frames"))
        sent = rogue.flood(spec.frames)
        for category, count in sorted(sent.items()):
            log.write(Note(t=now(), what="sent", detail=category, count=count))
        rogue.probe(log, spec.wait_timeout, spec.fingerprint)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    with open(args[0], "rb") as f:
        spec = msgspec.json.decode(f.read(), type=WorkerSpec)
    log = HistoryWriter(spec.log_path, role=spec.role, rank=spec.dp_rank, name=spec.name)
    if spec.role == "joiner":
        return run_joiner(spec, log)
    if spec.role == "impostor":
        return run_impostor(spec, log)
    if spec.role == "garbage":
        return run_rogue(spec, log)
    worker = Worker(spec, log)
    driver: ClientDriver | RawRank
    driver = RawRank(config=client_config(spec)) if spec.role == "raw" else ClientDriver(spec)
    try:
        return worker.run(driver)
    finally:
        driver.close()


if __name__ == "__main__":
    sys.exit(main())
