"""Fuzz the boundary a rank's frame crosses in coordd: decode, validate, then the coordinator.

Random bytes and random field values (ints at and past every limit, floats, strings, None,
nested values) must end in a typed error (`ProtocolError` from the decoder, `InvalidReport`
from the validator, a `StepFailed` from the coordinator) or a valid message that the policy
decides within range, never in another exception. The decoder's own fuzz is in
test_messages.py; this one follows a frame all the way through (`COORDD_HYPOTHESIS_PROFILE=fuzz`
for a long search).
"""

from __future__ import annotations

import msgspec
from hypothesis import event, given
from hypothesis import strategies as st

from coordd.proto import (
    Coordinator,
    InvalidReport,
    ProtocolError,
    Send,
    StepFailed,
    StepKind,
    StepReport,
    decide,
    validate_report,
)
from coordd.proto.messages import (
    GatherReport,
    Hello,
    decode_from_coordinator,
    decode_to_coordinator,
    encode,
)
from coordd.proto.policy import CUDAGRAPH_MODES, MAX_TOKENS, validate_gather

DP = 2
EPOCH = 3
REPORT_FIELDS = tuple(StepReport.__struct_fields__)
GATHER_FIELDS = tuple(GatherReport.__struct_fields__)

#: Ints at and just past every limit the wire or the policy has.
edges = st.sampled_from(
    [0, 1, -1, 2, 3, 7, MAX_TOKENS, MAX_TOKENS + 1, 2**32, 2**63 - 1, -(2**63), 2**64 - 1]
)
scalars = st.one_of(
    edges,
    st.integers(-(2**63), 2**64 - 1),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from([k.value for k in StepKind] + ["report", "gather", ""]),
    st.binary(max_size=8),
)
hostile = st.one_of(
    scalars,
    st.lists(scalars, max_size=4),
    st.dictionaries(st.text(max_size=4), scalars, max_size=2),
)
#: Mostly ints the wire carries (so the report reaches the validator), one time in five
#: anything (one_of would flatten `hostile`'s branches and pick an int rarely).
wire_ints = st.one_of(edges, st.integers(-(2**63), 2**64 - 1), st.integers(-3, 9))
counts = st.integers(0, 4).flatmap(lambda i: hostile if i == 0 else wire_ints)
flags = st.integers(0, 4).flatmap(lambda i: hostile if i == 0 else st.booleans())
kinds = st.sampled_from([k.value for k in StepKind])
mixed = st.integers(0, 2).flatmap(
    lambda i: hostile if i == 0 else st.one_of(wire_ints, st.booleans(), kinds)
)


def registered() -> Coordinator:
    c = Coordinator(DP, epoch=EPOCH, step_timeout=10.0)
    for r in range(DP):
        hello = Hello(dp_size=DP, dp_rank=r, config_fingerprint="fp", incarnation=f"i{r}")
        c.receive(f"p{r}".encode(), hello, 1.0)
    return c


def through_the_boundary(frame: bytes) -> None:
    """What coordd does with one frame from rank 0's connection; asserts every outcome typed."""
    try:
        message = decode_to_coordinator(frame)
    except ProtocolError:
        return  # dropped as a bad frame
    assert isinstance(message, msgspec.Struct)
    if type(message) is StepReport:
        try:
            validate_report(0, message)
        except InvalidReport as error:
            assert error.ranks == (0,)
            assert error.field in REPORT_FIELDS
        else:
            assert 0 <= message.num_tokens <= message.num_tokens_padded <= MAX_TOKENS
            assert message.cudagraph_mode in CUDAGRAPH_MODES
            assert message.kind is not StepKind.GATHER
            d = decide([message, message], epoch=EPOCH, seq=0, kind=message.kind)
            assert all(0 <= n <= MAX_TOKENS for n in d.num_tokens_across_dp)
            assert d.cudagraph_mode in CUDAGRAPH_MODES
    elif type(message) is GatherReport:
        try:
            validate_gather(0, message, DP, None)
        except InvalidReport as error:
            assert error.ranks == (0,) and error.field == "values"
    c = registered()
    sends = list(c.receive(b"p0", message, 2.0))
    sends += c.receive(b"stranger", message, 2.0)
    for send in sends:
        assert isinstance(send, Send)
        answer = send.message
        again = decode_from_coordinator(encode(answer))  # what every rank decodes
        assert encode(again) == encode(answer)
        if type(answer) is StepFailed and answer.reason.value == "invalid":
            assert answer.culprits == [0] and answer.field in REPORT_FIELDS + GATHER_FIELDS


@given(st.binary(max_size=256))
def test_random_bytes_end_in_a_typed_error_or_a_valid_message(data: bytes) -> None:
    through_the_boundary(data)


@given(st.lists(mixed, min_size=0, max_size=len(REPORT_FIELDS) + 2))
def test_random_report_fields_end_in_a_typed_error_or_a_valid_message(values: list[object]) -> None:
    through_the_boundary(msgspec.msgpack.encode(["report", *values]))


@given(
    st.fixed_dictionaries(
        {name: counts for name in ("num_tokens", "num_tokens_padded", "cudagraph_mode")},
        optional={name: flags for name in ("want_ubatch", "has_unfinished", "want_pause")},
    ),
    kinds.filter(lambda k: k != StepKind.GATHER.value),
)
def test_a_registered_ranks_report_with_random_values_is_decided_or_invalid(
    fields: dict[str, object], kind: str
) -> None:
    """The envelope right (rank 0, this epoch, seq 0), the payload hostile: the report reaches
    the validator, and a value out of range fails the round for every rank naming rank 0."""
    values = [fields.get(name, False) for name in REPORT_FIELDS[:5]]
    values += [0, EPOCH, 0, kind, fields.get("want_pause", False)]
    frame = msgspec.msgpack.encode(["report", *values])
    through_the_boundary(frame)
    try:
        report = decode_to_coordinator(frame)
    except ProtocolError:
        return
    assert type(report) is StepReport
    sends = list(registered().receive(b"p0", report, 2.0))
    try:
        validate_report(0, report)
    except InvalidReport as error:
        event(f"invalid {error.field}")
        ((to, failed),) = sends
        assert isinstance(failed, StepFailed) and sorted(to) == [b"p0", b"p1"]
        assert failed.culprits == [0] and failed.field == error.field
        assert failed.value == repr(error.value)
    else:
        event("valid")
        assert sends == []  # the round waits for rank 1


@given(st.lists(mixed, min_size=0, max_size=len(GATHER_FIELDS) + 2))
def test_random_gather_fields_end_in_a_typed_error_or_a_valid_message(values: list[object]) -> None:
    through_the_boundary(msgspec.msgpack.encode(["gather", *values]))
