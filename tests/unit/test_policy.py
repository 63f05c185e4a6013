"""coordd.proto.policy: the agreement rules, as properties and as hand-worked examples."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordd.proto import InvalidReport, StepKind, StepReport, decide, validate_report
from coordd.proto.policy import MAX_TOKENS

# -- strategies ----------------------------------------------------------------------------


@st.composite
def reports(draw: st.DrawFn, max_tokens: int = 4096) -> StepReport:
    num_tokens = draw(st.integers(0, max_tokens))
    padded = num_tokens + draw(st.integers(0, max_tokens))
    return StepReport(
        num_tokens=num_tokens,
        num_tokens_padded=padded,
        want_ubatch=draw(st.booleans()),
        cudagraph_mode=draw(st.integers(0, 2)),
        has_unfinished=draw(st.booleans()),
        want_pause=draw(st.booleans()),
    )


report_lists = st.lists(reports(), min_size=1, max_size=16)
num_ubatches = st.integers(1, 4)


@st.composite
def reports_with_dead(draw: st.DrawFn) -> list[StepReport | None]:
    """At least one live report; any others may be dead (None)."""
    live = draw(report_lists)
    out: list[StepReport | None] = list(live)
    for _ in range(draw(st.integers(0, 8))):
        out.insert(draw(st.integers(0, len(out))), None)
    return out


def reference(rs: list[StepReport | None], n: int) -> dict[str, object]:
    """The rules in coordd.proto.policy's docstring, written out independently of its code."""
    live = [r for r in rs if r is not None]
    p = max(r.num_tokens_padded for r in live)
    u = min(r.num_tokens for r in live)
    mode = min(r.cudagraph_mode for r in live)
    ubatch = all(r.want_ubatch for r in live) and not ((p // n) * (n - 1) >= u)
    pad = mode != 0 or ubatch
    return dict(
        cudagraph_mode=mode,
        should_ubatch=ubatch,
        should_pad=pad,
        num_tokens_across_dp=(
            [p] * len(rs) if pad else [0 if r is None else r.num_tokens_padded for r in rs]
        ),
        any_unfinished=any(r.has_unfinished for r in live),
        all_idle=all(r.num_tokens == 0 for r in live),
        should_pause=all(r.want_pause for r in live),
        any_pause=any(r.want_pause for r in live),
        dead_ranks=[i for i, r in enumerate(rs) if r is None],
    )


DECISION_FIELDS = ("cudagraph_mode", "should_ubatch", "should_pad", "num_tokens_across_dp",
                   "any_unfinished", "all_idle", "should_pause", "any_pause", "dead_ranks")


def as_fields(decision: object) -> dict[str, object]:
    return {k: getattr(decision, k) for k in DECISION_FIELDS}


# -- properties ----------------------------------------------------------------------------


@given(reports_with_dead(), num_ubatches)
def test_decide_matches_the_written_rules(rs: list[StepReport | None], n: int) -> None:
    assert as_fields(decide(rs, n)) == reference(rs, n)


@given(report_lists, num_ubatches, st.randoms(use_true_random=False))
def test_decision_does_not_depend_on_rank_order(rs, n, rnd) -> None:  # type: ignore[no-untyped-def]
    perm = list(range(len(rs)))
    rnd.shuffle(perm)
    shuffled = [rs[i] for i in perm]
    a, b = decide(rs, n), decide(shuffled, n)
    for name in ("should_ubatch", "should_pad", "cudagraph_mode", "any_unfinished", "all_idle",
                 "dead_ranks", "should_pause", "any_pause", "epoch", "seq", "kind"):
        assert getattr(a, name) == getattr(b, name), name
    # the per-rank column moves with its rank
    assert b.num_tokens_across_dp == [a.num_tokens_across_dp[i] for i in perm]


@given(reports_with_dead(), num_ubatches, st.randoms(use_true_random=False))
def test_rank_order_with_dead_ranks(rs, n, rnd) -> None:  # type: ignore[no-untyped-def]
    perm = list(range(len(rs)))
    rnd.shuffle(perm)
    shuffled = [rs[i] for i in perm]
    a, b = decide(rs, n), decide(shuffled, n)
    assert (a.should_ubatch, a.should_pad, a.cudagraph_mode, a.any_unfinished, a.all_idle) == (
        b.should_ubatch, b.should_pad, b.cudagraph_mode, b.any_unfinished, b.all_idle)
    assert b.num_tokens_across_dp == [a.num_tokens_across_dp[i] for i in perm]
    assert b.dead_ranks == sorted(j for j, i in enumerate(perm) if rs[i] is None)


@given(reports_with_dead(), num_ubatches)
def test_padding_rule(rs: list[StepReport | None], n: int) -> None:
    d = decide(rs, n)
    live = [r for r in rs if r is not None]
    assert d.should_pad == (d.cudagraph_mode != 0 or d.should_ubatch)
    assert len(d.num_tokens_across_dp) == len(rs)
    if d.should_pad:
        assert d.num_tokens_across_dp == [max(r.num_tokens_padded for r in live)] * len(rs)
    else:
        assert d.num_tokens_across_dp == [0 if r is None else r.num_tokens_padded for r in rs]


@given(report_lists, num_ubatches)
def test_ubatch_is_all_or_none_and_never_leaves_an_empty_last_ubatch(rs, n) -> None:  # type: ignore[no-untyped-def]
    d = decide(rs, n)
    p = max(r.num_tokens_padded for r in rs)
    u = min(r.num_tokens for r in rs)
    if not all(r.want_ubatch for r in rs) or (p // n) * (n - 1) >= u:
        assert not d.should_ubatch
    else:
        assert d.should_ubatch
    if d.should_ubatch:
        # every rank's last micro-batch holds at least one real token
        assert all(r.num_tokens > (p // n) * (n - 1) for r in rs)


@given(report_lists)
def test_one_ubatch_only_needs_tokens(rs: list[StepReport]) -> None:
    # n=1: (P // 1) * 0 = 0 >= U only when some rank has no tokens
    d = decide(rs, 1)
    assert d.should_ubatch == (
        all(r.want_ubatch for r in rs) and min(r.num_tokens for r in rs) > 0
    )


@given(report_lists, num_ubatches)
def test_cudagraph_min_unfinished_or_all_idle(rs: list[StepReport], n: int) -> None:
    d = decide(rs, n)
    assert d.cudagraph_mode == min(r.cudagraph_mode for r in rs)
    assert d.any_unfinished == any(r.has_unfinished for r in rs)
    assert d.all_idle == all(r.num_tokens == 0 for r in rs)
    assert d.dead_ranks == []


@given(reports_with_dead(), num_ubatches)
def test_dead_ranks_are_neutral(rs: list[StepReport | None], n: int) -> None:
    with_dead = decide(rs, n)
    live_only = decide([r for r in rs if r is not None], n)
    # a dead rank never lowers the min, never vetoes ubatch, never raises the max
    for name in ("cudagraph_mode", "should_ubatch", "should_pad", "any_unfinished", "all_idle",
                 "should_pause", "any_pause"):
        assert getattr(with_dead, name) == getattr(live_only, name), name
    assert with_dead.dead_ranks == [i for i, r in enumerate(rs) if r is None]
    columns = zip(with_dead.num_tokens_across_dp, rs, strict=True)
    live_columns = [c for c, r in columns if r is not None]
    assert live_columns == live_only.num_tokens_across_dp
    for i in with_dead.dead_ranks:
        expected = max(live_only.num_tokens_across_dp) if with_dead.should_pad else 0
        assert with_dead.num_tokens_across_dp[i] == expected


@given(report_lists, num_ubatches, st.integers(0, 2**31), st.integers(0, 2**31),
       st.sampled_from(StepKind))
def test_envelope_is_copied(rs, n, epoch, seq, kind) -> None:  # type: ignore[no-untyped-def]
    d = decide(rs, n, epoch=epoch, seq=seq, kind=kind)
    assert (d.epoch, d.seq, d.kind) == (epoch, seq, kind)


def test_no_live_report_is_an_error() -> None:
    with pytest.raises(ValueError):
        decide([None, None])
    with pytest.raises(ValueError):
        decide([])


# -- hand-worked examples ------------------------------------------------------------------


def R(tokens: int, padded: int, *, ub: bool = True, mode: int = 0, unfinished: bool = False,
      ) -> StepReport:
    return StepReport(num_tokens=tokens, num_tokens_padded=padded, want_ubatch=ub,
                      cudagraph_mode=mode, has_unfinished=unfinished)


@pytest.mark.parametrize(
    ("rs", "n", "ubatch", "pad", "mode", "across"),
    [
        # P=16, U=1, n=2: (16//2)*1 = 8 >= 1 -> last ubatch empty -> no ubatch, no pad
        ([R(5, 8), R(1, 16)], 2, False, False, 0, [8, 16]),
        # P=16, U=9: 8 >= 9 is false -> ubatch, pad to 16 everywhere
        ([R(9, 16), R(12, 16)], 2, True, True, 0, [16, 16]),
        # exactly at the edge: P=16, U=8: 8 >= 8 -> empty -> off
        ([R(8, 16), R(16, 16)], 2, False, False, 0, [16, 16]),
        # n=3, P=9, U=7: (9//3)*2 = 6 >= 7 false -> on
        ([R(7, 9), R(9, 9)], 3, True, True, 0, [9, 9]),
        # n=3, P=9, U=6: 6 >= 6 -> off
        ([R(6, 9), R(9, 9)], 3, False, False, 0, [9, 9]),
        # n=4, P=10, U=7: (10//4)*3 = 6 >= 7 false -> on
        ([R(7, 8), R(10, 10)], 4, True, True, 0, [10, 10]),
        # one rank does not want it -> off for all
        ([R(9, 16), R(12, 16, ub=False)], 2, False, False, 0, [16, 16]),
        # cudagraph min: 2 and 1 -> 1 -> pad even without ubatch
        ([R(3, 4, ub=False, mode=2), R(1, 2, ub=False, mode=1)], 2, False, True, 1, [4, 4]),
        # one rank can do no cuda graph -> NONE, unpadded
        ([R(3, 4, ub=False, mode=2), R(1, 2, ub=False, mode=0)], 2, False, False, 0, [4, 2]),
        # n=1 with tokens everywhere -> on
        ([R(1, 1), R(2, 4)], 1, True, True, 0, [4, 4]),
        # n=1 with an idle rank -> off
        ([R(0, 0), R(2, 4)], 1, False, False, 0, [0, 4]),
        # a single rank
        ([R(9, 16)], 2, True, True, 0, [16]),
    ],
)
def test_examples(rs, n, ubatch, pad, mode, across) -> None:  # type: ignore[no-untyped-def]
    d = decide(rs, n)
    assert (d.should_ubatch, d.should_pad, d.cudagraph_mode, d.num_tokens_across_dp) == (
        ubatch, pad, mode, across)


def test_example_unfinished_and_idle() -> None:
    d = decide([R(0, 0, unfinished=False), R(0, 0, unfinished=True)])
    assert d.all_idle and d.any_unfinished
    d = decide([R(0, 0), R(1, 1)])
    assert not d.all_idle and not d.any_unfinished


def test_example_dead_rank() -> None:
    # rank 1 is dead: its zero tokens would have vetoed ubatch and its mode 0 lowered the min,
    # but a dead rank carries no values at all
    d = decide([R(9, 16, mode=2), None, R(12, 12, mode=1)])
    assert d.dead_ranks == [1]
    assert d.cudagraph_mode == 1
    assert d.should_ubatch  # P=16, U=9: 8 >= 9 is false
    assert d.num_tokens_across_dp == [16, 16, 16]
    d = decide([R(9, 16, ub=False), None, R(12, 12, ub=False)])
    assert not d.should_pad
    assert d.num_tokens_across_dp == [16, 0, 12]
    # a dead rank never raises the max: only live ranks' padding counts
    d = decide([None, R(2, 3, mode=1)])
    assert d.num_tokens_across_dp == [3, 3]


# -- validate_report -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field", "value"),
    [
        (dict(num_tokens=-1, num_tokens_padded=0), "num_tokens", -1),
        (dict(num_tokens=5, num_tokens_padded=4), "num_tokens_padded", 4),
        (dict(num_tokens=5, num_tokens_padded=8, cudagraph_mode=3), "cudagraph_mode", 3),
        (dict(num_tokens=5, num_tokens_padded=8, cudagraph_mode=-1), "cudagraph_mode", -1),
    ],
)
def test_validate_report_names_rank_field_value(fields, field, value) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidReport) as info:
        validate_report(3, StepReport(**fields))
    err = info.value
    assert (err.rank, err.field, err.value) == (3, field, value)
    assert err.ranks == (3,)
    assert "rank 3" in str(err) and field in str(err) and repr(value) in str(err)


@given(reports())
def test_validate_report_accepts_every_valid_report(r: StepReport) -> None:
    validate_report(0, r)


@given(st.integers(-(2**40), 2**40), st.integers(-(2**40), 2**40), st.integers(-5, 5))
def test_validate_report_accepts_exactly_the_valid_range(tokens, padded, mode) -> None:  # type: ignore[no-untyped-def]
    r = StepReport(num_tokens=tokens, num_tokens_padded=padded, cudagraph_mode=mode)
    ok = 0 <= tokens <= padded <= MAX_TOKENS and mode in (0, 1, 2)
    if ok:
        validate_report(1, r)
    else:
        with pytest.raises(InvalidReport):
            validate_report(1, r)
