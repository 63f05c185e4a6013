"""The rank wire's way into a group: each rank registers for itself and reports for itself,
and coordd decides (`coordd.proto.group.GroupMachine`, where every group rule lives, with
members that speak for one rank each). Sans-IO: messages and the time go in, messages to send
come out; the daemon passes `now` in and moves the bytes, and tests drive it with a fake clock.

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
ranks of the group stay connected waits until they have all left or been lost, then opens the
new epoch at its size; if they are still there after the step timeout, it is refused with
`Rejected(dp_size)` naming them (a misconfigured rank, not a re-form).

Identity: a peer is a connection (the daemon binds a routing id to the connection its Hello
came in on). After a failure the next Hello passes the same checks as the first registration,
against the ranks still connected (`_held`): see `coordd.proto.membership.check_membership`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from coordd.proto.defaults import STEP_TIMEOUT
from coordd.proto.errors import CoordError, InvalidReport, ProtocolError, RankLost, Rejected
from coordd.proto.group import LEFT_THE_GROUP, GroupMachine
from coordd.proto.group_state import GroupEvent, GroupState
from coordd.proto.membership import (
    check_basics,
    check_membership,
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
    StepKind,
    StepReport,
    ToCoordinator,
)
from coordd.proto.policy import decide, validate_gather, validate_report
from coordd.proto.rounds import CompletedRound, Round
from coordd.proto.snapshot import Member, OnRankLoss

__all__ = ["LEFT_THE_GROUP", "CompletedRound", "Coordinator", "OnRankLoss", "Send"]

_GATHER = StepKind.GATHER
_ROUND_OPEN = GroupState.ROUND_OPEN
_IDLE = GroupState.IDLE
_E_OPEN = GroupEvent.OPEN
_E_REPORT = GroupEvent.REPORT


class Send(NamedTuple):
    """Send `message` to every peer in `peers` (encode it once)."""

    peers: tuple[bytes, ...]
    message: FromCoordinator


class Coordinator(GroupMachine[Member, Send]):
    """One DP group served flat: each member is one rank's connection."""

    def __init__(
        self,
        dp_size: int,
        *,
        epoch: int,
        step_timeout: float = STEP_TIMEOUT,
        on_rank_loss: OnRankLoss = OnRankLoss.FAIL,
    ) -> None:
        super().__init__(dp_size, epoch=epoch, step_timeout=step_timeout, on_rank_loss=on_rank_loss)

    def receive(self, peer: bytes, message: ToCoordinator, now: float) -> Sequence[Send]:
        """Feed one decoded message from `peer`; returns what to send."""
        if type(message) is StepReport:
            # The hot path: a member's policy report for the round open now (or the one it
            # opens), of its kind, the first from its rank, with no rank departed: the checks
            # of `_on_part` and `_check_part` and the move, written out; whatever differs
            # takes `_on_part`. tests/unit/test_report_fast_path.py pins the two together.
            member = self._by_peer.get(peer)
            if (
                member is not None
                and message.seq == self._seq
                and message.epoch == self._epoch
                and message.dp_rank == member.rank
                and not self._left
            ):
                rnd = self._round
                rank = member.rank
                if rnd is None:
                    if self._state is _IDLE and message.kind is not _GATHER:
                        try:
                            validate_report(rank, message)
                        except InvalidReport as error:
                            return self._fail(error, now, message)
                        self._move(_E_OPEN)
                        rnd = self._round = Round(self._seq, message, now, self.dp_size)
                        rnd.add(rank, message, now)
                        return self._complete_if_ready(now, rank)
                elif (
                    message.kind is rnd.kind
                    and rnd.kind is not _GATHER
                    and rnd.reports[rank] is None
                    and self._state is _ROUND_OPEN
                ):
                    try:
                        validate_report(rank, message)
                    except InvalidReport as error:
                        return self._fail(error, now, message)
                    self._move(_E_REPORT)
                    rnd.add(rank, message, now)
                    if rnd.reported < len(self._by_peer):
                        return ()
                    return self._complete_if_ready(now, rank)
            return self._on_part(peer, message, now)
        if type(message) is GatherReport:
            # The same hot path for a member's gather part (the vLLM plugin's every sync): the
            # round open now of its site (or the one it opens), the first from its rank, no
            # rank departed; `validate_gather` as `_check_part` calls it (the count rule: as
            # the round's first report's, or within one frame for the first). Whatever differs
            # takes `_on_part`; tests/unit/test_report_fast_path.py pins the two together.
            member = self._by_peer.get(peer)
            if (
                member is not None
                and message.seq == self._seq
                and message.epoch == self._epoch
                and message.dp_rank == member.rank
                and not self._left
            ):
                rnd = self._round
                rank = member.rank
                if rnd is None:
                    if self._state is _IDLE:
                        try:
                            validate_gather(rank, message, self.dp_size, None)
                        except InvalidReport as error:
                            return self._fail(error, now, message)
                        self._move(_E_OPEN)
                        rnd = self._round = Round(self._seq, message, now, self.dp_size)
                        rnd.add(rank, message, now)
                        return self._complete_if_ready(now, rank)
                elif (
                    rnd.kind is _GATHER and rnd.reports[rank] is None and self._state is _ROUND_OPEN
                ):
                    first = rnd.first
                    if type(first) is GatherReport and first.site == message.site:
                        try:
                            validate_gather(rank, message, self.dp_size, first)
                        except InvalidReport as error:
                            return self._fail(error, now, message)
                        self._move(_E_REPORT)
                        rnd.add(rank, message, now)
                        return self._complete_if_ready(now, rank)
            return self._on_part(peer, message, now)
        if type(message) is Hello:
            return self._on_hello(peer, message, now)
        if type(message) is Heartbeat:
            return (Send((peer,), message),)
        if type(message) is Goodbye:
            return self._on_goodbye(peer, now)
        raise TypeError(f"not a message to the coordinator: {message!r}")

    def _on_goodbye(self, peer: bytes, now: float) -> Sequence[Send]:
        return self._depart(peer, now)

    def undecodable(self, peer: bytes, detail: str, now: float) -> Sequence[Send]:
        """A message from member `peer` did not decode (a report over the size limits, a
        value out of range of its type): a protocol violation by that rank, which fails the
        group at once with a `ProtocolError` naming it (the others would otherwise wait out
        the step timeout and blame it as late). As with a lost rank, only an open round's
        ranks are sent the failure now; the others get it when they next report. Nothing for
        a peer that holds no rank, or once the group has failed."""
        member = self._by_peer.get(peer)
        if member is None or self._state is GroupState.FAILED:
            return ()
        waiting = self._round is not None
        sends = self._fail(ProtocolError(f"undecodable message: {detail}", rank=member.rank), now)
        return sends if waiting else ()

    # -- the rank wire's part of the rules ---------------------------------------------------

    def _out(self, peers: tuple[bytes, ...], message: FromCoordinator) -> Send:
        return Send(peers, message)

    def _check_basics(self, hello: Hello) -> None:
        check_basics(hello, self.max_dp_size)

    def _claim(self, peer: bytes, hello: Hello) -> tuple[int, ...]:
        members: dict[int, Member] = self._members
        if self._held:
            members = {**{m.rank: m for m in self._held.values()}, **members}
        check_membership(peer, hello, members, {m.peer: r for r, m in members.items()})
        return (hello.dp_rank,)

    def _member(self, peer: bytes, hello: Hello, ranks: tuple[int, ...], now: float) -> Member:
        return Member(peer, hello, now)

    def _greet(self, member: Member) -> Send:
        return Send((member.peer,), self._welcome_now())

    def _holding(self, holder: Member, hello: Hello) -> Rejected:
        return resize_while_holding(hello, holder.rank, self.dp_size)

    def _resize_refusal(self, hello: Hello) -> Rejected:
        holders = [r for m in self._holders() for r in m.ranks]
        return resize_refused(hello, self.dp_size, holders, self.step_timeout)

    def _misfit(self, member: Member, report: StepReport | GatherReport) -> CoordError | None:
        rank = member.rank
        if report.dp_rank != rank:
            # the culprit is the sender, not the rank it claimed
            return ProtocolError(
                f"peer registered as rank {rank} reported as rank {report.dp_rank}", rank=rank
            )
        if report.kind is _GATHER and type(report) is StepReport:
            return ProtocolError(
                "a StepReport of kind gather (a gather round takes a GatherReport)", rank=rank
            )
        return None

    def _check_part(
        self, member: Member, report: StepReport | GatherReport, first: object
    ) -> CoordError | bool:
        rank = member.rank
        if report.dp_rank != rank or (report.kind is _GATHER and type(report) is StepReport):
            return self._misfit(member, report) or False
        if type(report) is StepReport:
            validate_report(rank, report)
        else:
            validate_gather(rank, report, self.dp_size, first)  # type: ignore[arg-type]
        return False

    def _outcome(self, rnd: Round) -> Outcome:
        dead = self._dead
        if rnd.kind is _GATHER:
            rows = [
                [] if rep is None or r in dead else rep.values  # type: ignore[attr-defined]
                for r, rep in enumerate(rnd.reports)
            ]
            return GatherResult(
                epoch=self._epoch, seq=rnd.seq, site=rnd.site, rows=rows, dead_ranks=sorted(dead)
            )
        group = self._members[min(self._members)].hello
        # with no rank left out, every rank reported: the round's own list, as it is
        reports = rnd.reports
        if dead:
            reports = [None if r in dead else rep for r, rep in enumerate(reports)]
        return decide(
            reports,  # type: ignore[arg-type]
            group.num_ubatches,
            epoch=self._epoch,
            seq=rnd.seq,
            kind=rnd.kind,
        )

    def _lost_error(self, member: Member, detail: str) -> CoordError:
        return RankLost([member.rank], detail)

    def _unregistered(self, report: StepReport | GatherReport) -> CoordError:
        if report.dp_rank in self._dead:
            # Elastic: a rank left out of the group (lost, then back without a Hello) gets an
            # error, never a decision of rounds it is no longer part of.
            return RankLost(
                [report.dp_rank], "it was left out of the group after it was lost: register again"
            )
        return ProtocolError("report from a peer that has not registered", rank=report.dp_rank)
