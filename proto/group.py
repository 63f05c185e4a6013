"""One DP group's membership, rounds and faults, sans-IO, for every way into the group.

A group's members are whoever registered to speak for a set of its DP ranks: a rank speaks
for itself (the rank wire, `coordd.proto.coordinator.Coordinator`), a relay for its node's
ranks (the relay wire at the root, `coordd.proto.tree.TreeCoordinator`). Every group rule is
written here once, over members:
- registration against the ranks live connections hold, and the wait of one at another size
  until they leave (`ResizeWaits`), refused after the step timeout;
- a round: each member sends one part (a report, a bundle) covering its ranks; the round is
  decided once every member sent its part and every rank is a member's or left out; another
  seq, a second different part or an invalid one fails it naming the member's lowest rank,
  and parts that disagree on the kind (or site) fail it by the evidence (`Round.verdict`);
- the step timeout (`StepTimeout` naming the uncovered ranks), a lost member (`RankLost`
  naming its ranks), fail-stop with re-forming in a new epoch while the failed epoch's
  members still connected hold their ranks (`_held`), clean departures and stops, elastic
  leaving-out (`_dead`), and the snapshot readers see.
The group's states and moves are `coordd.proto.group_state`'s table; `_move` is the only
place the state changes. A way in adds what only its wire knows: how a registration claims
ranks (`_claim`), how a part is checked (`_misfit`, `_check_part`) and decided (`_outcome`),
and how answers are addressed (`_out`).

Fail-stop and clean exits are as `coordd.proto.coordinator` tells them for ranks: a failure
stands until a member registers again (a new epoch, the seq after the failed one); a member
leaving between rounds takes its ranks out (`left`), and once all have, the group is STOPPED.
"""

# Whole though over 500 lines: one state machine; split, each part would reach into the
# others' membership and round.

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from coordd.proto.errors import (
    ConflictingReport,
    CoordError,
    CoordinatorUnavailable,
    InvalidReport,
    RankLost,
    Rejected,
    StepMismatch,
    StepTimeout,
)
from coordd.proto.group_state import TRANSITIONS, GroupEvent, GroupState, IllegalTransition
from coordd.proto.membership import rank_taken
from coordd.proto.messages import (
    Goodbye,
    StepFailed,
    StepKind,
    Welcome,
    failure_message,
    reject_message,
)
from coordd.proto.resize_waits import ResizeWaits
from coordd.proto.rounds import CompletedRound, Decided, Round, Verdict
from coordd.proto.snapshot import GroupMember, GroupSnapshot, Member, OnRankLoss

_E, _S = GroupEvent, GroupState
_GATHER = StepKind.GATHER

#: `RankLost.detail` of a rank that said Goodbye: an orderly departure, not a crash.
LEFT_THE_GROUP = "left the group"


M = TypeVar("M", bound=GroupMember)
S = TypeVar("S")


class GroupMachine(Generic[M, S]):
    """One DP group's members, rounds and faults (`M`: a member, `S`: what `_out` builds)."""

    #: Whether a failure between rounds goes to every member at once (relays may have a
    #: node's round open) or to each when it next sends a part (ranks: nobody waits).
    tell_idle_failures = False
    #: How much past the step timeout the open round waits.
    grace = 0.0
    #: Whether a registration brings its ranks back in (elastic): a rank's does; a relay's
    #: does not (its ranks are back once a bundle carries them).
    registration_revives = True

    def __init__(
        self, dp_size: int, *, epoch: int, step_timeout: float, on_rank_loss: OnRankLoss
    ) -> None:
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        #: coordd's --dp: the most ranks an epoch may have.
        self.max_dp_size = dp_size
        #: This epoch's size, set by the first registration of an epoch.
        self.dp_size = dp_size
        self.step_timeout = step_timeout
        self.on_rank_loss = on_rank_loss
        self._state = _S.EMPTY
        self._epoch = epoch
        self._seq = 0
        #: Every rank a member of this epoch speaks for, and the member.
        self._members: dict[int, M] = {}
        self._by_peer: dict[bytes, M] = {}
        #: Members of an earlier (failed) epoch whose connections are still open and that have
        #: not registered again: each still holds its ranks and binds the group's settings,
        #: so a stranger cannot take them or re-form the group with other settings. One leaves
        #: here when its connection closes, it leaves, or it registers again.
        self._held: dict[bytes, M] = {}
        #: Elastic: ranks left out of rounds (neutral in every decision).
        self._dead: frozenset[int] = frozenset()
        #: Ranks of this epoch whose members left cleanly between rounds.
        self._left: frozenset[int] = frozenset()
        self._departures = 0
        self._stops = 0
        self._round: Round | None = None
        #: Elastic: members back for ranks left out, admitted when the open round ends.
        self._queued: list[tuple[bytes, Any, tuple[int, ...]]] = []
        self._resizing: ResizeWaits[Any] = ResizeWaits()
        self._failure: StepFailed | None = None
        self._failures = 0
        #: The group failed and has not re-formed since (no later epoch had every rank
        #: registered): the failure stands, whatever a Hello or Goodbye of one peer does.
        self._reforming = False
        self._decided: Decided | None = None
        self._decisions = 0
        self._last_round: CompletedRound | None = None
        self._peers: tuple[bytes, ...] | None = None
        self._view: MappingProxyType[int, Member] | None = None
        self._snapshot: GroupSnapshot | None = None

    # -- what a way in supplies -------------------------------------------------------------

    def _out(self, peers: tuple[bytes, ...], message: Any) -> S:
        """The send of `message` (a Welcome, Reject, decision or failure) to `peers`."""
        raise NotImplementedError

    def _check_basics(self, hello: Any) -> None:
        """What a registration must satisfy whoever holds the group; `Rejected` if not."""
        raise NotImplementedError

    def _claim(self, peer: bytes, hello: Any) -> tuple[int, ...]:
        """The ranks `hello` may take against the members and held ones; `Rejected` if not."""
        raise NotImplementedError

    def _member(self, peer: bytes, hello: Any, ranks: tuple[int, ...], now: float) -> M:
        raise NotImplementedError

    def _greet(self, member: M) -> S:
        """The Welcome to a member that joined (`_welcome_now`, addressed)."""
        raise NotImplementedError

    def _welcome_now(self) -> Welcome:
        return Welcome(
            epoch=self._epoch,
            next_seq=self._seq,
            dp_size=self.dp_size,
            step_timeout=self.step_timeout,
        )

    def _holding(self, holder: M, hello: Any) -> Rejected:
        """A connection that holds ranks asks another size: it must leave first."""
        raise NotImplementedError

    def _resize_refusal(self, hello: Any) -> Rejected:
        """A registration at another size whose wait ran out: the holders stayed."""
        raise NotImplementedError

    def _misfit(self, member: M, part: Any) -> CoordError | None:
        """A part that is not its member's to send (the group goes on; only it is told)."""
        raise NotImplementedError

    def _check_part(self, member: M, part: Any, first: Any) -> CoordError | bool:
        """The part's `_misfit` error if any; else `InvalidReport` raised for a part no member
        could send, True if the part itself shows its ranks disagree on the round's kind (the
        round is disputed), False if it is fine. One call on the hot path for both checks."""
        raise NotImplementedError

    def _outcome(self, rnd: Round) -> Any:
        """The decision (or gather result) of a round every rank is in or left out of."""
        raise NotImplementedError

    def _lost_error(self, member: M, detail: str) -> CoordError:
        raise NotImplementedError

    def _unregistered(self, part: Any) -> CoordError:
        """The error for a part of this epoch from a peer that is no member."""
        raise NotImplementedError

    def _verdict(self, rnd: Round) -> Verdict | None:
        return rnd.verdict()

    # -- inputs -----------------------------------------------------------------------------

    def peer_lost(self, peer: bytes, now: float, detail: str = "disconnected") -> Sequence[S]:
        """The transport says `peer` is gone (closed, or missed heartbeats)."""
        if not self._resizing:
            return self._on_lost(peer, now, detail)
        self._resizing.drop(peer)
        return [*self._on_lost(peer, now, detail), *self._admit_resizes(now)]

    def next_deadline(self) -> float | None:
        """When `on_deadline` must next be called, or None."""
        rnd = self._round
        due = None if rnd is None else rnd.started + self.step_timeout + self.grace
        if self._resizing:  # (no registration waiting, most of the time: no min() over none)
            waiting = self._resizing.deadline()
            if waiting is not None:
                due = waiting if due is None else min(due, waiting)
        return due

    def marks(self) -> tuple[int, int, float | None]:
        """`failures`, `stops` and `next_deadline()` in one call: what the shell compares
        after every drain that fed the group (once per wakeup)."""
        return self._failures, self._stops, self.next_deadline()

    def on_deadline(self, now: float) -> Sequence[S]:
        if self._resizing.due(now):
            return [*self._refuse_resizes(now), *self._round_deadline(now)]
        return self._round_deadline(now)

    def shutdown(self, text: str = "coordd is shutting down") -> Sequence[S]:
        peers = self.peers()
        return (self._out(peers, Goodbye(text=text)),) if peers else ()

    # -- queries ----------------------------------------------------------------------------

    @property
    def state(self) -> GroupState:
        return self._state

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def seq(self) -> int:
        return self._seq

    @property
    def stops(self) -> int:
        """Times every member left the group cleanly (as in the snapshot)."""
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

    @property
    def last_failure(self) -> StepFailed | None:
        return self._failure

    @property
    def last_round(self) -> CompletedRound | None:
        """The last completed round (as in the snapshot), without building one."""
        return self._last_round

    def ranks_registered(self) -> int:
        """How many ranks are registered in this epoch: the snapshot's `len(members)`,
        without building one."""
        return len(self._member_view())

    def rank_of(self, peer: bytes) -> int | None:
        """The (lowest) rank `peer` speaks for in this epoch, or None: one dict lookup, for
        the shell's per-report checks (the snapshot's `rank_of` scans the members)."""
        member = self._by_peer.get(peer)
        return None if member is None else member.rank

    def holders(self) -> list[bytes]:
        """Every peer that holds ranks: this epoch's members, and the members of a failed
        epoch still connected that have not registered again (the daemon must tell the
        machine when any of them closes)."""
        return [*self._by_peer, *self._held]

    def peers(self) -> tuple[bytes, ...]:
        """Every member of the current epoch, in rank order (cached)."""
        if self._peers is None:
            members = self._members
            self._peers = tuple(dict.fromkeys(members[r].peer for r in sorted(members)))
        return self._peers

    def snapshot(self) -> GroupSnapshot:
        """The group as it stands, read-only (built again only after the group changed)."""
        snap = self._snapshot
        if snap is None:
            rnd = self._round
            snap = self._snapshot = GroupSnapshot(
                state=self._state,
                dp_size=self.dp_size,
                max_dp_size=self.max_dp_size,
                on_rank_loss=self.on_rank_loss,
                step_timeout=self.step_timeout,
                epoch=self._epoch,
                seq=self._seq,
                members=self._member_view_cached(),
                dead=self._dead,
                round=None if rnd is None else rnd.view(),
                last_failure=self._failure,
                failures=self._failures,
                decisions=self._decisions,
                left=self._left,
                reforming=self._reforming,
                held=sum(len(m.ranks) for m in self._held.values()),
                departures=self._departures,
                stops=self._stops,
                last_round=self._last_round,
            )
        return snap

    def _member_view_cached(self) -> MappingProxyType[int, Member]:
        if self._view is None:
            self._view = MappingProxyType(dict(sorted(self._member_view().items())))
        return self._view

    def _member_view(self) -> dict[int, Member]:
        """Each rank registered in this epoch as a `Member` (a rank's own member)."""
        return self._members  # type: ignore[return-value]

    # -- the one place the state changes ----------------------------------------------------

    def _move(self, event: GroupEvent) -> None:
        """Take `event` by the table (`IllegalTransition` if it has no such move):
        `next_state`, written out (a move a report)."""
        try:
            self._state = TRANSITIONS[self._state][event]
        except KeyError:
            raise IllegalTransition(self._state, event) from None
        self._snapshot = None

    def _members_changed(self) -> None:
        self._peers = None
        self._view = None
        self._snapshot = None

    def _loss_event(self) -> GroupEvent:
        """What losing a member (already removed) does to the group."""
        if self._state is _S.FAILED:
            return _E.LEAVE
        if not self._members and self._reforming:
            return _E.ABANDON
        if not self._members:
            # the last member lost: a loss after others left cleanly is still a fault
            return _E.FAIL if self._left - self._dead else _E.DISBAND
        if self.on_rank_loss is OnRankLoss.NEUTRALIZE:
            return _E.LEAVE
        return _E.FAIL

    # -- members ----------------------------------------------------------------------------

    def _on_hello(
        self, peer: bytes, hello: Any, now: float, resize_deadline: float | None = None
    ) -> Sequence[S]:
        try:
            self._check_basics(hello)
            if hello.dp_size != self.dp_size and (self._members or self._held):
                return self._wait_to_resize(peer, hello, now, resize_deadline)
            # The same checks before and after a failure: ranks held by a live connection
            # (of this epoch, or of a failed one not registered again) are taken, and the
            # group's settings are those of the members still connected.
            ranks = self._claim(peer, hello)
        except Rejected as error:
            return (self._out((peer,), reject_message(error)),)
        resized = hello.dp_size != self.dp_size
        if self._state is _S.FAILED:
            self._reform()
        elif self._state is _S.STOPPED:
            self._restart()
        elif resized:
            self._renew()
        if resized:  # no member holds the group: it forms at this size
            self.dp_size = hello.dp_size
            self._dead = frozenset()
            self._members_changed()
        if self._round is not None and not self._dead.isdisjoint(ranks):
            return self._queue(peer, hello, ranks)
        return self._join(peer, hello, ranks, now)

    def _wait_to_resize(
        self, peer: bytes, hello: Any, now: float, deadline: float | None
    ) -> Sequence[S]:
        """A registration at another size while members hold the group: it waits for them
        to leave (elastic EP re-forming DP), until the step timeout."""
        holding = self._by_peer.get(peer) or self._held.get(peer)
        if holding is not None:
            raise self._holding(holding, hello)
        self._resizing.wait(peer, hello, now + self.step_timeout if deadline is None else deadline)
        return ()

    def _admit_resizes(self, now: float) -> list[S]:
        """Once no member holds the group, the waiting registrations count, in their order."""
        if self._members or self._held:
            return []
        sends: list[S] = []
        for peer, hello, deadline in self._resizing.take():
            sends.extend(self._on_hello(peer, hello, now, resize_deadline=deadline))
        return sends

    def _refuse_resizes(self, now: float) -> list[S]:
        return [
            self._out((waiting.peer,), reject_message(self._resize_refusal(waiting.hello)))
            for waiting in self._resizing.expire(now)
        ]

    def _holders(self) -> list[M]:
        """The members and held ones, by their lowest rank."""
        return sorted({**self._held, **self._by_peer}.values(), key=lambda m: m.ranks)

    def _queue(self, peer: bytes, hello: Any, ranks: tuple[int, ...]) -> Sequence[S]:
        """Elastic: a member back for ranks left out joins at the next round boundary."""
        for queued, _, queued_ranks in self._queued:
            taken = set(ranks).intersection(queued_ranks)
            if queued != peer and taken:
                return (self._out((peer,), reject_message(rank_taken(min(taken)))),)
        self._move(_E.QUEUE)
        self._queued = [q for q in self._queued if q[0] != peer]
        self._queued.append((peer, hello, ranks))
        return ()

    def _join(self, peer: bytes, hello: Any, ranks: tuple[int, ...], now: float) -> Sequence[S]:
        self._move(_E.JOIN)
        old = self._by_peer.get(peer)
        if old is not None:
            self._remove(old)
        self._held.pop(peer, None)
        self._left -= set(ranks)
        if self.registration_revives:
            self._dead -= set(ranks)
        member = self._member(peer, hello, ranks, now)
        self._by_peer[peer] = member
        for r in ranks:
            self._members[r] = member
        if self._reforming and self._accounted():
            self._reforming = False  # every rank is back: the group re-formed
        self._members_changed()
        return (self._greet(member),)

    def _accounted(self) -> bool:
        """Every rank is a member's or left out."""
        if len(self._members) >= self.dp_size:
            return True
        return len(self._members.keys() | self._dead) >= self.dp_size

    def _rejoin_queued(self, now: float) -> list[S]:
        """The open round ended without a decision: each member queued to rejoin was no part
        of it, so its Hello counts now, as if it had come a moment later."""
        queued, self._queued = self._queued, []
        sends: list[S] = []
        for peer, hello, _ in queued:
            sends.extend(self._on_hello(peer, hello, now))
        return sends

    def _remove(self, member: M) -> None:
        del self._by_peer[member.peer]
        for r in member.ranks:
            if self._members.get(r) is member:
                del self._members[r]
        self._members_changed()

    def _reform(self) -> None:
        """The first registration after a failure re-forms the group: new epoch, the seq
        after the failed one. The old members still connected hold their ranks until they
        register again or leave; `_dead` stays (elastic: the epoch goes on without them)."""
        assert self._failure is not None
        self._move(_E.REFORM)
        self._epoch += 1
        self._seq = self._failure.seq + 1
        self._held.update(self._by_peer)
        self._members.clear()
        self._by_peer.clear()
        self._left = frozenset()
        self._members_changed()

    def _restart(self) -> None:
        """The first registration after every member left cleanly: a new epoch."""
        self._move(_E.REFORM)
        self._epoch += 1
        self._left = frozenset()
        self._members_changed()

    def _renew(self) -> None:
        """An empty group forms at another size: a new epoch (an epoch has one size)."""
        self._epoch += 1
        self._members_changed()

    def _abandon(self) -> None:
        """The last member of a re-forming epoch left before every rank was back: FAILED
        again with the failure that started it (not counted again)."""
        self._move(_E.ABANDON)
        self._round = None
        self._left = frozenset()
        self._queued = []

    def _depart(self, peer: bytes, now: float) -> Sequence[S]:
        """A member leaves in order. Between rounds that is no fault: its ranks have `left`,
        and the group STOPPED once no member is registered. With a round open (its peers wait
        on it) or the group failed, it is a loss like any other, said as a departure."""
        member = self._by_peer.get(peer)
        if member is None or self._state is not _S.IDLE:
            return self.peer_lost(peer, now, detail=LEFT_THE_GROUP)
        self._remove(member)
        self._departures += 1
        self._left |= set(member.ranks)
        if not self._members and self._reforming:
            self._abandon()
        elif not self._members:
            self._move(_E.STOP)
            self._stops += 1
            self._dead = frozenset()
            self._left = frozenset()
        else:
            self._move(_E.DEPART)
            if self.on_rank_loss is OnRankLoss.NEUTRALIZE:
                self._dead |= set(member.ranks)  # left out of later rounds, as if lost
        return [*self._admit_resizes(now)] if self._resizing else ()

    def _on_lost(self, peer: bytes, now: float, detail: str) -> Sequence[S]:
        member = self._by_peer.get(peer)
        if member is None:
            self._queued = [q for q in self._queued if q[0] != peer]
            self._held.pop(peer, None)
            return ()
        self._remove(member)
        match self._loss_event():
            case _E.FAIL:
                waiting = self._state is _S.ROUND_OPEN
                sends = self._fail(self._lost_error(member, detail), now)
                return sends if waiting or self.tell_idle_failures else ()
            case _E.ABANDON:
                self._abandon()
                return ()
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
                    self._dead |= set(member.ranks)
                    if self._round is not None:
                        self._round.withdraw(member.rank)
                return self._complete_if_ready(now, None)

    # -- rounds -----------------------------------------------------------------------------

    def _on_part(self, peer: bytes, part: Any, now: float) -> Sequence[S]:
        member = self._by_peer.get(peer)
        if member is None or part.epoch != self._epoch:
            return (self._out((peer,), self._stranger_failure(part)),)
        if self._state is _S.FAILED:
            return (self._out((peer,), self._failure),)
        rank = member.rank
        rnd = self._round
        decided = self._decided
        if (
            part.seq != self._seq
            and decided is not None
            and part.seq == decided.round.seq
            and decided.round.reports[rank] == part
        ):
            return (self._out((peer,), decided.decision),)
        if (
            part.seq != self._seq
            or (self._left and self._left - self._dead)
            or (rnd is not None and rnd.reports[rank] is not None)
        ):
            return self._off_course(member, part, now)
        first = None
        differs = False
        if rnd is not None:
            first = rnd.first
            if part.kind is not rnd.kind or (rnd.kind is _GATHER and part.label != rnd.label):
                differs = True
                first = rnd.first_of(part.label)
        try:
            checked = self._check_part(member, part, first)
        except InvalidReport as error:
            return self._fail(error, now, part)
        if checked is not False and checked is not True:
            return (self._out((peer,), self._failure_of(checked, part)),)
        if differs:
            # Another kind (or site) than the first part's: which rank is wrong shows only
            # once the others have sent theirs (see `Round.verdict`).
            rnd.disputed = True  # type: ignore[union-attr]
        if rnd is None:
            self._move(_E.OPEN)
            rnd = self._round = Round(self._seq, part, now, self.dp_size)
        else:
            self._move(_E.REPORT)
        rnd.add(rank, part, now)
        if checked:
            rnd.disputed = True
        return self._complete_if_ready(now, rank)

    def _off_course(self, member: M, part: Any, now: float) -> Sequence[S]:
        """A part that is not the next one its member owes the open round: not its to send
        (only it is told), ranks have left (the round can never complete), another seq, or
        a second one for the round (the same again is ignored; another is a conflict)."""
        misfit = self._misfit(member, part)
        if misfit is not None:
            return (self._out((member.peer,), self._failure_of(misfit, part)),)
        rank = member.rank
        rnd = self._round
        gone = self._left - self._dead
        if gone:
            # Ranks left cleanly and this member still syncs: the round can never complete.
            sends = self._fail(RankLost(sorted(gone), LEFT_THE_GROUP), now, part)
            return sends if self.tell_idle_failures else (self._out((member.peer,), self._failure),)
        if part.seq != self._seq:
            expected = part.label if rnd is None else rnd.label
            return self._fail(
                StepMismatch(rank, self._seq, expected, part.seq, part.label), now, part
            )
        if rnd is not None and rnd.reports[rank] == part:
            return ()
        return self._fail(ConflictingReport(rank, part.seq), now, part)

    def _complete_if_ready(self, now: float, last_rank: int | None) -> Sequence[S]:
        rnd = self._round
        if rnd is None or rnd.reported == 0 or rnd.reported < len(self._by_peer):
            return ()
        if len(self._members) < self.dp_size and not self._accounted():
            return ()
        if rnd.disputed:
            verdict = self._verdict(rnd)
            if verdict is not None:
                return self._fail_disputed(rnd, verdict, now)
        return self._settle(rnd, self._outcome(rnd), now, last_rank)

    def _settle(self, rnd: Round, outcome: Any, now: float, last_rank: int | None) -> list[S]:
        """The round is decided: every member gets `outcome`; members queued join now."""
        self._move(_E.DECIDE)
        self._round = None
        self._seq += 1
        self._decided = Decided(rnd, outcome)
        self._decisions += 1
        self._last_round = CompletedRound(
            rnd.seq, rnd.kind, rnd.started, now, last_rank, rnd.arrivals, rnd.site
        )
        sends = [self._out(self.peers(), outcome)]
        queued, self._queued = self._queued, []
        for peer, hello, ranks in queued:
            sends.extend(self._join(peer, hello, ranks, now))
        return sends

    def _round_deadline(self, now: float) -> Sequence[S]:
        rnd = self._round
        if rnd is None or now < rnd.started + self.step_timeout + self.grace:
            return ()
        if rnd.disputed:
            verdict = self._verdict(rnd)
            if verdict is not None:
                return self._fail_disputed(rnd, verdict, now)
        reports, members, dead = rnd.reports, self._members, self._dead
        missing = [
            r
            for r in range(self.dp_size)
            if r not in dead and (r not in members or reports[members[r].rank] is None)
        ]
        return self._fail(StepTimeout(missing, self.step_timeout), now)

    # -- faults -----------------------------------------------------------------------------

    def _stranger_failure(self, part: Any) -> StepFailed:
        """A part from a peer outside the current epoch's membership."""
        last = self._failure
        if last is not None and part.epoch == last.epoch:
            return last
        if part.epoch != self._epoch:
            error: CoordError = CoordinatorUnavailable(
                f"epoch {part.epoch} is not coordd's current epoch {self._epoch} "
                "(coordd restarted or the group re-formed): register again"
            )
        else:
            error = self._unregistered(part)
        return self._failure_of(error, part)

    def _failure_of(self, error: CoordError, part: Any) -> StepFailed:
        return failure_message(error, epoch=self._epoch, seq=part.seq, kind=part.kind)

    def _fail_disputed(self, rnd: Round, verdict: Verdict, now: float) -> Sequence[S]:
        """A round whose parts disagree on the kind (or site) fails naming the culprit by its
        evidence: the lowest rank off the majority label (the device path's rule)."""
        rnd.kind = verdict.kind
        error = StepMismatch(verdict.rank, rnd.seq, verdict.label, rnd.seq, verdict.got)
        return self._fail(error, now)

    def _fail(self, error: CoordError, now: float, part: Any = None) -> list[S]:
        """End the round (and the group) with `error`; `part` is the one that caused it."""
        if self._round is not None:
            kind = self._round.kind
        else:
            kind = part.kind if part is not None else StepKind.FORWARD
        failure = failure_message(error, epoch=self._epoch, seq=self._seq, kind=kind)
        return self._fail_with(failure, now)

    def _fail_with(self, failure: StepFailed, now: float) -> list[S]:
        self._move(_E.FAIL)
        self._round = None
        self._failure = failure
        self._failures += 1
        self._reforming = True
        return [self._out(self.peers(), failure), *self._rejoin_queued(now)]
