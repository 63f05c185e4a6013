"""The root's side of a group served through relays, sans-IO: relays register for the DP ranks
they speak for, each sends one bundle per round, and the root decides from the bundles.

The root's work per round grows with the number of relays, not of ranks: a policy round is
decided from each bundle's reductions (max padded, min tokens, min mode, the ANDs and ORs:
`decide`'s rules over partial results), and a list of dp counts or rows is assembled by slices
for relays of contiguous ranks; one answer is encoded once for every relay.

The rules are the flat coordinator's (`coordd.proto.coordinator`), per relay:
- a relay's registration is checked as a rank's Hello is (version, dp size, settings, ranks in
  range and held by no other relay: `rank_taken` names the relay and the ranks);
- a round completes when every rank is covered by a bundle; a bundle of another seq, a second
  different one, or invalid reductions fail the group naming the relay's lowest rank; bundles
  that disagree on the kind (or site) fail it by the evidence over every rank (`majority`);
- a relay lost is `RankLost` naming every rank it spoke for; a relay silent past the step
  timeout and `RELAY_GRACE` is `StepTimeout` naming its ranks (the relay's own timeout, which
  names the late rank, comes first); a fault a relay found (`RelayFault`) fails the group for
  every relay with that relay's error, whose culprits must be its own ranks;
- fail-stop: the group stays FAILED until a relay registers again, which opens a new epoch
  (seq after the failed one); relays of the failed epoch still connected keep their ranks;
- elastic (`OnRankLoss.NEUTRALIZE`, the root's setting, which its Welcome gives each relay):
  a rank a relay lost is missing from its bundles, a relay lost (or leaving) takes all its
  ranks out; those ranks are neutral in every decision and listed in `dead_ranks`, as the
  flat coordinator's `_dead`, and a rank is back in from the first bundle that carries it;
- resize, as the flat coordinator's: the root's `--dp` bounds the size and each epoch has the
  size its first registration says; a registration at another size while relays hold ranks
  of the group waits until they have all left (or were lost), then opens the new epoch at its
  size, or is refused after the step timeout naming the relays and ranks that stay.
The group's states and moves are `coordd.proto.group_state`'s table.
"""

# Whole though over 500 lines: one state machine, as `coordinator.py` is; every input moves
# the group's one state through `_move`.

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import NamedTuple

from coordd.proto.coordinator import LEFT_THE_GROUP
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
from coordd.proto.messages import (
    MAX_DP_SIZE,
    POLICY_KINDS,
    PROTOCOL_VERSION,
    GatherResult,
    Hello,
    RejectReason,
    StepDecision,
    StepFailed,
    StepKind,
    Welcome,
    failure_message,
    max_gather_values,
    reject_message,
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
from coordd.proto.resize_waits import ResizeWaits
from coordd.proto.rounds import majority
from coordd.proto.snapshot import GroupSnapshot, Member, OnRankLoss

_E, _S = GroupEvent, GroupState
_GATHER = StepKind.GATHER


class RelaySend(NamedTuple):
    """Send `message` to every relay in `peers` (encode it once)."""

    peers: tuple[bytes, ...]
    message: RelayAnswer


_NOTHING: tuple[RelaySend, ...] = ()


class RelayMember(NamedTuple):
    """A registered relay: its connection, its Hello, its ranks (ascending), and the first of
    them if they are contiguous (-1 if not): then its part of a list is one slice."""

    peer: bytes
    hello: RelayHello
    ranks: tuple[int, ...]
    first: int

    @property
    def name(self) -> str:
        return self.hello.relay or f"ranks {self.ranks[0]}..{self.ranks[-1]}"


class _TreeRound:
    __slots__ = ("bundles", "covered", "disputed", "first", "seq", "started")

    def __init__(self, first: RelayBundle, started: float) -> None:
        self.seq = first.seq
        self.first = first
        self.started = started
        self.bundles: dict[bytes, RelayBundle] = {}
        self.covered = 0
        self.disputed = bool(first.labels)


class TreeCoordinator:
    """One DP group at the root, served through relays."""

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
        #: The root's --dp: the most ranks an epoch may have.
        self.max_dp_size = dp_size
        #: This epoch's size, set by the first registration of an epoch.
        self.dp_size = dp_size
        self.group = group
        self.step_timeout = step_timeout
        self.on_rank_loss = on_rank_loss
        self._state = _S.EMPTY
        self._epoch = epoch
        self._seq = 0
        self._relays: dict[bytes, RelayMember] = {}
        self._owner: list[bytes | None] = [None] * dp_size
        self._covered = 0
        #: Relays of a failed epoch still connected that have not registered again.
        self._held: dict[bytes, RelayMember] = {}
        #: Ranks of relays that left cleanly in this epoch.
        self._left: set[int] = set()
        #: Elastic: the ranks left out: no bundle of the last round carried them, or their
        #: relay was lost or left since. A relay registering keeps them out (its Welcome says
        #: which), until a bundle carries them again.
        self._dead: set[int] = set()
        self._resizing: ResizeWaits[RelayHello] = ResizeWaits()
        self._round: _TreeRound | None = None
        self._decided: tuple[dict[bytes, RelayBundle], RelayAnswer] | None = None
        self._decided_seq = -1
        self._failure: StepFailed | None = None
        self._failures = 0
        self._decisions = 0
        self._reforming = False
        self._peers: tuple[bytes, ...] | None = None

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
    def failures(self) -> int:
        return self._failures

    @property
    def decisions(self) -> int:
        return self._decisions

    @property
    def last_failure(self) -> StepFailed | None:
        return self._failure

    def snapshot(self) -> GroupSnapshot:
        """The group as readiness and status read a flat group: a member per rank a relay
        speaks for and that is not left out (built on demand: it is read by probes, never per
        round)."""
        members: dict[int, Member] = {}
        dead = self._dead
        for member in self._relays.values():
            h = member.hello
            for r in member.ranks:
                if r in dead:
                    continue
                hello = Hello(
                    dp_size=h.dp_size,
                    dp_rank=r,
                    config_fingerprint=h.config_fingerprint,
                    incarnation=h.incarnation,
                    group=h.group,
                    num_ubatches=h.num_ubatches,
                )
                members[r] = Member(member.peer, hello, 0.0)
        return GroupSnapshot(
            state=self._state,
            dp_size=self.dp_size,
            max_dp_size=self.max_dp_size,
            on_rank_loss=self.on_rank_loss,
            step_timeout=self.step_timeout,
            epoch=self._epoch,
            seq=self._seq,
            members=MappingProxyType(dict(sorted(members.items()))),
            dead=frozenset(self._dead),
            round=None,
            last_failure=self._failure,
            failures=self._failures,
            decisions=self._decisions,
            last_round=None,
            left=frozenset(self._left),
            reforming=self._reforming,
            held=sum(len(m.ranks) for m in self._held.values()),
        )

    def relays(self) -> dict[bytes, RelayMember]:
        return dict(self._relays)

    def holders(self) -> list[bytes]:
        """Every relay the shell binds to its connection and tells the loss of: registered,
        held from a failed epoch, or waiting to re-form the group at another size."""
        return [*self._relays, *self._held, *self._resizing.peers()]

    def peers(self) -> tuple[bytes, ...]:
        if self._peers is None:
            self._peers = tuple(self._relays)
        return self._peers

    def next_deadline(self) -> float | None:
        due = None if self._round is None else self._round.started + self.step_timeout + RELAY_GRACE
        waiting = self._resizing.deadline()
        if waiting is not None:
            due = waiting if due is None else min(due, waiting)
        return due

    # -- inputs -----------------------------------------------------------------------------

    def receive(self, peer: bytes, message: RelayUp, now: float) -> Sequence[RelaySend]:
        if type(message) is RelayBundle:
            return self._on_bundle(peer, message, now)
        if type(message) is RelayHello:
            return self._on_hello(peer, message, now)
        if type(message) is RelayFault:
            return self._on_fault(peer, message, now)
        if type(message) is RelayLeave:
            sends = self._on_leave(peer, message, now)
            return [*sends, *self._admit_resizes(now)] if self._resizing else sends
        raise TypeError(f"not a message from a relay: {message!r}")

    def relay_lost(
        self, peer: bytes, now: float, detail: str = "connection closed"
    ) -> Sequence[RelaySend]:
        """The connection of relay `peer` closed (or missed heartbeats)."""
        if not self._resizing:
            return self._on_lost(peer, now, detail)
        self._resizing.drop(peer)
        return [*self._on_lost(peer, now, detail), *self._admit_resizes(now)]

    def _on_lost(self, peer: bytes, now: float, detail: str) -> Sequence[RelaySend]:
        if self._held.pop(peer, None) is not None:
            return _NOTHING
        member = self._relays.get(peer)
        if member is None:
            return _NOTHING
        self._remove(member)
        if self._state is _S.FAILED:
            self._move(_E.LEAVE)
            return _NOTHING
        if not self._relays and self._reforming:
            self._move(_E.ABANDON)
            self._round = None
            return _NOTHING
        if not self._relays and not self._left:
            self._move(_E.DISBAND)
            self._round = None
            self._dead = set()
            return _NOTHING
        if self.on_rank_loss is OnRankLoss.NEUTRALIZE:
            return self._neutralize(member, now)
        # every relay hears of it: a relay's ranks may wait on a round only it has open
        return self._fail(RankLost(list(member.ranks), f"relay {member.name} lost ({detail})"), now)

    def _neutralize(self, member: RelayMember, now: float) -> Sequence[RelaySend]:
        """Elastic: the relay's ranks are left out, its bundle of the open round withdrawn."""
        self._move(_E.LEAVE)
        self._dead |= set(member.ranks)
        rnd = self._round
        if rnd is None:
            return _NOTHING
        withdrawn = rnd.bundles.pop(member.peer, None)
        if withdrawn is not None:
            rnd.covered -= len(withdrawn.ranks)
        return self._complete_if_ready(rnd, now)

    def on_deadline(self, now: float) -> Sequence[RelaySend]:
        if self._resizing.due(now):
            return [*self._refuse_resizes(now), *self._round_deadline(now)]
        return self._round_deadline(now)

    def _round_deadline(self, now: float) -> Sequence[RelaySend]:
        rnd = self._round
        if rnd is None or now < rnd.started + self.step_timeout + RELAY_GRACE:
            return _NOTHING
        if rnd.disputed:
            return self._fail_disputed(rnd, now)
        missing = [
            r
            for r, owner in enumerate(self._owner)
            if owner not in rnd.bundles and r not in self._dead
        ]
        return self._fail(StepTimeout(missing, self.step_timeout), now)

    # -- registration -----------------------------------------------------------------------

    def _on_hello(
        self, peer: bytes, hello: RelayHello, now: float, deadline: float | None = None
    ) -> Sequence[RelaySend]:
        try:
            if self._must_wait(peer, hello):
                return self._wait_to_resize(peer, hello, now, deadline)
            ranks = self._check(peer, hello)
        except Rejected as error:
            return (RelaySend((peer,), self._answer(reject_message(error))),)
        resized = hello.dp_size != self.dp_size
        if resized:  # no relay holds a rank of the group: it forms at this size
            self.dp_size = hello.dp_size
            self._owner = [None] * hello.dp_size
            self._dead = set()
        if self._state is _S.FAILED:
            self._reform()
        elif self._state is _S.STOPPED:
            self._move(_E.REFORM)
            self._epoch += 1
            self._left = set()
        elif resized:
            self._epoch += 1  # an epoch has one size
        old = self._relays.get(peer)
        if old is not None:
            if old.ranks == ranks:
                return (RelaySend((peer,), self._welcome(ranks)),)
            self._remove(old)
        self._held.pop(peer, None)
        contiguous = ranks[-1] - ranks[0] + 1 == len(ranks)
        member = RelayMember(peer, hello, ranks, ranks[0] if contiguous else -1)
        self._move(_E.JOIN)
        self._relays[peer] = member
        for r in ranks:
            self._owner[r] = peer
        self._left -= set(ranks)
        self._covered += len(ranks)
        self._peers = None
        if self._reforming and self._accounted():
            self._reforming = False
        return (RelaySend((peer,), self._welcome(ranks)),)

    def _accounted(self) -> bool:
        """Every rank is a relay's or left out."""
        if self._covered == self.dp_size:
            return True
        dead = self._dead
        return all(o is not None or r in dead for r, o in enumerate(self._owner))

    def _welcome(self, ranks: tuple[int, ...]) -> RelayAnswer:
        welcome = Welcome(
            epoch=self._epoch,
            next_seq=self._seq,
            dp_size=self.dp_size,
            step_timeout=self.step_timeout,
        )
        dead = sorted(self._dead.intersection(ranks))
        return RelayAnswer(
            group=self.group, message=welcome, on_rank_loss=self.on_rank_loss, dead_ranks=dead
        )

    def _must_wait(self, peer: bytes, hello: RelayHello) -> bool:
        """Whether a registration that may stand must first wait for the group's relays to
        leave (another size than the epoch's); `Rejected` if it may never stand."""
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
        if hello.dp_size == self.dp_size or not (self._relays or self._held):
            return False
        holding = self._relays.get(peer) or self._held.get(peer)
        if holding is not None:
            raise Rejected(
                RejectReason.DP_SIZE.value,
                f"relay {holding.name} holds ranks {list(holding.ranks)} of the group at "
                f"dp_size={self.dp_size}: its ranks must leave before it registers at "
                f"dp_size={hello.dp_size}",
                expected=str(self.dp_size),
                got=str(hello.dp_size),
            )
        return True

    def _wait_to_resize(
        self, peer: bytes, hello: RelayHello, now: float, deadline: float | None
    ) -> Sequence[RelaySend]:
        if deadline is None:
            deadline = now + self.step_timeout
        self._resizing.wait(peer, hello, deadline)
        return _NOTHING

    def _admit_resizes(self, now: float) -> list[RelaySend]:
        """Once no relay holds the group, the waiting registrations count, in their order."""
        if self._relays or self._held:
            return []
        sends: list[RelaySend] = []
        for peer, hello, deadline in self._resizing.take():
            sends.extend(self._on_hello(peer, hello, now, deadline))
        return sends

    def _refuse_resizes(self, now: float) -> list[RelaySend]:
        holders = sorted({**self._held, **self._relays}.values(), key=lambda m: m.ranks)
        ranks = sorted(r for m in holders for r in m.ranks)
        who = "; ".join(f"relay {m.name}: {list(m.ranks)}" for m in holders)
        sends: list[RelaySend] = []
        for waiting in self._resizing.expire(now):
            hello = waiting.hello
            error = Rejected(
                RejectReason.DP_SIZE.value,
                f"relay {hello.relay or '?'} asks dp_size={hello.dp_size} for ranks "
                f"{hello.ranks}, the group runs at dp_size={self.dp_size} and ranks {ranks} "
                f"still hold it ({who}): a group re-forms at another size only once its ranks "
                f"leave (waited {self.step_timeout:g} s)",
                expected=str(self.dp_size),
                got=str(hello.dp_size),
            )
            sends.append(RelaySend((waiting.peer,), self._answer(reject_message(error))))
        return sends

    def _check(self, peer: bytes, hello: RelayHello) -> tuple[int, ...]:
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
        others = {**self._held, **self._relays}
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

    def _reform(self) -> None:
        assert self._failure is not None
        self._move(_E.REFORM)
        self._epoch += 1
        self._seq = self._failure.seq + 1
        self._held.update(self._relays)
        self._relays.clear()
        self._owner = [None] * self.dp_size
        self._covered = 0
        self._left = set()
        self._peers = None
        # `_dead` stays: in elastic mode the new epoch goes on without the ranks that are gone

    def _remove(self, member: RelayMember) -> None:
        del self._relays[member.peer]
        for r in member.ranks:
            if self._owner[r] == member.peer:
                self._owner[r] = None
        self._covered -= len(member.ranks)
        self._peers = None

    def _on_leave(self, peer: bytes, leave: RelayLeave, now: float) -> Sequence[RelaySend]:
        """Every rank of the relay left: between rounds that is no fault; a relay of a failed
        epoch that no rank holds any more holds the group no longer either. Every rank of the
        relay lost (`lost`) is their loss, as a flat coordd's."""
        held = self._held.get(peer)
        if held is not None and peer not in self._relays:
            del self._held[peer]
            return _NOTHING
        member = self._relays.get(peer)
        if member is None or leave.epoch != self._epoch:
            return _NOTHING
        if leave.lost:
            return self._on_lost(peer, now, f"every rank under relay {member.name} lost")
        if self._state is not _S.IDLE:
            return self._on_lost(peer, now, LEFT_THE_GROUP)
        self._remove(member)
        elastic = self.on_rank_loss is OnRankLoss.NEUTRALIZE
        if elastic:
            self._dead |= set(member.ranks)  # left out of later rounds, like a lost relay
        else:
            self._left |= set(member.ranks)
        if not self._relays:
            if self._reforming:
                self._move(_E.ABANDON)
            else:
                self._move(_E.STOP)
                self._left = set()
                self._dead = set()
            return _NOTHING
        self._move(_E.DEPART)
        return _NOTHING

    # -- rounds -----------------------------------------------------------------------------

    def _on_bundle(self, peer: bytes, bundle: RelayBundle, now: float) -> Sequence[RelaySend]:
        member = self._relays.get(peer)
        if member is None or bundle.epoch != self._epoch:
            return (RelaySend((peer,), self._stranger_failure(member, bundle)),)
        if self._state is _S.FAILED:
            assert self._failure is not None
            return (RelaySend((peer,), self._answer(self._failure)),)
        first_rank = member.ranks[0]
        if tuple(bundle.ranks) != member.ranks and not self._live_subset(member, bundle):
            error = ProtocolError(
                f"relay {member.name} registered for ranks {list(member.ranks)} sent a bundle "
                f"for ranks {bundle.ranks}",
                rank=first_rank,
            )
            return (RelaySend((peer,), self._answer(self._failure_of(error, bundle))),)
        decided = self._decided
        if (
            bundle.seq == self._decided_seq
            and decided is not None
            and decided[0].get(peer) == bundle
        ):
            return (RelaySend((peer,), decided[1]),)
        if self._left:
            return self._fail(RankLost(sorted(self._left), LEFT_THE_GROUP), now, bundle)
        rnd = self._round
        if bundle.seq != self._seq:
            expected = bundle.label if rnd is None else rnd.first.label
            mismatch = StepMismatch(first_rank, self._seq, expected, bundle.seq, bundle.label)
            return self._fail(mismatch, now, bundle)
        if rnd is not None:
            previous = rnd.bundles.get(peer)
            if previous is not None:
                if previous == bundle:
                    return _NOTHING
                return self._fail(ConflictingReport(first_rank, bundle.seq), now, bundle)
            if bundle.labels or bundle.label != rnd.first.label:
                rnd.disputed = True
        try:
            self._validate(member, bundle, None if rnd is None else rnd.first)
        except InvalidReport as error:
            return self._fail(error, now, bundle)
        if rnd is None:
            self._move(_E.OPEN)
            rnd = self._round = _TreeRound(bundle, now)
        else:
            self._move(_E.REPORT)
        rnd.bundles[peer] = bundle
        rnd.covered += len(bundle.ranks)
        return self._complete_if_ready(rnd, now)

    def _live_subset(self, member: RelayMember, bundle: RelayBundle) -> bool:
        """Elastic: a bundle may leave out ranks its relay lost (ascending, none foreign)."""
        ranks = bundle.ranks
        return (
            self.on_rank_loss is OnRankLoss.NEUTRALIZE
            and bool(ranks)
            and list(ranks) == sorted(set(ranks))
            and set(ranks) <= set(member.ranks)
        )

    def _complete_if_ready(self, rnd: _TreeRound, now: float) -> Sequence[RelaySend]:
        """Every relay sent its bundle and every rank is some relay's or left out."""
        if not rnd.bundles or len(rnd.bundles) < len(self._relays):
            return _NOTHING
        if not self._accounted():
            return _NOTHING
        return self._complete(rnd, now)

    def _validate(
        self, member: RelayMember, bundle: RelayBundle, first: RelayBundle | None
    ) -> None:
        """Reductions that cannot be a relay's reports (a relay checked each report): the
        relay's lowest rank is named."""
        rank = member.ranks[0]
        n = len(bundle.ranks)
        if bundle.labels:
            if len(bundle.labels) != n:
                raise InvalidReport(rank, "labels", len(bundle.labels), f"{n} labels")
            return
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
            return
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

    def _complete(self, rnd: _TreeRound, now: float) -> Sequence[RelaySend]:
        if rnd.disputed:
            return self._fail_disputed(rnd, now)
        bundles = rnd.bundles
        first = rnd.first
        dead: list[int] = []
        if rnd.covered < self.dp_size:  # elastic: ranks no bundle carries are left out
            live = {r for b in bundles.values() for r in b.ranks}
            dead = [r for r in range(self.dp_size) if r not in live]
        if dead or self._dead:
            self._dead = set(dead)
        outcome: StepDecision | GatherResult
        if first.kind is _GATHER:
            rows: list[list[int]] = [[]] * self.dp_size
            for peer, b in bundles.items():
                self._place(rows, self._relays[peer], b)
            outcome = GatherResult(
                epoch=self._epoch, seq=rnd.seq, site=first.site, rows=rows, dead_ranks=dead
            )
        else:
            outcome = self._decide(rnd, dead)
        self._move(_E.DECIDE)
        self._round = None
        self._seq += 1
        self._decisions += 1
        answer = self._answer(outcome)
        self._decided = (bundles, answer)
        self._decided_seq = rnd.seq
        return (RelaySend(self.peers(), answer),)

    def _decide(self, rnd: _TreeRound, dead: list[int]) -> StepDecision:
        """`decide`'s rules over the bundles' reductions (`dead`: ranks left out, neutral)."""
        parts = list(rnd.bundles.values())
        max_padded = max(b.max_padded for b in parts)
        min_tokens = min(b.min_tokens for b in parts)
        mode = min(b.cudagraph_mode for b in parts)
        n = self._relays[next(iter(rnd.bundles))].hello.num_ubatches
        should_ubatch = all(b.all_ubatch for b in parts) and not last_ubatch_empty(
            max_padded, min_tokens, n
        )
        should_pad = mode != 0 or should_ubatch
        if should_pad:
            across = [max_padded] * self.dp_size
        else:
            across = [0] * self.dp_size
            for peer, b in rnd.bundles.items():
                self._place(across, self._relays[peer], b)
        return StepDecision(
            epoch=self._epoch,
            seq=rnd.seq,
            kind=rnd.first.kind,
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

    def _labels(self, rnd: _TreeRound) -> list[tuple[int, str, StepKind]]:
        """Every covered rank's label, in rank order (a disputed round's evidence)."""
        out: list[tuple[int, str, StepKind]] = []
        for b in rnd.bundles.values():
            ranks = tuple(b.ranks)
            labels = b.labels or [b.label] * len(ranks)
            for r, label in zip(ranks, labels, strict=True):
                out.append((r, label, _kind_of(label)))
        out.sort()
        return out

    def _fail_disputed(self, rnd: _TreeRound, now: float) -> Sequence[RelaySend]:
        evidence = self._labels(rnd)
        label = majority([lab for _, lab, _ in evidence])
        kind = next(k for _, lab, k in evidence if lab == label)
        culprit, got, _ = next(e for e in evidence if e[1] != label)
        error = StepMismatch(culprit, rnd.seq, label, rnd.seq, got)
        return self._fail(error, now, kind=kind)

    def _on_fault(self, peer: bytes, fault: RelayFault, now: float) -> Sequence[RelaySend]:
        member = self._relays.get(peer)
        failure = fault.failure
        if member is None or failure.epoch != self._epoch or self._state is _S.FAILED:
            return _NOTHING
        foreign = sorted(set(failure.culprits) - set(member.ranks))
        if foreign:
            error = ProtocolError(
                f"relay {member.name} blamed ranks {foreign}, which it does not serve",
                rank=member.ranks[0],
            )
            return self._fail(error, now)
        return self._fail_with(failure)

    def _stranger_failure(self, member: RelayMember | None, bundle: RelayBundle) -> RelayAnswer:
        last = self._failure
        if last is not None and bundle.epoch == last.epoch:
            return self._answer(last)
        error: CoordError
        if bundle.epoch != self._epoch:
            error = CoordinatorUnavailable(
                f"epoch {bundle.epoch} is not the root's current epoch {self._epoch} (the root "
                "restarted or the group re-formed): register again"
            )
        else:
            error = ProtocolError(
                "bundle from a relay that has not registered",
                rank=bundle.ranks[0] if bundle.ranks else 0,
            )
        return self._answer(self._failure_of(error, bundle))

    def _failure_of(self, error: CoordError, bundle: RelayBundle) -> StepFailed:
        return failure_message(error, epoch=self._epoch, seq=bundle.seq, kind=bundle.kind)

    def _fail(
        self,
        error: CoordError,
        now: float,
        bundle: RelayBundle | None = None,
        kind: StepKind | None = None,
    ) -> Sequence[RelaySend]:
        if kind is None:
            if self._round is not None:
                kind = self._round.first.kind
            else:
                kind = bundle.kind if bundle is not None else StepKind.FORWARD
        failure = failure_message(error, epoch=self._epoch, seq=self._seq, kind=kind)
        return self._fail_with(failure)

    def _fail_with(self, failure: StepFailed) -> Sequence[RelaySend]:
        self._move(_E.FAIL)
        self._round = None
        self._failure = failure
        self._failures += 1
        self._reforming = True
        return (RelaySend(self.peers(), self._answer(failure)),)

    # -- helpers ----------------------------------------------------------------------------

    def _answer(
        self, message: Welcome | StepDecision | GatherResult | StepFailed | object
    ) -> RelayAnswer:
        return RelayAnswer(group=self.group, message=message)  # type: ignore[arg-type]

    def _move(self, event: GroupEvent) -> None:
        self._state = next_state(self._state, event)


def _kind_of(label: str) -> StepKind:
    return _GATHER if label.startswith("gather:") else StepKind(label)
