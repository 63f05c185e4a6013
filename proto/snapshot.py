"""What the coordinator shows its readers: one frozen `GroupSnapshot` of the group.

Status, metrics and the daemon read the group only through a snapshot, never the machine's
own fields, so what they show cannot drift from what the machine does. The records here are
immutable, or (the arrival lists) never written again once handed over.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from coordd.proto.group_state import GroupState
from coordd.proto.messages import Hello, StepFailed, StepKind
from coordd.proto.rounds import CompletedRound, OpenRound


class OnRankLoss(str, enum.Enum):
    """What a lost rank does to the group: fail it (fail-stop) or leave the rank out."""

    FAIL = "fail"
    NEUTRALIZE = "neutralize"


@dataclass(frozen=True)
class Member:
    """A registered rank: the peer (ZeroMQ routing id) that holds it, and its Hello."""

    peer: bytes
    hello: Hello
    joined_at: float
    #: The rank it speaks for (read per report: a field, not a property).
    rank: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank", self.hello.dp_rank)

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.hello.dp_rank,)


class GroupMember(Protocol):
    """Who speaks for a set of ranks: its connection, its registration, its ranks (ascending)
    and the lowest of them (its part's place in a round, and the rank its faults name)."""

    @property
    def peer(self) -> bytes: ...
    @property
    def hello(self) -> Any: ...
    @property
    def ranks(self) -> tuple[int, ...]: ...
    @property
    def rank(self) -> int: ...


@dataclass(frozen=True, slots=True)
class GroupSnapshot:
    """The group at one moment, read-only. Counters only grow, so a reader tells "something
    happened since I last looked" by comparing them (`failures`, `decisions`)."""

    state: GroupState
    #: This epoch's size (a group may re-form at another size, up to `max_dp_size`).
    dp_size: int
    #: coordd's --dp: the most ranks an epoch of the group may have.
    max_dp_size: int
    on_rank_loss: OnRankLoss
    step_timeout: float
    epoch: int
    #: The open round's seq, or the next round's.
    seq: int
    #: The ranks registered in this epoch, by rank.
    members: Mapping[int, Member]
    #: Lost ranks left out of rounds (elastic).
    dead: frozenset[int]
    round: OpenRound | None
    #: The group's latest failure; it is pending while `state` is FAILED (see `failure`).
    last_failure: StepFailed | None
    #: Group failures so far.
    failures: int
    #: Rounds decided so far.
    decisions: int
    last_round: CompletedRound | None
    #: Ranks of this epoch that left cleanly (Goodbye between rounds) while others stay.
    left: frozenset[int] = frozenset()
    #: The group failed and has not re-formed since: `last_failure` stands (see `failure`)
    #: while a new epoch waits for every rank.
    reforming: bool = False
    #: Ranks of a failed epoch whose connections are still open and have not registered again.
    held: int = 0
    #: Goodbyes between rounds so far (orderly departures, not failures).
    departures: int = 0
    #: Times every registered rank left cleanly (the group STOPPED) so far.
    stops: int = 0

    @property
    def failure(self) -> StepFailed | None:
        """The group's standing failure: the one every report gets now (FAILED), or the one a
        re-forming epoch has not yet put right (not every rank is back); else None."""
        if self.state is GroupState.FAILED or self.reforming:
            return self.last_failure
        return None

    @property
    def stopped(self) -> bool:
        """Every rank of the epoch left cleanly: an orderly end, not a failure."""
        return self.state is GroupState.STOPPED

    @property
    def group(self) -> Hello | None:
        """The Hello that set the group's settings (the lowest registered rank's)."""
        return self.members[min(self.members)].hello if self.members else None

    @property
    def open_kind(self) -> StepKind | None:
        return self.round.kind if self.round is not None else None

    def rank_of(self, peer: bytes) -> int | None:
        """The rank `peer` registered as in this epoch, or None."""
        for rank, member in self.members.items():
            if member.peer == peer:
                return rank
        return None
