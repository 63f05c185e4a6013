"""The round's hot path, cut for issue 37, against the rules as first written.

- `decision_misfit`, rewritten without its calls (the highest mode a constant, the seq read
  only for an error), against a verbatim copy of the rule before the cut, on random
  decisions that break every field it checks, one or several at a time;
- `RankSession.report`'s written-out `check_carriable` common case: the same `InvalidReport`
  as the rule, nothing taken, on reports with any values;
- the queued-frame look (`edge.queued`, zmq_poll with no wait) against ZMQ_EVENTS itself.
"""

from __future__ import annotations

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from coordd.client._config import ClientConfig
from coordd.client._edge import queued
from coordd.client._session import RankSession
from coordd.proto.errors import InvalidAnswer, InvalidReport
from coordd.proto.messages import StepDecision, StepKind, StepReport, Welcome
from coordd.proto.policy import (
    CUDAGRAPH_MODES,
    MAX_TOKENS,
    check_carriable,
    decide,
    decision_misfit,
)
from tests.unit.test_rules_once import any_reports

pytestmark = pytest.mark.timeout(120)


def rule_as_first_written(
    decision: StepDecision,
    sent: StepReport,
    dp_rank: int,
    dp_size: int,
    kind: StepKind | None = None,
) -> InvalidAnswer | None:
    """`decision_misfit` as it was before issue 37's cut (main at 8cee9ea), verbatim."""
    seq = decision.seq
    asked = sent.kind if kind is None else kind
    if decision.kind is not asked:
        return InvalidAnswer(seq, "kind", decision.kind.value, asked.value)
    across = decision.num_tokens_across_dp
    if len(across) != dp_size:
        return InvalidAnswer(seq, "num_tokens_across_dp", across, f"{dp_size} values, one per rank")
    mode = decision.cudagraph_mode
    if not 0 <= mode <= max(CUDAGRAPH_MODES) or mode > sent.cudagraph_mode:
        return InvalidAnswer(
            seq,
            "cudagraph_mode",
            mode,
            f"0..{min(sent.cudagraph_mode, max(CUDAGRAPH_MODES))} (the min over ranks; this "
            f"rank reported {sent.cudagraph_mode})",
        )
    if decision.should_ubatch and not sent.want_ubatch:
        return InvalidAnswer(seq, "should_ubatch", True, "False: this rank did not want it")
    if decision.should_pad != (mode != 0 or decision.should_ubatch):
        return InvalidAnswer(
            seq, "should_pad", decision.should_pad, "cudagraph_mode != 0 or should_ubatch"
        )
    own = across[dp_rank]
    padded = sent.num_tokens_padded
    if decision.should_pad:
        if not padded <= own <= MAX_TOKENS or across.count(own) != dp_size:
            return InvalidAnswer(
                seq,
                "num_tokens_across_dp",
                across,
                f"one count for every rank (padded), in {padded}..{MAX_TOKENS} (this rank's "
                f"num_tokens_padded is {padded})",
            )
    elif own != padded:
        return InvalidAnswer(
            seq, f"num_tokens_across_dp[{dp_rank}]", own, f"{padded} (what this rank reported)"
        )
    elif min(across) < 0 or max(across) > MAX_TOKENS:
        return InvalidAnswer(seq, "num_tokens_across_dp", across, f"counts in 0..{MAX_TOKENS}")
    if sent.has_unfinished and not decision.any_unfinished:
        return InvalidAnswer(
            seq, "any_unfinished", False, "True: this rank has unfinished requests"
        )
    if decision.all_idle and sent.num_tokens != 0:
        return InvalidAnswer(
            seq, "all_idle", True, f"False: this rank runs {sent.num_tokens} tokens"
        )
    if decision.should_pause and not sent.want_pause:
        return InvalidAnswer(seq, "should_pause", True, "False: this rank does not want to pause")
    if (sent.want_pause or decision.should_pause) and not decision.any_pause:
        return InvalidAnswer(seq, "any_pause", False, "True: this rank wants to pause")
    dead = decision.dead_ranks
    if dead:
        if min(dead) < 0 or max(dead) >= dp_size:
            return InvalidAnswer(seq, "dead_ranks", dead, f"ranks in 0..{dp_size - 1}")
        if dp_rank in dead:
            return InvalidAnswer(seq, "dead_ranks", dead, f"not this rank ({dp_rank}): it reported")
    return None


def verdict(error: InvalidAnswer | None) -> tuple[object, ...] | None:
    if error is None:
        return None
    return (type(error), error.seq, error.field, repr(error.value), error.expected, str(error))


COUNT = st.sampled_from([-1, 0, 1, 3, 4, 8, 16, MAX_TOKENS, MAX_TOKENS + 1])


@st.composite
def reports(draw: st.DrawFn) -> StepReport:
    tokens = draw(st.sampled_from([0, 1, 3, 8, 100]))
    return StepReport(
        num_tokens=tokens,
        num_tokens_padded=tokens + draw(st.sampled_from([0, 1, 5])),
        want_ubatch=draw(st.booleans()),
        cudagraph_mode=draw(st.sampled_from([0, 1, 2, 2, 7])),
        has_unfinished=draw(st.booleans()),
        want_pause=draw(st.booleans()),
        kind=draw(st.sampled_from([StepKind.FORWARD, StepKind.DRAFT, StepKind.STATE])),
    )


@st.composite
def rounds(draw: st.DrawFn) -> tuple[StepDecision, StepReport, int, int, StepKind | None]:
    """A round at dp 1..8 as coordd decides it, then up to four of its fields redrawn."""
    dp = draw(st.integers(1, 8))
    rank = draw(st.integers(0, dp - 1))
    all_reports = [draw(reports()) for _ in range(dp)]
    sent = all_reports[rank]
    dead = draw(st.lists(st.integers(0, dp - 1), max_size=dp - 1, unique=True))
    honest = decide(
        [None if r in dead and r != rank else rep for r, rep in enumerate(all_reports)],
        epoch=3,
        seq=draw(st.integers(0, 99)),
        kind=sent.kind,
    )
    fields: dict[str, st.SearchStrategy[object]] = {
        "kind": st.sampled_from(list(StepKind)),
        "num_tokens_across_dp": st.one_of(
            st.lists(COUNT, min_size=0, max_size=dp + 1),
            st.just([max(honest.num_tokens_across_dp, default=0)] * dp),
        ),
        "cudagraph_mode": st.integers(-1, 3),
        "should_ubatch": st.booleans(),
        "should_pad": st.booleans(),
        "any_unfinished": st.booleans(),
        "all_idle": st.booleans(),
        "should_pause": st.booleans(),
        "any_pause": st.booleans(),
        "dead_ranks": st.lists(st.integers(-1, dp), max_size=3),
    }
    names = draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True))
    decision = msgspec.structs.replace(honest, **{n: draw(fields[n]) for n in names})
    kind = draw(st.sampled_from([None, None, None, StepKind.FORWARD, StepKind.DRAFT]))
    return decision, sent, rank, dp, kind


@settings(max_examples=3000, deadline=None)
@given(rounds())
def test_the_cut_misfit_rule_gives_the_first_rules_verdict(case: tuple) -> None:
    decision, sent, rank, dp, kind = case
    assert verdict(decision_misfit(decision, sent, rank, dp, kind)) == verdict(
        rule_as_first_written(decision, sent, rank, dp, kind)
    )


REPORT = StepReport(num_tokens=3, num_tokens_padded=4, cudagraph_mode=1, has_unfinished=True)
HONEST = decide([REPORT, REPORT], epoch=3, seq=10)
#: One break of each field the rule checks, and the field it names.
BREAKS = [
    ({"kind": StepKind.DRAFT}, "kind"),
    ({"num_tokens_across_dp": [4]}, "num_tokens_across_dp"),
    ({"cudagraph_mode": 2}, "cudagraph_mode"),
    ({"cudagraph_mode": -1}, "cudagraph_mode"),
    ({"should_ubatch": True}, "should_ubatch"),
    ({"should_pad": False}, "should_pad"),
    ({"num_tokens_across_dp": [4, 5]}, "num_tokens_across_dp"),
    ({"num_tokens_across_dp": [3, 3]}, "num_tokens_across_dp"),
    ({"cudagraph_mode": 0, "should_pad": False, "num_tokens_across_dp": [5, 4]}, "[0]"),
    ({"cudagraph_mode": 0, "should_pad": False, "num_tokens_across_dp": [4, -1]}, "dp"),
    ({"cudagraph_mode": 0, "should_pad": False, "num_tokens_across_dp": [4, 2**31]}, "dp"),
    ({"any_unfinished": False}, "any_unfinished"),
    ({"all_idle": True}, "all_idle"),
    ({"should_pause": True, "any_pause": True}, "should_pause"),
    ({"dead_ranks": [2]}, "dead_ranks"),
    ({"dead_ranks": [0]}, "dead_ranks"),
]


@pytest.mark.parametrize(("changes", "field"), BREAKS)
def test_each_field_broken_alone_gets_the_same_error(changes: dict, field: str) -> None:
    decision = msgspec.structs.replace(HONEST, **changes)
    error = decision_misfit(decision, REPORT, 0, 2)
    assert error is not None and error.field.endswith(field)
    assert verdict(error) == verdict(rule_as_first_written(decision, REPORT, 0, 2))


def test_any_pause_is_checked_when_this_rank_wants_to_pause() -> None:
    sent = msgspec.structs.replace(REPORT, want_pause=True)
    decision = decide([sent, REPORT], epoch=3, seq=10)
    assert decision_misfit(decision, sent, 0, 2) is None
    broken = msgspec.structs.replace(decision, any_pause=False)
    error = decision_misfit(broken, sent, 0, 2)
    assert error is not None and error.field == "any_pause"
    assert verdict(error) == verdict(rule_as_first_written(broken, sent, 0, 2))


def _registered() -> RankSession:
    session = RankSession(ClientConfig(address="ipc:///tmp/unused", dp_rank=1, dp_size=2))
    session.hello()
    session.receive(Welcome(epoch=3, next_seq=10, dp_size=2))
    return session


@settings(max_examples=1000, deadline=None)
@given(any_reports())
def test_report_refuses_exactly_what_the_carriable_rule_refuses(report: StepReport) -> None:
    """The session's written-out common case: the rule's error, and no seq taken; else sent."""
    try:
        check_carriable(1, report)
        expected = None
    except InvalidReport as error:
        expected = repr(error)
    session = _registered()
    try:
        stamped = session.report(report, StepKind.FORWARD)
    except InvalidReport as error:
        assert repr(error) == expected
        assert session.next_seq == 10 and not session._asked
    else:
        assert expected is None
        assert stamped.seq == 10 and session.next_seq == 11 and session._asked[10] is stamped
        assert stamped.num_tokens is report.num_tokens


def test_the_queued_look_reads_what_zmq_events_says() -> None:
    context = zmq.Context()
    try:
        server = context.socket(zmq.PAIR)
        server.bind("inproc://look")
        client = context.socket(zmq.PAIR)
        client.connect("inproc://look")
        assert not queued(client)
        assert not int(client.getsockopt(zmq.EVENTS)) & zmq.POLLIN
        server.send(b"one")
        assert client.poll(5000)  # arrived
        assert queued(client)
        assert int(client.getsockopt(zmq.EVENTS)) & zmq.POLLIN
        assert client.recv() == b"one"
        assert not queued(client)
        client.close(linger=0)
        server.close(linger=0)
    finally:
        context.term()
