"""The wire contract: every message is a msgspec Struct in one tagged union (msgpack, never pickle).

Structs are array-like (a message is a msgpack array whose first item is its tag), which keeps
a `StepReport` under 40 bytes and decoding at a few hundred nanoseconds. Fields are only
ever appended, with defaults, so an older peer can read a newer one's messages; anything that
changes meaning bumps `PROTOCOL_VERSION`, which `Hello` carries.
"""

from __future__ import annotations

import enum
from typing import Annotated, Union

import msgspec

from coordd.proto.errors import (
    ConflictingReport,
    CoordError,
    CoordinatorUnavailable,
    InvalidReport,
    ProtocolError,
    RankLost,
    Rejected,
    StepMismatch,
    StepTimeout,
)

PROTOCOL_VERSION = 1
#: Largest frame either side accepts; a dp=4096 decision is ~25 KB.
MAX_MESSAGE_BYTES = 64 * 1024
MAX_DP_SIZE = 4096

ShortStr = Annotated[str, msgspec.Meta(max_length=256)]
RankList = Annotated[list[int], msgspec.Meta(max_length=MAX_DP_SIZE)]


class StepKind(str, enum.Enum):
    """What a round synchronises; all kinds share one sequence per group."""

    FORWARD = "forward"
    DRAFT = "draft"
    STATE = "state"


class RejectReason(str, enum.Enum):
    VERSION = "version"
    DP_SIZE = "dp_size"
    RANK_RANGE = "rank_range"
    RANK_TAKEN = "rank_taken"
    GROUP = "group"
    NUM_UBATCHES = "num_ubatches"
    FINGERPRINT = "fingerprint"


class FailReason(str, enum.Enum):
    MISMATCH = "mismatch"
    CONFLICT = "conflict"
    INVALID = "invalid"
    LOST = "lost"
    TIMEOUT = "timeout"
    UNAVAILABLE = "unavailable"
    PROTOCOL = "protocol"


class _Message(msgspec.Struct, array_like=True, tag_field="type", frozen=True, kw_only=True):
    pass


class Hello(_Message, tag="hello", frozen=True):
    """A rank registers: everything here must agree with the ranks already in."""

    dp_size: int
    dp_rank: int
    config_fingerprint: ShortStr
    incarnation: ShortStr
    group: ShortStr = "default"
    num_ubatches: int = 2
    protocol_version: int = PROTOCOL_VERSION


class Welcome(_Message, tag="welcome", frozen=True):
    epoch: int
    next_seq: int
    dp_size: int


class Reject(_Message, tag="reject", frozen=True):
    reason: RejectReason
    text: str
    expected: str = ""
    got: str = ""


class StepReport(_Message, tag="report", frozen=True):
    """One rank's view of the coming step; the client fills in rank, epoch, seq and kind."""

    num_tokens: int
    num_tokens_padded: int
    want_ubatch: bool = False
    cudagraph_mode: int = 0
    has_unfinished: bool = False
    dp_rank: int = -1
    epoch: int = 0
    seq: int = -1
    kind: StepKind = StepKind.FORWARD
    want_pause: bool = False


class StepDecision(_Message, tag="decision", frozen=True):
    """The one outcome of a round, identical for every rank."""

    epoch: int
    seq: int
    kind: StepKind
    num_tokens_across_dp: RankList
    should_ubatch: bool
    should_pad: bool
    cudagraph_mode: int
    any_unfinished: bool
    all_idle: bool
    dead_ranks: RankList = []
    should_pause: bool = False


class StepFailed(_Message, tag="failed", frozen=True):
    """A round ended in an error; every rank of the round gets the same one."""

    epoch: int
    seq: int
    kind: StepKind
    reason: FailReason
    culprits: RankList
    text: str
    expected_seq: int = -1
    expected_kind: str = ""
    got_seq: int = -1
    got_kind: str = ""
    field: str = ""
    value: str = ""
    timeout: float = 0.0


class Heartbeat(_Message, tag="heartbeat", frozen=True):
    """A liveness probe; coordd answers with the same nonce."""

    nonce: int = 0


class Goodbye(_Message, tag="goodbye", frozen=True):
    """Sent by a rank that leaves, and by coordd to every rank when it shuts down."""

    text: str = ""


ToCoordinator = Union[Hello, StepReport, Heartbeat, Goodbye]
FromCoordinator = Union[Welcome, Reject, StepDecision, StepFailed, Heartbeat, Goodbye]
Message = Union[Hello, Welcome, Reject, StepReport, StepDecision, StepFailed, Heartbeat, Goodbye]

_encoder = msgspec.msgpack.Encoder()
_to_coordinator: msgspec.msgpack.Decoder[ToCoordinator] = msgspec.msgpack.Decoder(ToCoordinator)
_from_coordinator: msgspec.msgpack.Decoder[FromCoordinator] = msgspec.msgpack.Decoder(
    FromCoordinator
)

encode = _encoder.encode


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes | memoryview):  # type: ignore[no-untyped-def]
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            f"frame of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES} byte limit"
        )
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from None


def decode_to_coordinator(data: bytes | memoryview) -> ToCoordinator:
    """Decode a frame a rank sent; raises `ProtocolError` for anything else."""
    return _decode(_to_coordinator, data)


def decode_from_coordinator(data: bytes | memoryview) -> FromCoordinator:
    """Decode a frame coordd sent; raises `ProtocolError` for anything else."""
    return _decode(_from_coordinator, data)


def failure_message(error: CoordError, *, epoch: int, seq: int, kind: StepKind) -> StepFailed:
    """The wire form of a round's error; `error_from_failure` turns it back."""
    fields: dict[str, object] = {}
    culprits: list[int] = list(getattr(error, "ranks", ()))
    if isinstance(error, StepMismatch):
        fields = dict(
            expected_seq=error.expected_seq,
            expected_kind=error.expected_kind,
            got_seq=error.got_seq,
            got_kind=error.got_kind,
        )
    elif isinstance(error, ConflictingReport):
        fields = dict(got_seq=error.seq)
    elif isinstance(error, InvalidReport):
        fields = dict(field=error.field, value=repr(error.value), got_kind=error.expected)
    elif isinstance(error, StepTimeout):
        fields = dict(timeout=error.timeout)
    elif isinstance(error, RankLost):
        fields = dict(value=error.detail)
    elif isinstance(error, ProtocolError):
        culprits = [] if error.rank is None else [error.rank]
        fields = dict(value=error.detail)
    elif isinstance(error, CoordinatorUnavailable):
        fields = dict(value=error.detail)
    return StepFailed(
        epoch=epoch,
        seq=seq,
        kind=kind,
        reason=FailReason(error.reason),
        culprits=culprits,
        text=str(error),
        **fields,  # type: ignore[arg-type]
    )


_NEEDS_CULPRIT = frozenset({FailReason.MISMATCH, FailReason.CONFLICT, FailReason.INVALID})


def error_from_failure(msg: StepFailed) -> CoordError:
    """The typed error that a `StepFailed` stands for, equal to the one coordd raised."""
    r = msg.reason
    if not msg.culprits and r in _NEEDS_CULPRIT:
        return ProtocolError(f"malformed {r.value} failure without a culprit rank: {msg.text}")
    if r is FailReason.MISMATCH:
        return StepMismatch(
            msg.culprits[0], msg.expected_seq, msg.expected_kind, msg.got_seq, msg.got_kind
        )
    if r is FailReason.CONFLICT:
        return ConflictingReport(msg.culprits[0], msg.got_seq)
    if r is FailReason.INVALID:
        return InvalidReport(msg.culprits[0], msg.field, _literal(msg.value), msg.got_kind)
    if r is FailReason.LOST:
        return RankLost(msg.culprits, msg.value)
    if r is FailReason.TIMEOUT:
        return StepTimeout(msg.culprits, msg.timeout)
    if r is FailReason.UNAVAILABLE:
        return CoordinatorUnavailable(msg.value)
    return ProtocolError(msg.value, rank=msg.culprits[0] if msg.culprits else None)


def _literal(text: str) -> object:
    """Undo the repr() of an invalid report value (ints and bools only ever travel)."""
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        return text


def reject_message(error: Rejected) -> Reject:
    return Reject(
        reason=RejectReason(error.reason), text=error.detail, expected=error.expected, got=error.got
    )


def error_from_reject(msg: Reject) -> Rejected:
    return Rejected(msg.reason.value, msg.text, expected=msg.expected, got=msg.got)
