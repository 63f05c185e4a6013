"""The relay wire's way into a group at the root, sans-IO: relays register for the DP ranks
they speak for, each sends one bundle per round, and the root decides from the bundles.

Every group rule is `coordd.proto.group.GroupMachine`'s, as for a flat group: a relay is a
member that speaks for its node's ranks. What only this wire knows is here:
- a relay's registration claims ranks (in range, held by no other relay: `rank_taken` names
  the relay and the ranks) with a rank's settings;
- a bundle is the relay's part of a round: its ranks' reductions (max padded, min tokens, min
  mode, the ANDs and ORs: `decide`'s rules over partial results) or rows, checked as reports
  are (`_validate`); the root's work per round grows with the relays, not the ranks, and a
  list of dp counts or rows is assembled by slices for relays of contiguous ranks;
- bundles that disagree on the kind (or site), or one whose `labels` do, fail the round by
  the evidence over every rank (`majority`);
- a lost relay is `RankLost` naming all its ranks, and every relay hears of a failure at once
  (its node may have a round open); the root waits `RELAY_GRACE` past the step timeout, so the
  relay's own timeout, which names the late rank, comes first; a fault a relay found
  (`RelayFault`) fails the group with that relay's error, whose culprits must be its ranks;
- elastic (`OnRankLoss.NEUTRALIZE`, the root's setting, which its Welcome gives each relay):
  a rank a relay lost is missing from its bundles and is left out from that round, and back
  from the first bundle that carries it (a relay's registration is not its ranks' return).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from coordd.proto.defaults import STEP_TIMEOUT
from coordd.proto.errors import CoordError, InvalidReport, ProtocolError, RankLost, Rejected
from coordd.proto.group import GroupMachine
from coordd.proto.group_state import GroupState
from coordd.proto.messages import (
    MAX_DP_SIZE,
    POLICY_KINDS,
    PROTOCOL_VERSION,
    GatherResult,
    Hello,
    RejectReason,
    StepDecision,
    StepKind,
    max_gather_values,
)
from coordd.proto.policy import CUDAGRAPH_MODES, MAX_TOKENS, last_ubatch_empty
from coordd.proto.relay import RELAY_GRACE
from coordd.proto.relay_messages import (
    RelayAnswer,
    RelayBundle,
    RelayFault,
    RelayHello,
    RelayLeave,
    RelayUp,
)
from coordd.proto.rounds import Round, Verdict, majority
from coordd.proto.snapshot import Member, OnRankLoss

_GATHER = StepKind.GATHER


class RelaySend(NamedTuple):
    """Send `message` to every relay in `peers` (encode it once)."""

    peers: tuple[bytes, ...]
    message: RelayAnswer


class RelayMember(NamedTuple):
    """A registered relay: its connection, its Hello, its ranks (ascending), and the first of
    them if they are contiguous (-1 if not): then its part of a list is one slice."""

    peer: bytes
    hello: RelayHello
    ranks: tuple[int, ...]
    first: int

    @property
    def rank(self) -> int:
        return self.ranks[0]

    @property
    def name(self) -> str:
        return self.hello.relay or f"ranks {self.ranks[0]}..{self.ranks[-1]}"


class TreeCoordinator(GroupMachine[RelayMember, RelaySend]):
    """One DP group at the root, served through relays."""

    tell_idle_failures = True
    grace = RELAY_GRACE
    registration_revives = False

    def __init__(
        self,
        dp_size: int,
        *,
        group: str,
        epoch: int,
        step_timeout: float = STEP_TIMEOUT,
        on_rank_loss: OnRankLoss = OnRankLoss.FAIL,
    ) -> None:
        if not 1 <= dp_size <= MAX_DP_SIZE:
            raise ValueError(f"dp_size must be in 1..{MAX_DP_SIZE}, got {dp_size}")
        super().__init__(dp_size, epoch=epoch, step_timeout=step_timeout, on_rank_loss=on_rank_loss)
        self.group = group

    def relays(self) -> dict[bytes, RelayMember]:
        return dict(self._by_peer)

    def holders(self) -> list[bytes]:
        """Every relay the shell binds to its connection and tells the loss of: registered,
        held from a failed epoch, or waiting to re-form the group at another size."""
        return [*super().holders(), *self._resizing.peers()]

    # -- inputs -----------------------------------------------------------------------------

    def receive(self, peer: bytes, message: RelayUp, now: float) -> Sequence[RelaySend]:
        if type(message) is RelayBundle:
            return self._on_part(peer, message, now)
        if type(message) is RelayHello:
            return self._on_hello(peer, message, now)
        if type(message) is RelayFault:
            return self._on_fault(peer, message, now)
        if type(message) is RelayLeave:
            return self._on_leave(peer, message, now)
        raise TypeError(f"not a message from a relay: {message!r}")

    def relay_lost(
        self, peer: bytes, now: float, detail: str = "connection closed"
    ) -> Sequence[RelaySend]:
        """The connection of relay `peer` closed (or missed heartbeats)."""
        return self.peer_lost(peer, now, detail)

    def _on_leave(self, peer: bytes, leave: RelayLeave, now: float) -> Sequence[RelaySend]:
        """Every rank of the relay left: between rounds that is no fault; a relay of a failed
        epoch that no rank holds any more holds the group no longer either. Every rank of the
        relay lost (`lost`) is their loss, as a flat coordd's."""
        if peer in self._held and peer not in self._by_peer:
            del self._held[peer]
            return self._admit_resizes(now) if self._resizing else ()
        member = self._by_peer.get(peer)
        if member is None or leave.epoch != self._epoch:
            return ()
        if leave.lost:
            return self.peer_lost(peer, now, f"every rank under relay {member.name} lost")
        return self._depart(peer, now)

    def _on_fault(self, peer: bytes, fault: RelayFault, now: float) -> Sequence[RelaySend]:
        member = self._by_peer.get(peer)
        failure = fault.failure
        if member is None or failure.epoch != self._epoch or self._state is GroupState.FAILED:
            return ()
        foreign = sorted(set(failure.culprits) - set(member.ranks))
        if foreign:
            error = ProtocolError(
                f"relay {member.name} blamed ranks {foreign}, which it does not serve",
                rank=member.rank,
            )
            return self._fail(error, now)
        return self._fail_with(failure, now)

    # -- the relay wire's part of the rules --------------------------------------------------

    def _out(self, peers: tuple[bytes, ...], message: object) -> RelaySend:
        return RelaySend(peers, RelayAnswer(group=self.group, message=message))  # type: ignore[arg-type]

    def _greet(self, member: RelayMember) -> RelaySend:
        answer = RelayAnswer(
            group=self.group,
            message=self._welcome_now(),
            on_rank_loss=self.on_rank_loss,
            dead_ranks=sorted(self._dead.intersection(member.ranks)),
        )
        return RelaySend((member.peer,), answer)

    def _member(
        self, peer: bytes, hello: RelayHello, ranks: tuple[int, ...], now: float
    ) -> RelayMember:
        contiguous = ranks[-1] - ranks[0] + 1 == len(ranks)
        return RelayMember(peer, hello, ranks, ranks[0] if contiguous else -1)

    def _member_view(self) -> dict[int, Member]:
        """A `Member` per rank a relay speaks for and that is not left out, as readiness and
        status read a flat group's."""
        members: dict[int, Member] = {}
        dead = self._dead
        for r, member in self._members.items():
            if r in dead:
                continue
            h = member.hello
            hello = Hello(
                dp_size=h.dp_size,
                dp_rank=r,
                config_fingerprint=h.config_fingerprint,
                incarnation=h.incarnation,
                group=h.group,
                num_ubatches=h.num_ubatches,
            )
            members[r] = Member(member.peer, hello, 0.0)
        return members

    def _check_basics(self, hello: RelayHello) -> None:
        if hello.protocol_version != PROTOCOL_VERSION:
            raise Rejected(
                RejectReason.VERSION.value,
                f"relay protocol {hello.protocol_version}, root {PROTOCOL_VERSION}",
                expected=str(PROTOCOL_VERSION),
                got=str(hello.protocol_version),
            )
        if not 1 <= hello.dp_size <= self.max_dp_size:
            raise Rejected(
                RejectReason.DP_SIZE.value,
                f"relay {hello.relay or '?'} asks dp_size={hello.dp_size}, the root coordd "
                f"serves groups of at most --dp {self.max_dp_size} ranks",
                expected=f"1..{self.max_dp_size}",
                got=str(hello.dp_size),
            )

    def _holding(self, holder: RelayMember, hello: RelayHello) -> Rejected:
        return Rejected(
            RejectReason.DP_SIZE.value,
            f"relay {holder.name} holds ranks {list(holder.ranks)} of the group at "
            f"dp_size={self.dp_size}: its ranks must leave before it registers at "
            f"dp_size={hello.dp_size}",
            expected=str(self.dp_size),
            got=str(hello.dp_size),
        )

    def _resize_refusal(self, hello: RelayHello) -> Rejected:
        holders = self._holders()
        ranks = sorted(r for m in holders for r in m.ranks)
        who = "; ".join(f"relay {m.name}: {list(m.ranks)}" for m in holders)
        return Rejected(
            RejectReason.DP_SIZE.value,
            f"relay {hello.relay or '?'} asks dp_size={hello.dp_size} for ranks "
            f"{hello.ranks}, the group runs at dp_size={self.dp_size} and ranks {ranks} "
            f"still hold it ({who}): a group re-forms at another size only once its ranks "
            f"leave (waited {self.step_timeout:g} s)",
            expected=str(self.dp_size),
            got=str(hello.dp_size),
        )

    def _claim(self, peer: bytes, hello: RelayHello) -> tuple[int, ...]:
        """The relay's ranks, ascending, if its registration may stand at its size (no relay
        holds the group at another); else `Rejected`."""
        dp = hello.dp_size
        ranks = tuple(sorted(set(hello.ranks)))
        if not ranks or len(ranks) != len(hello.ranks) or ranks[0] < 0 or ranks[-1] >= dp:
            raise Rejected(
                RejectReason.RANK_RANGE.value,
                f"relay {hello.relay or '?'} claims ranks {hello.ranks}: distinct ranks in "
                f"0..{dp - 1} are needed (dp_size={dp})",
                expected=f"distinct ranks in 0..{dp - 1}",
                got=str(hello.ranks),
            )
        others = {**self._held, **self._by_peer}
        clashes = [
            (sorted(set(ranks) & set(other.ranks)), other)
            for other in others.values()
            if other.peer != peer and not set(ranks).isdisjoint(other.ranks)
        ]
        if clashes:
            clashes.sort(key=lambda c: c[0])
            taken = sorted(r for held, _ in clashes for r in held)
            holders = "; ".join(f"{held} by relay {other.name}" for held, other in clashes)
            raise Rejected(
                RejectReason.RANK_TAKEN.value,
                f"relay {hello.relay or '?'} claims ranks {taken}, which other relays hold "
                f"({holders})",
                expected="ranks no other relay holds",
                got=str(taken),
            )
        ref = next((m for m in others.values() if m.peer != peer), None)
        if ref is not None:
            if hello.num_ubatches != ref.hello.num_ubatches:
                raise Rejected(
                    RejectReason.NUM_UBATCHES.value,
                    f"relay {hello.relay or '?'}: num_ubatches {hello.num_ubatches}, the "
                    f"group's {ref.hello.num_ubatches}",
                    expected=str(ref.hello.num_ubatches),
                    got=str(hello.num_ubatches),
                )
            if hello.config_fingerprint != ref.hello.config_fingerprint:
                raise Rejected(
                    RejectReason.FINGERPRINT.value,
                    f"relay {hello.relay or '?'}: config fingerprint differs from the group's",
                    expected=ref.hello.config_fingerprint,
                    got=hello.config_fingerprint,
                )
        return ranks

    def _misfit(self, member: RelayMember, bundle: RelayBundle) -> CoordError | None:
        if tuple(bundle.ranks) == member.ranks or self._live_subset(member, bundle):
            return None
        return ProtocolError(
            f"relay {member.name} registered for ranks {list(member.ranks)} sent a bundle "
            f"for ranks {bundle.ranks}",
            rank=member.rank,
        )

    def _live_subset(self, member: RelayMember, bundle: RelayBundle) -> bool:
        """Elastic: a bundle may leave out ranks its relay lost (ascending, none foreign)."""
        ranks = bundle.ranks
        return (
            self.on_rank_loss is OnRankLoss.NEUTRALIZE
            and bool(ranks)
            and list(ranks) == sorted(set(ranks))
            and set(ranks) <= set(member.ranks)
        )

    def _check_part(
        self, member: RelayMember, bundle: RelayBundle, first: RelayBundle | None
    ) -> CoordError | bool:
        return self._misfit(member, bundle) or self._validate(member, bundle, first)

    def _validate(
        self, member: RelayMember, bundle: RelayBundle, first: RelayBundle | None
    ) -> bool:
        """Reductions that cannot be a relay's reports (a relay checked each report): the
        relay's lowest rank is named. True for a bundle whose ranks disagree on the round's
        kind (its `labels`, which must disagree)."""
        rank = member.ranks[0]
        n = len(bundle.ranks)
        if bundle.labels:
            if len(bundle.labels) != n:
                raise InvalidReport(rank, "labels", len(bundle.labels), f"{n} labels")
            if len(set(bundle.labels)) < 2:
                raise InvalidReport(rank, "labels", bundle.labels[0], "labels that disagree")
            return True
        if bundle.kind is _GATHER:
            rows = bundle.rows
            if len(rows) != n:
                raise InvalidReport(rank, "rows", len(rows), f"{n} rows, one per rank")
            count = len(rows[0])
            expected = (
                len(first.rows[0])
                if first is not None and first.rows and first.kind is _GATHER
                else None
            )
            if expected is None and count > max_gather_values(self.dp_size):
                raise InvalidReport(
                    rank, "values", count, f"at most {max_gather_values(self.dp_size)} values"
                )
            want = count if expected is None else expected
            for offset, row in enumerate(rows):
                if len(row) != want:
                    raise InvalidReport(
                        bundle.ranks[offset],
                        "values",
                        len(row),
                        f"{want} values, as the round's first report",
                    )
            return False
        if bundle.kind not in POLICY_KINDS:
            raise InvalidReport(rank, "kind", bundle.kind.value, "forward, draft or state")
        padded = bundle.padded
        if len(padded) != n or (padded and max(padded) != bundle.max_padded):
            raise InvalidReport(rank, "num_tokens_padded", bundle.max_padded, "each rank's count")
        if not 0 <= bundle.min_tokens <= bundle.max_padded <= MAX_TOKENS:
            raise InvalidReport(
                rank, "num_tokens", bundle.min_tokens, f"0..num_tokens_padded ({bundle.max_padded})"
            )
        if bundle.cudagraph_mode not in CUDAGRAPH_MODES:
            raise InvalidReport(rank, "cudagraph_mode", bundle.cudagraph_mode, "0, 1 or 2")
        return False

    def _outcome(self, rnd: Round) -> StepDecision | GatherResult:
        """The answer from every relay's bundle; under neutralize the ranks no bundle carries
        are left out from this round on."""
        reports = rnd.reports
        bundles: list[tuple[RelayMember, RelayBundle]] = [
            (m, reports[m.rank])  # type: ignore[misc]
            for m in self._by_peer.values()
        ]
        dead: list[int] = []
        if sum(len(b.ranks) for _, b in bundles) < self.dp_size:
            live = {r for _, b in bundles for r in b.ranks}
            dead = [r for r in range(self.dp_size) if r not in live]
        if dead or self._dead:
            self._dead = frozenset(dead)
        if rnd.kind is _GATHER:
            rows: list[list[int]] = [[]] * self.dp_size
            for member, b in bundles:
                self._place(rows, member, b)
            return GatherResult(
                epoch=self._epoch, seq=rnd.seq, site=rnd.site, rows=rows, dead_ranks=dead
            )
        return self._decide(rnd, bundles, dead)

    def _decide(
        self, rnd: Round, bundles: list[tuple[RelayMember, RelayBundle]], dead: list[int]
    ) -> StepDecision:
        """`decide`'s rules over the bundles' reductions (`dead`: ranks left out, neutral)."""
        parts = [b for _, b in bundles]
        max_padded = max(b.max_padded for b in parts)
        min_tokens = min(b.min_tokens for b in parts)
        mode = min(b.cudagraph_mode for b in parts)
        n = bundles[0][0].hello.num_ubatches
        should_ubatch = all(b.all_ubatch for b in parts) and not last_ubatch_empty(
            max_padded, min_tokens, n
        )
        should_pad = mode != 0 or should_ubatch
        if should_pad:
            across = [max_padded] * self.dp_size
        else:
            across = [0] * self.dp_size
            for member, b in bundles:
                self._place(across, member, b)
        return StepDecision(
            epoch=self._epoch,
            seq=rnd.seq,
            kind=rnd.kind,
            num_tokens_across_dp=across,
            should_ubatch=should_ubatch,
            should_pad=should_pad,
            cudagraph_mode=mode,
            any_unfinished=any(b.any_unfinished for b in parts),
            all_idle=all(b.all_idle for b in parts),
            should_pause=all(b.all_pause for b in parts),
            any_pause=any(b.any_pause for b in parts),
            dead_ranks=dead,
        )

    @staticmethod
    def _place(into: list, member: RelayMember, bundle: RelayBundle) -> None:
        """The bundle's rows or padded counts into their ranks' places (one slice for a relay
        of contiguous ranks that left none out)."""
        values = bundle.rows if bundle.kind is _GATHER else bundle.padded
        if member.first >= 0 and len(values) == len(member.ranks):
            into[member.first : member.first + len(values)] = values
        else:
            for r, v in zip(bundle.ranks, values, strict=True):
                into[r] = v

    # -- faults -----------------------------------------------------------------------------

    def _verdict(self, rnd: Round) -> Verdict | None:
        """A disputed round's culprit by the evidence over every covered rank's label (the
        majority, a tie to the lowest rank's; the culprit the lowest rank off it); None when
        the bundles in hand agree (the one that disagreed was withdrawn): the round is then
        re-based on them."""
        parts: list[RelayBundle] = [b for b in rnd.reports if b is not None]  # type: ignore[misc]
        evidence = sorted(
            (r, label)
            for b in parts
            for r, label in zip(b.ranks, b.labels or [b.label] * len(b.ranks), strict=True)
        )
        label = majority([lab for _, lab in evidence]) if evidence else rnd.label
        kind = _kind_of(label)
        for rank, got in evidence:
            if got != label:
                return Verdict(label, kind, rank, got)
        if parts:
            rnd.first = parts[0]
            rnd.kind = kind
            rnd.label = label
        rnd.disputed = False
        return None

    def _lost_error(self, member: RelayMember, detail: str) -> CoordError:
        return RankLost(list(member.ranks), f"relay {member.name} lost ({detail})")

    def _unregistered(self, bundle: RelayBundle) -> CoordError:
        return ProtocolError(
            "bundle from a relay that has not registered",
            rank=bundle.ranks[0] if bundle.ranks else 0,
        )


def _kind_of(label: str) -> StepKind:
    return _GATHER if label.startswith("gather:") else StepKind(label)
