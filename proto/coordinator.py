"""The coordinator state machine, sans-IO: messages and the time go in, messages to send come out.

It owns membership (who is which rank), the round (which seq and kind is open, who reported
what) and the fault rules. It never reads a clock or touches a socket: the daemon passes
`now` in and moves the bytes, and tests drive it with a fake clock.

Fail-stop: the first fault ends the round for every rank with one `StepFailed`; the group then
stays failed, and every later report gets that same failure at once, until a rank registers
again, which opens a new epoch.

Elastic (`OnRankLoss.NEUTRALIZE`): a lost rank is left out instead; it counts as a neutral
value in every later decision (`dead_ranks`, as vLLM's `neutralize_dead_dp_columns` in
vllm/v1/worker/dp_utils.py does), its peer gets `RankLost` if it reports without registering,
and a returning rank is admitted only at a round boundary. Other faults still fail the round.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

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
from coordd.proto.messages import (
    PROTOCOL_VERSION,
    FromCoordinator,
    Goodbye,
    Heartbeat,
    Hello,
    RejectReason,
    StepDecision,
    StepFailed,
    StepKind,
    StepReport,
    ToCoordinator,
    Welcome,
    failure_message,
    reject_message,
)
from coordd.proto.policy import decide, validate_report


class Send(NamedTuple):
    """Send `message` to every peer in `peers` (encode it once)."""

    peers: tuple[bytes, ...]
    message: FromCoordinator


class OnRankLoss(str, enum.Enum):
    FAIL = "fail"
    NEUTRALIZE = "neutralize"


@dataclass(frozen=True)
class Member:
    peer: bytes
    hello: Hello
    joined_at: float


class CompletedRound(NamedTuple):
    """The last completed round, for metrics and status (recorded once per round, never read
    on the hot path): when it started (the first report) and completed, and whose report
    completed it (the straggler; None when a rank loss completed it)."""

    seq: int
    kind: StepKind
    started: float
    completed: float
    last_rank: int | None
    arrivals: list[float | None]  # each rank's report time; None for a rank left out


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
        step_timeout: float = 30.0,
        on_rank_loss: OnRankLoss = OnRankLoss.FAIL,
    ) -> None:
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        self.dp_size = dp_size
        self.epoch = epoch
        self.step_timeout = step_timeout
        self.on_rank_loss = on_rank_loss
        self.members: dict[int, Member] = {}
        self.peer_rank: dict[bytes, int] = {}
        self.dead: set[int] = set()
        self.seq = 0
        self.kind: StepKind | None = None
        self.reports: list[StepReport | None] = [None] * dp_size
        self.reported = 0
        self.round_started: float | None = None
        self.failure: StepFailed | None = None
        self.last_failure: StepFailed | None = None
        self.last_reports: list[StepReport | None] = [None] * dp_size
        self.last_decision: StepDecision | None = None
        self.arrivals: list[float | None] = [None] * dp_size
        self.last_round: CompletedRound | None = None
        self._peers: tuple[bytes, ...] | None = None
        self._joining: list[tuple[bytes, Hello]] = []

    # -- inputs -----------------------------------------------------------------------------

    def receive(self, peer: bytes, message: ToCoordinator, now: float) -> Sequence[Send]:
        """Feed one decoded message from `peer`; returns what to send."""
        if type(message) is StepReport:
            return self._on_report(peer, message, now)
        if type(message) is Hello:
            return self._on_hello(peer, message, now)
        if type(message) is Heartbeat:
            return (Send((peer,), message),)
        if type(message) is Goodbye:
            return self.peer_lost(peer, now, detail=LEFT_THE_GROUP)
        raise TypeError(f"not a message to the coordinator: {message!r}")

    def peer_lost(self, peer: bytes, now: float, detail: str = "disconnected") -> Sequence[Send]:
        """The transport says `peer` is gone (closed, or missed heartbeats)."""
        rank = self.peer_rank.get(peer)
        if rank is None:
            self._joining = [(p, h) for p, h in self._joining if p != peer]
            return _NOTHING
        self._remove(rank)
        neutralize = self.on_rank_loss is OnRankLoss.NEUTRALIZE
        if self.failure is not None:
            # Elastic: the re-formed group (next epoch) must not wait for a rank that is gone.
            if neutralize and self.members:
                self.dead.add(rank)
            elif neutralize:
                self.dead.clear()
            return _NOTHING
        if neutralize and self.members:
            self.dead.add(rank)
            if self.reports[rank] is not None:
                self.reports[rank] = None
                self.reported -= 1
                self.arrivals[rank] = None
            return self._complete_if_ready(now, None)
        if not self.members:
            self._reset_group()
            return _NOTHING
        was_open = self.round_open
        sends = self._fail(RankLost([rank], detail), now)
        # Between rounds nobody waits: each rank gets the failure when it next reports.
        return sends if was_open else _NOTHING

    def next_deadline(self) -> float | None:
        """When `on_deadline` must next be called, or None."""
        if self.round_started is None or self.failure is not None:
            return None
        return self.round_started + self.step_timeout

    def on_deadline(self, now: float) -> Sequence[Send]:
        deadline = self.next_deadline()
        if deadline is None or now < deadline:
            return _NOTHING
        missing = [r for r in range(self.dp_size) if self.reports[r] is None and r not in self.dead]
        return self._fail(StepTimeout(missing, self.step_timeout), now)

    def shutdown(self, text: str = "coordd is shutting down") -> Sequence[Send]:
        peers = self.peers()
        return (Send(peers, Goodbye(text=text)),) if peers else _NOTHING

    # -- queries ----------------------------------------------------------------------------

    def peers(self) -> tuple[bytes, ...]:
        """Every registered peer of the current epoch, in rank order (cached)."""
        if self._peers is None:
            self._peers = tuple(self.members[r].peer for r in sorted(self.members))
        return self._peers

    @property
    def group(self) -> Hello | None:
        """The Hello that set the group's settings (the lowest registered rank's)."""
        return self.members[min(self.members)].hello if self.members else None

    @property
    def round_open(self) -> bool:
        return self.reported > 0

    # -- reports ----------------------------------------------------------------------------

    def _on_report(self, peer: bytes, report: StepReport, now: float) -> Sequence[Send]:
        rank = self.peer_rank.get(peer)
        if rank is None or report.epoch != self.epoch:
            return (Send((peer,), self._stranger_failure(rank, report)),)
        if self.failure is not None:
            return (Send((peer,), self.failure),)
        if report.dp_rank != rank:
            error = ProtocolError(
                f"peer registered as rank {rank} reported as rank {report.dp_rank}",
                rank=rank,  # the culprit is the sender, not the rank it claimed
            )
            return (Send((peer,), self._failure_of(error, report)),)
        if report.seq != self.seq:
            if report.seq == self.seq - 1 and self.last_reports[rank] == report:
                assert self.last_decision is not None
                return (Send((peer,), self.last_decision),)
            expected_kind = (self.kind or report.kind).value
            return self._fail(
                StepMismatch(rank, self.seq, expected_kind, report.seq, report.kind.value),
                now,
                report,
            )
        if self.kind is not None and report.kind is not self.kind:
            return self._fail(
                StepMismatch(rank, self.seq, self.kind.value, report.seq, report.kind.value),
                now,
                report,
            )
        previous = self.reports[rank]
        if previous is not None:
            if previous == report:
                return _NOTHING
            return self._fail(ConflictingReport(rank, report.seq), now, report)
        try:
            validate_report(rank, report)
        except InvalidReport as error:
            return self._fail(error, now, report)
        self.reports[rank] = report
        self.arrivals[rank] = now
        self.reported += 1
        if self.round_started is None:
            self.round_started = now
            self.kind = report.kind
        return self._complete_if_ready(now, rank)

    def _complete_if_ready(self, now: float, last_rank: int | None) -> Sequence[Send]:
        if self.reported == 0 or self.reported < self.dp_size - len(self.dead):
            return _NOTHING
        if len(self.members) + len(self.dead) < self.dp_size:
            return _NOTHING
        assert self.kind is not None
        hello = self.group
        decision = decide(
            [None if r in self.dead else rep for r, rep in enumerate(self.reports)],
            hello.num_ubatches if hello else 2,
            epoch=self.epoch,
            seq=self.seq,
            kind=self.kind,
        )
        self.last_reports, self.reports = self.reports, [None] * self.dp_size
        self.last_decision = decision
        started = now if self.round_started is None else self.round_started
        self.last_round = CompletedRound(
            self.seq, self.kind, started, now, last_rank, self.arrivals
        )
        self.arrivals = [None] * self.dp_size
        self.reported = 0
        self.seq += 1
        self.kind = None
        self.round_started = None
        sends = [Send(self.peers(), decision)]
        sends.extend(self._admit_joining(now))
        return sends

    def _stranger_failure(self, rank: int | None, report: StepReport) -> StepFailed:
        """A report from a peer outside the current epoch's membership."""
        last = self.last_failure
        if last is not None and report.epoch == last.epoch:
            return last
        if report.epoch != self.epoch:
            error: CoordError = CoordinatorUnavailable(
                f"epoch {report.epoch} is not coordd's current epoch {self.epoch} "
                "(coordd restarted or the group re-formed): register again"
            )
        elif report.dp_rank in self.dead:
            # Elastic: a rank left out of the group (lost, then back without a Hello) gets an
            # error, never a decision of rounds it is no longer part of.
            error = RankLost(
                [report.dp_rank], "it was left out of the group after it was lost: register again"
            )
        else:
            error = ProtocolError("report from a peer that has not registered", rank=report.dp_rank)
        return self._failure_of(error, report)

    def _failure_of(self, error: CoordError, report: StepReport) -> StepFailed:
        return failure_message(error, epoch=self.epoch, seq=report.seq, kind=report.kind)

    def _fail(
        self, error: CoordError, now: float, report: StepReport | None = None
    ) -> Sequence[Send]:
        """End the round (and the group) with `error`; `report` is the one that caused it."""
        kind = self.kind or (report.kind if report is not None else StepKind.FORWARD)
        failure = failure_message(error, epoch=self.epoch, seq=self.seq, kind=kind)
        self.failure = self.last_failure = failure
        self.reports = [None] * self.dp_size
        self.arrivals = [None] * self.dp_size
        self.reported = 0
        self.kind = None
        self.round_started = None
        sends = [Send(self.peers(), failure)]
        # A rank queued to rejoin was not part of the failed round: its Hello now counts as the
        # first Hello after the failure (it opens the new epoch), as if it had come a moment later.
        joining, self._joining = self._joining, []
        for peer, hello in joining:
            sends.extend(self._on_hello(peer, hello, now))
        return sends

    # -- membership -------------------------------------------------------------------------

    def _on_hello(self, peer: bytes, hello: Hello, now: float) -> Sequence[Send]:
        try:
            self._check_hello(peer, hello)
        except Rejected as error:
            return (Send((peer,), reject_message(error)),)
        if self.failure is not None:
            self._new_epoch()
        rank = hello.dp_rank
        if rank in self.dead and self.round_open:
            # Elastic: a returning rank joins at the next round boundary, never mid-round.
            for queued, queued_hello in self._joining:
                if queued_hello.dp_rank == rank and queued != peer:
                    return (Send((peer,), reject_message(self._rank_taken(queued_hello, hello))),)
            self._joining = [(p, h) for p, h in self._joining if p != peer]
            self._joining.append((peer, hello))
            return _NOTHING
        return self._admit(peer, hello, now)

    def _admit(self, peer: bytes, hello: Hello, now: float) -> Sequence[Send]:
        self.dead.discard(hello.dp_rank)
        self.members[hello.dp_rank] = Member(peer, hello, now)
        self.peer_rank[peer] = hello.dp_rank
        self._peers = None
        return (Send((peer,), Welcome(epoch=self.epoch, next_seq=self.seq, dp_size=self.dp_size)),)

    def _admit_joining(self, now: float) -> list[Send]:
        joining, self._joining = self._joining, []
        sends: list[Send] = []
        for peer, hello in joining:
            sends.extend(self._admit(peer, hello, now))
        return sends

    @staticmethod
    def _rank_taken(holder: Hello, hello: Hello) -> Rejected:
        return Rejected(
            RejectReason.RANK_TAKEN.value,
            f"dp_rank {hello.dp_rank} is already rejoining (incarnation {holder.incarnation})",
            expected=holder.incarnation,
            got=hello.incarnation,
        )

    def _check_hello(self, peer: bytes, hello: Hello) -> None:
        def reject(reason: RejectReason, detail: str, expected: object, got: object) -> Rejected:
            return Rejected(reason.value, detail, expected=str(expected), got=str(got))

        if hello.protocol_version != PROTOCOL_VERSION:
            raise reject(
                RejectReason.VERSION,
                f"rank {hello.dp_rank} speaks protocol "
                f"{hello.protocol_version}, coordd speaks {PROTOCOL_VERSION}",
                PROTOCOL_VERSION,
                hello.protocol_version,
            )
        if hello.dp_size != self.dp_size:
            raise reject(
                RejectReason.DP_SIZE,
                f"rank {hello.dp_rank} has dp_size={hello.dp_size}, "
                f"coordd serves dp_size={self.dp_size}",
                self.dp_size,
                hello.dp_size,
            )
        if not 0 <= hello.dp_rank < self.dp_size:
            raise reject(
                RejectReason.RANK_RANGE,
                f"dp_rank {hello.dp_rank} is outside 0..{self.dp_size - 1}",
                f"0..{self.dp_size - 1}",
                hello.dp_rank,
            )
        if hello.num_ubatches < 1:
            raise reject(
                RejectReason.NUM_UBATCHES,
                f"rank {hello.dp_rank} has num_ubatches={hello.num_ubatches}",
                ">= 1",
                hello.num_ubatches,
            )
        if self.failure is not None:
            return  # this Hello opens a new epoch: the old members' settings no longer bind
        held = self.members.get(hello.dp_rank)
        if held is not None and held.peer != peer:
            raise reject(
                RejectReason.RANK_TAKEN,
                f"dp_rank {hello.dp_rank} is held by a live "
                f"peer (incarnation {held.hello.incarnation})",
                held.hello.incarnation,
                hello.incarnation,
            )
        other = self.peer_rank.get(peer)
        if other is not None and other != hello.dp_rank:
            raise reject(
                RejectReason.RANK_TAKEN,
                f"this peer is already registered as rank {other}",
                other,
                hello.dp_rank,
            )
        group = self.group
        if group is None or (held is not None and len(self.members) == 1):
            return
        for reason, name in (
            (RejectReason.GROUP, "group"),
            (RejectReason.NUM_UBATCHES, "num_ubatches"),
            (RejectReason.FINGERPRINT, "config_fingerprint"),
        ):
            want, got = getattr(group, name), getattr(hello, name)
            if want != got:
                raise reject(
                    reason,
                    f"rank {hello.dp_rank} has {name}={got!r}, the group "
                    f"(rank {group.dp_rank}) has {want!r}",
                    want,
                    got,
                )

    def _remove(self, rank: int) -> None:
        member = self.members.pop(rank)
        self.peer_rank.pop(member.peer, None)
        self._peers = None

    def _new_epoch(self) -> None:
        """The first Hello after a failure re-forms the group: new epoch, next seq."""
        assert self.failure is not None
        self.epoch += 1
        self.seq = self.failure.seq + 1
        self.failure = None
        self.members.clear()
        self.peer_rank.clear()
        self._peers = None
        # `dead` stays: in elastic mode the new epoch goes on without the ranks that are gone.

    def _reset_group(self) -> None:
        """Everyone left: the next Hello may set new group settings."""
        self.reports = [None] * self.dp_size
        self.arrivals = [None] * self.dp_size
        self.reported = 0
        self.kind = None
        self.round_started = None
        self.dead.clear()
