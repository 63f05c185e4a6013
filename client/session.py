"""The rank's side of the protocol, sans-IO: what to send, and what a received message means.

Both clients (blocking and asyncio) are thin shells over this, so they cannot disagree about
epochs, sequence numbers or which failures end the group.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

import msgspec

from coordd.proto.errors import CoordError, CoordinatorUnavailable, ProtocolError, Rejected
from coordd.proto.messages import (
    FailReason,
    FromCoordinator,
    Goodbye,
    Heartbeat,
    Hello,
    Reject,
    StepDecision,
    StepFailed,
    StepKind,
    StepReport,
    Welcome,
    error_from_failure,
    error_from_reject,
)


@dataclass(frozen=True)
class Registered:
    welcome: Welcome


@dataclass(frozen=True)
class RegistrationFailed:
    error: Rejected


@dataclass(frozen=True)
class Resolved:
    """The outcome of one round: a decision, or an error for this rank's report alone."""

    seq: int
    outcome: StepDecision | CoordError


@dataclass(frozen=True)
class GroupFailed:
    """Every pending and later round fails with `error` until the rank registers again."""

    error: CoordError


@dataclass(frozen=True)
class Pong:
    nonce: int


Event = Registered | RegistrationFailed | Resolved | GroupFailed | Pong


def new_incarnation() -> str:
    return f"{os.getpid()}-{secrets.token_hex(4)}"


class RankSession:
    """One rank's registration, sequence counter and fail-stop state."""

    def __init__(
        self,
        *,
        dp_rank: int,
        dp_size: int,
        config_fingerprint: str = "",
        group: str = "default",
        num_ubatches: int = 2,
        incarnation: str | None = None,
    ) -> None:
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.hello_message = Hello(
            dp_size=dp_size,
            dp_rank=dp_rank,
            config_fingerprint=config_fingerprint,
            incarnation=incarnation or new_incarnation(),
            group=group,
            num_ubatches=num_ubatches,
        )
        self.epoch: int | None = None
        self.next_seq = 0
        self.failed: CoordError | None = None

    @property
    def identity(self) -> bytes:
        """The ZeroMQ routing id: stable across reconnects of this incarnation."""
        return f"{self.dp_rank}:{self.hello_message.incarnation}".encode()

    def report(self, report: StepReport, kind: StepKind) -> StepReport:
        """Stamp `report` with this rank's envelope and take the next seq."""
        if self.failed is not None:
            raise self.failed
        if self.epoch is None:
            raise ProtocolError("not registered: call connect() first", rank=self.dp_rank)
        stamped = msgspec.structs.replace(
            report, dp_rank=self.dp_rank, epoch=self.epoch, seq=self.next_seq, kind=kind
        )
        self.next_seq += 1
        return stamped

    def receive(self, msg: FromCoordinator) -> Event | None:
        """What `msg` means for this rank; None for stale messages of an older epoch."""
        if type(msg) is StepDecision:
            return Resolved(msg.seq, msg) if msg.epoch == self.epoch else None
        if type(msg) is StepFailed:
            return self._on_failed(msg)
        if type(msg) is Welcome:
            self.epoch = msg.epoch
            self.next_seq = msg.next_seq
            self.failed = None
            return Registered(msg)
        if type(msg) is Reject:
            return RegistrationFailed(error_from_reject(msg))
        if type(msg) is Heartbeat:
            return Pong(msg.nonce)
        if type(msg) is Goodbye:
            return self.fail(CoordinatorUnavailable(f"coordd said goodbye: {msg.text}"))
        return None

    def fail(self, error: CoordError) -> GroupFailed:
        self.failed = error
        return GroupFailed(error)

    def _on_failed(self, msg: StepFailed) -> Event | None:
        error = error_from_failure(msg)
        if msg.reason is FailReason.PROTOCOL:
            return Resolved(msg.seq, error)
        if msg.reason is FailReason.UNAVAILABLE or msg.epoch == self.epoch:
            return self.fail(error)
        return None
