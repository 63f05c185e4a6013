"""A relay's group, sans-IO: one node's ranks served as coordd serves them, and one message up
to the root per round (the per-node partial round).

`RelayCoordinator` is the rank-facing `Coordinator` with four changes:
- registration goes up first: the first Hello of an epoch (the group's first, or the first
  after a failure or a stop) is held while the relay registers its ranks with the root
  (`RelayHello`), and the root's Welcome sets the epoch and seq the node's ranks get, so a
  rank's report, the relay's bundle and the root's decision all carry the same numbers;
- a round is complete on the node when every rank of the relay reported: it goes up as one
  `RelayBundle` (`bundle_of`), and the round stays open until the root's answer comes back
  (`from_root`), which goes to every rank of the node unchanged;
- a fault found on the node (a rank lost, late, skipping, conflicting, invalid) fails the
  node's group as coordd would, naming the rank, and goes up as a `RelayFault`; a failure
  from the root fails the node's group with the root's very message;
- the root lost (`root_lost`) or silent past the step timeout and its grace fails the node's
  group with `CoordinatorUnavailable`; ranks then register again, and with them the relay;
- resize: a Hello at another size (up to the relay's --dp) first waits, as coordd's would, for
  the node's own ranks of the old epoch to leave; then it goes up as the relay's registration
  at that size, for the relay's ranks that exist at that size (`serving`): `--relay-ranks
  8-15` speak for no rank of a group re-formed at dp 8. Once no rank of the node holds the
  group, the relay leaves it at the root (`RelayLeave`), so it blocks no re-form there.
- the rank-loss mode is the root's (its Welcome says it): under neutralize a rank the node
  lost is left out as coordd leaves it out (`_dead`), the bundle carries only live ranks, and
  a rank back rejoins when the node's round ends (the root's answer came).

Upstream messages leave through `uplink`, a callable the shell gives (a list's append in tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from coordd.proto.coordinator import Coordinator, Send
from coordd.proto.defaults import STEP_TIMEOUT
from coordd.proto.errors import CoordError, CoordinatorUnavailable, Rejected, StepTimeout
from coordd.proto.group_state import GroupEvent, GroupState
from coordd.proto.membership import check_basics
from coordd.proto.messages import (
    Hello,
    Reject,
    RejectReason,
    StepFailed,
    StepKind,
    StepReport,
    Welcome,
    reject_message,
)
from coordd.proto.relay_messages import (
    RelayAnswer,
    RelayBundle,
    RelayFault,
    RelayHello,
    RelayLeave,
    RelayUp,
)
from coordd.proto.rounds import Round
from coordd.proto.snapshot import OnRankLoss

_E, _S = GroupEvent, GroupState
_NOTHING: tuple[Send, ...] = ()

#: How much longer than the step timeout the root waits for a relay's bundle: the relay's own
#: timeout, which names the late rank, comes first. The relay waits twice this for the root.
RELAY_GRACE = 0.5


def bundle_of(group: str, epoch: int, rnd: Round, ranks: Sequence[int]) -> RelayBundle:
    """The one message for a round every rank in `ranks` reported (`rnd.reports` by rank):
    the reports reduced as `decide` reduces them, or a gather round's rows."""
    reports = [rnd.reports[r] for r in ranks]
    labels = [rep.label for rep in reports]  # type: ignore[union-attr]
    disputed = rnd.disputed and len(set(labels)) > 1
    common = {
        "group": group,
        "epoch": epoch,
        "seq": rnd.seq,
        "kind": rnd.kind,
        "ranks": list(ranks),
        "site": rnd.site,
        "labels": labels if disputed else [],
    }
    if disputed:
        return RelayBundle(**common)  # type: ignore[arg-type]
    if rnd.kind is StepKind.GATHER:
        return RelayBundle(rows=[rep.values for rep in reports], **common)  # type: ignore[union-attr, arg-type]
    steps: list[StepReport] = reports  # type: ignore[assignment]
    tokens = [r.num_tokens for r in steps]
    padded = [r.num_tokens_padded for r in steps]
    return RelayBundle(
        padded=padded,
        max_padded=max(padded),
        min_tokens=min(tokens),
        cudagraph_mode=min(r.cudagraph_mode for r in steps),
        all_ubatch=all(r.want_ubatch for r in steps),
        all_idle=not any(tokens),
        any_unfinished=any(r.has_unfinished for r in steps),
        all_pause=all(r.want_pause for r in steps),
        any_pause=any(r.want_pause for r in steps),
        **common,  # type: ignore[arg-type]
    )


def parse_ranks(text: str) -> frozenset[int]:
    """`"0-3,8"` -> {0, 1, 2, 3, 8}; `"8@2"` (8 ranks a node, node 2) -> 16..23, the form a
    pod template fills in from its index; ValueError for anything else."""
    size, at, index = text.strip().partition("@")
    if at:
        if not size.isdigit() or not index.isdigit() or int(size) < 1:
            raise ValueError(f"{text!r}: SIZE@INDEX needs two numbers, like 8@2")
        first = int(size) * int(index)
        return frozenset(range(first, first + int(size)))
    ranks: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{part!r} is not a rank or a range of ranks (like 0-3)")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"{part!r}: the range runs backwards")
        ranks.update(range(first, last + 1))
    if not ranks:
        raise ValueError("no ranks")
    return frozenset(ranks)


class RelayCoordinator(Coordinator):
    """One group on a relay: its node's ranks (`ranks`), rounds decided by the root."""

    def __init__(
        self,
        dp_size: int,
        *,
        group: str,
        ranks: frozenset[int],
        uplink: Callable[[RelayUp], None],
        epoch: int,
        step_timeout: float = STEP_TIMEOUT,
        on_rank_loss: OnRankLoss = OnRankLoss.FAIL,
        relay: str = "",
    ) -> None:
        super().__init__(dp_size, epoch=epoch, step_timeout=step_timeout, on_rank_loss=on_rank_loss)
        if not ranks or min(ranks) < 0 or max(ranks) >= dp_size:
            raise ValueError(f"a relay's ranks must be in 0..{dp_size - 1}, got {sorted(ranks)}")
        self.group = group
        #: Every rank the relay may speak for (--relay-ranks).
        self.ranks = tuple(sorted(ranks))
        #: The ranks it speaks for in this epoch: those that exist at the epoch's size.
        self.serving = self.ranks
        self.relay = relay
        self._uplink = uplink
        #: The root welcomed this relay for the current epoch.
        self.registered = False
        #: The epoch in which the root counts this relay as holding ranks, until it leaves.
        self._at_root: int | None = None
        #: A RelayHello is out and not yet answered.
        self._asking = False
        #: Hellos held until the root answers the relay's registration: (peer, hello).
        self._pending: list[tuple[bytes, Hello]] = []
        #: The root's Welcome that the held Hellos are admitted under.
        self._welcome: Welcome | None = None
        #: The open round went up as a bundle: the root decides it now.
        self.forwarded = False
        self._from_root = False
        #: Answers from the root for no round of this node (an older epoch's, a closed round's).
        self.stale_answers = 0

    # -- registration ------------------------------------------------------------------------

    def _on_hello(
        self, peer: bytes, hello: Hello, now: float, resize_deadline: float | None = None
    ) -> Sequence[Send]:
        try:
            check_basics(hello, self.max_dp_size)
        except Rejected as refused:
            return (Send((peer,), reject_message(refused)),)
        if hello.dp_rank not in self.ranks:
            error = Rejected(
                RejectReason.RANK_RANGE.value,
                f"dp_rank {hello.dp_rank} is not served by this relay{self._named()}: it "
                f"serves ranks {_span(self.ranks)} (register with the relay of that rank's node)",
                expected=_span(self.ranks),
                got=str(hello.dp_rank),
            )
            return (Send((peer,), reject_message(error)),)
        if self.registered and hello.dp_size != self.dp_size and not self._members:
            self._leave_root()  # welcomed at the old size, no rank came: ask at the new one
        if self.registered:
            return super()._on_hello(peer, hello, now, resize_deadline)
        if hello.dp_size != self.dp_size and (self._members or self._held):
            try:  # the node's own ranks of the old size leave first
                return self._wait_to_resize(peer, hello, now, resize_deadline)
            except Rejected as holding:
                return (Send((peer,), reject_message(holding)),)
        self._pending = [(p, h) for p, h in self._pending if p != peer]
        self._pending.append((peer, hello))
        if not self._asking:
            self._ask(hello)
        return _NOTHING

    def _ask(self, hello: Hello) -> None:
        self._asking = True
        self._uplink(
            RelayHello(
                group=self.group,
                dp_size=hello.dp_size,
                ranks=[r for r in self.ranks if r < hello.dp_size],
                config_fingerprint=hello.config_fingerprint,
                incarnation=hello.incarnation,
                num_ubatches=hello.num_ubatches,
                relay=self.relay,
                protocol_version=hello.protocol_version,
            )
        )

    def root_back(self) -> None:
        """The connection to the root is up again: ask for the registration Hellos wait on."""
        if self._pending and not self.registered:
            self._ask(self._pending[0][1])

    def _welcomed(self, welcome: Welcome, answer: RelayAnswer, now: float) -> Sequence[Send]:
        self._asking = False
        if not 1 <= welcome.dp_size <= self.max_dp_size:
            return self._refuse_pending(
                Rejected(
                    RejectReason.DP_SIZE.value,
                    f"the root coordd welcomed dp={welcome.dp_size}, this relay serves at most "
                    f"--dp {self.max_dp_size}",
                    expected=f"1..{self.max_dp_size}",
                    got=str(welcome.dp_size),
                )
            )
        self.registered = True
        self.on_rank_loss = answer.on_rank_loss
        # the root's word: a rank still connected from a failed epoch is out until it is back
        self._dead = frozenset(answer.dead_ranks).intersection(self.ranks)
        self._members_changed()
        self._at_root = welcome.epoch
        self._welcome = welcome
        self.serving = tuple(r for r in self.ranks if r < welcome.dp_size)
        if self._state is _S.EMPTY:
            self._adopt(welcome)
        sends: list[Send] = []
        pending, self._pending = self._pending, []
        for peer, hello in pending:
            sends.extend(super()._on_hello(peer, hello, now))
        return sends

    def _adopt(self, welcome: Welcome) -> None:
        """The node's epoch and next seq are the root's."""
        self._epoch = welcome.epoch
        self._seq = welcome.next_seq
        self.step_timeout = welcome.step_timeout or self.step_timeout
        self._members_changed()

    def _reform(self) -> None:
        super()._reform()
        if self._welcome is not None:
            self._adopt(self._welcome)

    def _restart(self) -> None:
        super()._restart()
        if self._welcome is not None:
            self._adopt(self._welcome)

    def _renew(self) -> None:
        super()._renew()
        if self._welcome is not None:
            self._adopt(self._welcome)

    def _refuse_pending(self, error: Rejected) -> Sequence[Send]:
        """The root refused the relay's registration: so are the Hellos that asked for it
        (with the root's reason), except those with other settings, which ask again."""
        sent = self._pending[0][1] if self._pending else None
        refused = [
            (p, h) for p, h in self._pending if sent is None or _settings(h) == _settings(sent)
        ]
        self._pending = [item for item in self._pending if item not in refused]
        if self._pending:
            self._ask(self._pending[0][1])
        reject = reject_message(error)
        return [Send((p,), reject) for p, _ in refused]

    # -- rounds ------------------------------------------------------------------------------

    def _complete_if_ready(self, now: float, last_rank: int | None) -> Sequence[Send]:
        rnd = self._round
        live = self._live()
        if rnd is None or self.forwarded or not live or rnd.reported < len(live):
            return _NOTHING
        self.forwarded = True
        self._uplink(bundle_of(self.group, self._epoch, rnd, live))
        return _NOTHING

    def _live(self) -> tuple[int, ...]:
        """The ranks a bundle speaks for: those served, less those left out (elastic)."""
        dead = self._dead
        return tuple(r for r in self.serving if r not in dead) if dead else self.serving

    def next_deadline(self) -> float | None:
        rnd = self._round
        due = None
        if rnd is not None:
            due = rnd.started + self.step_timeout + (2 * RELAY_GRACE if self.forwarded else 0.0)
        waiting = self._resizing.deadline()  # a Hello at another size waits for own ranks
        if waiting is not None:
            due = waiting if due is None else min(due, waiting)
        return due

    def _round_deadline(self, now: float) -> Sequence[Send]:
        rnd = self._round
        if rnd is not None and self.forwarded:
            if now < rnd.started + self.step_timeout + 2 * RELAY_GRACE:
                return _NOTHING
            return self._fail_quietly(
                CoordinatorUnavailable(
                    f"the root coordd did not answer round {rnd.seq} within the step timeout "
                    f"({self.step_timeout:g}s) and {2 * RELAY_GRACE:g}s"
                ),
                now,
            )
        if rnd is None or now < rnd.started + self.step_timeout or rnd.disputed:
            return super()._round_deadline(now)
        missing = [r for r in self._live() if rnd.reports[r] is None]
        return self._fail(StepTimeout(missing, self.step_timeout), now)

    # -- faults ------------------------------------------------------------------------------

    def _fail(self, error: CoordError, now: float, part: object = None) -> list[Send]:
        self.forwarded = False
        self.registered = False
        sends = super()._fail(error, now, part)
        if not self._from_root and self._failure is not None:
            self._uplink(RelayFault(group=self.group, failure=self._failure))
        return sends

    def _fail_quietly(self, error: CoordError, now: float) -> Sequence[Send]:
        """Fail the node's group without telling the root (it is gone, or is the source)."""
        self._from_root = True
        try:
            return self._fail(error, now)
        finally:
            self._from_root = False

    def _fail_from_root(self, failure: StepFailed, now: float) -> Sequence[Send]:
        """Fail the node's group with the root's own message (the same for every node)."""
        waiting = self._state is _S.ROUND_OPEN
        self.forwarded = False
        self.registered = False
        sends = self._fail_with(failure, now)
        # between rounds nobody waits: each rank gets the failure when it next reports
        return sends if waiting else sends[1:]

    def root_lost(self, now: float, detail: str) -> Sequence[Send]:
        """The connection to the root dropped: every rank of the node gets
        `CoordinatorUnavailable` (now if a round is open, else at its next report)."""
        self.registered = False
        self._asking = False
        self._at_root = None  # the root let go of this relay with its connection
        if self._state in (_S.EMPTY, _S.FAILED, _S.STOPPED):
            return _NOTHING
        waiting = self._state is _S.ROUND_OPEN
        sends = self._fail_quietly(
            CoordinatorUnavailable(f"the relay lost its root coordd ({detail}): register again"),
            now,
        )
        return sends if waiting else _NOTHING

    def _on_goodbye(self, peer: bytes, now: float) -> Sequence[Send]:
        sends = super()._on_goodbye(peer, now)
        self._leave_if_unheld()
        return sends

    def _on_lost(self, peer: bytes, now: float, detail: str) -> Sequence[Send]:
        before = self._state
        sends = super()._on_lost(peer, now, detail)
        if self._state is _S.EMPTY and before is not _S.EMPTY:
            self._leave_root(lost=True)  # coordd's own group disbands; the root lost them
        self._leave_if_unheld()
        return sends

    def _leave_if_unheld(self) -> None:
        """Every rank of the node left (the group stopped), or the group failed and none of
        its ranks is connected: the relay leaves the group at the root, where it would
        otherwise hold its ranks and keep a re-form at another size waiting."""
        if self._members:
            return
        if self._state is _S.STOPPED or (self._state is _S.FAILED and not self._held):
            self._leave_root()

    def _leave_root(self, lost: bool = False) -> None:
        """Tell the root this relay holds no rank of the group any more (`lost`: they were
        lost, which the root's other relays hear as `RankLost`); the next Hello asks again."""
        if self._at_root is not None:
            self._uplink(RelayLeave(group=self.group, epoch=self._at_root, lost=lost))
            self._at_root = None
        self.registered = False

    def peer_lost(self, peer: bytes, now: float, detail: str = "disconnected") -> Sequence[Send]:
        self._pending = [(p, h) for p, h in self._pending if p != peer]
        return super().peer_lost(peer, now, detail)

    # -- the root's answers ------------------------------------------------------------------

    def from_root(self, answer: RelayAnswer, now: float) -> Sequence[Send]:
        """What the root answered for this group: the registration's outcome, the open round's
        outcome, or a failure of the group."""
        msg = answer.message
        if type(msg) is Welcome:
            return self._welcomed(msg, answer, now)
        if type(msg) is Reject:
            self._asking = False
            return self._refuse_pending(
                Rejected(msg.reason.value, msg.text, expected=msg.expected, got=msg.got)
            )
        if type(msg) is StepFailed:
            if msg.epoch != self._epoch or self._state in (_S.FAILED, _S.EMPTY, _S.STOPPED):
                self.stale_answers += 1
                return _NOTHING
            return self._fail_from_root(msg, now)
        rnd = self._round
        if (
            rnd is None
            or not self.forwarded
            or msg.epoch != self._epoch  # type: ignore[union-attr]
            or msg.seq != rnd.seq  # type: ignore[union-attr]
        ):
            self.stale_answers += 1
            return _NOTHING
        self.forwarded = False
        return self._settle(rnd, msg, now, None)

    def _named(self) -> str:
        return f" ({self.relay})" if self.relay else ""


def _settings(hello: Hello) -> tuple[int, str, int, int]:
    return (hello.dp_size, hello.config_fingerprint, hello.num_ubatches, hello.protocol_version)


def _span(ranks: Sequence[int]) -> str:
    """(0, 1, 2, 3) -> "0-3"; gaps as commas."""
    parts: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(parts)
