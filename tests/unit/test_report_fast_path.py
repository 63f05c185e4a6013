"""The hot path's shortcuts against the rules they write out (issue 37).

`Coordinator.receive` takes a member's ordinary report (and gather part) without `_on_part`,
`validate_report`
checks the common case in one expression before its field-by-field rule, and `Observer.sent`
reads the machine's counters instead of a snapshot. Each is pinned here to the general rule
over random inputs: the same answers, the same group, the same errors, the same metrics.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordd.ops.observer import WAIT_BUCKETS, DurationHistogram, Observer
from coordd.proto.coordinator import Coordinator, OnRankLoss, Send
from coordd.proto.errors import InvalidReport
from coordd.proto.messages import (
    GatherReport,
    Goodbye,
    Hello,
    StepKind,
    StepReport,
    ToCoordinator,
    max_gather_values,
)
from coordd.proto.policy import _validate_fields, validate_report

EPOCH = 3
KINDS = [StepKind.FORWARD, StepKind.DRAFT, StepKind.STATE, StepKind.GATHER]


class Slow(Coordinator):
    """Every report through `_on_part`: the rule the fast path writes out."""

    def receive(self, peer: bytes, message: ToCoordinator, now: float) -> Sequence[Send]:
        if type(message) is StepReport or type(message) is GatherReport:
            return self._on_part(peer, message, now)
        return super().receive(peer, message, now)


def _peer(rank: int) -> bytes:
    return f"p{rank}".encode()


# One step of a script: (what, rank, seq offset, epoch offset, kind, claimed rank offset,
# tokens, padded - tokens, mode, waited).
steps = st.tuples(
    st.sampled_from(
        ["report"] * 8
        + ["round"] * 3
        + ["gather"] * 6
        + ["gathers"] * 2
        + ["goodbye"] * 2
        + ["hello", "lost", "deadline"]
    ),
    st.integers(0, 3),
    st.sampled_from([0] * 8 + [-1, 1]),
    st.sampled_from([0] * 10 + [1]),
    st.sampled_from(KINDS[:1] * 10 + KINDS),
    st.sampled_from([0] * 10 + [1]),
    st.sampled_from([1] * 12 + [0, 5, 2**31 - 1, 2**31, -1]),
    st.sampled_from([0] * 12 + [3, -1, 2**31]),
    st.sampled_from([0, 1, 2] * 4 + [3]),
    st.sampled_from([-1, 0, 7, 120, 5_000_000]),
)


def _message(c: Coordinator, step: tuple[Any, ...], dp: int) -> tuple[bytes, Any] | None:
    what, rank, dseq, depoch, kind, dclaim, tokens, extra, mode, waited = step
    rank %= dp
    seq, epoch = c.seq + dseq, c.epoch + depoch
    if what == "report":
        report = StepReport(
            num_tokens=tokens,
            num_tokens_padded=tokens + extra,
            cudagraph_mode=mode,
            want_ubatch=bool(tokens % 2),
            has_unfinished=rank == 1,
            dp_rank=(rank + dclaim) % dp,
            epoch=epoch,
            seq=seq,
            kind=kind,
            waited_us=waited,
        )
        return _peer(rank), report
    if what == "round":  # every rank's proper report, one after another
        return None
    if what == "gather":  # mode picks the site; tokens the count (2**31: past one frame)
        count = max_gather_values(dp) + 1 if tokens == 2**31 else tokens % 4
        return _peer(rank), GatherReport(
            site="s" if mode == 0 else f"t{mode}",
            values=[rank] * count,
            dp_rank=(rank + dclaim) % dp,
            epoch=epoch,
            seq=seq,
            waited_us=waited,
        )
    if what == "hello":
        hello = Hello(dp_size=dp, dp_rank=rank, incarnation="i", config_fingerprint="fp")
        return _peer(rank), hello
    if what == "goodbye":
        return _peer(rank), Goodbye()
    return None


def _step(what: str, rank: int, kind: StepKind = StepKind.FORWARD, **kw: int) -> tuple[Any, ...]:
    return (
        what,
        rank,
        kw.get("dseq", 0),
        kw.get("depoch", 0),
        kind,
        kw.get("dclaim", 0),
        kw.get("tokens", 1),
        kw.get("extra", 0),
        kw.get("mode", 0),
        kw.get("waited", 5),
    )


G = StepKind.GATHER


@pytest.mark.parametrize(
    ("dp", "script"),
    [
        # a rank left between rounds: the next report fails the group (RankLost)
        (2, [_step("round", 0), _step("goodbye", 0), _step("report", 1)]),
        (3, [_step("round", 0), _step("goodbye", 2), _step("report", 0), _step("report", 1)]),
        # a StepReport of kind gather into an open gather round: a misfit, told to it alone
        (2, [_step("gather", 0), _step("report", 1, G)]),
        (2, [_step("report", 0, G)]),
        # gather parts: another site, another count, past one frame, a second part (the
        # same again, another), a step report into a gather round and back, a departed rank
        (3, [_step("gather", 0), _step("gather", 1, mode=1), _step("gather", 2)]),
        (2, [_step("gather", 0), _step("gather", 1, tokens=2)]),
        (2, [_step("gather", 0, tokens=2**31)]),
        (2, [_step("gather", 0), _step("gather", 1, tokens=2**31)]),
        (3, [_step("gather", 0), _step("gather", 0), _step("gather", 0, tokens=2)]),
        (2, [_step("gather", 0), _step("report", 1)]),
        (2, [_step("report", 0), _step("gather", 1)]),
        (2, [_step("gathers", 0), _step("goodbye", 0), _step("gather", 1)]),
        (2, [_step("gather", 0, dclaim=1), _step("gather", 1, dseq=1)]),
        (2, [_step("gathers", 0), _step("gather", 1, dseq=-1), _step("gather", 0, depoch=1)]),
        # a second report for the round: the same again is ignored, another one conflicts
        (3, [_step("report", 0), _step("report", 0), _step("report", 0, tokens=2)]),
        # another kind, another seq, another epoch, another rank's id, an invalid value
        (2, [_step("report", 0), _step("report", 1, StepKind.DRAFT)]),
        (2, [_step("report", 0), _step("report", 1, dseq=1)]),
        (2, [_step("round", 0), _step("report", 1, dseq=-1), _step("report", 0, depoch=1)]),
        (2, [_step("report", 0, dclaim=1), _step("report", 1, mode=3)]),
        (2, [_step("report", 0, tokens=-1), _step("hello", 0), _step("report", 0)]),
    ],
)
def test_the_fast_path_answers_as_on_part_does_in_each_way_off_it(
    dp: int, script: list[tuple[Any, ...]]
) -> None:
    for mode in OnRankLoss:
        _compare(dp, mode, script)


@given(
    dp=st.integers(1, 4),
    mode=st.sampled_from(list(OnRankLoss)),
    script=st.lists(steps, max_size=60),
)
def test_the_fast_path_answers_as_on_part_does(
    dp: int, mode: OnRankLoss, script: list[tuple[Any, ...]]
) -> None:
    """Two groups fed the same script, one with every report through `_on_part`: the same
    sends (or the same exception) and the same snapshot after every step."""
    _compare(dp, mode, script)


def _compare(dp: int, mode: OnRankLoss, script: list[tuple[Any, ...]]) -> None:
    fast = Coordinator(dp, epoch=EPOCH, step_timeout=5.0, on_rank_loss=mode)
    slow = Slow(dp, epoch=EPOCH, step_timeout=5.0, on_rank_loss=mode)
    for c in (fast, slow):
        for r in range(dp):
            c.receive(
                _peer(r),
                Hello(dp_size=dp, dp_rank=r, incarnation="i", config_fingerprint="fp"),
                0.0,
            )
    for i, step in enumerate(script):
        now = 1.0 + i
        outcomes = []
        for c in (fast, slow):
            try:
                if step[0] == "lost":
                    got: Any = list(c.peer_lost(_peer(step[1] % dp), now))
                elif step[0] == "deadline":
                    got = list(c.on_deadline(now + 10.0))
                elif step[0] == "gathers":  # every rank's proper gather part, in turn
                    got = []
                    for r in range(dp):
                        part = GatherReport(
                            site="s", values=[r, 1], dp_rank=r, epoch=c.epoch, seq=c.seq
                        )
                        got += c.receive(_peer(r), part, now)
                elif step[0] == "round":
                    got = []
                    for r in range(dp):
                        got += c.receive(
                            _peer(r),
                            StepReport(
                                num_tokens=r,
                                num_tokens_padded=r,
                                dp_rank=r,
                                epoch=c.epoch,
                                seq=c.seq,
                                kind=step[4],
                            ),
                            now,
                        )
                else:
                    peer, message = _message(c, step, dp)  # type: ignore[misc]
                    got = list(c.receive(peer, message, now))
            except Exception as exc:  # the two must raise alike
                got = (type(exc), str(exc))
            outcomes.append(got)
        assert outcomes[0] == outcomes[1], step
        assert fast.snapshot() == slow.snapshot(), step


class _Mode(enum.IntEnum):
    FULL = 2


BAD = [0, 1, 2, 3, -1, 2**31 - 1, 2**31, 2**63, True, False, 1.0, None, "1", _Mode.FULL]
FIELDS = [
    "num_tokens",
    "num_tokens_padded",
    "cudagraph_mode",
    "want_ubatch",
    "has_unfinished",
    "want_pause",
    "kind",
]


@given(
    tokens=st.integers(0, 2**31 - 1),
    extra=st.integers(0, 2**31),
    mode=st.integers(-1, 3),
    flags=st.tuples(st.booleans(), st.booleans(), st.booleans()),
    kind=st.sampled_from(KINDS),
    changes=st.lists(
        st.tuples(st.sampled_from(FIELDS), st.one_of(st.sampled_from(BAD), st.integers())),
        max_size=2,
    ),
)
def test_validate_report_in_one_expression_is_the_rule_field_by_field(
    tokens: int,
    extra: int,
    mode: int,
    flags: tuple[bool, bool, bool],
    kind: StepKind,
    changes: list[tuple[str, Any]],
) -> None:
    """The common case's expression accepts only what the field-by-field rule accepts, and
    refuses with the same error (field, value, range) as it: near-valid reports, with a
    field or two set to anything."""
    fields: dict[str, Any] = dict(
        num_tokens=tokens,
        num_tokens_padded=tokens + extra,
        cudagraph_mode=mode,
        want_ubatch=flags[0],
        has_unfinished=flags[1],
        want_pause=flags[2],
        kind=kind,
    )
    for name, value in changes:
        fields[name] = KINDS[value % 4] if name == "kind" and type(value) is int else value
    report = StepReport(**fields)

    def outcome(check: Any) -> Any:
        try:
            check(4, report)
        except InvalidReport as exc:
            return (exc.rank, str(exc))
        except TypeError as exc:  # a value no rule compares (None against an int)
            return type(exc)
        return None

    assert outcome(validate_report) == outcome(_validate_fields)


def _round(c: Coordinator, dp: int, seq: int, waited: int, now: float) -> list[Send]:
    sends: list[Send] = []
    kind = KINDS[seq % 5 % 3]  # the wait's site changes from round to round, or stays
    for r in range(dp):
        report = StepReport(
            num_tokens=r + seq,
            num_tokens_padded=r + seq + 1,
            dp_rank=r,
            epoch=c.epoch,
            seq=seq,
            kind=kind,
            waited_us=waited * (r + 1),
        )
        sends += c.receive(_peer(r), report, now)
    return sends


@pytest.mark.parametrize("dp", [1, 3, 8])
def test_the_observers_metrics_are_those_a_snapshot_view_counts(dp: int) -> None:
    """An observer that reads the machine's counters (the server's) and one that reads
    snapshots (any other view) count the same rounds, waits, stragglers and members, through
    joins, a loss, a failure and a re-formed group."""
    c = Coordinator(dp, epoch=EPOCH, step_timeout=5.0, on_rank_loss=OnRankLoss.NEUTRALIZE)
    fast = Observer(c.snapshot, name="g", wall=lambda: 0.0)
    slow = Observer(lambda: c.snapshot(), name="g", wall=lambda: 0.0)
    assert fast._machine is c and slow._machine is None

    def carry(sends: Sequence[Send]) -> None:
        for observer in (fast, slow):
            for s in sends:
                observer.sent(s.peers, s.message)
            if c.failures != observer.failures_seen:
                observer.group_failed(c.snapshot())

    for r in range(dp):
        carry(
            c.receive(
                _peer(r),
                Hello(dp_size=dp, dp_rank=r, incarnation="i", config_fingerprint="fp"),
                0.0,
            )
        )
    now = 1.0
    expected: dict[str, list[int]] = {}  # the wait rule, by hand: under the last decided
    for seq in range(40):  # round's site, once per rank, only for that round's next seq
        now += 0.001 * (seq % 7 + 1)
        last = c.last_round
        for r in range(dp):
            waited = 10 * seq * (r + 1) + (r * 997 if seq % 4 == 0 else 0)
            # (before any decision: seq 0's, under "", as the observer always did)
            site, last_seq = ("", -1) if last is None else (last.site or last.kind.value, last.seq)
            if seq - 1 == last_seq:
                expected.setdefault(site, []).append(waited)
            for observer in (fast, slow):
                observer.waited(r, seq, waited)
                observer.waited(r, seq, waited + 1)  # a second one for the round: not counted
        carry(_round(c, c.dp_size - len(c.snapshot().dead), c.seq, seq, now))
        if seq == 15 and dp > 1:
            carry(c.peer_lost(_peer(dp - 1), now))
            for observer in (fast, slow):
                observer.lost(dp - 1, _peer(dp - 1), "disconnected")
        if seq == 25:
            # a report of another epoch fails one peer; a bad one fails the group
            bad = StepReport(
                num_tokens=-1, num_tokens_padded=0, dp_rank=0, epoch=c.epoch, seq=c.seq
            )
            carry(c.receive(_peer(0), bad, now))
            assert c.snapshot().state.value == "failed"
            for r in range(dp if dp == 1 else dp - 1):
                carry(
                    c.receive(
                        _peer(r),
                        Hello(dp_size=dp, dp_rank=r, incarnation="j", config_fingerprint="fp"),
                        now,
                    )
                )
    assert fast.rounds_completed > 30
    for name in (
        "decided",
        "stragglers",
        "failed",
        "faults",
        "registrations",
        "rounds_at_join",
        "rounds_before_leaving",
        "lost_ranks",
    ):
        assert getattr(fast, name) == getattr(slow, name), name
    for a, b in ((fast.durations, slow.durations), (fast.waits, slow.waits)):
        assert a.keys() == b.keys()
        for k in a:
            assert (a[k].counts, a[k].sum) == (b[k].counts, b[k].sum), k
    assert list(fast.recent) == list(slow.recent)
    assert fast.waits.keys() == expected.keys()
    for site, waits in expected.items():
        reference = DurationHistogram(WAIT_BUCKETS)
        for waited in waits:
            reference.observe(waited / 1e6)
        assert (fast.waits[site].counts, fast.waits[site].sum) == (reference.counts, reference.sum)
    assert sum(h.count for h in fast.waits.values()) > 0
