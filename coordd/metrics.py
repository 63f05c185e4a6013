"""What coordd counts about its rounds, and the Prometheus view of it.

`Observer` is told about each completed round once, each fault once, and each registration,
and reads the group only through the coordinator's `GroupSnapshot` (a decision or a failure is
new when the snapshot's counter moved); it keeps plain integers and lists, with no lock, because
everything (the socket, the timer and the HTTP endpoints) runs on the daemon's one event loop.
Per round it does a handful of additions (a histogram bucket, the straggler's counter, a deque
append), so metrics add no per-message cost. `CoorddCollector` turns those numbers into
Prometheus metric families only when /metrics is scraped.
"""

from __future__ import annotations

import logging
import platform
import time
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any

import zmq

from coordd import logs
from coordd.proto.coordinator import LEFT_THE_GROUP
from coordd.proto.group_state import GroupState
from coordd.proto.messages import (
    PROTOCOL_VERSION,
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

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

    from coordd.server import ServerStats

log = logging.getLogger("coordd")

#: Round duration buckets (seconds): from tens of microseconds (ipc, small dp) to the timeout.
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

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(DURATION_BUCKETS) + 1)
        self.sum = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)


class Observer:
    """Counts rounds, faults and registrations of one coordinator; logs each fault once.

    `view` returns the group as it stands now (the coordinator's `snapshot`)."""

    def __init__(self, view: Callable[[], GroupSnapshot], *, wall: Any = time.time) -> None:
        self.view = view
        first = view()
        self.dp_size = first.dp_size
        self.wall = wall
        self.started_wall = wall()
        self.durations: dict[str, DurationHistogram] = {}
        self.failed: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.registrations = 0
        self.stragglers = [0] * self.dp_size
        self.rounds_at_join: dict[int, int] = {}
        self.addresses: dict[bytes, str] = {}
        self.recent: deque[CompletedRound] = deque(
            maxlen=max(8, min(1000, LATENESS_BUDGET // self.dp_size))
        )
        self.recent_failures: deque[dict[str, Any]] = deque(maxlen=RECENT_FAILURES)
        #: The snapshot's `failures` and `decisions` when this observer last counted them.
        self.failures_seen = first.failures
        self._decisions_seen = first.decisions
        self._registering: tuple[bytes, Hello] | None = None
        self._group = "-"
        #: Clients refused by the CURVE gate (set when coordd runs with CURVE).
        self.curve_refused: Any = None

    # -- what the server tells it -------------------------------------------------------------

    def sent(self, peers: Sequence[bytes], message: object) -> None:
        """The server sent `message` (once per round for a decision; rare otherwise).

        A decision costs a few microseconds here: the snapshot (built once per change), one
        histogram bucket, the straggler's counter and a deque append."""
        kind = type(message)
        if kind is StepDecision or kind is GatherResult:
            snap = self.view()
            rnd = snap.last_round
            if rnd is None or snap.decisions == self._decisions_seen:
                return  # a re-sent decision (a rank repeated its report): not a new round
            self._decisions_seen = snap.decisions
            histogram = self.durations.get(rnd.kind._value_)
            if histogram is None:
                histogram = self.durations[rnd.kind._value_] = DurationHistogram()
            seconds = rnd.completed - rnd.started
            histogram.counts[bisect_left(DURATION_BUCKETS, seconds)] += 1
            histogram.sum += seconds
            if rnd.last_rank is not None:
                self.stragglers[rnd.last_rank] += 1
            self.recent.append(rnd)
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
        self._fault(failure, "group failed", level=logging.INFO if departed else logging.WARNING)

    def lost(self, rank: int | None, peer: bytes, detail: str) -> None:
        """A registered rank's connection closed (called after the coordinator was told)."""
        if rank is None:
            return
        snap = self.view()
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
        """The group's name (the last known one once every rank is gone)."""
        hello = self.view().group
        if hello is not None:
            self._group = hello.group
        return self._group

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
        """Rounds completed since `rank` registered."""
        return self.rounds_completed - self.rounds_at_join.get(rank, self.rounds_completed)

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
            member = snap.members[rank]
            self._group = member.hello.group
            logs.event(
                log,
                logging.INFO,
                "rank registered",
                group=member.hello.group,
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
                group=hello.group if hello else self.group,
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


def _peer_text(peer: bytes) -> str:
    return peer.decode("utf-8", "backslashreplace")


class CoorddCollector:
    """Renders an `Observer`, the server's frame counters and the group's snapshot at scrape time
    (prometheus_client is imported only here, so the daemon's round path never loads it)."""

    def __init__(self, observer: Observer, stats: ServerStats, ready: Any) -> None:
        self.observer = observer
        self.stats = stats
        self.ready = ready

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
            InfoMetricFamily,
        )

        o = self.observer
        c = o.view()
        s = self.stats
        info = InfoMetricFamily("coordd_build", "coordd's version and what it was built with")
        info.add_metric(
            [],
            {
                "version": version(),
                "protocol_version": str(PROTOCOL_VERSION),
                "python_version": platform.python_version(),
                "pyzmq_version": zmq.__version__,
                "libzmq_version": zmq.zmq_version(),
            },
        )
        yield info
        yield _gauge("coordd_dp_size", "Data-parallel size this coordd serves", c.dp_size)
        yield _gauge(
            "coordd_epoch", "Current epoch (a new one after a failed group re-forms)", c.epoch
        )
        yield _gauge("coordd_round_seq", "Sequence number of the open (or next) round", c.seq)
        yield _gauge(
            "coordd_registered_ranks", "Ranks registered in the current epoch", len(c.members)
        )
        yield _gauge(
            "coordd_dead_ranks", "Lost ranks left out of rounds (neutralize mode)", len(c.dead)
        )
        yield _gauge(
            "coordd_group_failed",
            "1 while the group is failed (until ranks re-register)",
            int(c.state is GroupState.FAILED),
        )
        state = GaugeMetricFamily(
            "coordd_group_state", "1 for the group's current state", labels=["state"]
        )
        for each in GroupState:
            state.add_metric([each.value], int(each is c.state))
        yield state
        yield _gauge("coordd_ready", "1 when /readyz answers 200", int(self.ready()[0]))

        rounds = CounterMetricFamily(
            "coordd_rounds", "Rounds ended, by kind and outcome", labels=["kind", "outcome"]
        )
        for kind, n in sorted(o.decided.items()):
            rounds.add_metric([kind, "decided"], n)
        for kind, n in sorted(o.failed.items()):
            rounds.add_metric([kind, "failed"], n)
        yield rounds

        duration = HistogramMetricFamily(
            "coordd_round_duration_seconds",
            "Seconds from a round's first report to its decision, by kind",
            labels=["kind"],
        )
        for kind, h in sorted(o.durations.items()):
            cumulative, buckets = 0, []
            for bound, n in zip((*DURATION_BUCKETS, float("inf")), h.counts, strict=True):
                cumulative += n
                buckets.append((_bound(bound), cumulative))
            duration.add_metric([kind], buckets, h.sum)
        yield duration

        straggler = CounterMetricFamily(
            "coordd_straggler_rounds",
            "Rounds whose decision this rank's report completed (it arrived last)",
            labels=["rank"],
        )
        for rank, n in enumerate(o.stragglers):
            if n:
                straggler.add_metric([str(rank)], n)
        yield straggler

        faults = CounterMetricFamily("coordd_faults", "Faults, by reason", labels=["reason"])
        for reason, n in sorted(o.faults.items()):
            faults.add_metric([reason], n)
        yield faults

        rejected = CounterMetricFamily(
            "coordd_registrations_rejected", "Registrations refused, by reason", labels=["reason"]
        )
        for reason, n in sorted(o.rejected.items()):
            rejected.add_metric([reason], n)
        yield rejected
        yield _counter("coordd_registrations", "Registrations accepted", o.registrations)
        yield _counter(
            "coordd_bad_frames", "Frames dropped as undecodable or malformed", s.bad_frames
        )
        yield _counter("coordd_frames_received", "Frames received from ranks", s.frames_in)
        yield _counter("coordd_frames_sent", "Frames sent to ranks", s.frames_out)
        yield _counter(
            "coordd_disconnects", "Registered ranks whose connection closed", s.disconnects
        )
        if o.curve_refused is not None:
            yield _counter(
                "coordd_curve_refused",
                "Connections refused: a CURVE client key coordd was not given",
                o.curve_refused(),
            )


def _bound(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def _gauge(name: str, doc: str, value: float) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> Any:
    from prometheus_client.core import CounterMetricFamily

    return CounterMetricFamily(name, doc, value=value)


def make_registry(collector: CoorddCollector) -> CollectorRegistry:
    """A registry of coordd's own metrics plus the standard process and platform ones."""
    from prometheus_client import PlatformCollector, ProcessCollector
    from prometheus_client.registry import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry
