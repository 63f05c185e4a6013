"""coordd's status: the /status document and readiness, built in the daemon.

The document says whether coordd is ready and, for every group it serves, where the group
stands (its state, epoch, the open round, readiness, the failure if any) and, per rank, who
holds it (a label of its connection, never the routing id; its address and incarnation), when
it last reported, how many rounds it took part in, how late its reports come on average, and
how often it was the last to report (the straggler). `coordd status` (coordd.cli.status)
fetches it over HTTP and prints it as a table.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from coordd.core._daemon_defaults import STATUS_RANK_ROWS
from coordd.core._peers import peer_label
from coordd.proto.coordinator import LEFT_THE_GROUP
from coordd.proto.messages import PROTOCOL_VERSION, FailReason, StepFailed
from coordd.proto.snapshot import GroupSnapshot, OnRankLoss

if TYPE_CHECKING:
    from coordd.ops.view import GroupView, RelayedGroup, RelayRow, ServerView


def departed(failure: StepFailed) -> bool:
    """The group failed because a rank left in order (its client said Goodbye) while the
    others still synced: the round failed, the rank that left did not crash."""
    return failure.reason is FailReason.LOST and failure.detail == LEFT_THE_GROUP


#: What /readyz and `coordd status` say of a group that every rank left cleanly.
LEFT_CLEANLY = "every rank left cleanly (Goodbye)"


def group_readiness(snap: GroupSnapshot) -> tuple[bool, str]:
    """A group is formed: every dp rank registered (neutralize mode: or left out), not failed.
    A stopped group (every rank left cleanly) is not formed, and not failed either."""
    failure = snap.failure
    if failure is not None:
        if departed(failure):
            return False, (
                f"failed at seq {failure.seq}: rank(s) {list(failure.culprits)} left the group "
                "(closed cleanly) while the others still synced; fail-stop: the other ranks "
                "get RankLost and connect() again to start a new epoch once every rank is back"
            )
        return False, f"failed at seq {failure.seq}: {failure.text}"
    if snap.stopped:
        return False, (
            f"stopped at seq {snap.seq}: {LEFT_CLEANLY}; the next registration starts "
            f"epoch {snap.epoch + 1}"
        )
    present = len(snap.members)
    counted = present + (len(snap.dead) if snap.on_rank_loss is OnRankLoss.NEUTRALIZE else 0)
    if present == 0 or counted < snap.dp_size:
        return False, f"{present}/{snap.dp_size} ranks registered"
    if snap.dead:
        return True, f"{present}/{snap.dp_size} ranks registered, left out: {sorted(snap.dead)}"
    return True, f"{present}/{snap.dp_size} ranks registered"


def holds_back(snap: GroupSnapshot) -> bool:
    """Whether a failed group holds /readyz at 503: it was a formed group (it served rounds,
    or every rank was in when it failed) and ranks of it are still connected. One that never
    formed (a peer's group of its own, one rank of dp) is only not formed, and one whose ranks
    all left serves nobody: a peer that fails a group and leaves cannot keep coordd out of
    service (the expected groups' count, `--expect-groups`, still does)."""
    failure = snap.failure
    connected = len(snap.members) + snap.held  # a failed epoch's ranks still connected count
    if failure is None or not connected:
        return False
    if snap.decisions > 0:
        return True
    lost = len(failure.culprits) if failure.reason is FailReason.LOST else 0
    return connected + lost >= snap.dp_size


def readiness(
    groups: Mapping[str, GroupSnapshot], expect_groups: int | Collection[str] = 0
) -> tuple[bool, str]:
    """coordd is ready (/readyz 200) when no group holds it back (`holds_back`: failed, with
    ranks still connected) and at least `expect_groups` groups (at least one when 0) are
    formed or stopped (every rank left cleanly: an orderly end, after which coordd serves the
    next registration as before); a group still forming, or empty because its ranks left,
    holds nothing back once enough others are formed. `expect_groups` as names (`--expect-groups
    dp-tp0-pp0,enginecore`): ready when each of those is formed or stopped, and no other group
    counts or holds it back (a peer's junk group cannot make coordd ready, nor keep it out of
    service). The reason names the group."""
    if not isinstance(expect_groups, int):
        return _named_readiness(groups, expect_groups)
    want = max(1, expect_groups)
    formed = stopped = 0
    waiting: tuple[str, str] | None = None
    for name, snap in groups.items():
        ready, why = group_readiness(snap)
        if holds_back(snap):
            return False, f"group {name} {why}"
        if ready:
            formed += 1
        elif snap.stopped:
            stopped += 1
        elif waiting is None:
            waiting = (name, why)
    if not groups:
        return False, "no group has registered yet"
    if formed + stopped >= want:
        if len(groups) == 1:
            ((name, snap),) = groups.items()
            what = "stopped" if stopped else "formed"
            return True, f"1/1 groups {what} ({name}: {group_readiness(snap)[1]})"
        if stopped:
            names = ", ".join(n for n, s in groups.items() if s.stopped)
            return True, (
                f"{formed}/{len(groups)} groups formed, {stopped} stopped ({LEFT_CLEANLY}: {names})"
            )
        return True, f"{formed}/{len(groups)} groups formed"
    if waiting is None:  # every group is formed, but fewer groups than expected exist
        return False, f"{formed}/{want} groups formed: {want - formed} more to register"
    return False, f"{formed}/{want} groups formed: group {waiting[0]} has {waiting[1]}"


def _named_readiness(
    groups: Mapping[str, GroupSnapshot], names: Collection[str]
) -> tuple[bool, str]:
    """`readiness` when the expected groups are named: only those count, in the given order."""
    formed = stopped = 0
    for name in names:
        snap = groups.get(name)
        if snap is None:
            return (
                False,
                f"{formed}/{len(names)} expected groups formed: group {name} has not registered",
            )
        ready, why = group_readiness(snap)
        if ready:
            formed += 1
        elif snap.stopped:
            stopped += 1
        elif holds_back(snap):
            return False, f"group {name} {why}"
        else:
            return False, f"{formed}/{len(names)} expected groups formed: group {name} has {why}"
    others = len(groups) - sum(1 for name in names if name in groups)
    what = f"{formed}/{len(names)} expected groups formed"
    if stopped:
        what += f", {stopped} stopped ({LEFT_CLEANLY})"
    if others:
        what += f"; {others} other group(s) not counted"
    return True, what


def server_readiness(server: ServerView) -> tuple[bool, str]:
    """`readiness` of a running coordd's groups."""
    snaps = {name: group.coordinator.snapshot() for name, group in server.groups.items()}
    # a root's groups served through relays
    snaps.update((name, one.snapshot) for name, one in server.relayed_groups().items())
    settings = server.settings
    return readiness(snaps, settings.expected_names or settings.expected_count)


def group_document(group: GroupView, now: float, rank_rows: int | None = None) -> dict[str, Any]:
    """One group's part of /status, with a row for at most `rank_rows` of its ranks (None:
    all; the rest are counted in `ranks_summary`): O(dp x recent rounds) work, only when asked."""
    observer = group.observer
    snap = group.coordinator.snapshot()
    ready, why = group_readiness(snap)
    shown = snap.dp_size if rank_rows is None else max(0, min(rank_rows, snap.dp_size))
    lateness = observer.mean_lateness() if shown else []
    observer.settle(snap)
    last = snap.last_round
    open_round = snap.round
    ranks = []
    for rank in range(shown):
        member = snap.members.get(rank)
        state = _rank_state(snap, rank)
        if state == "missing" and snap.stopped and observer.left_cleanly(rank):
            state = "left"  # the group stopped: every rank it had said Goodbye
        arrived = open_round.arrivals[rank] if open_round is not None else None
        seen = arrived
        if seen is None and last is not None:
            seen = last.arrivals[rank]
        if seen is None and member is not None:
            seen = member.joined_at
        entry: dict[str, Any] = {
            "rank": rank,
            "state": state,
            "peer": peer_label(member.peer) if member else None,
            "address": observer.addresses.get(member.peer) if member else None,
            "incarnation": member.hello.incarnation if member else None,
            "last_seen_s": None if seen is None else round(max(0.0, now - seen), 6),
            "reported_open_round": arrived is not None,
            "rounds": observer.rounds_of(rank),
            "mean_lateness_s": lateness[rank],
            "straggler_rounds": observer.stragglers[rank],
        }
        ranks.append(entry)
    failure = snap.failure
    return {
        **_group_head(group.name, "flat", snap),
        "left_cleanly": snap.stopped,
        "departures": snap.departures,
        "stops": snap.stops,
        "ready": ready,
        "ready_detail": why,
        "round": {
            "open": open_round is not None,
            "kind": open_round.kind.value if open_round is not None else None,
            "reported": open_round.reported if open_round is not None else 0,
            "age_s": None if open_round is None else round(now - open_round.started, 6),
        },
        "failure": None if failure is None else _failure_fields(failure),
        "rounds": {
            "completed": observer.rounds_completed,
            "decided": dict(observer.decided),
            "failed": dict(observer.failed),
        },
        "lateness_window_rounds": len(observer.recent),
        "faults": dict(observer.faults),
        "registrations": observer.registrations,
        "returns": observer.returns,
        "last_away_s": observer.last_away_s,
        "rejected": dict(observer.rejected),
        "ranks": ranks,
        "ranks_summary": _ranks_summary(snap, shown),
        "recent_failures": list(observer.recent_failures),
    }


def relayed_group_document(
    name: str, group: RelayedGroup, rank_rows: int | None = None
) -> dict[str, Any]:
    """A relayed group's part of /status at the root: its state, its relays and which relay
    speaks for each rank (at most `rank_rows` rows). The root hears one message per relay
    per round, so per-rank timing is in each relay's own /status, not here."""
    snap = group.snapshot
    ready, why = group_readiness(snap)
    shown = snap.dp_size if rank_rows is None else max(0, min(rank_rows, snap.dp_size))
    relay_of: dict[int, RelayRow] = {r: row for row in group.relays for r in row.ranks}
    ranks = []
    for rank in range(shown):
        row = relay_of.get(rank)
        ranks.append(
            {
                "rank": rank,
                "state": _rank_state(snap, rank),
                "relay": row.name if row is not None else None,
                "address": row.address or None if row is not None else None,
            }
        )
    failure = snap.failure
    return {
        **_group_head(name, "relays", snap),
        "ready": ready,
        "ready_detail": why,
        "failure": None if failure is None else _failure_fields(failure),
        "rounds": {"decided": snap.decisions, "failed": snap.failures},
        "relays": [
            {"name": row.name, "ranks": _span(row.ranks), "address": row.address or None}
            for row in group.relays
        ],
        "ranks": ranks,
        "ranks_summary": _ranks_summary(snap, shown),
    }


def _rank_state(snap: GroupSnapshot, rank: int) -> str:
    if rank in snap.members:
        return "registered"
    if rank in snap.left:
        return "left"  # said Goodbye; the others are still registered
    return "left out" if rank in snap.dead else "missing"


def _ranks_summary(snap: GroupSnapshot, shown: int) -> dict[str, int]:
    left_out = sum(1 for rank in snap.dead if rank not in snap.members)
    return {
        "registered": len(snap.members),
        "left out": left_out,
        "missing": snap.dp_size - len(snap.members) - left_out,
        "shown": shown,
    }


def _group_head(name: str, served: str, snap: GroupSnapshot) -> dict[str, Any]:
    """The fields every group's document opens with, flat or through relays."""
    return {
        "name": name,
        "served": served,
        "dp_size": snap.dp_size,
        "state": snap.state.value,
        "epoch": snap.epoch,
        "seq": snap.seq,
        "on_rank_loss": snap.on_rank_loss.value,
        "step_timeout_s": snap.step_timeout,
        "members": len(snap.members),
    }


def _failure_fields(failure: StepFailed) -> dict[str, Any]:
    return {
        "epoch": failure.epoch,
        "seq": failure.seq,
        "kind": failure.kind.value,
        "reason": failure.reason.value,
        "ranks": list(failure.culprits),
        "text": failure.text,
    }


def _span(ranks: tuple[int, ...]) -> str:
    """`0-7` for a contiguous run, else the ranks listed (`0,2,4`)."""
    if ranks and ranks[-1] - ranks[0] == len(ranks) - 1:
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return ",".join(map(str, ranks))


def status_document(
    server: ServerView, *, group: str | None = None, rank_rows: int = STATUS_RANK_ROWS
) -> dict[str, Any]:
    """The /status JSON: coordd, its readiness, and every group (in the order they came), or
    only `group` with a row for each of its ranks. Over all groups, at most `rank_rows` rank
    rows (the groups first in order get theirs; every group keeps its `ranks_summary`), so a
    scrape's cost and size stop growing with dp x groups: ~256 rows is ~70 KB."""
    from coordd.ops.observer import version

    now = server.clock()
    if group is not None:
        chosen = server.groups.get(group)
        relayed = server.relayed_groups().get(group)
        documents = [] if chosen is None else [group_document(chosen, now)]
        if relayed is not None:
            documents.append(relayed_group_document(group, relayed))
    else:
        documents = []
        budget = rank_rows
        for one in server.groups.values():
            documents.append(group_document(one, now, budget))
            budget -= documents[-1]["ranks_summary"]["shown"]
        for name, through in server.relayed_groups().items():
            documents.append(relayed_group_document(name, through, budget))
            budget -= documents[-1]["ranks_summary"]["shown"]
    counters = server.counters()
    ready, why = server_readiness(server)
    return {
        "coordd": {
            "version": version(),
            "protocol_version": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "address": server.bound_address,
            "uptime_s": round(server.wall() - server.started_wall, 3),
            "dp_size": server.settings.dp_size,
            "max_groups": server.settings.max_groups,
            "expect_groups": server.settings.expected_count,
            "expected_groups": list(server.settings.expected_names),
            "relay_root": server.settings.relay_root,
        },
        "ready": ready,
        "ready_detail": why,
        "groups": documents,
        "outside_groups": {
            "rejected": dict(server.events.rejected),
            "faults": dict(server.events.faults),
            "groups_dropped": server.events.dropped_groups,
        },
        "frames": {
            "received": counters.frames_in,
            "sent": counters.frames_out,
            "bad": counters.bad_frames,
        },
        "disconnects": counters.disconnects,
    }
