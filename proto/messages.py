"""The wire contract: every message is a msgspec Struct in one tagged union (msgpack, never pickle).

Structs are array-like (a message is a msgpack array whose first item is its tag), which keeps
a `StepReport` under 40 bytes and decoding at a few hundred nanoseconds. Fields are only
ever appended, with defaults, so an older peer can read a newer one's messages; anything that
changes meaning bumps `PROTOCOL_VERSION`, which `Hello` carries.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, ClassVar, Union

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

#: 2: gather rounds (`GatherReport`, `GatherResult`, `StepKind.GATHER`);
#: `StepFailed.expected` (InvalidReport's range, which 1 sent in `got_kind`);
#: `StepDecision.any_pause`; a state round's report means what its fields say (1 sent the
#: rank's has_unfinished as num_tokens, and has_unfinished as "has work or waits to pause").
PROTOCOL_VERSION = 2
#: Largest frame either side accepts; a dp=4096 decision is ~25 KB.
MAX_MESSAGE_BYTES = 64 * 1024
MAX_DP_SIZE = 4096

ShortStr = Annotated[str, msgspec.Meta(max_length=256)]
RankList = Annotated[list[int], msgspec.Meta(max_length=MAX_DP_SIZE)]
#: Most values one rank contributes to a gather round (vLLM's syncs carry 2 to 7).
MAX_GATHER_VALUES = 256
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
GatherValues = Annotated[list[Int64], msgspec.Meta(max_length=MAX_GATHER_VALUES)]
GatherRows = Annotated[list[GatherValues], msgspec.Meta(max_length=MAX_DP_SIZE)]
#: A wait in microseconds (-1: none), at most a day's.
MAX_WAITED_US = 86_400_000_000
WaitedUs = Annotated[int, msgspec.Meta(ge=-1, le=MAX_WAITED_US)]
#: What a `GatherResult` holds besides its rows, at most (a 256-character site is up to
#: 1 KiB of UTF-8; the rest is the envelope).
_GATHER_RESULT_HEADER_BYTES = 2048


class StepKind(str, enum.Enum):
    """What a round synchronises; all kinds share one sequence per group."""

    FORWARD = "forward"
    DRAFT = "draft"
    STATE = "state"
    #: A gather round (`GatherReport`): every rank's values, unchanged, to every rank.
    GATHER = "gather"


#: The kinds of policy rounds (a `StepReport`, decided by `coordd.proto.policy.decide`).
POLICY_KINDS: tuple[StepKind, ...] = (StepKind.FORWARD, StepKind.DRAFT, StepKind.STATE)


class RejectReason(str, enum.Enum):
    """Why a `Hello` was refused; `coordd.proto.errors.REJECT_HINTS` says what to fix."""

    VERSION = "version"
    DP_SIZE = "dp_size"
    RANK_RANGE = "rank_range"
    RANK_TAKEN = "rank_taken"
    GROUP = "group"
    NUM_UBATCHES = "num_ubatches"
    FINGERPRINT = "fingerprint"
    #: coordd already serves --max-groups groups; a Hello for another one is refused.
    GROUP_LIMIT = "group_limit"
    #: The connection's CURVE key is bound to other ranks (`--curve-client-keys N=PATH` or a
    #: key file named rank<N>.key).
    CURVE_KEY = "curve_key"
    #: The connection's routing id starts with a zero byte: ZeroMQ's names for peers that set
    #: none (see coordd.io._gate for why such a connection cannot be a rank).
    ROUTING_ID = "routing_id"
    #: The group is not one the deployment expects (coordd's --groups names and patterns).
    GROUP_UNEXPECTED = "group_unexpected"
    #: A relay's registration reached a coordd not started as a root (`--relay-root`).
    NOT_ROOT = "not_root"


class FailReason(str, enum.Enum):
    """Why a round failed: one per round error class (see `WIRE_ERRORS`)."""

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
    #: How long this rank's group ran without coordd (its own collective, the fallback) before
    #: this registration brought it back, in ms; 0: it did not.
    away_ms: int = 0


class Welcome(_Message, tag="welcome", frozen=True):
    epoch: int
    next_seq: int
    dp_size: int
    #: coordd's --step-timeout (0: not said: an older coordd, or the device path): a client's
    #: default wait outlives it, so coordd's `StepTimeout` naming the late ranks comes first.
    step_timeout: float = 0.0


class Reject(_Message, tag="reject", frozen=True):
    reason: RejectReason
    text: str
    expected: str = ""
    got: str = ""


class StepReport(_Message, tag="report", frozen=True):
    """One rank's view of the coming step; the client fills in rank, epoch, seq and kind.

    A state round (kind "state") has no batch: it reports 0 tokens, and `has_unfinished` and
    `want_pause` mean what they say (this rank has requests; this rank waits to pause).
    """

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
    #: How long this rank's wait() blocked for its previous round's answer (seq - 1, same
    #: epoch), in microseconds; -1: nothing to report. coordd exports it per group and site
    #: (`coordd_rank_wait_seconds`): what the sync costs the rank's step.
    waited_us: WaitedUs = -1

    @property
    def label(self) -> str:
        """What the round is, as a `StepMismatch` names it: the kind's name."""
        return self.kind._value_


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
    #: Every live rank wants to pause.
    should_pause: bool = False
    #: Some live rank wants to pause (with `should_pause`: "some but not all").
    any_pause: bool = False


class GatherReport(_Message, tag="gather", frozen=True):
    """One rank's contribution to a gather round; the client fills in rank, epoch and seq.

    A gather round decides nothing: coordd hands every rank every rank's `values` (an engine's
    own sync tensor, one column per rank) and the engine computes from them as it would from
    its own all-gather. `site` labels the call site; every rank of a round must report the
    same site and the same number of values.
    """

    site: ShortStr
    values: GatherValues
    dp_rank: int = -1
    epoch: int = 0
    seq: int = -1
    #: As `StepReport.waited_us`: this rank's wait for its previous round, us; -1: none.
    waited_us: WaitedUs = -1

    kind: ClassVar[StepKind] = StepKind.GATHER

    @property
    def label(self) -> str:
        """What the round is, as a `StepMismatch` names it: "gather:<site>"."""
        return f"gather:{self.site}"


class GatherResult(_Message, tag="gathered", frozen=True):
    """The outcome of a gather round, identical for every rank: rows[r] is rank r's values
    ([] for a rank left out in elastic mode, which `dead_ranks` lists)."""

    epoch: int
    seq: int
    site: ShortStr
    rows: GatherRows
    dead_ranks: RankList = []


def max_gather_values(dp_size: int) -> int:
    """Most values per rank a gather round of `dp_size` ranks takes: MAX_GATHER_VALUES, or
    fewer where dp_size rows of int64s would not fit in one frame (26 at dp=256)."""
    row_bytes = MAX_MESSAGE_BYTES - _GATHER_RESULT_HEADER_BYTES - 6 * dp_size
    return max(0, min(MAX_GATHER_VALUES, row_bytes // (9 * dp_size)))


class StepFailed(_Message, tag="failed", frozen=True):
    """A round ended in an error; every rank of the round gets the same one.

    `reason` picks the error class (`WIRE_ERRORS`); each class fills only its own fields.
    """

    epoch: int
    seq: int
    kind: StepKind
    reason: FailReason
    #: The ranks at fault (mismatch, conflict, invalid: exactly one).
    culprits: RankList
    #: str() of the error, for logs; the fields below rebuild it.
    text: str
    #: mismatch: the seq and kind the round expects, and what the rank reported.
    expected_seq: int = -1
    expected_kind: str = ""
    #: mismatch: the rank's seq; conflict: the seq it reported twice.
    got_seq: int = -1
    got_kind: str = ""
    #: invalid: the name of the report field out of range.
    field: str = ""
    #: invalid: repr() of the value.
    value: str = ""
    #: timeout: the step timeout in seconds.
    timeout: float = 0.0
    #: invalid: the range the value must be in.
    expected: str = ""
    #: lost, unavailable, protocol: what happened (which timeout, or that a rank left).
    detail: str = ""


class Heartbeat(_Message, tag="heartbeat", frozen=True):
    """A liveness probe; coordd answers with the same nonce."""

    nonce: int = 0


class Goodbye(_Message, tag="goodbye", frozen=True):
    """Sent by a rank that leaves, and by coordd to every rank when it shuts down."""

    text: str = ""


ToCoordinator = Union[Hello, StepReport, GatherReport, Heartbeat, Goodbye]
FromCoordinator = Union[Welcome, Reject, StepDecision, GatherResult, StepFailed, Heartbeat, Goodbye]
Message = Union[
    Hello,
    Welcome,
    Reject,
    StepReport,
    GatherReport,
    StepDecision,
    GatherResult,
    StepFailed,
    Heartbeat,
    Goodbye,
]
#: A rank's report for a round of either family: a policy round or a gather round.
Report = Union[StepReport, GatherReport]
#: A completed round's one outcome.
Outcome = Union[StepDecision, GatherResult]

_encoder = msgspec.msgpack.Encoder()
_to_coordinator: msgspec.msgpack.Decoder[ToCoordinator] = msgspec.msgpack.Decoder(ToCoordinator)
_from_coordinator: msgspec.msgpack.Decoder[FromCoordinator] = msgspec.msgpack.Decoder(
    FromCoordinator
)

encode = _encoder.encode


def decode_frame(  # type: ignore[no-untyped-def]
    decoder: msgspec.msgpack.Decoder, data: bytes | memoryview, what: str = "frame"
):
    """One frame through `decoder`, within the size limit; `ProtocolError` naming `what`."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            f"frame of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES} byte limit"
        )
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable {what}: {exc}") from None


def decode_to_coordinator(data: bytes | memoryview) -> ToCoordinator:
    """Decode a frame a rank sent; raises `ProtocolError` for anything else."""
    return decode_frame(_to_coordinator, data)


def decode_from_coordinator(data: bytes | memoryview) -> FromCoordinator:
    """Decode a frame coordd sent; raises `ProtocolError` for anything else."""
    return decode_frame(_from_coordinator, data)


#: The registry: each round error class by its wire reason (`Rejected` travels as `Reject`).
WIRE_ERRORS: Mapping[FailReason, type[CoordError]] = MappingProxyType(
    {
        FailReason(cls.reason): cls
        for cls in (
            StepMismatch,
            ConflictingReport,
            InvalidReport,
            RankLost,
            StepTimeout,
            CoordinatorUnavailable,
            ProtocolError,
        )
    }
)
assert set(WIRE_ERRORS) == set(FailReason), "every FailReason needs its error class"
_REASONS = {cls: reason for reason, cls in WIRE_ERRORS.items()}


def failure_message(error: CoordError, *, epoch: int, seq: int, kind: StepKind) -> StepFailed:
    """The wire form of a round's error; `error_from_failure` turns it back."""
    reason = _REASONS.get(type(error))
    if reason is None:
        raise TypeError(f"{type(error).__name__} does not travel in a StepFailed")
    return StepFailed(
        epoch=epoch, seq=seq, kind=kind, reason=reason, text=str(error), **error.wire_fields()
    )


def error_from_failure(msg: StepFailed) -> CoordError:
    """The typed error that a `StepFailed` stands for, equal to the one coordd raised."""
    cls = WIRE_ERRORS[msg.reason]
    if cls.names_a_rank and not msg.culprits:
        return ProtocolError(
            f"malformed {msg.reason.value} failure without a culprit rank: {msg.text}"
        )
    return cls.from_wire(msg)


def reject_message(error: Rejected) -> Reject:
    """The wire form of a refused registration; `error_from_reject` turns it back."""
    return Reject(
        reason=RejectReason(error.reason), text=error.detail, expected=error.expected, got=error.got
    )


def error_from_reject(msg: Reject) -> Rejected:
    """The `Rejected` that a `Reject` stands for, equal to the one coordd raised."""
    return Rejected(msg.reason.value, msg.text, expected=msg.expected, got=msg.got)
