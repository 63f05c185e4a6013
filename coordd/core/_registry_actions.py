"""What the group registry (`coordd.core._registry`) returns for the shell to carry out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from coordd.core._logs import LogEvent
from coordd.proto.coordinator import Coordinator, Send
from coordd.proto.errors import Rejected
from coordd.proto.messages import Hello, ToCoordinator


class GroupLike(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def coordinator(self) -> Coordinator: ...


G = TypeVar("G", bound=GroupLike)


@dataclass(frozen=True, slots=True)
class Deliver(Generic[G]):
    """Send what `group`'s coordinator answered (and look at the group after the drain)."""

    group: G
    sends: Sequence[Send]


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer `hello` from `peer` with a Reject, counted outside any group (`group`: the
    name it asked for, shown safely)."""

    peer: bytes
    hello: Hello
    error: Rejected
    group: str


@dataclass(frozen=True, slots=True)
class Registering(Generic[G]):
    """A Hello from `peer` goes to `group` (its observer is told before any answer)."""

    group: G
    peer: bytes
    hello: Hello
    address: str


@dataclass(frozen=True, slots=True)
class AsStranger:
    """Answer `message` as a stranger's (the peer holds no rank it may speak for)."""

    peer: bytes
    message: ToCoordinator


@dataclass(frozen=True, slots=True)
class Lost(Generic[G]):
    """The connection that registered `peer` closed; `group` (None: none) lost it."""

    group: G | None
    peer: bytes
    rank: int | None
    detail: str = "connection closed"


@dataclass(frozen=True, slots=True)
class GroupCreated(Generic[G]):
    group: G
    epoch: int
    groups: int


@dataclass(frozen=True, slots=True)
class GroupDropped(Generic[G]):
    group: G
    epoch: int


Action = (
    Deliver[G]
    | Refuse
    | Registering[G]
    | AsStranger
    | Lost[G]
    | GroupCreated[G]
    | GroupDropped[G]
    | LogEvent
)
