"""Values at the boundary (issue 11, C): every report field's range is checked where a report
enters, in the client before sending and in coordd (and the device path) when it arrives, with
an `InvalidReport` naming the rank, the field, the value and the range."""

from __future__ import annotations

import pytest

from coordd.client._session import RankSession
from coordd.proto import InvalidReport, StepKind, StepReport, validate_report
from coordd.proto.coordinator import Coordinator
from coordd.proto.messages import Hello, StepFailed, Welcome
from coordd.proto.policy import MAX_TOKENS

INT32_OVER = 2**31


@pytest.mark.parametrize(
    ("fields", "field", "value", "in_expected"),
    [
        (dict(num_tokens=INT32_OVER, num_tokens_padded=INT32_OVER), "num_tokens", INT32_OVER,
         f"0..{MAX_TOKENS}"),
        (dict(num_tokens=8, num_tokens_padded=INT32_OVER), "num_tokens_padded", INT32_OVER,
         f"num_tokens (8)..{MAX_TOKENS}"),
        (dict(num_tokens=2**63, num_tokens_padded=2**63), "num_tokens", 2**63, f"..{MAX_TOKENS}"),
        (dict(num_tokens=1.5, num_tokens_padded=8), "num_tokens", 1.5, "an int"),
        (dict(num_tokens=1, num_tokens_padded="8"), "num_tokens_padded", "8", "an int"),
        (dict(num_tokens=1, num_tokens_padded=8, cudagraph_mode=True), "cudagraph_mode", True,
         "0, 1 or 2"),
        (dict(num_tokens=1, num_tokens_padded=8, want_ubatch=2), "want_ubatch", 2,
         "True or False"),
        (dict(num_tokens=1, num_tokens_padded=8, has_unfinished=None), "has_unfinished", None,
         "True or False"),
        (dict(num_tokens=1, num_tokens_padded=8, want_pause=1), "want_pause", 1,
         "True or False"),
    ],
)
def test_a_field_out_of_range_names_rank_field_value_and_range(
    fields: dict[str, object], field: str, value: object, in_expected: str
) -> None:
    with pytest.raises(InvalidReport) as caught:
        validate_report(3, StepReport(**fields))  # type: ignore[arg-type]
    error = caught.value
    assert (error.rank, error.field, error.value) == (3, field, value)
    assert in_expected in error.expected


def test_the_largest_int32_counts_are_valid() -> None:
    validate_report(0, StepReport(num_tokens=MAX_TOKENS, num_tokens_padded=MAX_TOKENS))


def _registered(dp_size: int = 2, rank: int = 0) -> RankSession:
    session = RankSession(dp_rank=rank, dp_size=dp_size, address="ipc:///nowhere/x.sock")
    session.hello()
    session.receive(Welcome(epoch=7, next_seq=0, dp_size=dp_size))
    return session


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        (dict(num_tokens=2**63, num_tokens_padded=2**63), "num_tokens"),
        (dict(num_tokens=1.5, num_tokens_padded=8), "num_tokens"),
        (dict(num_tokens=1, num_tokens_padded=8, cudagraph_mode=-(2**64)), "cudagraph_mode"),
        (dict(num_tokens=1, num_tokens_padded=8, want_ubatch=1), "want_ubatch"),
    ],
)
def test_the_client_refuses_what_the_wire_cannot_carry_and_takes_no_seq(
    fields: dict[str, object], field: str
) -> None:
    """Before: msgspec failed to encode (TypeError, OverflowError) or coordd dropped the frame
    as undecodable and every rank waited for the step timeout."""
    session = _registered(rank=1)
    with pytest.raises(InvalidReport) as caught:
        session.report(StepReport(**fields), StepKind.FORWARD)  # type: ignore[arg-type]
    assert (caught.value.rank, caught.value.field) == (1, field)
    assert session.next_seq == 0
    stamped = session.report(StepReport(num_tokens=4, num_tokens_padded=8), StepKind.FORWARD)
    assert stamped.seq == 0


def test_an_int32_overflow_is_sent_for_coordd_to_fail_the_round_for_everyone() -> None:
    """The wire carries 2**31: the client sends it, so that every rank gets coordd's
    InvalidReport naming this one (refused locally, the others would wait in vain)."""
    session = _registered(rank=1)
    big = StepReport(num_tokens=INT32_OVER, num_tokens_padded=INT32_OVER)
    assert session.report(big, StepKind.FORWARD).seq == 0


def test_coordd_fails_the_round_for_every_rank_naming_the_sender() -> None:
    """A foreign client that sends 2**31 tokens: every rank gets the same InvalidReport (before
    the fix the round was decided, and every vLLM rank failed building its int32 tensor)."""
    coordinator = Coordinator(2, epoch=5)
    for rank in (0, 1):
        hello = Hello(dp_size=2, dp_rank=rank, config_fingerprint="", incarnation=f"i{rank}")
        coordinator.receive(f"p{rank}".encode(), hello, 0.0)
    good = StepReport(num_tokens=1, num_tokens_padded=8, dp_rank=0, epoch=5, seq=0)
    bad = StepReport(num_tokens=INT32_OVER, num_tokens_padded=INT32_OVER, dp_rank=1, epoch=5,
                     seq=0)
    coordinator.receive(b"p0", good, 0.1)
    sends = coordinator.receive(b"p1", bad, 0.2)
    failed = [(peers, m) for peers, m in sends if isinstance(m, StepFailed)]
    assert failed, sends
    peers, message = failed[0]
    assert set(peers) == {b"p0", b"p1"}
    assert message.culprits == [1]
    assert message.field == "num_tokens"
    assert str(MAX_TOKENS) in message.expected
