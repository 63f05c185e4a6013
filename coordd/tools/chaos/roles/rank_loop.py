"""A rank of the group: it runs rounds until the group's seq reaches `end_seq`, logging every
sync (see `coordd.testing.history`), and after a typed error registers again and goes on
where coordd says, as an engine that survives a failed step would. The same loop carries the
faults a rank injects itself: a raw report that breaks a rule, a misuse of the real client,
an abandoned round."""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any, Protocol

import msgspec

from coordd.client._session import RoundStillOpen
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
)
from coordd.testing.rawrank import RawRank
from coordd.tools.chaos.roles._common import client_config, now, wait_for_go
from coordd.tools.chaos.seeded_reports import kind_for, other_report, report_for
from coordd.tools.chaos.spec import Fault, WorkerSpec


class Driver(Protocol):
    @property
    def epoch(self) -> int | None: ...

    @property
    def next_seq(self) -> int: ...

    def register(self, timeout: float) -> Welcome: ...

    def close(self) -> None: ...


class ClientDriver:
    """The real client, used as an engine uses it: `start` now, `wait` later."""

    def __init__(self, spec: WorkerSpec, **overrides: Any) -> None:
        self.config = client_config(spec, **overrides)
        self.client = CoordClient(config=self.config)
        #: close() was called (client_misuse): the next registration takes a new client, as
        #: an engine that closed its client makes a new one
        self.closed = False

    @property
    def epoch(self) -> int | None:
        return self.client.epoch

    @property
    def next_seq(self) -> int:
        return self.client.session.next_seq

    def register(self, timeout: float) -> Welcome:
        if self.closed:
            self.client.close()
            self.client = CoordClient(config=self.config)
            self.closed = False
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


class RankWorker:
    """The round loop shared by honest and misbehaving ranks."""

    def __init__(self, spec: WorkerSpec, log: HistoryWriter) -> None:
        self.spec = spec
        self.log = log
        self.rng = random.Random(f"work:{spec.seed}:{spec.dp_rank}:{spec.name}")
        self.injected = False
        self.misused: set[str] = set()
        self.until_end: int | None = None

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
            if spec.leak_identity and isinstance(driver, ClientDriver):
                identity = driver.client.session.identity.hex()
                self.log.write(Note(t=now(), what="identity", detail=identity))
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
            if seq >= self._end_seq():
                if isinstance(driver, ClientDriver):  # answers for no round it asked
                    dropped = driver.client.dropped_answers
                    self.log.write(Note(t=now(), what="dropped answers", count=dropped))
                self.log.write(Done(t=now(), next_seq=seq))
                return 0
            if now() >= spec.deadline:
                self.log.write(Done(t=now(), next_seq=seq, reason="deadline"))
                return 0
            epoch = driver.epoch or 0
            try:
                misuse = self._misuse_due(seq)
                if isinstance(driver, RawRank) and self._fault_due(seq):
                    self._misbehave(driver, seq)
                elif isinstance(driver, ClientDriver) and misuse:
                    self._misuse(driver, seq, misuse)
                elif isinstance(driver, ClientDriver) and self._abandon_due(seq):
                    self._abandon(driver, seq)
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

    def _end_seq(self) -> int:
        """`end_seq`, or with `until_file`: the end the ranks agreed on (none yet: on)."""
        spec = self.spec
        if not spec.until_file:
            return spec.end_seq
        return 2**62 if self.until_end is None else self.until_end

    def _until_agreed(self, seq: int, decision: StepDecision) -> None:
        """With `until_file`, the runner's "stop" reaches every rank in one round: a rank that
        has seen the file says so in its report's want_pause (drawn at random otherwise), and
        the first decision with any_pause, the same for all, ends every rank at one seq: the
        end the runner wrote, or the next one if that is past. (A rank reading the file on its
        own could stop a round before the others, which then lose it.)"""
        if not self.spec.until_file or not decision.any_pause or self.until_end is not None:
            return
        with open(self.spec.until_file) as f:  # it exists: some rank saw it
            self.until_end = max(int(f.read()), seq + 1)

    def _round(self, driver: ClientDriver | RawRank, seq: int) -> None:
        spec = self.spec
        kind = kind_for(spec.seed, seq)
        report = report_for(spec.seed, spec.dp_rank, seq)
        if (spec.rogue_first and seq == spec.fault_seq) or seq in spec.hold_seqs:
            time.sleep(min(0.1, spec.step_timeout / 10))  # the rogue's report opens the round
        if spec.bad_field and seq >= spec.fault_seq >= 0 and not self.injected:
            # invalid_value: a value the wire carries and the policy refuses, sent through the
            # real client (which refuses before sending only what the wire cannot carry)
            report = msgspec.structs.replace(report, **{spec.bad_field: spec.bad_value})
            self.injected = True
            detail = f"{spec.bad_field}={spec.bad_value}"
            self.log.write(Inject(t=now(), fault=spec.fault, rank=spec.dp_rank, detail=detail))
        if seq in spec.straggle_seqs:
            if not self.injected:
                self.injected = True
                self.log.write(Inject(t=now(), fault=spec.fault, rank=spec.dp_rank))
            time.sleep(spec.straggle_delay)
        if spec.until_file:
            report = msgspec.structs.replace(report, want_pause=os.path.exists(spec.until_file))
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
        self._until_agreed(seq, decision)

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

    # -- a user's misuse of the real client (client_misuse) ------------------------------------

    def _misuse_due(self, seq: int) -> str:
        for what, at in sorted(self.spec.misuse_seqs.items(), key=lambda item: item[1]):
            if what not in self.misused and seq >= at:
                return what
        return ""

    def _violation(self, detail: str) -> None:
        self.log.write(Note(t=now(), what="violation", detail=detail))

    def _misuse(self, driver: ClientDriver, seq: int, what: str) -> None:
        """One round with a misuse in it; the client must keep its rules (checked here, logged
        as a "violation" note where broken) and the group its rounds:
        - second_wait: wait() again on the answered round returns the same decision at once;
        - start_twice: start() while the round is open raises RoundStillOpen, takes no seq;
        - close: close() from another thread during wait() ends the wait with a typed error
          (the injected fault: the group sees the rank leave)."""
        spec = self.spec
        self.misused.add(what)
        kind = kind_for(spec.seed, seq)
        report = report_for(spec.seed, spec.dp_rank, seq)
        epoch = driver.epoch or 0
        client = driver.client
        timer: threading.Timer | None = None
        if what == "close":
            detail = f"close() from another thread {spec.close_delay * 1000:.0f} ms into wait()"
            self.log.write(Inject(t=now(), fault=spec.fault, rank=spec.dp_rank, detail=detail))
        self._begin(epoch, seq, kind, [driver.stamped(report, kind)])
        pending = client.start(report, kind)
        if what == "start_twice" and pending.done():
            # answered already (an answered round does not hold the next start): try again
            # next round, while one is open
            self.misused.discard(what)
        elif what == "start_twice":
            before = driver.next_seq
            nxt = seq + 1
            try:
                client.start(report_for(spec.seed, spec.dp_rank, nxt), kind_for(spec.seed, nxt))
            except RoundStillOpen as error:
                self.log.write(Note(t=now(), what="misuse", detail=f"start() twice: {error}"))
            except Exception as error:  # the rule says RoundStillOpen, nothing else
                self._violation(f"start() while round {seq} was open raised {error!r}")
            else:
                self._violation(f"a second start() while round {seq} was open went through")
            if driver.next_seq != before:
                self._violation(f"the refused start() took a seq ({before} -> {driver.next_seq})")
        elif what == "close":
            driver.closed = True
            timer = threading.Timer(spec.close_delay, client.close)
            timer.start()
        self._work()
        try:
            decision = pending.wait(spec.wait_timeout)
        except CoordError:
            if timer is not None:
                timer.join(5.0)
            raise
        self._end(epoch, seq, decision)
        if what == "second_wait":
            began = now()
            try:
                again = pending.wait(1.0)
            except CoordError as error:
                self._violation(f"the second wait() of round {seq} raised {error!r}")
                return
            took = now() - began
            if again != decision:
                self._violation(f"the second wait() of round {seq} gave {again}, not {decision}")
            elif took > 0.5:
                self._violation(f"the second wait() of round {seq} blocked {took:.2f}s")
            else:
                note = f"second wait(): the same decision in {took * 1000:.1f} ms"
                self.log.write(Note(t=now(), what="misuse", detail=note))
        elif timer is not None:
            timer.join(5.0)
            note = "the decision came before the close"
            self.log.write(Note(t=now(), what="misuse", detail=note))

    # -- a round started early and abandoned (abandoned_round) ---------------------------------

    def _abandon_due(self, seq: int) -> bool:
        return not self.injected and seq >= self.spec.abandon_seq >= 0

    def _abandon(self, driver: ClientDriver, seq: int) -> None:
        """Start round `seq` early, then abandon it as the vLLM plugin does when the step
        raises between its early start and its sync: leave without Goodbye (coordd must count
        the rank lost and fail the round for everyone, naming it), and the round's wait ends
        with the closed client's typed error; the rank then registers with a new client."""
        spec = self.spec
        kind = kind_for(spec.seed, seq)
        report = report_for(spec.seed, spec.dp_rank, seq)
        self._begin(driver.epoch or 0, seq, kind, [driver.stamped(report, kind)])
        pending = driver.client.start(report, kind)
        self.injected = True
        detail = "started the round, then left without Goodbye before waiting for it"
        self.log.write(Inject(t=now(), fault=spec.fault, rank=spec.dp_rank, detail=detail))
        self._work()
        driver.client.close(goodbye=False)
        driver.closed = True
        pending.wait(spec.wait_timeout)

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


def run_rank(spec: WorkerSpec, log: HistoryWriter) -> int:
    """An honest rank (the real client) or, with role "raw", one that injects `spec.fault`."""
    worker = RankWorker(spec, log)
    driver: ClientDriver | RawRank
    driver = RawRank(config=client_config(spec)) if spec.role == "raw" else ClientDriver(spec)
    try:
        return worker.run(driver)
    finally:
        driver.close()
