"""The Prometheus view of coordd: every group's `Observer` and snapshot, and the server's
own counters (read through `coordd.ops.view.ServerView`), rendered only when /metrics is
scraped; every per-group series carries a `group` label."""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import zmq

from coordd.core._daemon_defaults import METRICS_RANK_SERIES, METRICS_WAIT_SERIES
from coordd.ops.observer import DURATION_BUCKETS, DurationHistogram, version
from coordd.ops.status_doc import group_readiness
from coordd.ops.view import ServerView
from coordd.proto.group_state import GroupState
from coordd.proto.messages import PROTOCOL_VERSION
from coordd.proto.snapshot import GroupSnapshot

if TYPE_CHECKING:
    from prometheus_client.core import HistogramMetricFamily
    from prometheus_client.registry import CollectorRegistry


class CoorddCollector:
    """Renders every group's `Observer` and snapshot, and the server's own counters, at scrape
    time (prometheus_client is imported only here, so the daemon's round path never loads it).
    Per-group series carry a `group` label; what is not one group's (frames, refusals outside
    any group: label group="") is the server's."""

    def __init__(self, server: ServerView, ready: Callable[[], tuple[bool, str]]) -> None:
        self.server = server
        self.ready = ready

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
            InfoMetricFamily,
        )

        server = self.server
        s = server.counters()
        groups = [(name, g.observer, g.coordinator.snapshot()) for name, g in server.groups.items()]
        relayed = server.relayed_groups()
        #: the state of every group, flat or through relays (only flat ones have an observer)
        every = [*groups, *((name, None, one.snapshot) for name, one in relayed.items())]
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
        yield _gauge("coordd_dp_size", "Data-parallel size of every group", server.settings.dp_size)
        yield _gauge("coordd_groups", "Groups this coordd serves", len(every))
        yield _gauge(
            "coordd_max_groups",
            "Most groups this coordd serves (--max-groups)",
            server.settings.max_groups,
        )
        yield _gauge("coordd_ready", "1 when /readyz answers 200", int(self.ready()[0]))

        def per_group(name: str, doc: str, value: Callable[[GroupSnapshot], float]) -> Any:
            family = GaugeMetricFamily(name, doc, labels=["group"])
            for group, _, snap in every:
                family.add_metric([group], value(snap))
            return family

        yield per_group(
            "coordd_epoch",
            "Current epoch (a new one after a failed group re-forms)",
            lambda c: c.epoch,
        )
        yield per_group(
            "coordd_round_seq", "Sequence number of the open (or next) round", lambda c: c.seq
        )
        yield per_group(
            "coordd_registered_ranks",
            "Ranks registered in the current epoch",
            lambda c: len(c.members),
        )
        yield per_group(
            "coordd_dead_ranks",
            "Lost ranks left out of rounds (neutralize mode)",
            lambda c: len(c.dead),
        )
        yield per_group(
            "coordd_group_failed",
            "1 while the group's failure stands: from the fault until every rank is back in a "
            "new epoch",
            lambda c: int(c.state is GroupState.FAILED or c.failure is not None),
        )
        yield per_group(
            "coordd_group_stopped",
            "1 while every rank of the group has left cleanly (Goodbye): not a failure",
            lambda c: int(c.state is GroupState.STOPPED),
        )
        yield _counter_per_group(
            every,
            "coordd_departures",
            "Ranks that left cleanly (Goodbye between rounds): orderly departures, not faults",
            lambda c: c.departures,
        )
        yield _counter_per_group(
            every,
            "coordd_group_stops",
            "Times every rank of the group left cleanly (the group stopped, not failed)",
            lambda c: c.stops,
        )
        yield per_group(
            "coordd_group_ready",
            "1 when the group is formed (every rank registered) and not failed",
            lambda c: int(group_readiness(c)[0]),
        )
        state = GaugeMetricFamily(
            "coordd_group_state", "1 for the group's current state", labels=["group", "state"]
        )
        for group, _, snap in every:
            for each in GroupState:
                state.add_metric([group, each.value], int(each is snap.state))
        yield state
        if relayed:
            relays = GaugeMetricFamily(
                "coordd_group_relays",
                "Relays registered for a group served through relays",
                labels=["group"],
            )
            relayed_rounds = CounterMetricFamily(
                "coordd_relayed_rounds",
                "Rounds of a group served through relays, by outcome (per-kind counts and "
                "per-rank timing are in each relay's own metrics)",
                labels=["group", "outcome"],
            )
            for name, one in relayed.items():
                relays.add_metric([name], len(one.relays))
                relayed_rounds.add_metric([name, "decided"], one.snapshot.decisions)
                relayed_rounds.add_metric([name, "failed"], one.snapshot.failures)
            yield relays
            yield relayed_rounds

        rounds = CounterMetricFamily(
            "coordd_rounds",
            "Rounds ended, by group, kind and outcome",
            labels=["group", "kind", "outcome"],
        )
        duration = HistogramMetricFamily(
            "coordd_round_duration_seconds",
            "Seconds from a round's first report to its decision, by group and kind",
            labels=["group", "kind"],
        )
        waits = HistogramMetricFamily(
            "coordd_rank_wait_seconds",
            "Seconds a rank's wait() blocked for a round's answer (what the sync costs its "
            "step), by group and site (a policy round's kind, a gather round's call site), "
            f"as the ranks report it with their next round; past {METRICS_WAIT_SERIES} site "
            'series in all, a group\'s other sites are summed as site="other"',
            labels=["group", "site"],
        )
        straggler = CounterMetricFamily(
            "coordd_straggler_rounds",
            "Rounds whose decision this rank's report completed (it arrived last); past "
            f"{METRICS_RANK_SERIES} rank series in all, a group's other ranks are summed as "
            'rank="other"',
            labels=["group", "rank"],
        )
        faults = CounterMetricFamily(
            "coordd_faults", "Faults, by group and reason", labels=["group", "reason"]
        )
        rejected = CounterMetricFamily(
            "coordd_registrations_rejected",
            "Registrations refused, by group and reason",
            labels=["group", "reason"],
        )
        registrations = CounterMetricFamily(
            "coordd_registrations", "Registrations accepted", labels=["group"]
        )
        returns = CounterMetricFamily(
            "coordd_returns",
            "Registrations of ranks back from their own collective (the fallback: coordd was "
            "lost, or absent when they started), one per rank and return",
            labels=["group"],
        )
        away = GaugeMetricFamily(
            "coordd_away_seconds",
            "How long the latest rank back from its own collective ran without coordd",
            labels=["group"],
        )
        rank_series = wait_series = 0
        for group, o, _ in groups:
            for kind, n in sorted(o.decided.items()):
                rounds.add_metric([group, kind, "decided"], n)
            for kind, n in sorted(o.failed.items()):
                rounds.add_metric([group, kind, "failed"], n)
            for kind, h in sorted(o.durations.items()):
                cumulative, buckets = 0, []
                for bound, n in zip((*DURATION_BUCKETS, float("inf")), h.counts, strict=True):
                    cumulative += n
                    buckets.append((_bound(bound), cumulative))
                duration.add_metric([group, kind], buckets, h.sum)
            wait_series = _add_waits(waits, group, o.waits, wait_series)
            rest = 0
            for rank, n in enumerate(o.stragglers):
                if not n:
                    continue
                if rank_series < METRICS_RANK_SERIES:
                    rank_series += 1
                    straggler.add_metric([group, str(rank)], n)
                else:
                    rest += n
            if rest:
                straggler.add_metric([group, "other"], rest)
            for reason, n in sorted(o.faults.items()):
                faults.add_metric([group, reason], n)
            for reason, n in sorted(o.rejected.items()):
                rejected.add_metric([group, reason], n)
            registrations.add_metric([group], o.registrations)
            returns.add_metric([group], o.returns)
            away.add_metric([group], o.last_away_s)
        for reason, n in sorted(server.events.faults.items()):
            faults.add_metric(["", reason], n)
        for reason, n in sorted(server.events.rejected.items()):
            rejected.add_metric(["", reason], n)
        yield from (rounds, duration, waits, straggler, faults, rejected, registrations)
        yield from (returns, away)
        yield _counter(
            "coordd_groups_dropped",
            "Groups without members dropped to make room for a new one at --max-groups",
            server.events.dropped_groups,
        )
        yield _counter(
            "coordd_bad_frames", "Frames dropped as undecodable or malformed", s.bad_frames
        )
        yield _counter("coordd_frames_received", "Frames received from ranks", s.frames_in)
        yield _counter("coordd_frames_sent", "Frames sent to ranks", s.frames_out)
        yield _counter(
            "coordd_disconnects", "Registered ranks whose connection closed", s.disconnects
        )
        if s.memory_shed is not None:
            yield _counter(
                "coordd_memory_strangers_closed",
                "Connections that held no rank closed because coordd's RSS passed --max-rss-mb",
                s.memory_shed,
            )
        if s.memory_refused is not None:
            yield _counter(
                "coordd_memory_handshakes_refused",
                "New connections refused in their handshake while coordd's RSS was over "
                "--max-rss-mb",
                s.memory_refused,
            )
        if s.rate_refused is not None:
            yield _counter(
                "coordd_handshakes_rate_refused",
                "New connections refused in their handshake over --max-handshake-rate (they "
                "retry): refused with their source over its share, or all sources over it",
                s.rate_refused,
            )
        yield _gauge("coordd_connections_open", "ZeroMQ connections open now", s.connections_open)
        closed = CounterMetricFamily(
            "coordd_connections_closed",
            "Connections that held no rank, shut down by coordd: over --max-connections "
            "(cap), flooding (flood), from a process cut off for flooding (banned), or silent: "
            "no Hello within the stranger grace (silent); and members' connections ended for a "
            "protocol violation: over a rank's share of messages (violation)",
            labels=["reason"],
        )
        for reason, n in (
            ("cap", s.closed_cap),
            ("flood", s.closed_flood),
            ("banned", s.closed_banned),
            ("silent", s.closed_silent),
            ("violation", s.closed_violation),
        ):
            closed.add_metric([reason], n)
        yield closed
        yield _counter(
            "coordd_closed_connection_messages_dropped",
            "Messages still queued from connections coordd shut down, dropped undecoded",
            s.closed_messages_dropped,
        )
        if s.curve_refused is not None:
            yield _counter(
                "coordd_curve_refused",
                "Connections refused: a CURVE client key coordd was not given",
                s.curve_refused,
            )
        takeovers = CounterMetricFamily(
            "coordd_rank_takeovers_refused",
            "Attempts to speak for a rank over a connection that did not register it: a Hello "
            "for a rank a live connection holds (rank_held), a message over another connection "
            "(other_connection), a Hello for a rank its CURVE key is not bound to (key_bound)",
            labels=["group", "kind"],
        )
        for (group_name, kind), count in sorted(server.takeovers_refused().items()):
            takeovers.add_metric([group_name, kind], count)
        yield takeovers


def _add_waits(
    family: HistogramMetricFamily,
    group: str,
    waits: dict[str, DurationHistogram],
    series: int,
) -> int:
    """Adds one group's wait histograms while `series` (the site series added so far, over all
    groups) is under METRICS_WAIT_SERIES; the rest are summed as site="other". Returns the new
    `series`: what a scrape writes stays bounded however many groups make up sites."""
    rest: DurationHistogram | None = None
    for site, h in sorted(waits.items()):
        if series < METRICS_WAIT_SERIES and site != "other":
            series += 1
            family.add_metric([group, site], _buckets(h), h.sum)
            continue
        if rest is None:
            rest = DurationHistogram(h.buckets)
        rest.counts = [a + b for a, b in zip(rest.counts, h.counts, strict=True)]
        rest.sum += h.sum
    if rest is not None:
        family.add_metric([group, "other"], _buckets(rest), rest.sum)
        series += 1
    return series


def _buckets(h: DurationHistogram) -> list[tuple[str, int]]:
    """A histogram's cumulative (le, count) pairs, +Inf last."""
    cumulative, buckets = 0, []
    for bound, n in zip((*h.buckets, float("inf")), h.counts, strict=True):
        cumulative += n
        buckets.append((_bound(bound), cumulative))
    return buckets


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


def _counter_per_group(
    groups: list[tuple[str, Any, GroupSnapshot]],
    name: str,
    doc: str,
    value: Callable[[GroupSnapshot], float],
) -> Any:
    from prometheus_client.core import CounterMetricFamily

    family = CounterMetricFamily(name, doc, labels=["group"])
    for group, _, snap in groups:
        family.add_metric([group], value(snap))
    return family
