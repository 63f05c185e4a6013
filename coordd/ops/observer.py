"""What coordd counts about its rounds and outside them (the Prometheus view of it is
`coordd.ops.collector`).

One `Observer` per group is told about each completed round once, each fault once, and each
registration, and reads its group only through the coordinator's `GroupSnapshot` (a decision or
a failure is new when the snapshot's counter moved); it keeps plain integers and lists, with no
lock, because everything (the socket, the timer and the HTTP endpoints) runs on the daemon's one
event loop. Per round it does a handful of additions (a histogram bucket, the straggler's
counter, a deque append), so metrics add no per-message cost. `ServerEvents` counts what happens
outside any group. `CoorddCollector` turns those numbers into Prometheus metric families only
when /metrics is scraped.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any, Protocol

from coordd.core import _logs as logs
from coordd.core._bounds import Throttle
from coordd.core._peers import peer_label
from coordd.proto.coordinator import LEFT_THE_GROUP
from coordd.proto.group import GroupMachine
from coordd.proto.messages import (
    FailReason,
    GatherResult,
    Hello,
    Reject,
    StepDecision,
    StepFailed,
    Welcome,
)
from coordd.proto.rounds import CompletedRound
from coordd.proto.snapshot import GroupSnapshot

log = logging.getLogger("coordd")

#: Round duration buckets (seconds): from tens of microseconds (ipc, small dp) to the timeout.
#: "group created" and "group dropped" lines written per 10 s at most, over all names.
GROUP_LINES = 32
DURATION_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
#: Rank wait buckets (seconds): a wait that found its answer queued takes microseconds.
WAIT_BUCKETS = (0.00001, 0.000025, *DURATION_BUCKETS)
#: Most sites one group's wait histogram keeps apart; the rest are counted as site="other"
#: (a gather site is a peer's string: the series a group can make stay bounded).
MAX_WAIT_SITES = 32
#: Recent failures kept for /status.
RECENT_FAILURES = 20
#: Mean lateness is taken over the last LATENESS_BUDGET // dp rounds (8..1000), which bounds
#: the work one /status request does on the event loop to about a millisecond or two.
LATENESS_BUDGET = 16384


def version() -> str:
    try:
        return metadata.version("coordd")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "0+unknown"


class DurationHistogram:
    """Bucket counts (`le` semantics, +Inf last) and the sum, in seconds."""

    __slots__ = ("buckets", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...] = DURATION_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)


class Observer:
    """Counts rounds, faults and registrations of one group's coordinator; logs each fault once.

    `view` returns the group as it stands now (the coordinator's `snapshot`); `name` is the
    group's name (its metrics label and log field)."""

    def __init__(
        self, view: Callable[[], GroupSnapshot], *, name: str = "default", wall: Any = time.time
    ) -> None:
        self.view = view
        #: The group's machine when `view` is its `snapshot`: a decision reads the machine's
        #: counters (`decisions`, `last_round`, `ranks_registered`) instead of a snapshot built
        #: again every round for them.
        self._machine: _Counted | None = _machine_of(view)
        self.name = name
        first = view()
        self.dp_size = first.max_dp_size  # the most ranks any epoch of the group may have
        self.wall = wall
        self.started_wall = wall()
        self.durations: dict[str, DurationHistogram] = {}
        self.failed: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.registrations = 0
        #: Registrations of ranks back from their own collective (the fallback), and how long
        #: the latest of them ran without coordd, as its Hello said.
        self.returns = 0
        self.last_away_s = 0.0
        self.stragglers = [0] * self.dp_size
        self.rounds_at_join: dict[int, int] = {}
        #: Rounds decided while a rank no longer registered was (its latest registration).
        self.rounds_before_leaving: dict[int, int] = {}
        #: Ranks whose latest registration ended in a loss (`lost`), not a Goodbye.
        self.lost_ranks: set[int] = set()
        self.addresses: dict[bytes, str] = {}
        self.recent: deque[CompletedRound] = deque(
            maxlen=max(8, min(1000, LATENESS_BUDGET // self.dp_size))
        )
        self.recent_failures: deque[dict[str, Any]] = deque(maxlen=RECENT_FAILURES)
        #: The snapshot's `failures` and `decisions` when this observer last counted them.
        self.failures_seen = first.failures
        #: The snapshot's `stops` when this observer last logged one (every rank left).
        self.stops_seen = first.stops
        self._decisions_seen = first.decisions
        self._registering: tuple[bytes, Hello] | None = None
        #: How long ranks' waits blocked for their rounds' answers, by site (a policy round's
        #: kind, a gather round's site), as the ranks report it in their next report.
        self.waits: dict[str, DurationHistogram] = {}
        #: The last decided round (seq, site) and the ranks whose wait for it was counted.
        self._wait_seq = -1
        self._wait_site = ""
        self._waits_counted: set[int] = set()
        #: The histogram the last decided round's waits go to, once the first came.
        self._wait_histogram: DurationHistogram | None = None

    # -- what the server tells it -------------------------------------------------------------

    def sent(self, peers: Sequence[bytes], message: object) -> None:
        """The server sent `message` (once per round for a decision; rare otherwise).

        A decision costs a few microseconds here: the snapshot (built once per change), one
        histogram bucket, the straggler's counter and a deque append."""
        kind = type(message)
        if kind is StepDecision or kind is GatherResult:
            machine = self._machine
            if machine is None:
                snap = self.view()
                rnd, decisions, registered = snap.last_round, snap.decisions, len(snap.members)
            else:
                rnd, decisions = machine.last_round, machine.decisions
                registered = machine.ranks_registered()
            if rnd is None or decisions == self._decisions_seen:
                return  # a re-sent decision (a rank repeated its report): not a new round
            if registered != len(self.rounds_at_join):
                self.settle(self.view())  # a rank left before this round: it took no part
            self._decisions_seen = decisions
            histogram = self.durations.get(rnd.kind._value_)
            if histogram is None:
                histogram = self.durations[rnd.kind._value_] = DurationHistogram()
            seconds = rnd.completed - rnd.started
            histogram.counts[bisect_left(DURATION_BUCKETS, seconds)] += 1
            histogram.sum += seconds
            if rnd.last_rank is not None:
                self.stragglers[rnd.last_rank] += 1
            self.recent.append(rnd)
            self._wait_seq = rnd.seq
            self._wait_site = rnd.site or rnd.kind._value_
            self._wait_histogram = None
            self._waits_counted.clear()
        elif kind is StepFailed:
            snap = self.view()
            if snap.failures != self.failures_seen:
                self.group_failed(snap)
            if message != snap.last_failure:  # not the group's failure: one peer's error
                self._peer_error(peers, message)  # type: ignore[arg-type]
        elif kind is Welcome:
            self._welcomed(peers)
        elif kind is Reject:
            self._rejected(peers, message)  # type: ignore[arg-type]

    def waited(self, rank: int, seq: int, waited_us: int) -> None:
        """Rank `rank`'s report for `seq` says its wait for round seq - 1 blocked `waited_us`:
        counted under that round's site if it is the last one decided, once per rank."""
        counted = self._waits_counted
        if seq - 1 != self._wait_seq or not 0 <= rank < self.dp_size or rank in counted:
            return
        counted.add(rank)
        histogram = self._wait_histogram
        if histogram is None:
            histogram = self._wait_histogram = self._wait_histogram_now()
        seconds = waited_us / 1e6  # `observe`, written out: once per rank per round
        histogram.counts[bisect_left(WAIT_BUCKETS, seconds)] += 1
        histogram.sum += seconds

    def _wait_histogram_now(self) -> DurationHistogram:
        """The histogram of the last decided round's site (made at its first wait), or the
        "other" one once MAX_WAIT_SITES sites have theirs."""
        site = self._wait_site
        histogram = self.waits.get(site)
        if histogram is None:
            if len(self.waits) >= MAX_WAIT_SITES:
                site = "other"
                histogram = self.waits.get(site)
            if histogram is None:
                histogram = self.waits[site] = DurationHistogram(WAIT_BUCKETS)
        return histogram

    def registering(self, peer: bytes, hello: Hello, address: object) -> None:
        """A Hello arrived from `peer` (ZeroMQ's Peer-Address `address`), before the
        coordinator sees it."""
        self._registering = (peer, hello)
        if address:
            self.addresses[peer] = str(address)
        if len(self.addresses) > 4 * self.dp_size + 16:
            live = {member.peer for member in self.view().members.values()}
            self.addresses = {p: a for p, a in self.addresses.items() if p in live or p == peer}

    def group_failed(self, snap: GroupSnapshot) -> None:
        """The group failed since this observer last looked (`snap.failures` moved): the
        server checks once per drain, which also catches failures nobody was sent."""
        self.failures_seen = snap.failures
        failure = snap.last_failure
        if failure is None:
            return
        self.failed[failure.kind.value] += 1
        departed = failure.reason is FailReason.LOST and failure.detail == LEFT_THE_GROUP
        if departed:
            # A rank said Goodbye while a round needed it (one was open, or another rank
            # still reported): that round failed, but the rank that left did not crash.
            self._fault(
                failure,
                "group failed",
                level=logging.WARNING,
                then="a rank left (said Goodbye) while the others still synced; they get "
                "RankLost(left the group) and connect() again",
            )
            return
        self._fault(failure, "group failed", level=logging.WARNING)

    def group_stopped(self, snap: GroupSnapshot) -> None:
        """Every rank left the group cleanly since this observer last looked (`snap.stops`
        moved): an orderly end, logged at info and counted apart from failures."""
        self.stops_seen = snap.stops
        logs.event(
            log,
            logging.INFO,
            "group stopped",
            group=self.group,
            epoch=snap.epoch,
            seq=snap.seq,
            detail="every rank left cleanly (Goodbye); the next registration starts a new epoch",
        )

    def lost(self, rank: int | None, peer: bytes, detail: str) -> None:
        """A registered rank's connection closed (called after the coordinator was told)."""
        if rank is None:
            return
        snap = self.view()
        self.settle(snap)
        self.lost_ranks.add(rank)
        kind = snap.open_kind
        logs.event(
            log,
            logging.WARNING,
            "rank lost",
            **logs.fault_fields(
                group=self.group,
                epoch=snap.epoch,
                seq=snap.seq,
                kind=kind.value if kind is not None else "-",
                ranks=[rank],
            ),
            reason="lost",
            peer=self.addresses.get(peer, "") or _peer_text(peer),
            detail=detail,
            on_rank_loss=snap.on_rank_loss.value,
        )

    # -- derived ------------------------------------------------------------------------------

    @property
    def group(self) -> str:
        """The group's name (its label and log field)."""
        return self.name

    def fault_fields(self, kind: str) -> dict[str, Any]:
        """Fault-line fields for an event outside a round (a refused connection)."""
        snap = self.view()
        return logs.fault_fields(
            group=self.group, epoch=snap.epoch, seq=snap.seq, kind=kind, ranks=[]
        )

    @property
    def decided(self) -> dict[str, int]:
        """Rounds decided, by kind."""
        return {kind: h.count for kind, h in self.durations.items()}

    @property
    def rounds_completed(self) -> int:
        return sum(h.count for h in self.durations.values())

    def rounds_of(self, rank: int) -> int:
        """Rounds decided while `rank` was registered, its latest registration (up to now if
        it still is; call `settle` first, so a rank that left stops counting)."""
        joined = self.rounds_at_join.get(rank)
        if joined is None:
            return self.rounds_before_leaving.get(rank, 0)
        return self.rounds_completed - joined

    def left_cleanly(self, rank: int) -> bool:
        """`rank` registered and left with no loss said (a Goodbye): after `settle`."""
        return rank in self.rounds_before_leaving and rank not in self.lost_ranks

    def settle(self, snap: GroupSnapshot) -> None:
        """Freeze the round count of every rank that is no longer registered: O(ranks), run
        only when the registered count differs from the counted one, or when asked."""
        for rank in [r for r in self.rounds_at_join if r not in snap.members]:
            self.rounds_before_leaving[rank] = self.rounds_completed - self.rounds_at_join.pop(rank)

    def mean_lateness(self) -> list[float | None]:
        """Per rank: mean seconds between a round's first report and this rank's, over the
        recent rounds (None for a rank with no report among them)."""
        dp = self.dp_size
        sums = [0.0] * dp
        counts = [0] * dp
        for rnd in self.recent:
            started = rnd.started
            for rank, arrived in enumerate(rnd.arrivals):
                if arrived is not None:
                    sums[rank] += arrived - started
                    counts[rank] += 1
        return [s / n if n else None for s, n in zip(sums, counts, strict=True)]

    # -- internals ----------------------------------------------------------------------------

    def _peer_error(self, peers: Sequence[bytes], failure: StepFailed) -> None:
        """An error for one peer's report only (unregistered, spoofed, stale epoch)."""
        self._fault(failure, "report refused", peer=", ".join(_peer_text(p) for p in peers))

    def _fault(
        self, failure: StepFailed, name: str, level: int = logging.WARNING, **extra: Any
    ) -> None:
        self.faults[failure.reason.value] += 1
        fields = logs.fault_fields(
            group=self.group,
            epoch=failure.epoch,
            seq=failure.seq,
            kind=failure.kind.value,
            ranks=failure.culprits,
        )
        record = {
            "time": self.wall(),
            **fields,
            "reason": failure.reason.value,
            "text": failure.text,
            **extra,
        }
        self.recent_failures.append(record)
        logs.event(
            log,
            level,
            name,
            **fields,
            reason=failure.reason.value,
            detail=failure.text,
            **extra,
        )

    def _welcomed(self, peers: Sequence[bytes]) -> None:
        snap = self.view()
        for peer in peers:
            rank = snap.rank_of(peer)
            if rank is None:
                continue
            self.registrations += 1
            self.rounds_at_join[rank] = self.rounds_completed
            self.rounds_before_leaving.pop(rank, None)
            self.lost_ranks.discard(rank)
            member = snap.members[rank]
            if member.hello.away_ms > 0:
                self.returns += 1
                self.last_away_s = member.hello.away_ms / 1000
            logs.event(
                log,
                logging.INFO,
                "rank registered",
                group=self.name,
                epoch=snap.epoch,
                seq=snap.seq,
                rank=rank,
                incarnation=member.hello.incarnation,
                peer=self.addresses.get(peer, "") or _peer_text(peer),
                registered=f"{len(snap.members)}/{snap.dp_size}",
            )

    def _rejected(self, peers: Sequence[bytes], reject: Reject) -> None:
        self.rejected[reject.reason.value] += 1
        snap = self.view()
        registering = self._registering
        hello = registering[1] if registering and registering[0] in peers else None
        logs.event(
            log,
            logging.WARNING,
            "registration rejected",
            **logs.fault_fields(
                group=self.name,
                epoch=snap.epoch,
                seq=snap.seq,
                kind="register",
                ranks=[hello.dp_rank] if hello else [],
            ),
            reason=reject.reason.value,
            expected=reject.expected,
            got=reject.got,
            detail=reject.text,
        )


class _Counted(Protocol):
    """What a decision reads of the group's machine (`coordd.proto.group.GroupMachine`)."""

    @property
    def decisions(self) -> int: ...
    @property
    def last_round(self) -> CompletedRound | None: ...
    def ranks_registered(self) -> int: ...
    def snapshot(self) -> GroupSnapshot: ...


def _machine_of(view: Callable[[], GroupSnapshot]) -> _Counted | None:
    """The machine whose `snapshot` method `view` is, or None (another view: snapshots)."""
    machine = getattr(view, "__self__", None)
    if isinstance(machine, GroupMachine) and view == machine.snapshot:
        return machine
    return None


class ServerEvents:
    """What happens outside any group, counted and logged like a group's faults: a Hello
    refused before a group took it (a bad group name, the group limit, settings no group could
    admit) and a report from a peer that registered with no group. Groups created and dropped
    are logged here too."""

    def __init__(self) -> None:
        self.rejected: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.dropped_groups = 0
        # A peer can cause these once per message: the first of each 10 s is logged, the rest
        # counted into one summary line (coordd.core._logs.Aggregated).
        self._rejected_log = logs.Aggregated(log, "registration rejected")
        self._refused_log = logs.Aggregated(log, "report refused")
        #: "group created" / "group dropped": a line per name, but at most GROUP_LINES per 10 s
        #: over all names (a peer cycling names through a pattern makes two per name).
        self._group_lines = Throttle(10.0, keys=1024, lines=GROUP_LINES)

    def aggregated(self) -> tuple[logs.Aggregated, ...]:
        """The aggregated log lines (the server gives them its loop's timer)."""
        return (self._rejected_log, self._refused_log)

    def rejected_hello(self, peer: bytes, hello: Hello, reject: Reject, group: str) -> None:
        """`hello` (for group `group`, shown safely) was refused before any group took it."""
        self.rejected[reject.reason.value] += 1
        self._rejected_log(
            **logs.fault_fields(
                group=group, epoch=0, seq=0, kind="register", ranks=[hello.dp_rank]
            ),
            reason=reject.reason.value,
            expected=reject.expected,
            got=reject.got,
            detail=reject.text,
            peer=_peer_text(peer),
        )

    def refused_report(self, peer: bytes, failure: StepFailed) -> None:
        """A report from a peer of no group got `failure` (sent to it alone). The rank the
        report names is the peer's claim, not a culprit: logged as `claimed`, so a reader
        never takes the rank's own process for the sender."""
        self.faults[failure.reason.value] += 1
        self._refused_log(
            **logs.fault_fields(
                group="-", epoch=failure.epoch, seq=failure.seq, kind=failure.kind.value, ranks=[]
            ),
            reason=failure.reason.value,
            detail=failure.text,
            peer=_peer_text(peer),
            claimed=list(failure.culprits),
        )

    def _group_line(self, name: str, event: str, now: float | None) -> dict[str, int] | None:
        """Whether the line of `event` for group `name` is written: None if held back, else
        the `suppressed` field for it (lines held back since the last one)."""
        throttle = self._group_lines
        if not throttle.admit((name, event), time.monotonic() if now is None else now):
            return None
        more = throttle.held_all()
        return {"suppressed": more} if more else {}

    def group_created(
        self, name: str, epoch: int, groups: int, max_groups: int, now: float | None = None
    ) -> None:
        more = self._group_line(name, "created", now)
        if more is None:
            return
        logs.event(
            log,
            logging.INFO,
            "group created",
            group=name,
            epoch=epoch,
            groups=f"{groups}/{max_groups}",
            **more,
        )

    def group_dropped(self, name: str, epoch: int, now: float | None = None) -> None:
        self.dropped_groups += 1
        more = self._group_line(name, "dropped", now)
        if more is None:
            return
        logs.event(
            log,
            logging.INFO,
            "group dropped",
            group=name,
            epoch=epoch,
            why="no members, and --max-groups reached: its slot went to a new group",
            **more,
        )


def _peer_text(peer: bytes) -> str:
    """A routing id as logs show it: a keyed hash, never the id (see coordd.io._identity)."""
    return peer_label(peer)
