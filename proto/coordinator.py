"""The coordinator state machine, sans-IO: messages and the time go in, messages to send come out.

It owns membership (who is which rank), the round (which seq and kind is open, who reported
what) and the fault rules. It never reads a clock or touches a socket: the daemon passes
`now` in and moves the bytes, and tests drive it with a fake clock.

Every input becomes one event of `coordd.proto.group_state` (JOIN, OPEN, REPORT, DECIDE,
FAIL, ...), and `_move` checks it against that module's table, the one place the group's
legal moves are written down. Readers see the group only through `snapshot()`.

Fail-stop: the first fault ends the round for every rank with one `StepFailed`; the group then
stays FAILED, and every later report gets that same failure at once, until a rank registers
again, which opens a new epoch.

A clean exit is not a fault: a rank that says Goodbye between rounds leaves the group (its rank
is `left`), and once every registered rank has left so, the group is STOPPED, with no failure
counted (`departures` and `stops` count them instead). A report while a rank has left fails
the group at once with `RankLost(left the group)` naming it (the round could never complete),
and so does a Goodbye while a round is open; a connection closed without a Goodbye is a lost
rank, as before. The next Hello after a stop opens a new epoch.

Elastic (`OnRankLoss.NEUTRALIZE`): a lost rank is left out instead; it counts as a neutral
value in every later decision (`dead_ranks`, as vLLM's `neutralize_dead_dp_columns` in
vllm/v1/worker/dp_utils.py does), its peer gets `RankLost` if it reports without registering,
and a returning rank is admitted only at a round boundary. Other faults still fail the round.

Two families of rounds share the group's one seq sequence and every rule above: policy rounds
(a `StepReport` of kind forward, draft or state; coordd applies `decide` and sends a
`StepDecision`) and gather rounds (a `GatherReport`; coordd sends every rank's values back as
one `GatherResult`, a left-out rank's row empty). A report of the other family, kind or
gather site than the open round's is a `StepMismatch`, whose culprit the round's evidence
names: the round waits for every live rank (or the step timeout) and names the lowest rank off
the majority (`Round.verdict`; ties go to the lowest rank's kind, as on the device path).

Resize (elastic EP re-forms DP at another size): `dp_size` is coordd's `--dp`, the most ranks
the group may have; each epoch has the size its first Hello says. A Hello at another size while
ranks of the group stay connected waits (`_resizing`) until they have all left or been lost,
then opens the new epoch at its size; if they are still there after the step timeout, it is
refused with `Rejected(dp_size)` naming them (a misconfigured rank, not a re-form).

Identity: a peer is a connection (the daemon binds a routing id to the connection its Hello
came in on). After a failure the next Hello passes the same checks as the first registration,
against the ranks still connected (`_held`): see `coordd.proto.membership.check_membership`.
"""

# Whole though over 500 lines: one state machine; every input moves the group's one state
# through `_move`, and split, each part would reach into the others' membership and round.

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import NamedTuple

from coordd.proto.defaults import STEP_TIMEOUT
from coordd.proto.errors import (
    ConflictingReport,
    CoordError,
    CoordinatorUnavailable,
    InvalidReport,
    ProtocolError,
    RankLost,
    Rejected,
    StepMismatch,
    StepTimeout,
)
from coordd.proto.group_state import GroupEvent, GroupState, next_state
from coordd.proto.membership import (
    check_basics,
    check_membership,
    rank_taken,
    resize_refused,
    resize_while_holding,
)
from coordd.proto.messages import (
    FromCoordinator,
    GatherReport,
    GatherResult,
    Goodbye,
    Heartbeat,
    Hello,
    Outcome,
    Report,
    StepFailed,
    StepKind,
    StepReport,
    ToCoordinator,
    Welcome,
    failure_message,
    reject_message,
)
from coordd.proto.policy import decide, validate_gather, validate_report
from coordd.proto.resize_waits import ResizeWaits
from coordd.proto.rounds import CompletedRound, Round, Verdict
from coordd.proto.snapshot import GroupSnapshot, Member, OnRankLoss

_E, _S = GroupEvent, GroupState
_GATHER = StepKind.GATHER


class Send(NamedTuple):
    """Send `message` to every peer in `peers` (encode it once)."""

    peers: tuple[bytes, ...]
    message: FromCoordinator


class _Decided(NamedTuple):
    """The last decided round and its outcome: a rank that re-sends its report gets it again."""

    round: Round
    decision: Outcome


_NOTHING: tuple[Send, ...] = ()

#: `RankLost.detail` of a rank that said Goodbye: an orderly departure, not a crash.
LEFT_THE_GROUP = "left the group"


class Coordinator:
    """One DP group's membership, rounds and faults."""

    def __init__(
        self,
        dp_size: int,
        *,
        epoch: int,
        step_timeout: float = STEP_TIMEOUT,
        on_rank_loss: OnRankLoss = OnRankLoss.FAIL,
    ) -> None:
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        #: coordd's --dp: the most ranks an epoch may have.
        self.max_dp_size = dp_size
        #: This epoch's size, set by the first Hello of an epoch.
        self.dp_size = dp_size
        self.step_timeout = step_timeout
        self.on_rank_loss = on_rank_loss
        self._state = _S.EMPTY
        self._epoch = epoch
        self._seq = 0
        self._members: dict[int, Member] = {}
        self._peer_rank: dict[bytes, int] = {}
        #: Ranks of an earlier (failed) epoch whose connections are still open and that have
        #: not registered again: each still holds its rank and binds the group's settings, so a
        #: stranger's Hello after a failure cannot take the rank or re-form the group with
        #: other settings (see `_on_hello`). A rank leaves here when its connection closes or it
        #: registers again.
        self._held: dict[int, Member] = {}
        self._held_rank: dict[bytes, int] = {}
        self._dead: frozenset[int] = frozenset()
        #: Ranks of this epoch that said Goodbye between rounds (left cleanly).
        self._left: frozenset[int] = frozenset()
        self._departures = 0
        self._stops = 0
        self._round: Round | None = None
        self._queued: list[tuple[bytes, Hello]] = []  # lost ranks back mid-round (elastic)
        self._resizing: ResizeWaits[Hello] = ResizeWaits()
        self._failure: StepFailed | None = None
        self._failures = 0
        #: The group failed and has not re-formed since (no later epoch had every rank
        #: registered): the failure stands, whatever a Hello or Goodbye of one peer does.
        self._reforming = False
        self._decided: _Decided | None = None
        self._decisions = 0
        self._last_round: CompletedRound | None = None
        self._peers: tuple[bytes, ...] | None = None
        self._members_view: MappingProxyType[int, Member] | None = None
        self._snapshot: GroupSnapshot | None = None

    # -- inputs -----------------------------------------------------------------------------

    def receive(self, peer: bytes, message: ToCoordinator, now: float) -> Sequence[Send]:
        """Feed one decoded message from `peer`; returns what to send."""
        if type(message) is StepReport or type(message) is GatherReport:
            return self._on_report(peer, message, now)
        if type(message) is Hello:
            return self._on_hello(peer, message, now)
        if type(message) is Heartbeat:
            return (Send((peer,), message),)
        if type(message) is Goodbye:
            sends = self._on_goodbye(peer, now)
            return [*sends, *self._admit_resizes(now)] if self._resizing else sends
        raise TypeError(f"not a message to the coordinator: {message!r}")

    def _on_goodbye(self, peer: bytes, now: float) -> Sequence[Send]:
        """A rank leaves in order. Between rounds that is no fault: the rank is `left`, and
        the group STOPPED once no rank is registered. With a round open (its peers wait on
        it) or the group failed, it is a loss like any other, said as a departure."""
        rank = self._peer_rank.get(peer)
        if rank is None or self._state is not _S.IDLE:
            return self.peer_lost(peer, now, detail=LEFT_THE_GROUP)
        self._remove(rank)
        self._departures += 1
        self._left |= {rank}
        if not self._members and self._reforming:
            # The epoch never re-formed after a failure: its last rank leaving (a restarted
            # rank giving up, or a stranger's Hello and Goodbye) cannot make the crash a stop.
            self._abandon()
            return _NOTHING
        if not self._members:
            self._move(_E.STOP)
            self._stops += 1
            self._dead = frozenset()
            self._left = frozenset()
            return _NOTHING
        self._move(_E.DEPART)
        if self.on_rank_loss is OnRankLoss.NEUTRALIZE:
            self._dead |= {rank}  # elastic: left out of later rounds, like a lost rank
        return _NOTHING

    def peer_lost(self, peer: bytes, now: float, detail: str = "disconnected") -> Sequence[Send]:
        """The transport says `peer` is gone (closed, or missed heartbeats)."""
        if not self._resizing:
            return self._on_lost(peer, now, detail)
        self._resizing.drop(peer)
        return [*self._on_lost(peer, now, detail), *self._admit_resizes(now)]

    def _on_lost(self, peer: bytes, now: float, detail: str) -> Sequence[Send]:
        rank = self._peer_rank.get(peer)
        if rank is None:
            self._queued = [(p, h) for p, h in self._queued if p != peer]
            held = self._held_rank.pop(peer, None)
            if held is not None:
                del self._held[held]
            return _NOTHING
        self._remove(rank)
        match self._loss_event():
            case _E.FAIL:
                waiting = self._state is _S.ROUND_OPEN
                sends = self._fail(RankLost([rank], detail), now)
                # Between rounds nobody waits: each rank gets the failure when it next reports.
                return sends if waiting else _NOTHING
            case _E.ABANDON:
                self._abandon()
                return _NOTHING
            case _E.DISBAND:
                self._move(_E.DISBAND)
                self._round = None
                self._dead = frozenset()
                self._left = frozenset()
                return self._rejoin_queued(now)
            case _:
                self._move(_E.LEAVE)
                if not self._members:
                    self._dead = frozenset()  # failed and empty: the next epoch starts whole
                elif self.on_rank_loss is OnRankLoss.NEUTRALIZE:
                    self._dead |= {rank}
                    if self._round is not None:
                        self._round.withdraw(rank)
                return self._complete_if_ready(now, None)

    def undecodable(self, peer: bytes, detail: str, now: float) -> Sequence[Send]:
        """A message from member `peer` did not decode (a report over the size limits, a
        value out of range of its type): a protocol violation by that rank, which fails the
        group at once with a `ProtocolError` naming it (the others would otherwise wait out
        the step timeout and blame it as late). As with a lost rank, only an open round's
        ranks are sent the failure now; the others get it when they next report. Nothing for
        a peer that holds no rank, or once the group has failed."""
        rank = self._peer_rank.get(peer)
        if rank is None or self._state is _S.FAILED:
            return _NOTHING
        waiting = self._state is _S.ROUND_OPEN
        sends = self._fail(ProtocolError(f"undecodable message: {detail}", rank=rank), now)
        return sends if waiting else _NOTHING

    def next_deadline(self) -> float | None:
        """When `on_deadline` must next be called, or None."""
        due = None if self._round is None else self._round.started + self.step_timeout
        waiting = self._resizing.deadline()
        if waiting is not None:
            due = waiting if due is None else min(due, waiting)
        return due

    def on_deadline(self, now: float) -> Sequence[Send]:
        if self._resizing.due(now):
            return [*self._refuse_resizes(now), *self._round_deadline(now)]
        return self._round_deadline(now)

    def _round_deadline(self, now: float) -> Sequence[Send]:
        rnd = self._round
        if rnd is None or now < rnd.started + self.step_timeout:
            return _NOTHING
        if rnd.disputed:
            verdict = rnd.verdict()
            if verdict is not None:
                return self._fail_disputed(rnd, verdict, now)
        reports = rnd.reports
        missing = [r for r in range(self.dp_size) if reports[r] is None and r not in self._dead]
        return self._fail(StepTimeout(missing, self.step_timeout), now)

    def shutdown(self, text: str = "coordd is shutting down") -> Sequence[Send]:
        peers = self.peers()
        return (Send(peers, Goodbye(text=text)),) if peers else _NOTHING

    # -- queries ----------------------------------------------------------------------------

    @property
    def state(self) -> GroupState:
        return self._state

    @property
    def stops(self) -> int:
        """Times every rank left the group cleanly (as in the snapshot)."""
        return self._stops

    @property
    def failures(self) -> int:
        """Group failures so far (as in the snapshot): the daemon compares it once per drain,
        which costs nothing, and builds a snapshot only when it moved."""
        return self._failures

    @property
    def decisions(self) -> int:
        """Rounds decided so far (as in the snapshot), without building one."""
        return self._decisions

    def holders(self) -> list[bytes]:
        """Every peer that holds a rank: this epoch's members, and the ranks of a failed epoch
        still connected that have not registered again (the daemon must tell the machine when
        any of them closes)."""
        return [*(m.peer for m in self._members.values()), *self._held_rank]

    def peers(self) -> tuple[bytes, ...]:
        """Every registered peer of the current epoch, in rank order (cached)."""
        if self._peers is None:
            self._peers = tuple(self._members[r].peer for r in sorted(self._members))
        return self._peers

    def snapshot(self) -> GroupSnapshot:
        """The group as it stands, read-only (built again only after the group changed)."""
        snap = self._snapshot
        if snap is None:
            if self._members_view is None:
                self._members_view = MappingProxyType(dict(sorted(self._members.items())))
            snap = self._snapshot = GroupSnapshot(
                state=self._state,
                dp_size=self.dp_size,
                max_dp_size=self.max_dp_size,
                on_rank_loss=self.on_rank_loss,
                step_timeout=self.step_timeout,
                epoch=self._epoch,
                seq=self._seq,
                members=self._members_view,
                dead=self._dead,
                round=None if self._round is None else self._round.view(),
                last_failure=self._failure,
                failures=self._failures,
                decisions=self._decisions,
                left=self._left,
                reforming=self._reforming,
                held=len(self._held),
                departures=self._departures,
                stops=self._stops,
                last_round=self._last_round,
            )
        return snap

    # -- the one place the state changes ----------------------------------------------------

    def _move(self, event: GroupEvent) -> None:
        """Take `event` by the table (`IllegalTransition` if it has no such move)."""
        self._state = next_state(self._state, event)
        self._snapshot = None

    def _loss_event(self) -> GroupEvent:
        """What losing a member (already removed) does to the group."""
        if self._state is _S.FAILED:
            return _E.LEAVE
        if not self._members and self._reforming:
            return _E.ABANDON
        if not self._members:
            # the last rank lost: a loss after others left cleanly is still a fault
            return _E.FAIL if self._left - self._dead else _E.DISBAND
        if self.on_rank_loss is OnRankLoss.NEUTRALIZE:
            return _E.LEAVE
        return _E.FAIL

    # -- reports ----------------------------------------------------------------------------

    def _on_report(self, peer: bytes, report: Report, now: float) -> Sequence[Send]:
        rank = self._peer_rank.get(peer)
        if rank is None or report.epoch != self._epoch:
            return (Send((peer,), self._stranger_failure(report)),)
        if self._state is _S.FAILED:
            assert self._failure is not None
            return (Send((peer,), self._failure),)
        if report.dp_rank != rank:
            error = ProtocolError(
                f"peer registered as rank {rank} reported as rank {report.dp_rank}",
                rank=rank,  # the culprit is the sender, not the rank it claimed
            )
            return (Send((peer,), self._failure_of(error, report)),)
        if report.kind is _GATHER and type(report) is StepReport:
            error = ProtocolError(
                "a StepReport of kind gather (a gather round takes a GatherReport)", rank=rank
            )
            return (Send((peer,), self._failure_of(error, report)),)
        rnd = self._round
        decided = self._decided
        if (
            report.seq != self._seq
            and decided is not None
            and report.seq == decided.round.seq
            and decided.round.reports[rank] == report
        ):
            return (Send((peer,), decided.decision),)
        gone = self._left - self._dead
        if gone:
            # A peer left cleanly and this rank still syncs: that round can never complete.
            # Nobody else waits between rounds: each rank gets the failure when it reports.
            self._fail(RankLost(sorted(gone), LEFT_THE_GROUP), now, report)
            assert self._failure is not None
            return (Send((peer,), self._failure),)
        if report.seq != self._seq:
            expected = report.label if rnd is None else rnd.label
            return self._fail(
                StepMismatch(rank, self._seq, expected, report.seq, report.label), now, report
            )
        first: Report | None = None
        if rnd is not None:
            previous = rnd.reports[rank]
            if previous is not None:
                if previous == report:
                    return _NOTHING
                return self._fail(ConflictingReport(rank, report.seq), now, report)
            first = rnd.first
            if report.kind is not rnd.kind or (rnd.kind is _GATHER and report.label != rnd.label):
                # Another kind (or site) than the first report's: which rank is wrong shows
                # only once the others have reported (see `Round.verdict`).
                rnd.disputed = True
                first = rnd.first_of(report.label)
        try:
            if type(report) is StepReport:
                validate_report(rank, report)
            else:
                validate_gather(rank, report, self.dp_size, first)  # type: ignore[arg-type]
        except InvalidReport as error:
            return self._fail(error, now, report)
        if rnd is None:
            self._move(_E.OPEN)
            rnd = self._round = Round(self._seq, report, now, self.dp_size)
        else:
            self._move(_E.REPORT)
        rnd.add(rank, report, now)
        return self._complete_if_ready(now, rank)

    def _complete_if_ready(self, now: float, last_rank: int | None) -> Sequence[Send]:
        rnd = self._round
        if rnd is None or rnd.reported == 0 or rnd.reported < self.dp_size - len(self._dead):
            return _NOTHING
        if len(self._members) + len(self._dead) < self.dp_size:
            return _NOTHING
        if rnd.disputed:
            verdict = rnd.verdict()
            if verdict is not None:
                return self._fail_disputed(rnd, verdict, now)
        dead = self._dead
        decision: Outcome
        if rnd.kind is _GATHER:
            decision = self._gathered(rnd)
        else:
            group = self._members[min(self._members)].hello
            decision = decide(
                [None if r in dead else rep for r, rep in enumerate(rnd.reports)],  # type: ignore[misc]
                group.num_ubatches,
                epoch=self._epoch,
                seq=rnd.seq,
                kind=rnd.kind,
            )
        self._move(_E.DECIDE)
        self._round = None
        self._seq += 1
        self._decided = _Decided(rnd, decision)
        self._decisions += 1
        self._last_round = CompletedRound(
            rnd.seq, rnd.kind, rnd.started, now, last_rank, rnd.arrivals, rnd.site
        )
        sends = [Send(self.peers(), decision)]
        queued, self._queued = self._queued, []
        for peer, hello in queued:
            sends.extend(self._join(peer, hello, now))
        return sends

    def _gathered(self, rnd: Round) -> GatherResult:
        """A gather round's result: each rank's values, [] for a rank left out."""
        dead = self._dead
        rows = [
            [] if rep is None or r in dead else rep.values  # type: ignore[union-attr]
            for r, rep in enumerate(rnd.reports)
        ]
        return GatherResult(
            epoch=self._epoch, seq=rnd.seq, site=rnd.site, rows=rows, dead_ranks=sorted(dead)
        )

    def _stranger_failure(self, report: Report) -> StepFailed:
        """A report from a peer outside the current epoch's membership."""
        last = self._failure
        if last is not None and report.epoch == last.epoch:
            return last
        if report.epoch != self._epoch:
            error: CoordError = CoordinatorUnavailable(
                f"epoch {report.epoch} is not coordd's current epoch {self._epoch} "
                "(coordd restarted or the group re-formed): register again"
            )
        elif report.dp_rank in self._dead:
            # Elastic: a rank left out of the group (lost, then back without a Hello) gets an
            # error, never a decision of rounds it is no longer part of.
            error = RankLost(
                [report.dp_rank], "it was left out of the group after it was lost: register again"
            )
        else:
            error = ProtocolError("report from a peer that has not registered", rank=report.dp_rank)
        return self._failure_of(error, report)

    def _failure_of(self, error: CoordError, report: Report) -> StepFailed:
        return failure_message(error, epoch=self._epoch, seq=report.seq, kind=report.kind)

    def _fail_disputed(self, rnd: Round, verdict: Verdict, now: float) -> Sequence[Send]:
        """A round whose reports disagree on the kind (or site) fails naming the culprit by its
        evidence: the lowest rank off the majority label (the device path's rule)."""
        rnd.kind = verdict.kind
        got = verdict.report
        error = StepMismatch(verdict.rank, rnd.seq, verdict.label, got.seq, got.label)
        return self._fail(error, now)

    def _fail(self, error: CoordError, now: float, report: Report | None = None) -> Sequence[Send]:
        """End the round (and the group) with `error`; `report` is the one that caused it."""
        if self._round is not None:
            kind = self._round.kind
        else:
            kind = report.kind if report is not None else StepKind.FORWARD
        failure = failure_message(error, epoch=self._epoch, seq=self._seq, kind=kind)
        self._move(_E.FAIL)
        self._round = None
        self._failure = failure
        self._failures += 1
        self._reforming = True
        return [Send(self.peers(), failure), *self._rejoin_queued(now)]

    # -- membership -------------------------------------------------------------------------

    def _on_hello(
        self, peer: bytes, hello: Hello, now: float, resize_deadline: float | None = None
    ) -> Sequence[Send]:
        try:
            check_basics(hello, self.max_dp_size)
            if hello.dp_size != self.dp_size and (self._members or self._held):
                return self._wait_to_resize(peer, hello, now, resize_deadline)
            # The same checks before and after a failure: a rank held by a live connection (of
            # this epoch, or of a failed one that has not registered again) is taken, and the
            # group's settings are those of the ranks still connected.
            if self._held:
                holders = {**self._held, **self._members}
                check_membership(peer, hello, holders, {**self._held_rank, **self._peer_rank})
            else:
                check_membership(peer, hello, self._members, self._peer_rank)
        except Rejected as error:
            return (Send((peer,), reject_message(error)),)
        if self._state is _S.FAILED:
            self._reform()
        elif self._state is _S.STOPPED:
            self._restart()
        if hello.dp_size != self.dp_size:  # no rank holds the group: it forms at this size
            self.dp_size = hello.dp_size
            self._dead = frozenset()
            self._members_changed()
        if hello.dp_rank in self._dead and self._state is _S.ROUND_OPEN:
            return self._queue(peer, hello)
        return self._join(peer, hello, now)

    def _wait_to_resize(
        self, peer: bytes, hello: Hello, now: float, deadline: float | None
    ) -> Sequence[Send]:
        """A Hello at another size while ranks hold the group: it waits for them to leave
        (elastic EP re-forming DP), until the step timeout."""
        held = self._peer_rank.get(peer, self._held_rank.get(peer))
        if held is not None:
            raise resize_while_holding(hello, held, self.dp_size)
        if deadline is None:
            deadline = now + self.step_timeout
        self._resizing.wait(peer, hello, deadline)
        return _NOTHING

    def _admit_resizes(self, now: float) -> list[Send]:
        """Once no rank holds the group, the waiting Hellos count, in the order they came."""
        if self._members or self._held:
            return []
        sends: list[Send] = []
        for peer, hello, deadline in self._resizing.take():
            sends.extend(self._on_hello(peer, hello, now, resize_deadline=deadline))
        return sends

    def _refuse_resizes(self, now: float) -> list[Send]:
        holders = sorted({*self._members, *self._held})
        sends: list[Send] = []
        for waiting in self._resizing.expire(now):
            error = resize_refused(waiting.hello, self.dp_size, holders, self.step_timeout)
            sends.append(Send((waiting.peer,), reject_message(error)))
        return sends

    def _queue(self, peer: bytes, hello: Hello) -> Sequence[Send]:
        """Elastic: a returning rank joins at the next round boundary, never mid-round."""
        for queued, queued_hello in self._queued:
            if queued_hello.dp_rank == hello.dp_rank and queued != peer:
                return (Send((peer,), reject_message(rank_taken(queued_hello, hello))),)
        self._move(_E.QUEUE)
        self._queued = [(p, h) for p, h in self._queued if p != peer]
        self._queued.append((peer, hello))
        return _NOTHING

    def _join(self, peer: bytes, hello: Hello, now: float) -> Sequence[Send]:
        self._move(_E.JOIN)
        self._left -= {hello.dp_rank}
        held = self._held.pop(hello.dp_rank, None)
        if held is not None:
            del self._held_rank[held.peer]
        self._dead -= {hello.dp_rank}
        self._members[hello.dp_rank] = Member(peer, hello, now)
        self._peer_rank[peer] = hello.dp_rank
        if self._reforming and len(self._members) + len(self._dead) >= self.dp_size:
            self._reforming = False  # every rank is back: the group re-formed
        self._members_changed()
        welcome = Welcome(
            epoch=self._epoch,
            next_seq=self._seq,
            dp_size=self.dp_size,
            step_timeout=self.step_timeout,
        )
        return (Send((peer,), welcome),)

    def _rejoin_queued(self, now: float) -> list[Send]:
        """The open round ended without a decision: each rank queued to rejoin was no part of
        it, so its Hello counts now, as if it had come a moment later (after a failure the
        first one opens the new epoch)."""
        queued, self._queued = self._queued, []
        sends: list[Send] = []
        for peer, hello in queued:
            sends.extend(self._on_hello(peer, hello, now))
        return sends

    def _remove(self, rank: int) -> None:
        member = self._members.pop(rank)
        self._peer_rank.pop(member.peer, None)
        self._members_changed()

    def _reform(self) -> None:
        """The first Hello after a failure (checked against the failed epoch's ranks still
        connected) re-forms the group: new epoch, next seq. The old members that are still
        connected keep holding their ranks until they register again or leave."""
        assert self._failure is not None
        self._move(_E.REFORM)
        self._epoch += 1
        self._seq = self._failure.seq + 1
        for rank, member in self._members.items():
            self._held[rank] = member
            self._held_rank[member.peer] = rank
        self._members.clear()
        self._peer_rank.clear()
        self._left = frozenset()
        self._members_changed()
        # `_dead` stays: in elastic mode the new epoch goes on without the ranks that are gone.

    def _abandon(self) -> None:
        """The last rank of a re-forming epoch left (Goodbye or loss) before every rank was
        back: the group is FAILED again with the failure that started it (not counted again).
        The ranks of the failed epoch still connected keep holding their ranks."""
        self._move(_E.ABANDON)
        self._round = None
        self._left = frozenset()
        self._queued = []

    def _restart(self) -> None:
        """The first Hello after every rank left cleanly: a new epoch, the next seq."""
        self._move(_E.REFORM)
        self._epoch += 1
        self._left = frozenset()
        self._members_changed()

    def _members_changed(self) -> None:
        self._peers = None
        self._members_view = None
        self._snapshot = None
