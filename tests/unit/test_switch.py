"""The switch rules (coordd.client.switch): settlement, vote and pacing, without sockets."""

from __future__ import annotations

import pytest

from coordd.client.switch import (
    REJOIN_CALM,
    REJOIN_FIRST,
    REJOIN_LONGEST,
    VOTE_EVERY,
    RejoinPacing,
    Settlement,
    returns,
    settle,
    settle_row,
    votes_now,
)
from coordd.proto.errors import StepMismatch

SITE_A, SITE_B = "dp_utils@runner:sum:int32[4,2]:col", "dp_utils@drafter:sum:int32[4,2]:col"


def test_every_rank_lacks_the_same_round_so_it_runs_on_the_own_path() -> None:
    rows = [settle_row(7, (SITE_A, 8), (SITE_B, 8)) for _ in range(4)]
    assert settle(rows) == Settlement(7)


def test_a_rank_behind_takes_the_answer_from_the_lowest_rank_ahead() -> None:
    # coordd answered round 7 to ranks 1 and 3, then died before ranks 0 and 2 got it
    behind = settle_row(7, (SITE_A, 8), (SITE_B, 8))
    ahead = settle_row(8, (SITE_B, 8), (SITE_A, 8))
    assert settle([behind, ahead, behind, ahead]) == Settlement(8, (0, 2), 1, 8)


def test_a_rank_ahead_that_has_not_started_its_next_round_still_gives_the_answer() -> None:
    behind = settle_row(3, (SITE_A, 8), (SITE_B, 8))
    ahead = settle_row(4, (SITE_A, 8), (SITE_A, 8))  # the same site again next
    assert settle([ahead, behind]) == Settlement(4, (1,), 0, 8)


def test_two_rounds_apart_is_a_mismatch_naming_the_rank() -> None:
    rows = [settle_row(9, (SITE_A, 8), (SITE_B, 8)), settle_row(7, (SITE_A, 8), (SITE_B, 8))]
    with pytest.raises(StepMismatch) as caught:
        settle(rows)
    assert caught.value.rank == 1
    assert (caught.value.expected_seq, caught.value.got_seq) == (8, 7)


def test_a_rank_behind_at_another_site_is_named_never_given_an_answer() -> None:
    ahead = settle_row(5, (SITE_B, 8), (SITE_A, 8))
    other = settle_row(4, (SITE_B, 8), (SITE_A, 8))  # lacks round 4 at SITE_B, not SITE_A
    with pytest.raises(StepMismatch) as caught:
        settle([ahead, other])
    assert caught.value.rank == 1


def test_ranks_ahead_that_disagree_on_the_last_round_are_named() -> None:
    rows = [
        settle_row(5, (SITE_B, 8), (SITE_A, 8)),
        settle_row(5, (SITE_B, 8), (SITE_A, 6)),
        settle_row(4, (SITE_A, 8), None),
    ]
    with pytest.raises(StepMismatch) as caught:
        settle(rows)
    assert caught.value.rank == 1


def test_ranks_level_at_different_sites_are_named() -> None:
    rows = [settle_row(2, (SITE_A, 8), None), settle_row(2, (SITE_B, 8), None)]
    with pytest.raises(StepMismatch) as caught:
        settle(rows)
    assert caught.value.rank == 1


def test_a_missing_row_is_named() -> None:
    rows = [settle_row(2, (SITE_A, 8), None), [0] * 6]
    with pytest.raises(StepMismatch) as caught:
        settle(rows)
    assert caught.value.rank == 1


def test_votes_come_every_vote_every_rounds_after_the_switch_only() -> None:
    at = 13
    voting = [n for n in range(at, at + 3 * VOTE_EVERY + 1) if votes_now(n, at)]
    assert voting == [at + VOTE_EVERY, at + 2 * VOTE_EVERY, at + 3 * VOTE_EVERY]
    assert [n for n in range(at, at + 4) if votes_now(n, at, every=1)] == [at + 1, at + 2, at + 3]


def test_the_group_returns_only_when_every_rank_has_the_same_registration() -> None:
    assert returns([5, 5, 5])
    assert not returns([5, 0, 5])
    assert not returns([0, 0])
    assert not returns([5, 6, 5])


def test_pacing_doubles_for_a_flapping_coordd_and_starts_afresh_after_a_calm_spell() -> None:
    pacing = RejoinPacing()
    now = 100.0
    pacing.fell_back(now)
    assert not pacing.may_try(now + REJOIN_FIRST / 2)
    assert pacing.may_try(now + REJOIN_FIRST)
    waits = []
    for _ in range(8):  # coordd comes back and dies again within seconds, 8 times
        now += pacing.wait
        pacing.came_back(now)
        now += 1.0
        pacing.fell_back(now)
        waits.append(pacing.wait)
    assert waits[:3] == [2 * REJOIN_FIRST, 4 * REJOIN_FIRST, 8 * REJOIN_FIRST]
    assert max(waits) == REJOIN_LONGEST
    pacing.came_back(now)
    pacing.fell_back(now + REJOIN_CALM + 1)
    assert pacing.wait == REJOIN_FIRST
