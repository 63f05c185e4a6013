"""What the ops side (metrics, /status, /readyz) may read of the server: a narrow view, so the
collector and the documents never reach into the I/O shell's sockets, gates or guards.

`CoordServer` satisfies `ServerView`; its `counters()` is built at scrape time only."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from coordd.core._settings import ServerSettings
from coordd.ops.observer import Observer, ServerEvents
from coordd.proto.coordinator import Coordinator
from coordd.proto.snapshot import GroupSnapshot


class GroupView(Protocol):
    """One group as ops sees it: its state machine (read through snapshots) and its counts."""

    @property
    def name(self) -> str: ...

    @property
    def coordinator(self) -> Coordinator: ...

    @property
    def observer(self) -> Observer: ...


@dataclass(frozen=True)
class ShellCounters:
    """The I/O shell's own counts at one moment; None: that part is off (no memory guard, no
    handshake gate, no CURVE)."""

    frames_in: int
    frames_out: int
    bad_frames: int
    disconnects: int
    connections_open: int
    closed_cap: int
    closed_flood: int
    closed_banned: int
    closed_silent: int
    closed_messages_dropped: int
    memory_shed: int | None
    memory_refused: int | None
    rate_refused: int | None
    curve_refused: int | None
    #: members' connections ended for a protocol violation (over their share of messages)
    closed_violation: int = 0


@dataclass(frozen=True)
class RelayRow:
    """A relay registered for a group at the root: its name, the ranks it speaks for and the
    address of its connection (a tcp peer's IP, or `localhost:PID` over ipc)."""

    name: str
    ranks: tuple[int, ...]
    address: str


@dataclass(frozen=True)
class RelayedGroup:
    """A group the root serves through relays, as ops reads it: the root sees one message
    per relay per round, so there is no per-rank timing here (a relay's own /status has it)."""

    snapshot: GroupSnapshot
    relays: tuple[RelayRow, ...]


class ServerView(Protocol):
    """The server as metrics, /status and /readyz read it."""

    @property
    def settings(self) -> ServerSettings: ...

    @property
    def bound_address(self) -> str: ...

    @property
    def started_wall(self) -> float: ...

    @property
    def clock(self) -> Callable[[], float]: ...

    @property
    def wall(self) -> Callable[[], float]: ...

    @property
    def groups(self) -> Mapping[str, GroupView]: ...

    @property
    def events(self) -> ServerEvents: ...

    def takeovers_refused(self) -> Counter[tuple[str, str]]: ...

    def relayed_groups(self) -> Mapping[str, RelayedGroup]:
        """The groups served through relays (`coordd serve --relay-to` on the nodes)."""
        ...

    def counters(self) -> ShellCounters: ...
