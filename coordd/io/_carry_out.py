"""The shell's half of the group registry (`coordd.core._registry`): it carries out the
actions the registry returns, in order, and answers peers that hold no rank."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from coordd.core._admission import Admission
from coordd.core._logs import LogEvent, emit
from coordd.core._registry import Registry
from coordd.core._registry_actions import (
    Action,
    AsStranger,
    Deliver,
    GroupCreated,
    GroupDropped,
    Lost,
    Refuse,
    Registering,
)
from coordd.io._deadlines import Deadlines
from coordd.io._group import Group
from coordd.io._limits import DescriptorWatch
from coordd.io._outbox import Outbox
from coordd.io._stats import ServerStats
from coordd.ops.observer import ServerEvents
from coordd.proto.messages import StepFailed, ToCoordinator, reject_message

log = logging.getLogger("coordd")


class CarryOut:
    """Carry out the registry's actions: a group's sends, refusals, what the observers and
    `events` are told, the lines to log. `watch` (the listener's pause, if any) is told how
    many connections the ranks hold, which is no storm."""

    def __init__(
        self,
        registry: Registry[Group],
        admission: Admission,
        deadlines: Deadlines,
        outbox: Outbox,
        *,
        events: ServerEvents,
        stats: ServerStats,
        watch: DescriptorWatch | None,
        max_groups: int,
        clock: Callable[[], float],
    ) -> None:
        self._registry = registry
        self._admission = admission
        self._deadlines = deadlines
        self._outbox = outbox
        self._events = events
        self._stats = stats
        self._watch = watch
        self._max_groups = max_groups
        self._clock = clock

    def __call__(self, actions: Iterable[Action[Group]]) -> None:
        """Carry out `actions`, in order."""
        events = self._events
        for action in actions:
            if type(action) is Deliver:
                self._deadlines.touched.add(action.group)
                self._outbox.send(action.sends, action.group.observer)
            elif type(action) is Refuse:
                reject = reject_message(action.error)
                events.rejected_hello(action.peer, action.hello, reject, action.group)
                self._outbox.send_one(action.peer, reject)
            elif type(action) is Registering:
                action.group.observer.registering(action.peer, action.hello, action.address)
            elif type(action) is AsStranger:
                self.stranger(action.peer, action.message)
            elif type(action) is Lost:
                self._stats.disconnects += 1
                if action.group is not None:
                    action.group.observer.lost(action.rank, action.peer, action.detail)
            elif type(action) is GroupCreated:
                events.group_created(
                    action.group.name, action.epoch, action.groups, self._max_groups
                )
            elif type(action) is GroupDropped:
                self._deadlines.forget(action.group)
                events.group_dropped(action.group.name, action.epoch)
            elif type(action) is LogEvent:
                emit(log, action)
        if self._watch is not None:
            self._watch.held = self._registry.connections_held()

    def stranger(self, peer: bytes, message: ToCoordinator) -> None:
        """Answer a peer that registered with no group (`Admission.answer`)."""
        answer = self._admission.answer(message, self._clock(), self._registry.known_epoch)
        if type(answer) is StepFailed:
            self._events.refused_report(peer, answer)
        if answer is not None:
            self._outbox.send_one(peer, answer)
