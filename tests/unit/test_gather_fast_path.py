"""A gather round's written-out rank path (issue 37) against the rules it writes out.

- `RankSession.gather` (gather_report, stamp, the waited replace and `sent` in one) against
  those calls as first composed: the same report, seq and asks, or the same error with
  nothing taken, on any site, values, wait and session state;
- `RankSession.take_frame` for a `GatherResult` (`_judged` written out) against the method as
  first written: the same answer or event, the same session after, on random results and
  on each misfit alone.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordd.client._config import ClientConfig
from coordd.client._session import MAX_SITE_CHARS, RankSession
from coordd.proto.errors import CoordError, CoordinatorUnavailable
from coordd.proto.messages import (
    INT64_MAX,
    INT64_MIN,
    MAX_GATHER_VALUES,
    GatherReport,
    GatherResult,
    StepDecision,
    StepKind,
    StepReport,
    Welcome,
    encode,
)

pytestmark = pytest.mark.timeout(120)

DP = 3
RANK = 1
EPOCH = 3


def _session(state: str = "registered") -> RankSession:
    session = RankSession(ClientConfig(address="ipc:///tmp/unused", dp_rank=RANK, dp_size=DP))
    if state == "unregistered":
        return session
    session.hello()
    session.receive(Welcome(epoch=EPOCH, next_seq=10, dp_size=DP))
    if state == "failed":
        session.fail(CoordinatorUnavailable("gone"))
    elif state == "asked":  # seq 10 already asked (a test peer's report): answered twice
        session.sent(session.stamp(GatherReport(site="s", values=[1]), StepKind.GATHER))
    elif state == "registering":
        session.hello()
    return session


def gather_as_first_written(
    session: RankSession, site: str, values: Any, waited_us: int
) -> GatherReport:
    """`RankSession.gather` before the cut, verbatim."""
    stamped = session.stamp(session.gather_report(site, values), StepKind.GATHER)
    if waited_us >= 0:
        stamped = msgspec.structs.replace(stamped, waited_us=waited_us)
    session.next_seq += 1
    session.sent(stamped)
    return stamped


def _state(session: RankSession) -> tuple[object, ...]:
    return (
        session.next_seq,
        dict(session._asked),
        dict(session._asked_again),
        dict(session._answers),
        {k: list(v) for k, v in session._later.items()},
        repr(session.failed),
        session.dropped_answers,
    )


def _outcome(call: Any) -> tuple[str, object]:
    try:
        return ("ok", call())
    except CoordError as error:
        return ("error", repr(error))


value_items = st.one_of(
    st.integers(INT64_MIN, INT64_MAX),
    st.integers(INT64_MIN - 5, INT64_MIN - 1),
    st.integers(INT64_MAX + 1, INT64_MAX + 5),
    st.booleans(),
    st.floats(allow_nan=False),
    st.text(max_size=2),
)
value_lists = st.one_of(
    st.lists(st.integers(-(2**40), 2**40), max_size=10),
    st.lists(value_items, max_size=6),
    st.integers(MAX_GATHER_VALUES - 1, MAX_GATHER_VALUES + 1).map(lambda n: [0] * n),
    st.just(7),  # not a sequence at all
)
sites = st.one_of(
    st.text(max_size=8),
    st.integers(MAX_SITE_CHARS - 1, MAX_SITE_CHARS + 1).map(lambda n: "x" * n),
)
states = st.sampled_from(["registered"] * 4 + ["unregistered", "failed", "asked"])


@settings(max_examples=600, deadline=None)
@given(sites, value_lists, st.integers(-3, 10**7), states)
def test_gather_takes_and_refuses_as_the_calls_it_writes_out(
    site: str, values: Any, waited: int, state: str
) -> None:
    new, old = _session(state), _session(state)
    got = _outcome(lambda: new.gather(site, values, waited))
    want = _outcome(lambda: gather_as_first_written(old, site, values, waited))
    assert got == want
    assert _state(new) == _state(old)
    if got[0] == "ok":
        assert type(got[1]) is GatherReport
        assert msgspec.msgpack.encode(got[1]) == msgspec.msgpack.encode(want[1])


def take_frame_as_first_written(
    self: RankSession, frame: bytes, seq: int
) -> StepDecision | GatherResult | object | None:
    """`RankSession.take_frame` before the cut, verbatim (the module's names qualified)."""
    from coordd.client import _session as m

    if len(frame) > m.MAX_MESSAGE_BYTES:
        return None
    try:
        msg = m._decode_from_coordinator(frame)
    except msgspec.DecodeError:
        return None
    if type(msg) is StepDecision or type(msg) is GatherResult:
        if msg.seq == seq and seq not in self._answers:
            if (
                type(msg) is StepDecision
                and msg.epoch == self.epoch
                and not self.registering
                and not self._asked_again
            ):
                asked = self._asked.get(seq)
                if type(asked) is StepReport:
                    del self._asked[seq]
                    error = m.decision_misfit(msg, asked, self.dp_rank, self.dp_size)
                    return msg if error is None else self._unfit(error)
            judged = self._judged(msg)
            return msg if judged is True else judged
        return self._decided(msg)
    return self.receive(msg)


SENT = [5, -7, 2**40]


def _asking(state: str, asked_kind: str) -> RankSession:
    """A session that has asked seq 10: a gather of `SENT` at site "s" (or a step)."""
    session = _session("registered")
    if asked_kind == "gather":
        session.gather("s", SENT)
    else:
        session.report(StepReport(num_tokens=4, num_tokens_padded=4), StepKind.FORWARD)
    if state == "failed":
        session.fail(CoordinatorUnavailable("gone"))
    elif state == "asked_again":
        session.sent(session._asked[10])
    elif state == "registering":
        session.hello()
    elif state == "answered":  # an answer for seq 10 kept already
        session._answers[10] = GatherResult(epoch=EPOCH, seq=10, site="s", rows=[])
    return session


def _good_rows() -> list[list[int]]:
    return [[1, 2, 3], list(SENT), [0, 0, 0]]


def _compare(msg: GatherResult | StepDecision, wait_seq: int, state: str, asked: str) -> None:
    new, old = _asking(state, asked), _asking(state, asked)
    frame = encode(msg)
    got = new.take_frame(frame, wait_seq)
    want = take_frame_as_first_written(old, frame, wait_seq)
    assert repr(got) == repr(want)
    assert _state(new) == _state(old)


rows_strategy = st.one_of(
    st.just(_good_rows()),
    st.lists(st.lists(st.integers(-3, 3), max_size=4), min_size=0, max_size=5),
    st.builds(
        lambda own, other: [other, own, other],
        st.sampled_from([list(SENT), SENT[:2], [*SENT, 1], []]),
        st.sampled_from([[1, 2, 3], [], [1], [1, 2, 3, 4]]),
    ),
)


@settings(max_examples=800, deadline=None)
@given(
    st.sampled_from(["s", "s", "s", "t", ""]),
    rows_strategy,
    st.sampled_from([[], [], [], [0], [2], [1], [-1], [3], [0, 2]]),
    st.sampled_from([0, 0, 0, 1, -1]),
    st.sampled_from([10, 10, 10, 9, 11, 12]),
    st.sampled_from([10, 10, 10, 9, 11]),
    st.sampled_from(["registered"] * 5 + ["failed", "asked_again", "registering", "answered"]),
    st.sampled_from(["gather"] * 4 + ["step"]),
)
def test_take_frame_judges_a_gather_as_first_written(
    site: str,
    rows: list[list[int]],
    dead: list[int],
    epoch_off: int,
    seq: int,
    wait_seq: int,
    state: str,
    asked: str,
) -> None:
    result = GatherResult(epoch=EPOCH + epoch_off, seq=seq, site=site, rows=rows, dead_ranks=dead)
    _compare(result, wait_seq, state, asked)


MISFITS = {
    "fits": {},
    "site": {"site": "t"},
    "rows": {"rows": _good_rows()[:2]},
    "dead out of range": {"dead_ranks": [3], "rows": [[1, 2, 3], list(SENT), []]},
    "dead is this rank": {"dead_ranks": [RANK], "rows": [[1, 2, 3], [], [0, 0, 0]]},
    "own row": {"rows": [[1, 2, 3], SENT[:2], [0, 0, 0]]},
    "other row": {"rows": [[1, 2], list(SENT), [0, 0, 0]]},
    "dead row not empty": {"dead_ranks": [2]},
    "dead row empty": {"dead_ranks": [2], "rows": [[1, 2, 3], list(SENT), []]},
    "epoch": {"epoch": EPOCH + 1},
    "seq ahead": {"seq": 11},
}


@pytest.mark.parametrize("name", list(MISFITS))
@pytest.mark.parametrize("asked", ["gather", "step"])
def test_each_misfit_alone_gets_the_same_answer(name: str, asked: str) -> None:
    fields: dict[str, Any] = {"epoch": EPOCH, "seq": 10, "site": "s", "rows": _good_rows()}
    fields.update(MISFITS[name])
    result = GatherResult(**fields)
    _compare(result, fields["seq"], "registered", asked)
    if asked == "gather":
        got = _asking("registered", "gather").take_frame(encode(result), fields["seq"])
        if name in ("fits", "dead row empty"):
            assert got == result  # the rows come back, not kept
        elif name == "epoch":
            assert got is None  # an older (here: other) epoch's answer is dropped
        else:
            assert type(got).__name__ == "GroupFailed"  # the misfit fails the group
