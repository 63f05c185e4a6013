"""Registrations at another group size, waiting for the group's holders to leave (elastic EP
re-forming DP at another size): one queue for the flat coordinator's rank Hellos and the
root's relay Hellos. Pure; time is passed in."""

from __future__ import annotations

from typing import Generic, NamedTuple, TypeVar

H = TypeVar("H")


class Waiting(NamedTuple, Generic[H]):
    """A registration (`hello`) from `peer` at another size, waiting until `deadline`."""

    peer: bytes
    hello: H
    deadline: float


class ResizeWaits(Generic[H]):
    """The registrations waiting to re-form a group at another size, in the order they came
    (a peer's newer one replaces its older)."""

    def __init__(self) -> None:
        self._waiting: list[Waiting[H]] = []

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def wait(self, peer: bytes, hello: H, deadline: float) -> None:
        self.drop(peer)
        self._waiting.append(Waiting(peer, hello, deadline))

    def drop(self, peer: bytes) -> None:
        """`peer` is gone: its registration no longer waits."""
        self._waiting = [w for w in self._waiting if w.peer != peer]

    def peers(self) -> list[bytes]:
        return [w.peer for w in self._waiting]

    def deadline(self) -> float | None:
        """The earliest deadline, or None when none waits."""
        return min((w.deadline for w in self._waiting), default=None)

    def due(self, now: float) -> bool:
        """Whether a registration's deadline has passed at `now`."""
        first = self.deadline()
        return first is not None and now >= first

    def take(self) -> list[Waiting[H]]:
        """Every waiting registration, in order; none waits after (the holders have left)."""
        waiting, self._waiting = self._waiting, []
        return waiting

    def expire(self, now: float) -> list[Waiting[H]]:
        """The registrations past their deadline at `now`, removed (to be refused)."""
        due = [w for w in self._waiting if now >= w.deadline]
        if due:
            self._waiting = [w for w in self._waiting if now < w.deadline]
        return due
