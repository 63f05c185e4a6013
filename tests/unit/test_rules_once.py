"""Each rule the client applies lives in one place; where a faster copy stays beside it, a
property pins the copy to the rule:

- what the wire can carry: `check_carriable`'s one-expression fast path against its field
  loop (`_check_carriable_fields`), on reports with any values, wrong types included;
- a gather's rows: `gather_misfit`'s one-length shortcut against the per-row rule;
- a decision's fit: every way a shell feeds an answer to the session (`receive`,
  `receive_frame`, the blocking client's `take_frame`) gives `decision_misfit`'s verdict.
"""

from __future__ import annotations

import enum

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordd.client._config import ClientConfig
from coordd.client._session import GroupFailed, RankSession, Resolved
from coordd.proto.errors import InvalidReport
from coordd.proto.messages import (
    INT64_MAX,
    INT64_MIN,
    GatherReport,
    GatherResult,
    StepDecision,
    StepKind,
    StepReport,
    Welcome,
    encode,
)
from coordd.proto.policy import (
    _check_carriable_fields,
    check_carriable,
    decide,
    decision_misfit,
    gather_misfit,
)


class Mode(enum.IntEnum):
    FULL = 2


#: Values a user's report may hold: ints in and past int64, bools, floats, an IntEnum, None.
EDGES = [INT64_MIN - 1, INT64_MIN, INT64_MAX, INT64_MAX + 1, 2**31, 0, 1.0, 0.5, True, None]
ANY_VALUE = st.one_of(
    st.sampled_from([*EDGES, Mode.FULL]),
    st.integers(INT64_MIN - 2, INT64_MAX + 2),
    st.floats(allow_nan=False),
)
A_FLAG = st.sampled_from([True, False, 0, 1, None])
REPORT = StepReport(num_tokens=3, num_tokens_padded=4, has_unfinished=True)
CONFIG = ClientConfig(address="ipc:///tmp/unused", dp_rank=1, dp_size=2)


def _verdict(check: object, report: StepReport) -> str | None:
    try:
        check(1, report)  # type: ignore[operator]
    except InvalidReport as error:
        return repr(error)
    return None


COUNTS = ("num_tokens", "num_tokens_padded", "cudagraph_mode")
FLAGS = ("want_ubatch", "has_unfinished", "want_pause")


@st.composite
def any_reports(draw: st.DrawFn) -> StepReport:
    """A report that fits the wire, with up to three of its fields redrawn from anything."""
    report = StepReport(
        num_tokens=draw(st.integers(0, 2**31)),
        num_tokens_padded=draw(st.integers(0, 2**31)),
        cudagraph_mode=draw(st.integers(0, 2)),
        want_ubatch=draw(st.booleans()),
        has_unfinished=draw(st.booleans()),
        want_pause=draw(st.booleans()),
    )
    change = st.one_of(
        st.tuples(st.sampled_from(COUNTS), ANY_VALUE), st.tuples(st.sampled_from(FLAGS), A_FLAG)
    )
    return msgspec.structs.replace(report, **dict(draw(st.lists(change, max_size=3))))


@given(any_reports())
def test_the_carriable_fast_path_agrees_with_the_field_rule(report: StepReport) -> None:
    assert _verdict(check_carriable, report) == _verdict(_check_carriable_fields, report)


@pytest.mark.parametrize(
    ("name", "value"),
    [(n, v) for n in COUNTS for v in [*EDGES, Mode.FULL]]
    + [(n, v) for n in FLAGS for v in [True, False, 0, 1, None]],
)
def test_each_field_at_each_edge_gets_the_rules_verdict(name: str, value: object) -> None:
    report = msgspec.structs.replace(REPORT, **{name: value})
    assert _verdict(check_carriable, report) == _verdict(_check_carriable_fields, report)


@st.composite
def gathers(draw: st.DrawFn) -> tuple[GatherResult, GatherReport, int]:
    dp = draw(st.integers(1, 6))
    rank = draw(st.integers(0, dp - 1))
    values = draw(st.lists(st.integers(-3, 3), max_size=3))
    rows = [draw(st.lists(st.integers(-3, 3), max_size=4)) for _ in range(dp)]
    rows[rank] = list(values)
    sent = GatherReport(site="s", values=values)
    return GatherResult(epoch=1, seq=5, site="s", rows=rows), sent, dp


@given(gathers())
def test_the_gather_shortcut_agrees_with_the_row_rule(case: tuple) -> None:
    """No rank dead: the rows fit exactly when every row is as long as this rank's."""
    result, sent, dp = case
    rank = next(r for r, row in enumerate(result.rows) if row == sent.values)
    fits = all(len(row) == len(sent.values) for row in result.rows)
    assert (gather_misfit(result, sent, rank, dp) is None) == fits


@st.composite
def decisions(draw: st.DrawFn) -> StepDecision:
    """The decision for REPORT at seq 10, with any of its fields redrawn."""
    honest = decide([REPORT, REPORT], epoch=3, seq=10, kind=StepKind.FORWARD)
    changes: dict[str, object] = {}
    if draw(st.booleans()):
        changes["num_tokens_across_dp"] = draw(
            st.lists(st.sampled_from([-1, 0, 3, 4, 5, 2**31]), min_size=1, max_size=3)
        )
    for name in ("should_ubatch", "should_pad", "any_unfinished", "all_idle"):
        if draw(st.booleans()):
            changes[name] = draw(st.booleans())
    for name in ("should_pause", "any_pause"):
        if draw(st.booleans()):
            changes[name] = draw(st.booleans())
    if draw(st.booleans()):
        changes["cudagraph_mode"] = draw(st.integers(-1, 3))
    if draw(st.booleans()):
        changes["kind"] = draw(st.sampled_from([StepKind.FORWARD, StepKind.DRAFT]))
    if draw(st.booleans()):
        changes["dead_ranks"] = draw(st.lists(st.integers(-1, 2), max_size=2))
    return msgspec.structs.replace(honest, **changes)


def _session() -> RankSession:
    session = RankSession(CONFIG)
    session.hello()
    session.receive(Welcome(epoch=3, next_seq=10, dp_size=2))
    assert session.report(REPORT, StepKind.FORWARD).seq == 10
    return session


@given(decisions())
def test_every_route_gives_the_rules_verdict_on_a_decision(decision: StepDecision) -> None:
    sent = _session()._asked[10]  # the report as stamped and sent
    assert isinstance(sent, StepReport)
    error = decision_misfit(decision, sent, 1, 2)
    routes = {
        "receive": lambda s: s.receive(decision),
        "frame": lambda s: s.receive_frame(encode(decision)),
        "take": lambda s: s.take_frame(encode(decision), 10),
    }
    for route, feed in routes.items():
        session = _session()
        event = feed(session)
        if error is None:
            assert event in (decision, Resolved(10, decision)), route
            assert session.failed is None, route
        else:
            assert isinstance(event, GroupFailed) and event.error == error, route
