"""What the server offers the parts it builds: the guard and the deadline timer call it
through these, never through its private methods (and import no server)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from coordd.ops.observer import Observer
from coordd.proto.coordinator import Send


class GuardHost(Protocol):
    """The server as `coordd.io._guard.Guard` needs it."""

    def catch_up_monitor(self) -> bool:
        """Read the monitor's queued events; True if none is left (every descriptor is then
        one libzmq holds: what acting on a descriptor needs)."""
        ...

    def messages_queued(self) -> bool:
        """Whether messages wait unread on the socket."""
        ...

    def introduced_fds(self) -> Collection[int]:
        """The descriptors of connections that said a Hello and are open."""
        ...


class TimerHost(Protocol):
    """The server as `coordd.io._deadlines.Deadlines` needs it."""

    def send(self, sends: Sequence[Send], observer: Observer) -> None:
        """Send a coordinator's answers."""
        ...

    def drain(self) -> None:
        """Handle what is queued (and look at the groups the deadline touched)."""
        ...
