"""coordd.proto.messages: the wire round trip, refusals, error <-> StepFailed mapping, fuzz."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordd.proto import (
    MAX_GATHER_VALUES,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    ConflictingReport,
    CoordError,
    CoordinatorUnavailable,
    FailReason,
    GatherReport,
    GatherResult,
    Goodbye,
    Heartbeat,
    Hello,
    InvalidReport,
    ProtocolError,
    RankLost,
    Reject,
    Rejected,
    RejectReason,
    StepDecision,
    StepFailed,
    StepKind,
    StepMismatch,
    StepReport,
    StepTimeout,
    Welcome,
    decode_from_coordinator,
    decode_to_coordinator,
    encode,
    error_from_failure,
    failure_message,
    max_gather_values,
)
from coordd.proto.coordinator import Coordinator
from coordd.proto.errors import REJECT_HINTS, UNAVAILABLE_HINTS
from coordd.proto.messages import MAX_DP_SIZE, WIRE_ERRORS, error_from_reject, reject_message

# -- strategies ----------------------------------------------------------------------------

i64 = st.integers(-(2**63), 2**63 - 1)
small = st.integers(-(2**31), 2**31)
short = st.text(max_size=256)
text = st.text(max_size=300)
kinds = st.sampled_from(StepKind)
rank_lists = st.lists(st.integers(0, MAX_DP_SIZE - 1), max_size=64)
finite = st.floats(allow_nan=False)

hellos = st.builds(
    Hello, dp_size=i64, dp_rank=i64, config_fingerprint=short, incarnation=short, group=short,
    num_ubatches=i64, protocol_version=i64,
)
welcomes = st.builds(Welcome, epoch=i64, next_seq=i64, dp_size=i64,
                   step_timeout=st.floats(0, 86400))
rejects = st.builds(Reject, reason=st.sampled_from(RejectReason), text=text, expected=text,
                    got=text)
step_reports = st.builds(
    StepReport, num_tokens=i64, num_tokens_padded=i64, want_ubatch=st.booleans(),
    cudagraph_mode=i64, has_unfinished=st.booleans(), dp_rank=i64, epoch=i64, seq=i64,
    kind=kinds, want_pause=st.booleans(),
)
step_decisions = st.builds(
    StepDecision, epoch=i64, seq=i64, kind=kinds,
    num_tokens_across_dp=st.lists(i64, max_size=256), should_ubatch=st.booleans(),
    should_pad=st.booleans(), cudagraph_mode=i64, any_unfinished=st.booleans(),
    all_idle=st.booleans(), dead_ranks=rank_lists, should_pause=st.booleans(),
    any_pause=st.booleans(),
)
step_faileds = st.builds(
    StepFailed, epoch=i64, seq=i64, kind=kinds, reason=st.sampled_from(FailReason),
    culprits=rank_lists, text=text, expected_seq=i64, expected_kind=text, got_seq=i64,
    got_kind=text, field=text, value=text, timeout=finite, expected=text, detail=text,
)
gather_values = st.lists(i64, max_size=MAX_GATHER_VALUES)
gather_reports = st.builds(GatherReport, site=short, values=gather_values, dp_rank=i64,
                           epoch=i64, seq=i64)
gather_results = st.builds(
    GatherResult, epoch=i64, seq=i64, site=short,
    rows=st.lists(st.lists(i64, max_size=32), max_size=16), dead_ranks=rank_lists,
)
heartbeats = st.builds(Heartbeat, nonce=i64)
goodbyes = st.builds(Goodbye, text=text)

to_coordinator = st.one_of(hellos, step_reports, gather_reports, heartbeats, goodbyes)
from_coordinator = st.one_of(welcomes, rejects, step_decisions, gather_results, step_faileds,
                             heartbeats, goodbyes)

# -- round trips ---------------------------------------------------------------------------


@given(to_coordinator)
def test_round_trip_to_coordinator(msg) -> None:  # type: ignore[no-untyped-def]
    data = encode(msg)
    assert decode_to_coordinator(data) == msg
    assert decode_to_coordinator(memoryview(data)) == msg
    assert type(decode_to_coordinator(data)) is type(msg)


@given(from_coordinator)
def test_round_trip_from_coordinator(msg) -> None:  # type: ignore[no-untyped-def]
    data = encode(msg)
    assert decode_from_coordinator(data) == msg
    assert decode_from_coordinator(memoryview(data)) == msg
    assert type(decode_from_coordinator(data)) is type(msg)


@pytest.mark.parametrize(
    "msg",
    [
        Hello(dp_size=8, dp_rank=3, config_fingerprint="abc", incarnation="pid-1"),
        StepReport(num_tokens=5, num_tokens_padded=8),
        GatherReport(site="vllm.gpu.dp_utils", values=[1, 2, 3]),
        GatherReport(site="", values=[]),
        Heartbeat(nonce=7),
        Heartbeat(),
        Goodbye(text="bye"),
        Goodbye(),
    ],
)
def test_defaults_survive_to_coordinator(msg) -> None:  # type: ignore[no-untyped-def]
    assert decode_to_coordinator(encode(msg)) == msg


@pytest.mark.parametrize(
    "msg",
    [
        Welcome(epoch=1, next_seq=0, dp_size=8),
        Reject(reason=RejectReason.VERSION, text="no"),
        StepDecision(epoch=1, seq=2, kind=StepKind.DRAFT, num_tokens_across_dp=[4, 4],
                     should_ubatch=False, should_pad=True, cudagraph_mode=1,
                     any_unfinished=True, all_idle=False),
        StepFailed(epoch=1, seq=2, kind=StepKind.STATE, reason=FailReason.TIMEOUT,
                   culprits=[1], text="late", timeout=2.5),
        GatherResult(epoch=1, seq=2, site="s", rows=[[1], [2]]),
        GatherResult(epoch=1, seq=2, site="s", rows=[[1], []], dead_ranks=[1]),
        Heartbeat(nonce=1),
        Goodbye(),
    ],
)
def test_defaults_survive_from_coordinator(msg) -> None:  # type: ignore[no-untyped-def]
    assert decode_from_coordinator(encode(msg)) == msg


def test_report_is_small() -> None:
    report = StepReport(num_tokens=4096, num_tokens_padded=4096, want_ubatch=True,
                        cudagraph_mode=2, has_unfinished=True, dp_rank=255, epoch=3, seq=10**6,
                        kind=StepKind.FORWARD, waited_us=1_000_000)
    assert len(encode(report)) < 40  # with a 1 s wait of the previous round: 5 bytes of it


def test_gather_messages_are_small() -> None:
    """A 7-value column (vLLM's Model Runner V2 sync) and the rows of dp=8 and 256 ranks."""
    column = [4096, 2, 4096, 512, 1, 256, 0]
    report = GatherReport(site="vllm.gpu.dp_utils", values=column, dp_rank=255, epoch=3,
                          seq=10**6)
    assert len(encode(report)) == 51  # 18 of them the site's label, 1 waited_us (-1: none)
    assert len(encode(msgspec.structs.replace(report, waited_us=500))) == 53
    for dp, size in ((8, 164), (256, 4134)):
        result = GatherResult(epoch=3, seq=10**6, site="vllm.gpu.dp_utils", rows=[column] * dp)
        assert len(encode(result)) == size


def test_largest_gather_result_fits_the_frame_limit() -> None:
    for dp in (1, 8, 256, MAX_DP_SIZE):
        n = max_gather_values(dp)
        result = GatherResult(epoch=2**62, seq=2**62, site="\U0001f600" * 256,
                              rows=[[-(2**63)] * n] * dp, dead_ranks=list(range(dp)))
        data = encode(result)
        assert len(data) <= MAX_MESSAGE_BYTES, dp
        assert decode_from_coordinator(data) == result


def test_largest_decision_fits_the_frame_limit() -> None:
    d = StepDecision(epoch=2**62, seq=2**62, kind=StepKind.FORWARD,
                     num_tokens_across_dp=[2**31] * MAX_DP_SIZE, should_ubatch=True,
                     should_pad=True, cudagraph_mode=2, any_unfinished=True, all_idle=False,
                     dead_ranks=list(range(MAX_DP_SIZE)))
    data = encode(d)
    assert len(data) <= MAX_MESSAGE_BYTES
    assert decode_from_coordinator(data) == d


# -- refusals ------------------------------------------------------------------------------

DECODERS = [decode_to_coordinator, decode_from_coordinator]
pk = msgspec.msgpack.encode


@pytest.mark.parametrize("decode", DECODERS)
@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never used in msgpack
        b"hello world",
        b"\x00",
        b"\x90",  # empty array: no tag
        pk({"type": "report", "num_tokens": 1, "num_tokens_padded": 1}),  # a map, not an array
        pk(["nope", 1, 2]),  # unknown tag
        pk([1, 2, 3]),  # tag of the wrong type
        pk("heartbeat"),
        pk(None),
    ],
)
def test_garbage_is_refused(decode, data) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ProtocolError):
        decode(data)


SAMPLES_TO = [
    Hello(dp_size=8, dp_rank=3, config_fingerprint="abc", incarnation="pid-1"),
    StepReport(num_tokens=5, num_tokens_padded=8, want_ubatch=True, seq=3),
    GatherReport(site="vllm.v1.dp_utils", values=[3, -1, 2**40], dp_rank=1, epoch=2, seq=3),
    Heartbeat(nonce=99),
    Goodbye(text="bye"),
]
SAMPLES_FROM = [
    Welcome(epoch=1, next_seq=0, dp_size=8),
    Reject(reason=RejectReason.DP_SIZE, text="no", expected="8", got="4"),
    StepDecision(epoch=1, seq=2, kind=StepKind.FORWARD, num_tokens_across_dp=[4, 4],
                 should_ubatch=False, should_pad=True, cudagraph_mode=1, any_unfinished=True,
                 all_idle=False),
    StepFailed(epoch=1, seq=2, kind=StepKind.FORWARD, reason=FailReason.LOST, culprits=[1],
               text="gone"),
    GatherResult(epoch=1, seq=2, site="vllm.v1.dp_utils", rows=[[3, -1], [2, 2**40]]),
    Heartbeat(nonce=99),
    Goodbye(text="bye"),
]


@pytest.mark.parametrize(
    ("decode", "msg"),
    [(decode_to_coordinator, m) for m in SAMPLES_TO]
    + [(decode_from_coordinator, m) for m in SAMPLES_FROM],
)
def test_truncated_and_padded_frames_are_refused(decode, msg) -> None:  # type: ignore[no-untyped-def]
    data = encode(msg)
    for cut in range(len(data)):
        with pytest.raises(ProtocolError):
            decode(data[:cut])
    with pytest.raises(ProtocolError):
        decode(data + b"\x00")  # trailing bytes


@pytest.mark.parametrize("msg", [m for m in SAMPLES_FROM if type(m) not in (Heartbeat, Goodbye)])
def test_coordinator_messages_are_refused_by_the_coordinator(msg) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ProtocolError):
        decode_to_coordinator(encode(msg))


@pytest.mark.parametrize("msg", [m for m in SAMPLES_TO if type(m) not in (Heartbeat, Goodbye)])
def test_rank_messages_are_refused_by_the_rank(msg) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ProtocolError):
        decode_from_coordinator(encode(msg))


@pytest.mark.parametrize(
    "items",
    [
        ["report", "5", 8],  # string for num_tokens
        ["report", 5, 8.0],  # float for num_tokens_padded
        ["report", 5, 8, 1],  # int for want_ubatch (a bool)
        ["report", 5, 8, False, 0, 1],  # int for has_unfinished
        ["report", 5, 8, False, 0, False, -1, 0, -1, "backward"],  # unknown kind
        ["report", 5, 8, False, 0, False, -1, 0, -1, 0],  # int for kind
        ["report", 5, None],
        ["report", 5],  # a required field missing
        ["report"],
        ["hello", 8, 0, "fp", 1],  # int for incarnation (a str)
        ["hello", 8, 0, "fp", "x" * 257],  # longer than ShortStr
        ["hello", 8, 0, ["fp"], "inc"],
        ["heartbeat", "nonce"],
        ["goodbye", 5],
        ["gather", "site", [0] * (MAX_GATHER_VALUES + 1)],  # more values than the limit
        ["gather", "site", [2**63]],  # beyond int64
        ["gather", "site", [1.0]],  # not an int
        ["gather", "site", [True]],
        ["gather", "site", 5],
        ["gather", "x" * 257, [1]],  # longer than ShortStr
        ["gather", "site"],  # values missing
        ["gather", "site", [1], 0, 0, "3"],
    ],
)
def test_wrong_field_types_are_refused_by_the_coordinator(items) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ProtocolError):
        decode_to_coordinator(pk(items))


@pytest.mark.parametrize(
    "items",
    [
        ["welcome", 1, 0, "8"],
        ["reject", "no-such-reason", "text"],
        ["decision", 1, 2, "forward", [4, "4"], False, True, 1, True, False],
        ["decision", 1, 2, "forward", [4, 4], 0, True, 1, True, False],
        ["decision", 1, 2, "forward", [0] * (MAX_DP_SIZE + 1), False, True, 1, True, False],
        ["failed", 1, 2, "forward", "no-such-reason", [1], "text"],
        ["failed", 1, 2, "forward", "lost", 1, "text"],
        ["gathered", 1, 2, "site", [[1], [0] * (MAX_GATHER_VALUES + 1)]],
        ["gathered", 1, 2, "site", [[1]] * (MAX_DP_SIZE + 1)],
        ["gathered", 1, 2, "site", [[2**63]]],
        ["gathered", 1, 2, "site", [1, 2]],  # a row that is not a list
        ["gathered", 1, 2, "site", [[1]], [MAX_DP_SIZE + 1] * (MAX_DP_SIZE + 1)],
        ["gathered", 1, 2, "site"],
    ],
)
def test_wrong_field_types_are_refused_by_the_rank(items) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ProtocolError):
        decode_from_coordinator(pk(items))


def test_extra_trailing_fields_are_read_by_an_older_peer() -> None:
    # fields are only ever appended: an older peer ignores the ones it does not know
    data = pk(["report", 5, 8, True, 1, False, 2, 3, 4, "draft", False, 7, "a future field"])
    assert decode_to_coordinator(data) == StepReport(
        num_tokens=5, num_tokens_padded=8, want_ubatch=True, cudagraph_mode=1, dp_rank=2,
        epoch=3, seq=4, kind=StepKind.DRAFT, waited_us=7)


def test_a_report_without_its_wait_is_read_and_an_older_coordd_ignores_it() -> None:
    """Issue 30: a report says how long its rank's previous wait blocked (`waited_us`,
    appended): a report of an older client (without it) reads as -1 (nothing to report), and
    an older coordd, whose StepReport ends at want_pause, reads a newer one."""
    old = pk(["report", 5, 8, True, 1, False, 2, 3, 4, "draft", False])
    assert decode_to_coordinator(old).waited_us == -1  # type: ignore[union-attr]
    assert decode_to_coordinator(pk(["gather", "s", [1], 0, 1, 2])).waited_us == -1  # type: ignore[union-attr]

    class OlderReport(msgspec.Struct, array_like=True, tag_field="type", tag="report",
                      frozen=True, kw_only=True):
        num_tokens: int
        num_tokens_padded: int
        want_ubatch: bool = False
        cudagraph_mode: int = 0
        has_unfinished: bool = False
        dp_rank: int = -1
        epoch: int = 0
        seq: int = -1
        kind: str = "forward"
        want_pause: bool = False

    new = encode(StepReport(num_tokens=5, num_tokens_padded=8, seq=4, waited_us=250))
    assert msgspec.msgpack.decode(new, type=OlderReport).seq == 4
    with pytest.raises(ProtocolError):  # more than a day is refused with the frame
        decode_to_coordinator(pk(["report", 5, 8, True, 1, False, 2, 3, 4, "draft", False,
                                  86_400_000_001]))


def _goodbye_of_size(size: int) -> tuple[bytes, Goodbye]:
    # the str header grows at 2**16 characters: search the text length that lands on `size`
    for n in range(size - 32, size):
        msg = Goodbye(text="x" * n)
        data = encode(msg)
        if len(data) == size:
            return data, msg
    raise AssertionError(f"no Goodbye encodes to {size} bytes")


@pytest.mark.parametrize("decode", DECODERS)
def test_frames_over_the_limit_are_refused(decode) -> None:  # type: ignore[no-untyped-def]
    at_limit, msg = _goodbye_of_size(MAX_MESSAGE_BYTES)
    assert decode(at_limit) == msg
    over, _ = _goodbye_of_size(MAX_MESSAGE_BYTES + 1)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(over)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(memoryview(over))
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(b"\x00" * (10 * MAX_MESSAGE_BYTES))


# -- errors <-> StepFailed -----------------------------------------------------------------

ranks = st.integers(0, MAX_DP_SIZE - 1)
seqs = st.integers(-1, 2**40)
kind_names = st.sampled_from([k.value for k in StepKind])
fields = st.sampled_from(["num_tokens", "num_tokens_padded", "cudagraph_mode"])
report_values = st.one_of(st.integers(-(2**40), 2**40), st.booleans())

errors = st.one_of(
    st.builds(StepMismatch, ranks, seqs, kind_names, seqs, kind_names),
    st.builds(ConflictingReport, ranks, seqs),
    st.builds(InvalidReport, ranks, fields, report_values, text),
    st.builds(RankLost, st.lists(ranks, max_size=8), text),
    st.builds(StepTimeout, st.lists(ranks, max_size=8), st.floats(0, 1e6)),
    st.builds(CoordinatorUnavailable, text),
    st.builds(ProtocolError, text, rank=st.one_of(st.none(), ranks)),
)


def _all_subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _all_subclasses(sub)
    return out


ROUND_ERRORS = {StepMismatch, ConflictingReport, InvalidReport, RankLost, StepTimeout,
                CoordinatorUnavailable, ProtocolError}


def test_every_error_class_is_covered() -> None:
    reasons = {r.value for r in FailReason}
    travelling = {c for c in _all_subclasses(CoordError) if c.__dict__.get("reason") in reasons}
    assert travelling == ROUND_ERRORS
    assert Rejected in _all_subclasses(CoordError)
    assert {FailReason(cls.reason) for cls in ROUND_ERRORS} == set(FailReason)


def test_the_registry_is_keyed_by_reason() -> None:
    assert set(WIRE_ERRORS) == set(FailReason)
    for reason, cls in WIRE_ERRORS.items():
        assert cls.reason == reason.value
    assert {c for c in WIRE_ERRORS.values() if c.names_a_rank} == {
        StepMismatch, ConflictingReport, InvalidReport}


def test_rejected_does_not_travel_in_a_step_failed() -> None:
    with pytest.raises(TypeError, match="Rejected"):
        failure_message(Rejected("dp_size", "no"), epoch=1, seq=2, kind=StepKind.FORWARD)


@given(errors, i64, i64, kinds)
def test_failure_round_trip(error: CoordError, epoch: int, seq: int, kind: StepKind) -> None:
    msg = failure_message(error, epoch=epoch, seq=seq, kind=kind)
    assert (msg.epoch, msg.seq, msg.kind) == (epoch, seq, kind)
    assert msg.reason is FailReason(error.reason)
    assert msg.text == str(error)
    wire = decode_from_coordinator(encode(msg))
    assert wire == msg
    back = error_from_failure(wire)
    assert type(back) is type(error)
    assert back == error
    assert vars(back) == vars(error)
    assert str(back) == str(error)
    assert getattr(back, "ranks", ()) == getattr(error, "ranks", ())


@pytest.mark.parametrize(
    ("error", "culprits"),
    [
        (StepMismatch(2, 5, "forward", 6, "forward"), [2]),
        (ConflictingReport(1, 9), [1]),
        (InvalidReport(3, "num_tokens", -1, ">= 0"), [3]),
        (RankLost([3, 1, 3], "disconnected"), [1, 3]),
        (StepTimeout([2, 0], 1.5), [0, 2]),
        (CoordinatorUnavailable("restarted"), []),
        (ProtocolError("spoofed", rank=0), [0]),
        (ProtocolError("garbage"), []),
    ],
)
def test_failure_names_the_culprits(error: CoordError, culprits: list[int]) -> None:
    msg = failure_message(error, epoch=1, seq=2, kind=StepKind.FORWARD)
    assert msg.culprits == culprits
    assert error_from_failure(decode_from_coordinator(encode(msg))) == error


@given(st.sampled_from(RejectReason), text, text, text)
def test_reject_round_trip(reason: RejectReason, detail: str, expected: str, got: str) -> None:
    error = Rejected(reason.value, detail, expected=expected, got=got)
    msg = reject_message(error)
    assert msg.reason is reason
    back = error_from_reject(decode_from_coordinator(encode(msg)))  # type: ignore[arg-type]
    assert type(back) is Rejected
    assert back == error


def test_errors_compare_by_type_and_fields() -> None:
    assert RankLost([1], "x") == RankLost([1], "x")
    assert RankLost([1], "x") != RankLost([1], "y")
    assert RankLost([1]) != StepTimeout([1], 0.0)
    assert ProtocolError("x", rank=1) != ProtocolError("x")
    assert hash(RankLost([1, 2])) == hash(RankLost([2, 1]))


# -- fuzz ----------------------------------------------------------------------------------


def _decodes_or_refuses(decode, data: bytes) -> None:  # type: ignore[no-untyped-def]
    try:
        msg = decode(data)
    except ProtocolError:
        return
    assert isinstance(msg, msgspec.Struct)
    again = encode(msg)  # compare bytes: a decoded float may be NaN
    assert encode(decode(again)) == again


@given(st.binary(max_size=512))
def test_fuzz_bytes_to_coordinator(data: bytes) -> None:
    _decodes_or_refuses(decode_to_coordinator, data)


@given(st.binary(max_size=512))
def test_fuzz_bytes_from_coordinator(data: bytes) -> None:
    _decodes_or_refuses(decode_from_coordinator, data)


msgpack_values = st.recursive(
    st.one_of(st.none(), st.booleans(), i64, st.floats(), st.text(max_size=20),
              st.binary(max_size=20), kind_names, st.sampled_from([r.value for r in FailReason])),
    lambda inner: st.one_of(st.lists(inner, max_size=6),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=20,
)
tags = st.sampled_from(["hello", "welcome", "reject", "report", "decision", "failed",
                        "heartbeat", "goodbye", "gather", "gathered", "other"])


@given(tags, st.lists(msgpack_values, max_size=14))
def test_fuzz_tagged_arrays(tag: str, items: list[object]) -> None:
    data = pk([tag, *items])
    _decodes_or_refuses(decode_to_coordinator, data)
    _decodes_or_refuses(decode_from_coordinator, data)


@given(st.one_of(to_coordinator, from_coordinator), st.data())
def test_fuzz_mutated_frames(msg, data) -> None:  # type: ignore[no-untyped-def]
    frame = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    _decodes_or_refuses(decode_to_coordinator, bytes(frame))
    _decodes_or_refuses(decode_from_coordinator, bytes(frame))


def test_protocol_version_is_sent_by_default() -> None:
    hello = Hello(dp_size=1, dp_rank=0, config_fingerprint="", incarnation="")
    assert decode_to_coordinator(encode(hello)).protocol_version == PROTOCOL_VERSION  # type: ignore[union-attr]


def test_a_failure_without_its_culprit_is_a_protocol_error_not_a_crash() -> None:
    for reason in (FailReason.MISMATCH, FailReason.CONFLICT, FailReason.INVALID):
        msg = StepFailed(epoch=1, seq=2, kind=StepKind.FORWARD, reason=reason, culprits=[],
                         text="damaged")
        assert isinstance(error_from_failure(msg), ProtocolError)


# -- protocol version 2: proper fields ---------------------------------------------------


def test_invalid_report_expected_travels_in_its_own_field() -> None:
    error = InvalidReport(3, "num_tokens_padded", 4, ">= num_tokens (9)")
    msg = failure_message(error, epoch=1, seq=2, kind=StepKind.FORWARD)
    assert (msg.field, msg.value, msg.expected, msg.got_kind) == (
        "num_tokens_padded", "4", ">= num_tokens (9)", "")
    assert error_from_failure(decode_from_coordinator(encode(msg))) == error


def test_a_lost_rank_detail_travels_in_its_own_field_not_in_value() -> None:
    error = RankLost([2], "missed heartbeats for 5.0 s")
    msg = failure_message(error, epoch=1, seq=2, kind=StepKind.FORWARD)
    assert (msg.detail, msg.value, msg.field) == ("missed heartbeats for 5.0 s", "", "")
    assert error_from_failure(decode_from_coordinator(encode(msg))) == error


def test_a_previous_version_hello_gets_a_clear_version_reject() -> None:
    assert PROTOCOL_VERSION == 2
    old = Hello(dp_size=2, dp_rank=0, config_fingerprint="fp", incarnation="i",
                protocol_version=PROTOCOL_VERSION - 1)
    (send,) = Coordinator(2, epoch=1).receive(b"peer", decode_to_coordinator(encode(old)), 0.0)
    reject = decode_from_coordinator(encode(send.message))
    assert isinstance(reject, Reject) and reject.reason is RejectReason.VERSION
    assert (reject.expected, reject.got) == (str(PROTOCOL_VERSION), str(PROTOCOL_VERSION - 1))
    error = error_from_reject(reject)
    assert error.hint == REJECT_HINTS["version"]


# -- who is at fault, what to do next ------------------------------------------------------


def test_every_reject_reason_has_a_hint() -> None:
    assert set(REJECT_HINTS) == {r.value for r in RejectReason}
    assert "--data-parallel-size" in Rejected("dp_size", "x").hint


@pytest.mark.parametrize("cls", sorted(ROUND_ERRORS, key=lambda c: c.__name__))
def test_every_error_says_who_is_at_fault_and_what_to_do(cls: type[CoordError]) -> None:
    assert cls.hint and "At fault" in (cls.__doc__ or "")


@given(errors)
def test_the_hint_is_a_traceback_note_that_survives_the_wire(error: CoordError) -> None:
    assert error.__notes__ == [f"hint: {error.hint}"]
    back = error_from_failure(failure_message(error, epoch=1, seq=2, kind=StepKind.FORWARD))
    assert back.__notes__ == error.__notes__


def test_an_unavailable_coordd_gets_the_hint_of_its_cause() -> None:
    """Before: every CoordinatorUnavailable said "check that coordd is running", even for a
    closed client or a round superseded by connect()."""
    from coordd.client._session import SUPERSEDED
    from coordd.client.sync import _CLOSED

    default = CoordinatorUnavailable("connection to coordd dropped")
    assert default.hint == CoordinatorUnavailable.hint
    assert CoordinatorUnavailable(_CLOSED).hint == UNAVAILABLE_HINTS["closed"]
    assert CoordinatorUnavailable(SUPERSEDED).hint == UNAVAILABLE_HINTS["superseded"]
    given = CoordinatorUnavailable("x", hint=UNAVAILABLE_HINTS["address"])
    assert given.__notes__ == [f"hint: {UNAVAILABLE_HINTS['address']}"]
    assert given == CoordinatorUnavailable("x")  # the hint is advice, not the error's data


def test_rank_lost_says_to_reconnect() -> None:
    error = RankLost([2], "disconnected")
    assert str(error) == "rank(s) [2] lost: disconnected"
    assert "connect()" in error.hint
    error.add_note("a caller's own note")
    assert error == RankLost([2], "disconnected")  # notes are not part of the error's data


def test_the_welcome_says_coordds_step_timeout_and_an_older_one_is_read() -> None:
    """Issue 30: a client's default wait outlives coordd's step timeout, which the Welcome
    carries; a Welcome without it (an older coordd) reads as 0 (not said), and an older
    client ignores the field."""
    from coordd.proto.coordinator import Coordinator

    assert decode_from_coordinator(pk(["welcome", 1, 2, 3])) == Welcome(
        epoch=1, next_seq=2, dp_size=3, step_timeout=0.0)
    c = Coordinator(2, epoch=5, step_timeout=12.5)
    hello = Hello(dp_size=2, dp_rank=0, config_fingerprint="fp", incarnation="i")
    (send,) = c.receive(b"peer0", hello, 0.0)
    assert send.message.step_timeout == 12.5
    assert msgspec.msgpack.decode(encode(send.message))[-1] == 12.5
