"""One chaos process: a rank (real client, or a raw one that injects a fault), a bad joiner, an
impostor, the rogue that sends garbage, or another hostile peer.
`python -m coordd.tools.chaos.worker SPEC.json`.

A rank runs rounds until the group's seq reaches `end_seq`, logging every sync (see
`coordd.testing.history`). After a typed error it registers again and goes on where coordd says
(the new epoch's next seq), as an engine that survives a failed step would.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from coordd.client._config import ClientConfig
from coordd.client._session import RankSession, RoundStillOpen
from coordd.client.sync import CoordClient
from coordd.core._daemon_defaults import DEFAULT_HANDSHAKE_RATE, HANDSHAKE_TIMEOUT
from coordd.io._gate import REFUSAL_DELAY, SOURCE_SHARE
from coordd.proto.errors import CoordError, CoordinatorUnavailable, Rejected, StepTimeout
from coordd.proto.messages import (
    Goodbye,
    Heartbeat,
    Hello,
    Reject,
    StepDecision,
    StepFailed,
    StepKind,
    StepReport,
    Welcome,
    decode_from_coordinator,
    decode_to_coordinator,
    encode,
    error_from_failure,
    error_from_reject,
)
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
    tail_records,
    wait_for_round,
)
from coordd.testing.rawrank import RawRank
from coordd.testing.rogue import APP_LEVEL, RoguePeer
from coordd.tools.chaos.spec import Fault, WorkerSpec
from coordd.tools.chaos.workload import kind_for, other_report, report_for
from coordd.tools.load.claims import attack

now = time.monotonic
#: The rogue's probe (three questions) may take this long in all: coordd answers in
#: milliseconds, but on 2 cores at load 10 an answer came seconds late (stranger_noise failed
#: with the refusals in coordd's log); a coordd that does not answer still fails well within
#: the scenario's budget.
PROBE_TIMEOUT = 15.0


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


class Worker:
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
        end the runner wrote, or the next one if that is past. Each rank reading the file on
        its own raced (a rank began the end seq just before the file appeared, the other
        stopped there, and the first got RankLost): seen under load on 2 cores."""
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


def _rogue_peer(spec: WorkerSpec) -> RoguePeer:
    """A peer outside the group, with the scenario's heartbeat settings."""
    return RoguePeer(
        spec.address,
        spec.dp_size,
        seed=spec.seed,
        heartbeat_interval=spec.heartbeat_interval,
        heartbeat_timeout=spec.heartbeat_timeout,
    )


def run_rogue(spec: WorkerSpec, log: HistoryWriter) -> int:
    """The garbage scenario's culprit: a flood of bad frames once the group runs, then a probe."""
    with _rogue_peer(spec) as rogue:
        if not rogue.connected(timeout=5.0):
            log.write(Note(t=now(), what="rogue could not connect"))
            return 0
        wait_for_round(spec.trigger_log, spec.trigger_seq, spec.deadline)
        log.write(Inject(t=now(), fault=spec.fault, detail=f"{spec.frames} frames"))
        sent = rogue.flood(spec.frames)
        for category, count in sorted(sent.items()):
            log.write(Note(t=now(), what="sent", detail=category, count=count))
        rogue.probe(log, PROBE_TIMEOUT, spec.fingerprint)
    return 0


def _live_round(path: str, offset: int, last: tuple[int, int]) -> tuple[int, tuple[int, int]]:
    """The (epoch, seq) a rank's log shows it in last, read on from `offset`."""
    records, offset = tail_records(path, offset)
    for r in records:
        if isinstance(r, Begin):
            last = (r.epoch, r.seq)
    return offset, last


def _answers(sock: zmq.Socket, timeout: float = 0.0) -> list[object]:
    """Whatever coordd sent `sock` (undecodable frames left out), waiting up to `timeout`."""
    out: list[object] = []
    while sock.poll(int(timeout * 1000), zmq.POLLIN):
        with contextlib.suppress(CoordError, zmq.Again):
            out.append(decode_from_coordinator(sock.recv(zmq.NOBLOCK)))
        timeout = 0.0
    return out


def run_stranger(spec: WorkerSpec, log: HistoryWriter) -> int:
    """stranger_noise's culprit: a peer that never registers sends forged reports for the live
    rounds (right epoch and seq, any rank's id, other values) amid garbage frames, then checks
    coordd still answers (the rogue's probe), then bursts forged reports as fast as it can on
    a second connection (coordd may cut it off). The group's rounds must not notice."""
    rng = random.Random(f"stranger:{spec.seed}")
    with _rogue_peer(spec) as rogue:
        if not rogue.connected(timeout=5.0):
            log.write(Note(t=now(), what="stranger could not connect"))
            return 0
        wait_for_round(spec.trigger_log, spec.trigger_seq, spec.deadline)
        log.write(Inject(t=now(), fault=spec.fault, detail="forged reports amid garbage"))
        offset, live = _live_round(spec.trigger_log, 0, (0, 0))
        forged = answered = 0
        refused: set[str] = set()

        def collect(timeout: float = 0.0) -> None:
            nonlocal answered
            for answer in _answers(rogue.sock, timeout):
                if isinstance(answer, StepFailed):
                    answered += 1
                    error = error_from_failure(answer)
                    if type(error).__name__ not in refused:
                        refused.add(type(error).__name__)
                        info = error_info(error)
                        log.write(Refused(t=now(), error=info, what="forged report"))
                elif not isinstance(answer, Heartbeat):
                    log.write(Note(t=now(), what="violation", detail=f"a stranger got {answer}"))

        for i in range(60):
            offset, live = _live_round(spec.trigger_log, offset, live)
            if i % 2 == 0:
                epoch, seq = live[0], live[1] + rng.choice([0, 0, 1])
                report = report_for(spec.seed, 99, seq, salt=f"forged{i}")
                rogue.sock.send(
                    encode(
                        msgspec.structs.replace(
                            report,
                            num_tokens=report.num_tokens + 7919,
                            num_tokens_padded=report.num_tokens_padded + 7919,
                            dp_rank=rng.randrange(spec.dp_size),
                            epoch=epoch,
                            seq=seq,
                            kind=kind_for(spec.seed, seq),
                        )
                    ),
                    zmq.NOBLOCK,
                )
                forged += 1
            elif i % 6 == 1:
                rogue.sock.send(encode(Goodbye(text="forged")), zmq.NOBLOCK)
            else:
                rogue.send(rng.choice(APP_LEVEL))
            collect()
            time.sleep(rng.uniform(0.001, 0.004))
        collect(0.3)
        log.write(Note(t=now(), what="sent", detail="forged", count=forged))
        log.write(Note(t=now(), what="answered", detail="forged", count=answered))
        for category, count in sorted(rogue.sent.items()):
            log.write(Note(t=now(), what="sent", detail=category, count=count))
        rogue.probe(log, PROBE_TIMEOUT, spec.fingerprint)
        burst = _burst(spec, live)
        log.write(Note(t=now(), what="burst", detail="forged reports, one connection", count=burst))
    return 0


def _burst(spec: WorkerSpec, live: tuple[int, int]) -> int:
    """`spec.frames` forged reports as fast as a fresh DEALER takes them (a fast stranger)."""
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, spec.frames + 10)
    sock.connect(spec.address)
    sent = 0
    try:
        if not sock.poll(2000, zmq.POLLOUT):
            return 0
        frame = encode(
            StepReport(num_tokens=1, num_tokens_padded=1, dp_rank=0, epoch=live[0], seq=live[1])
        )
        for _ in range(spec.frames):
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                break
            sent += 1
        time.sleep(0.05)
    finally:
        sock.close()
    return sent


def run_taker(spec: WorkerSpec, log: HistoryWriter) -> int:
    """takeover_attempt's culprit: speaks for a live rank (`dp_rank`, the victim) without
    holding it: over a new connection presenting the victim's routing id (leaked: the victim
    logs it), it sends forged reports, a heartbeat and a Goodbye, and must receive nothing;
    then a Hello for the rank (refused rank_taken) and a report claiming it from a connection
    that never registered (refused). The victim's rounds must not notice."""
    victim = spec.dp_rank
    wait_for_round(spec.victim_log, spec.trigger_seq, spec.deadline)
    identity = ""
    for r in tail_records(spec.victim_log, 0)[0]:
        if isinstance(r, Note) and r.what == "identity":
            identity = r.detail
    _, live = _live_round(spec.victim_log, 0, (0, 0))
    if not identity:
        log.write(Note(t=now(), what="no identity in the victim's log"))
        return 0
    log.write(Inject(t=now(), fault=spec.fault, rank=victim, detail="the victim's routing id"))
    ctx: zmq.Context = zmq.Context.instance()
    sock: zmq.Socket = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, bytes.fromhex(identity))
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(spec.address)
    sent = 0
    got: list[object] = []
    try:
        sock.poll(1000, zmq.POLLOUT)
        epoch, seq = live
        for i in range(6):
            forged = other_report(report_for(spec.seed, victim, seq + 1 + i % 2))
            frames = [
                msgspec.structs.replace(
                    forged,
                    num_tokens=forged.num_tokens + 4999,
                    num_tokens_padded=forged.num_tokens_padded + 4999,
                    dp_rank=victim,
                    epoch=epoch,
                    seq=seq + 1 + i % 2,
                    kind=kind_for(spec.seed, seq + 1 + i % 2),
                ),
                Heartbeat(nonce=i),
            ]
            if i == 5:
                frames.append(Goodbye(text="forged"))
            for message in frames:
                try:
                    sock.send(encode(message), zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    pass
            got += _answers(sock, 0.05)
        got += _answers(sock, 0.3)
    finally:
        sock.close()
    for answer in got:
        log.write(Note(t=now(), what="violation", detail=f"the victim's id received {answer}"))
    log.write(Note(t=now(), what="id taken: nothing received", count=sent))
    # a Hello for the held rank, as a real client would say it
    rank = RawRank(config=client_config(spec))
    try:
        welcome = rank.register(min(5.0, spec.wait_timeout))
    except CoordError as error:
        log.write(Refused(t=now(), error=error_info(error), what="hello"))
    else:
        log.write(Registered(t=now(), epoch=welcome.epoch, next_seq=welcome.next_seq))
    finally:
        rank.close()
    # a report claiming the held rank from a connection that never registered
    _, live = _live_round(spec.victim_log, 0, live)
    claim = ctx.socket(zmq.DEALER)
    claim.setsockopt(zmq.LINGER, 0)
    claim.connect(spec.address)
    try:
        claim.poll(1000, zmq.POLLOUT)
        report = StepReport(
            num_tokens=1, num_tokens_padded=1, dp_rank=victim, epoch=live[0], seq=live[1] + 1
        )
        claim.send(encode(report), zmq.NOBLOCK)
        for answer in _answers(claim, spec.wait_timeout):
            if isinstance(answer, StepFailed):
                info = error_info(error_from_failure(answer))
                log.write(Refused(t=now(), error=info, what="claimed report"))
            else:
                detail = f"a report claiming rank {victim} got {answer}"
                log.write(Note(t=now(), what="violation", detail=detail))
            break
    finally:
        claim.close()
    log.write(Done(t=now(), next_seq=0, reason="taker"))
    return 0


#: The group the claimer's zero-led Hello asks for (as rank 0, coordd's dp_size): one of its
#: own, so that nothing but the routing id stands between it and a Welcome (a registered name
#: is exempt from the stranger grace). Checked: with the routing-id refusal taken out of
#: coordd, this Hello is welcomed and the scenario fails ("coordd admitted claimer").
CLAIMER_GROUP = "id-claims"


def run_claimer(spec: WorkerSpec, log: HistoryWriter) -> int:
    """id_claims' culprit: once the group's rounds are live, the routing-id attack for
    `claim_seconds` (`spec.claims` names held, id-less handshakes `spec.in_flight` at a time),
    with what it achieved logged; then a Hello from a routing id that starts with a zero byte
    (`\\x00` + 4 bytes from the seed), whose Reject (expected: routing_id) is logged as
    `Refused` and a Welcome as `Registered` (the checker's violation)."""
    rng = random.Random(f"claimer:{spec.seed}")
    wait_for_trigger(spec)
    detail = (
        f"{spec.claims} names held, id-less handshakes {spec.in_flight} at a time "
        f"for {spec.claim_seconds:g} s"
    )
    log.write(Inject(t=now(), fault=spec.fault, detail=detail))
    result = attack(spec.address, spec.claims, spec.claim_seconds, spec.in_flight)
    log.write(Note(t=now(), what="admitted", detail="id-less", count=result.idless_admitted))
    log.write(Note(t=now(), what="refused", detail="id-less", count=result.idless_refused))
    log.write(Note(t=now(), what="held", detail="names, most at once", count=result.held_max))
    log.write(Note(t=now(), what="admitted", detail="names", count=result.claims_admitted))
    log.write(Note(t=now(), what="closed", detail="names", count=result.claims_closed))
    log.write(Note(t=now(), what="attack", detail=result.summary()))
    # the attack spent this source's share of the handshake rate: a moment for a handshake's
    # worth to come back (else the gate stalls the Hello's handshake until coordd's
    # HANDSHAKE_IVL, ~5 s, and the scenario takes that much longer)
    time.sleep(1.25 / (DEFAULT_HANDSHAKE_RATE * SOURCE_SHARE))
    identity = b"\x00" + rng.randbytes(4)
    hello = RankSession(config=client_config(spec, dp_rank=0, group=CLAIMER_GROUP)).hello_message
    log.write(Note(t=now(), what="zero-led hello", detail=identity.hex()))
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(spec.address)
    try:
        sock.send(encode(hello))  # queued until the handshake (the gate may hold it a while)
        sent = now()
        # long enough for one stalled handshake as well
        timeout = spec.wait_timeout + HANDSHAKE_TIMEOUT + REFUSAL_DELAY
        answers = [a for a in _answers(sock, timeout) if not isinstance(a, Heartbeat)]
        took = now() - sent
    finally:
        sock.close()
    if not answers:
        log.write(Note(t=now(), what="no answer", detail="zero-led hello"))
    else:
        answer = answers[0]
        detail = f"{type(answer).__name__} after {took * 1000:.0f} ms"
        log.write(Note(t=now(), what="answered", detail=detail))
        if isinstance(answer, Reject):
            info = error_info(error_from_reject(answer))
            log.write(Refused(t=now(), error=info, what="hello"))
        elif isinstance(answer, Welcome):
            log.write(Registered(t=now(), epoch=answer.epoch, next_seq=answer.next_seq))
        else:
            log.write(Note(t=now(), what="violation", detail=f"a Hello got {answer}"))
    log.write(Done(t=now(), next_seq=0, reason="claimer"))
    return 0


#: The longest the squatter's member floods before it gives up on being cut off: coordd cuts
#: a member past ~2k messages in its one-second window (MEMBER_SLACK), which takes well under
#: a second of sending even on 2 busy cores.
FLOOD_SECONDS = 8.0


def _ask(spec: WorkerSpec, log: HistoryWriter, group: str, what: str) -> CoordClient | None:
    """A real client's Hello for rank 0 of `group`, waiting for its own answer: a `Rejected`
    is logged as `Refused` (`what`), a Welcome as `Registered` where `what` is a question coordd
    must refuse (the checker's "admitted"), else as a "welcomed" note; the welcomed client is
    returned, held (its slot with it)."""
    client = CoordClient(config=client_config(spec, dp_rank=0, group=group))
    try:
        welcome = client.connect(timeout=min(PROBE_TIMEOUT, max(0.1, spec.deadline - now())))
    except Rejected as error:
        client.close()
        log.write(Refused(t=now(), error=error_info(error), what=what))
        return None
    except CoordError as error:
        client.close()
        log.write(Note(t=now(), what="no answer", detail=f"{what} {group}: {error}"))
        return None
    if what == "fill":
        log.write(Note(t=now(), what="welcomed", detail=group))
    else:
        log.write(Registered(t=now(), epoch=welcome.epoch, next_seq=welcome.next_seq))
    return client


def _raw_member(spec: WorkerSpec, group: str) -> tuple[zmq.Socket, zmq.Socket, object]:
    """A DEALER that says Hello for rank 0 of `group` and never reconnects (a cut is final),
    the monitor that sees its connection end, and coordd's answer (None: none in time)."""
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, f"squat-{os.getpid()}".encode())
    sock.setsockopt(zmq.RECONNECT_IVL, -1)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(spec.address)
    hello = Hello(
        dp_size=spec.dp_size,
        dp_rank=0,
        config_fingerprint=spec.fingerprint,
        incarnation=f"squatter-{os.getpid()}",
        group=group,
    )
    sock.send(encode(hello))
    answers = [a for a in _answers(sock, PROBE_TIMEOUT) if not isinstance(a, Heartbeat)]
    return sock, monitor, answers[0] if answers else None


def _flood(sock: zmq.Socket, monitor: zmq.Socket, report: bytes, until: float) -> tuple[int, bool]:
    """Send `report` again and again (one report a round is a member's share) until the
    monitor sees the connection end, or `until`; what coordd sends back is read and dropped.
    How many went, and whether it was cut off."""
    sent = 0
    while now() < until:
        for _ in range(256):
            try:
                sock.send(report, zmq.NOBLOCK)
            except zmq.Again:
                time.sleep(0.001)
                break
            sent += 1
        while sock.poll(0, zmq.POLLIN):
            sock.recv(zmq.NOBLOCK)
        if monitor.poll(0, zmq.POLLIN):
            event = recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                return sent, True
    return sent, False


def run_squatter(spec: WorkerSpec, log: HistoryWriter) -> int:
    """junk_groups' culprit. Before the group starts, it takes every --max-groups slot with
    names coordd's patterns admit (`fill_groups`, rank 0 of each; the last over a raw DEALER)
    and asks for one more (refused group_limit): the group, named exactly, then registers at
    the limit. Once the group's rounds are live: Hellos for groups the deployment does not
    expect (`junk_names`, each refused group_unexpected), one more over the limit, then its
    raw member sends its report again and again until coordd cuts that connection off; the
    members it still holds must then answer pings (nothing else was cut)."""
    held: list[tuple[str, CoordClient]] = []
    sock = monitor = None
    try:
        for group in spec.fill_groups[:-1]:
            client = _ask(spec, log, group, "fill")
            if client is not None:
                held.append((group, client))
        sock, monitor, answer = _raw_member(spec, spec.fill_groups[-1])
        if isinstance(answer, Welcome):
            log.write(Note(t=now(), what="welcomed", detail=spec.fill_groups[-1]))
        else:
            detail = f"the flooding member's Hello for {spec.fill_groups[-1]} got {answer}"
            log.write(Note(t=now(), what="no member", detail=detail))
        over = list(spec.over_groups)
        _ask(spec, log, over.pop(0), "over the limit")
        filled = len(held) + isinstance(answer, Welcome)
        log.write(Note(t=now(), what="filled", detail="junk groups held", count=filled))
        wait_for_trigger(spec)
        detail = f"{len(spec.junk_names)} unexpected groups, then a member's flood"
        log.write(Inject(t=now(), fault=spec.fault, detail=detail))
        for name in spec.junk_names:
            _ask(spec, log, name, "unexpected group")
        for name in over:
            _ask(spec, log, name, "over the limit")
        log.write(Note(t=now(), what="asked", detail="unexpected", count=len(spec.junk_names)))
        log.write(Note(t=now(), what="asked", detail="over the limit", count=len(over) + 1))
        if isinstance(answer, Welcome):
            report = StepReport(
                num_tokens=1,
                num_tokens_padded=1,
                dp_rank=0,
                epoch=answer.epoch,
                seq=answer.next_seq,
                kind=kind_for(spec.seed, answer.next_seq),
            )
            began = now()
            sent, cut = _flood(
                sock, monitor, encode(report), min(spec.deadline, began + FLOOD_SECONDS)
            )
            detail = f"after {sent} copies of one report in {now() - began:.2f}s"
            log.write(Note(t=now(), what="cut" if cut else "not cut", detail=detail, count=sent))
        log.write(Note(t=now(), what="asked", detail="pings", count=len(held)))
        for group, client in held:
            try:
                client.ping(timeout=PROBE_TIMEOUT)
            except CoordError as error:
                log.write(Note(t=now(), what="no pong", detail=f"{group}: {error}"))
            else:
                log.write(Note(t=now(), what="pong", detail=group))
    finally:
        for _, client in held:
            client.close()
        if monitor is not None:
            monitor.close(linger=0)
        if sock is not None:
            sock.close(linger=0)
    log.write(Done(t=now(), next_seq=0, reason="squatter"))
    return 0


def _forged(decision: StepDecision, forge: str, dp_size: int, rng: random.Random) -> StepDecision:
    """`decision` with the one misfit `forge` names: an answer the rank must refuse."""
    replace = msgspec.structs.replace
    if forge == "seq":  # a round this rank has not reported yet
        return replace(decision, seq=decision.seq + rng.choice([1, 2]))
    if forge == "num_tokens_across_dp":
        across = list(decision.num_tokens_across_dp)
        return replace(decision, num_tokens_across_dp=rng.choice([across[:-1], [*across, 1]]))
    if forge == "dead_ranks":
        return replace(decision, dead_ranks=[rng.choice([dp_size, -1])])
    if forge == "cudagraph_mode":
        return replace(decision, cudagraph_mode=rng.choice([3, -1]))
    if forge == "kind":
        kinds = [
            k for k in (StepKind.FORWARD, StepKind.DRAFT, StepKind.STATE) if k != decision.kind
        ]
        return replace(decision, kind=rng.choice(kinds))
    raise ValueError(f"no such misfit: {forge}")


def _unsolicited(decision: StepDecision, extra: str) -> StepDecision:
    """An answer for no round the rank has open: `decision` again (its round is answered),
    or one of the epoch before."""
    if extra == "again":
        return decision
    if extra == "old_epoch":
        return msgspec.structs.replace(decision, epoch=decision.epoch - 1)
    raise ValueError(f"no such unsolicited answer: {extra}")


def run_proxy(spec: WorkerSpec, log: HistoryWriter) -> int:
    """forged_answers' culprit: a man in the middle between the ranks and the real coordd
    (`upstream`). It binds `address` (a ROUTER; the ranks are given it), opens one DEALER to
    coordd per rank connection, under that connection's routing id, and forwards every frame
    both ways as it is, but two: the victim's (`dp_rank`) decision of round `fault_seq` is
    replaced by a misfit (`forge`), and after `extra_rank`'s decision of that round comes one
    more that answers no round it has open (`extra`). It ends once `stop_file` exists.

    (A rank that reconnects under a new routing id would get a second DEALER while the first
    still holds its rank at coordd: nothing in this scenario drops a connection.)"""
    rng = random.Random(f"proxy:{spec.seed}")
    ctx: zmq.Context = zmq.Context.instance()
    front: zmq.Socket = ctx.socket(zmq.ROUTER)
    front.setsockopt(zmq.LINGER, 0)
    front.bind(spec.address)
    log.write(Note(t=now(), what="listening", detail=front.getsockopt_string(zmq.LAST_ENDPOINT)))
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    backs: dict[bytes, zmq.Socket] = {}
    owners: dict[zmq.Socket, bytes] = {}
    ranks: dict[bytes, int] = {}
    forged = added = False
    up = down = 0

    def back_for(identity: bytes) -> zmq.Socket:
        back = backs.get(identity)
        if back is None:
            back = backs[identity] = ctx.socket(zmq.DEALER)
            back.setsockopt(zmq.LINGER, 0)
            back.setsockopt(zmq.ROUTING_ID, identity)
            back.connect(spec.upstream)
            owners[back] = identity
            poller.register(back, zmq.POLLIN)
        return back

    def answers(identity: bytes, frames: list[bytes]) -> list[bytes]:
        """What goes to the rank behind `identity` for coordd's `frames`."""
        nonlocal forged, added
        rank = ranks.get(identity)
        if (forged and added) or rank not in (spec.dp_rank, spec.extra_rank):
            return frames
        try:
            message = decode_from_coordinator(frames[-1])
        except CoordError:
            return frames
        if not isinstance(message, StepDecision) or message.seq < spec.fault_seq:
            return frames
        if rank == spec.dp_rank and not forged:
            forged = True
            misfit = _forged(message, spec.forge, spec.dp_size, rng)
            detail = f"{spec.forge} of seq {message.seq} to rank {rank}: {misfit}"
            log.write(Inject(t=now(), fault=spec.fault, rank=rank, detail=detail))
            log.write(Note(t=now(), what="misfit", detail=spec.forge, count=message.seq))
            return [encode(misfit)]
        if rank == spec.extra_rank and not added:
            added = True
            extra = _unsolicited(message, spec.extra)
            detail = f"unsolicited ({spec.extra}) after seq {message.seq} to rank {rank}: {extra}"
            log.write(Inject(t=now(), fault=spec.fault, rank=rank, detail=detail))
            log.write(Note(t=now(), what="unsolicited", detail=spec.extra, count=rank))
            return [*frames, encode(extra)]
        return frames

    try:
        while now() < spec.deadline and not os.path.exists(spec.stop_file):
            for sock, _ in poller.poll(50):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if sock is front:
                        identity, payload = frames[0], frames[1:]
                        if identity not in ranks and payload:
                            with contextlib.suppress(CoordError):
                                hello = decode_to_coordinator(payload[-1])
                                if isinstance(hello, Hello):
                                    ranks[identity] = hello.dp_rank
                        back_for(identity).send_multipart(payload)
                        up += 1
                    else:
                        identity = owners[sock]
                        for frame in answers(identity, frames):
                            front.send_multipart([identity, frame])
                            down += 1
    finally:
        for back in backs.values():
            back.close(linger=0)
        front.close(linger=0)
    log.write(Note(t=now(), what="forwarded", detail="to coordd", count=up))
    log.write(Note(t=now(), what="forwarded", detail="to the ranks", count=down))
    log.write(Done(t=now(), next_seq=0, reason="proxy"))
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
    if spec.role == "stranger":
        return run_stranger(spec, log)
    if spec.role == "taker":
        return run_taker(spec, log)
    if spec.role == "claimer":
        return run_claimer(spec, log)
    if spec.role == "squatter":
        return run_squatter(spec, log)
    if spec.role == "proxy":
        return run_proxy(spec, log)
    worker = Worker(spec, log)
    driver: ClientDriver | RawRank
    driver = RawRank(config=client_config(spec)) if spec.role == "raw" else ClientDriver(spec)
    try:
        return worker.run(driver)
    finally:
        driver.close()


if __name__ == "__main__":
    sys.exit(main())
