"""The one flat error hierarchy that both paths (coordd and device) raise.

Every error carries the data a caller needs to act on it (which rank, what was expected,
what came), so engine code never parses a message string.
"""

from __future__ import annotations

from collections.abc import Iterable


class CoordError(Exception):
    """Base of every coordd error."""

    #: The wire reason code for this failure (see `coordd.proto.messages.FailReason`).
    reason: str = "error"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self), str(self)))


def _ranks(ranks: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted(set(ranks)))


class Rejected(CoordError):
    """Registration refused: `reason` is a `RejectReason` code, `expected`/`got` the values."""

    def __init__(self, reason: str, detail: str, *, expected: str = "", got: str = "") -> None:
        super().__init__(f"registration rejected ({reason}): {detail}")
        self.reason = reason
        self.detail = detail
        self.expected = expected
        self.got = got


class StepMismatch(CoordError):
    """A rank reported another seq or kind than the round expects (skipped/repeated sync)."""

    reason = "mismatch"

    def __init__(
        self, rank: int, expected_seq: int, expected_kind: str, got_seq: int, got_kind: str
    ) -> None:
        super().__init__(
            f"rank {rank} reported seq={got_seq} kind={got_kind}, "
            f"the round expects seq={expected_seq} kind={expected_kind}"
        )
        self.rank = rank
        self.expected_seq = expected_seq
        self.expected_kind = expected_kind
        self.got_seq = got_seq
        self.got_kind = got_kind

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.rank,)


class ConflictingReport(CoordError):
    """One rank sent two different reports for the same round."""

    reason = "conflict"

    def __init__(self, rank: int, seq: int) -> None:
        super().__init__(f"rank {rank} sent two different reports for seq={seq}")
        self.rank = rank
        self.seq = seq

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.rank,)


class InvalidReport(CoordError):
    """A report field is out of range: `field` names it, `value` is what came."""

    reason = "invalid"

    def __init__(self, rank: int, field: str, value: object, expected: str) -> None:
        super().__init__(f"rank {rank}: invalid {field}={value!r} (expected {expected})")
        self.rank = rank
        self.field = field
        self.value = value
        self.expected = expected

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.rank,)


class RankLost(CoordError):
    """Ranks disconnected or stopped answering heartbeats."""

    reason = "lost"

    def __init__(self, ranks: Iterable[int], detail: str = "") -> None:
        self.ranks = _ranks(ranks)
        super().__init__(f"rank(s) {list(self.ranks)} lost" + (f": {detail}" if detail else ""))
        self.detail = detail


class StepTimeout(CoordError):
    """The round was not complete within the step timeout; `ranks` had not reported."""

    reason = "timeout"

    def __init__(self, ranks: Iterable[int], timeout: float) -> None:
        self.ranks = _ranks(ranks)
        self.timeout = timeout
        who = f"rank(s) {list(self.ranks)} did not report" if self.ranks else "no decision"
        super().__init__(f"{who} within {timeout:g}s")


class CoordinatorUnavailable(CoordError):
    """coordd cannot be reached, shut down, or restarted (a new epoch)."""

    reason = "unavailable"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class ProtocolError(CoordError):
    """Bytes or messages that break the protocol: undecodable, unregistered, spoofed."""

    reason = "protocol"

    def __init__(self, detail: str, *, rank: int | None = None) -> None:
        super().__init__(detail if rank is None else f"rank {rank}: {detail}")
        self.detail = detail
        self.rank = rank


__all__ = [
    "ConflictingReport",
    "CoordError",
    "CoordinatorUnavailable",
    "InvalidReport",
    "ProtocolError",
    "RankLost",
    "Rejected",
    "StepMismatch",
    "StepTimeout",
]
