"""coordd's contract: wire messages, the step policy, the coordinator state machine, the errors.

Pure Python: no sockets, no clocks (time is passed in), nothing imported from coordd/ or client/.
"""

from coordd.proto.coordinator import Coordinator, OnRankLoss, Send
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
from coordd.proto.group_state import GroupEvent, GroupState, IllegalTransition
from coordd.proto.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    WIRE_ERRORS,
    FailReason,
    Goodbye,
    Heartbeat,
    Hello,
    Reject,
    RejectReason,
    StepDecision,
    StepFailed,
    StepKind,
    StepReport,
    Welcome,
    decode_from_coordinator,
    decode_to_coordinator,
    encode,
    error_from_failure,
    failure_message,
)
from coordd.proto.policy import decide, validate_report
from coordd.proto.snapshot import GroupSnapshot

__all__ = [
    "IllegalTransition",
    "GroupState",
    "GroupSnapshot",
    "GroupEvent",
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "WIRE_ERRORS",
    "ConflictingReport",
    "CoordError",
    "Coordinator",
    "CoordinatorUnavailable",
    "FailReason",
    "Goodbye",
    "Heartbeat",
    "Hello",
    "InvalidReport",
    "OnRankLoss",
    "ProtocolError",
    "RankLost",
    "Reject",
    "RejectReason",
    "Rejected",
    "Send",
    "StepDecision",
    "StepFailed",
    "StepKind",
    "StepMismatch",
    "StepReport",
    "StepTimeout",
    "Welcome",
    "decide",
    "decode_from_coordinator",
    "decode_to_coordinator",
    "encode",
    "error_from_failure",
    "failure_message",
    "validate_report",
]
