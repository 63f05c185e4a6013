"""The DP group's states and the one table of legal moves between them (as h11's `_state.py`).

The coordinator turns each input (a Hello, a report, a lost peer, the deadline) into one of
these events and moves through `next_state`; an event the table does not list for the current
state is a bug in the coordinator, and fails loudly here rather than corrupting the group.

    state        event    next state   what happened
    EMPTY        JOIN     IDLE         the first rank registered; its Hello sets the settings
    IDLE         JOIN     IDLE         another rank registered (or one said Hello again)
    IDLE         OPEN     ROUND_OPEN   the first report of the next seq arrived
    IDLE         LEAVE    IDLE         a rank was lost and is left out (elastic)
    IDLE         DEPART   IDLE         a rank said Goodbye; the others are still registered
    IDLE         STOP     STOPPED      the last registered rank said Goodbye: every rank left
    IDLE         DISBAND  EMPTY        the last rank was lost
    IDLE         FAIL     FAILED       a fault between rounds (a lost rank, a skipped seq)
    IDLE         ABANDON  FAILED       the last rank of a re-forming epoch left: the failure stands
    ROUND_OPEN   JOIN     ROUND_OPEN   a rank that was never in the round registered
    ROUND_OPEN   QUEUE    ROUND_OPEN   a lost rank is back: it joins when the round ends (elastic)
    ROUND_OPEN   REPORT   ROUND_OPEN   another rank reported
    ROUND_OPEN   LEAVE    ROUND_OPEN   a rank was lost and is left out (elastic)
    ROUND_OPEN   DECIDE   IDLE         every live rank reported: one decision for all
    ROUND_OPEN   DISBAND  EMPTY        the last rank was lost
    ROUND_OPEN   FAIL     FAILED       a fault ends the round for every rank
    ROUND_OPEN   ABANDON  FAILED       the last rank of a re-forming epoch was lost
    FAILED       LEAVE    FAILED       a rank was lost while the group waits to re-form
    FAILED       REFORM   EMPTY        a rank registered again: a new epoch, no members yet
    STOPPED      REFORM   EMPTY        a rank registered after the group stopped: a new epoch

REFORM is no fresh start: the Hello that causes it passed the same checks as a first
registration, against the failed epoch's ranks whose connections are still open; those keep
their ranks and the group's settings in the new epoch until they register again or leave
(the coordinator's `_held`), so EMPTY after a REFORM still binds a Hello to the settings of
the ranks still connected. Only with no rank held by any live connection does a Hello set new
settings.

A clean exit is not a fault. A rank that says Goodbye between rounds leaves (DEPART); once every
registered rank has left so, the group is STOPPED, and no failure is counted. What can still
fail after a departure is a round: a rank that reports while a peer has left (the round could
never complete) fails the group at once with RankLost naming the rank that left, and so does a
Goodbye while a round is open (its peers are waiting on it). A connection that closes without
a Goodbye is a lost rank, as ever.

A failure stands until the group re-forms: after a REFORM the epoch is *re-forming* (the
failure still pending: `/readyz`, `/status` and `coordd status` go on naming its culprit) until
every rank is registered in it (or left out, elastic). A re-forming epoch whose last rank
leaves, by Goodbye or loss, is ABANDONed back to FAILED with the same failure, never STOPPED:
one peer's Hello and Goodbye cannot turn a crash into a clean stop.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType


class GroupState(str, enum.Enum):
    """Where the group stands; the value is what /status shows."""

    #: No rank registered in this epoch and no failure pending: the next Hello sets the group's
    #: settings, unless ranks of a failed epoch are still connected (then it must match them).
    EMPTY = "empty"
    #: Ranks registered, between rounds.
    IDLE = "idle"
    #: A round has its first report and waits for the rest (the step timeout runs).
    ROUND_OPEN = "round_open"
    #: Fail-stop: every report gets the failure until a rank registers again.
    FAILED = "failed"
    #: Every rank of the epoch left cleanly (Goodbye between rounds): not a failure. The next
    #: Hello starts a new epoch.
    STOPPED = "stopped"


class GroupEvent(str, enum.Enum):
    """What the coordinator does to the group, one input at a time."""

    JOIN = "join"
    QUEUE = "queue"
    REFORM = "reform"
    OPEN = "open"
    REPORT = "report"
    DECIDE = "decide"
    FAIL = "fail"
    LEAVE = "leave"
    DISBAND = "disband"
    DEPART = "depart"
    STOP = "stop"
    ABANDON = "abandon"


_S, _E = GroupState, GroupEvent

#: The legal moves: for each state, the events it accepts and the state each leads to.
TRANSITIONS: Mapping[GroupState, Mapping[GroupEvent, GroupState]] = MappingProxyType(
    {
        _S.EMPTY: MappingProxyType({_E.JOIN: _S.IDLE}),
        _S.IDLE: MappingProxyType(
            {
                _E.JOIN: _S.IDLE,
                _E.OPEN: _S.ROUND_OPEN,
                _E.LEAVE: _S.IDLE,
                _E.DISBAND: _S.EMPTY,
                _E.FAIL: _S.FAILED,
                _E.DEPART: _S.IDLE,
                _E.STOP: _S.STOPPED,
                _E.ABANDON: _S.FAILED,
            }
        ),
        _S.ROUND_OPEN: MappingProxyType(
            {
                _E.JOIN: _S.ROUND_OPEN,
                _E.QUEUE: _S.ROUND_OPEN,
                _E.REPORT: _S.ROUND_OPEN,
                _E.LEAVE: _S.ROUND_OPEN,
                _E.DECIDE: _S.IDLE,
                _E.DISBAND: _S.EMPTY,
                _E.FAIL: _S.FAILED,
                _E.ABANDON: _S.FAILED,
            }
        ),
        _S.FAILED: MappingProxyType({_E.LEAVE: _S.FAILED, _E.REFORM: _S.EMPTY}),
        _S.STOPPED: MappingProxyType({_E.REFORM: _S.EMPTY}),
    }
)


class IllegalTransition(RuntimeError):
    """The coordinator tried an event its current state does not allow: a bug in coordd, not in
    a rank. Report it with the state and event; restarting coordd opens a fresh group."""

    def __init__(self, state: GroupState, event: GroupEvent) -> None:
        self.state = state
        self.event = event
        allowed = ", ".join(e.value for e in TRANSITIONS[state]) or "nothing"
        super().__init__(f"event {event.value!r} in state {state.value!r} (allowed: {allowed})")

    def __reduce__(self) -> tuple[type[IllegalTransition], tuple[GroupState, GroupEvent]]:
        return (type(self), (self.state, self.event))


def next_state(state: GroupState, event: GroupEvent) -> GroupState:
    """The state `event` leads to from `state`; raises `IllegalTransition` if the table has no
    such move."""
    try:
        return TRANSITIONS[state][event]
    except KeyError:
        raise IllegalTransition(state, event) from None
