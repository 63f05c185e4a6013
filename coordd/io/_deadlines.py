"""The server's one timer: armed for the earliest open round's deadline over the groups."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from coordd.io._group import Group
from coordd.io._hosts import TimerHost


class Deadlines:
    """The groups with an open round (`open`: group -> deadline) and the one timer.

    `touched` is the set the drain adds each group that got input to; `after_drain()` looks
    at those once per drain: a group failure nobody was sent (a rank lost between rounds)
    shows only in the failure counter, so the observer is told from there; and the group's
    deadline may have moved. At a deadline, the host sends the coordinator's answers and
    drains."""

    def __init__(self, clock: Callable[[], float], host: TimerHost) -> None:
        self.clock = clock
        self._host = host
        self.touched: set[Group] = set()
        self.open: dict[Group, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def after_drain(self) -> None:
        touched = self.touched
        earlier = False
        if touched:
            timer_at = self._timer_at
            for group in touched:
                coordinator = group.coordinator
                observer = group.observer
                failures, stops, deadline = coordinator.marks()
                if failures != observer.failures_seen:
                    observer.group_failed(coordinator.snapshot())
                if stops != observer.stops_seen:
                    observer.group_stopped(coordinator.snapshot())
                if deadline != group.deadline:
                    group.deadline = deadline
                    if deadline is None:
                        self.open.pop(group, None)
                    else:
                        self.open[group] = deadline
                        if timer_at is None or deadline < timer_at:
                            earlier = True
            touched.clear()
        if earlier or (self._timer_at is None and self.open):
            self._schedule()

    def forget(self, group: Group) -> None:
        """`group` was dropped."""
        self.open.pop(group, None)
        self.touched.discard(group)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _schedule(self) -> None:
        """Arm the one timer for the earliest open deadline, lazily: a round that ends leaves
        it armed (it fires, finds nothing due and is armed again for what is open then) and a
        later deadline never moves it, so a round costs no timer call."""
        if not self.open or self.loop is None:
            return
        deadline = min(self.open.values())
        if deadline == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = deadline
        delay = max(0.0, deadline - self.clock())
        self._timer = self.loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        now = self.clock()
        for group, deadline in list(self.open.items()):
            if deadline <= now:
                self.touched.add(group)
                self._host.send(group.coordinator.on_deadline(now), group.observer)
        self._host.drain()
