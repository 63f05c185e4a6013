"""Gather rounds in the coordinator, sans-IO with a fake clock.

A gather round is a round like any other (OPEN, REPORT, DECIDE or FAIL; one seq sequence with
the policy rounds): what differs is its outcome, every rank's values unchanged in one
`GatherResult`, and what makes a report not belong (another site, another length).
"""

from __future__ import annotations

import pytest

from coordd.proto import (
    ConflictingReport,
    GatherReport,
    GatherResult,
    GroupState,
    InvalidReport,
    OnRankLoss,
    ProtocolError,
    RankLost,
    Send,
    StepDecision,
    StepFailed,
    StepMismatch,
    StepTimeout,
    decide,
    encode,
    max_gather_values,
)
from coordd.proto.messages import INT64_MAX, INT64_MIN, StepKind
from tests.unit.test_coordinator import (
    DP,
    EPOCH,
    TIMEOUT,
    D,
    F,
    Group,
    S,
    all_peers,
    failed,
    peer,
    rep,
)

SITE = "vllm.gpu.dp_utils"
OTHER = "vllm.parallel.sync_dp_state"


def values(rank: int, seq: int, n: int = 7) -> list[int]:
    """Rank `rank`'s column at `seq`: told apart by rank and seq, int64 extremes included."""
    column = [rank * 1000 + seq * 10 + i for i in range(n)]
    if n >= 3:
        column[1], column[2] = INT64_MIN + rank, INT64_MAX - seq
    return column


def gat(rank: int, seq: int, *, site: str = SITE, n: int = 7, epoch: int = EPOCH,
        vals: list[int] | None = None) -> GatherReport:
    return GatherReport(site=site, values=values(rank, seq, n) if vals is None else vals,
                        dp_rank=rank, epoch=epoch, seq=seq)


def gather_round(g: Group, seq: int, *, site: str = SITE, n: int = 7,
                 order: list[int] | None = None) -> GatherResult:
    """Every live rank sends its values for `seq`; only the last one completes the round."""
    order = list(range(g.dp)) if order is None else order
    for r in order[:-1]:
        assert g.send(gat(r, seq, site=site, n=n)) == []
        assert g.c.state is GroupState.ROUND_OPEN
    sends = g.send(gat(order[-1], seq, site=site, n=n))
    assert len(sends) == 1
    (to, result), = sends
    assert to == g.c.peers()
    assert isinstance(result, GatherResult)
    assert g.c.state is GroupState.IDLE
    return result


def test_a_gather_round_sends_every_rank_every_ranks_values() -> None:
    g = Group()
    result = gather_round(g, 0, order=[2, 0, 3, 1])
    assert result == GatherResult(epoch=EPOCH, seq=0, site=SITE,
                                  rows=[values(r, 0) for r in range(DP)], dead_ranks=[])
    snap = g.c.snapshot()
    assert snap.seq == 1 and snap.decisions == 1
    assert snap.last_round is not None
    assert snap.last_round.kind is StepKind.GATHER and snap.last_round.site == SITE
    assert snap.last_round.last_rank == 1
    assert g.c.next_deadline() is None


def test_the_open_round_says_it_gathers_and_where() -> None:
    g = Group()
    g.send(gat(0, 0))
    snap = g.c.snapshot()
    assert snap.round is not None
    assert snap.open_kind is StepKind.GATHER and snap.round.site == SITE
    assert snap.round.reported == 1
    assert g.c.next_deadline() == g.now + TIMEOUT


@pytest.mark.parametrize("n", [0, 1, 256])
def test_any_length_up_to_the_limit_gathers(n: int) -> None:
    g = Group()
    result = gather_round(g, 0, n=n)
    assert result.rows == [values(r, 0, n) for r in range(DP)]


def test_gather_and_policy_rounds_share_one_seq_sequence() -> None:
    g = Group()
    script = [F, "gather", D, "gather", "gather", S, F, "gather"]
    for seq, what in enumerate(script):
        if what == "gather":
            site = SITE if seq % 2 else OTHER
            result = gather_round(g, seq, site=site, n=seq % 5)
            assert result.seq == seq and result.site == site
            assert result.rows == [values(r, seq, seq % 5) for r in range(DP)]
        else:
            assert isinstance(what, StepKind)
            decision, reports = g.round(seq, what)
            assert decision == decide(reports, epoch=EPOCH, seq=seq, kind=what)
        g.now += 1.0
    assert g.c.snapshot().seq == len(script)
    assert g.c.snapshot().decisions == len(script)


def test_a_gather_result_is_encoded_once_for_all_peers() -> None:
    g = Group(dp=8)
    result = gather_round(g, 0)
    sends = g.c.receive(peer(0), gat(0, 0), g.now)  # the previous round: it comes again
    assert sends == (Send((peer(0),), result),)
    assert len(encode(result)) < 600


# -- what does not belong --------------------------------------------------------------------


def test_another_site_is_a_mismatch_naming_the_rank() -> None:
    g = Group()
    g.send(gat(0, 0))
    g.send(gat(1, 0))
    assert g.send(gat(2, 0, site=OTHER)) == []  # the round waits for the evidence
    sends = g.send(gat(3, 0))
    msg = failed(sends, StepMismatch(2, 0, f"gather:{SITE}", 0, f"gather:{OTHER}"),
                 to=all_peers(), reported=all_peers(), seq=0)
    assert msg.kind is StepKind.GATHER
    assert g.c.state is GroupState.FAILED
    # Fail-stop: every later report, gather or not, gets the same failure at once.
    assert g.send(gat(3, 0)) == [Send((peer(3),), msg)]
    assert g.send(rep(3, 0)) == [Send((peer(3),), msg)]


def test_a_policy_report_in_a_gather_round_is_a_mismatch() -> None:
    g = Group()
    g.send(gat(0, 0))
    g.send(gat(2, 0))
    g.send(rep(1, 0, kind=D))
    sends = g.send(gat(3, 0))
    failed(sends, StepMismatch(1, 0, f"gather:{SITE}", 0, "draft"), to=all_peers(), seq=0)


def test_a_gather_in_a_policy_round_is_a_mismatch() -> None:
    g = Group()
    g.send(rep(0, 0, kind=F))
    g.send(gat(3, 0))
    g.send(rep(1, 0, kind=F))
    sends = g.send(rep(2, 0, kind=F))
    msg = failed(sends, StepMismatch(3, 0, "forward", 0, f"gather:{SITE}"), to=all_peers(), seq=0)
    assert msg.kind is StepKind.FORWARD


def test_a_rank_that_skips_a_gather_is_named() -> None:
    """Rank 3 skips seq 1's gather: its next sync (seq 2's) arrives while seq 1 is open."""
    g = Group()
    gather_round(g, 0)
    for r in range(3):
        g.send(gat(r, 1))
    sends = g.send(gat(3, 2, site=OTHER))
    failed(sends, StepMismatch(3, 1, f"gather:{SITE}", 2, f"gather:{OTHER}"), to=all_peers(),
           seq=1)


def test_a_skipped_seq_before_any_report_names_the_skipper() -> None:
    g = Group()
    sends = g.send(gat(1, 1))
    failed(sends, StepMismatch(1, 0, f"gather:{SITE}", 1, f"gather:{SITE}"), to=all_peers(),
           seq=0)


def test_rows_of_another_length_are_invalid() -> None:
    g = Group()
    g.send(gat(0, 0, n=7))
    sends = g.send(gat(1, 0, n=5))
    failed(sends, InvalidReport(1, "values", 5, "7 values, as the round's first report"),
           to=all_peers(), seq=0)


def test_more_values_than_a_result_frame_holds_are_invalid() -> None:
    g = Group(dp=256, registered=256)
    limit = max_gather_values(256)
    assert limit == 26
    sends = g.send(gat(5, 0, n=limit + 1))
    failed(sends, InvalidReport(5, "values", limit + 1, f"at most {limit} values at dp=256 "
                                "(one 64 KiB frame)"), to=all_peers(256), seq=0)


def test_the_largest_result_fits_in_a_frame() -> None:
    for dp in (1, 2, 8, 100, 256, 1000, 4096):
        n = max_gather_values(dp)
        assert n >= 1
        rows = [[INT64_MIN] * n for _ in range(dp)]
        result = GatherResult(epoch=2**62, seq=2**62, site="\U0001f600" * 256, rows=rows,
                              dead_ranks=list(range(dp)))
        assert len(encode(result)) <= 64 * 1024, dp
    assert max_gather_values(8) == 256


def test_an_identical_resend_is_harmless() -> None:
    g = Group()
    g.send(gat(0, 0))
    assert g.send(gat(0, 0)) == []
    assert g.c.snapshot().round.reported == 1
    result = gather_round(g, 0, order=[1, 2, 3])
    assert result.rows == [values(r, 0) for r in range(DP)]
    # A re-send for the round just completed gets its result again, to the sender alone.
    assert g.send(gat(2, 0)) == [Send((peer(2),), result)]
    assert g.c.snapshot().decisions == 1


def test_a_resend_with_other_values_for_the_previous_round_is_a_mismatch() -> None:
    g = Group()
    gather_round(g, 0)
    sends = g.send(gat(2, 0, vals=[9] * 7))
    failed(sends, StepMismatch(2, 1, f"gather:{SITE}", 0, f"gather:{SITE}"), to=all_peers())


def test_conflicting_duplicate_values_fail_the_round() -> None:
    g = Group()
    g.send(gat(0, 0))
    g.send(gat(1, 0))
    sends = g.send(gat(1, 0, vals=[0] * 7))
    failed(sends, ConflictingReport(1, 0), to=all_peers(), reported=[peer(0), peer(1)], seq=0)


# -- time and losses ------------------------------------------------------------------------


def test_a_gather_round_times_out_naming_the_missing_ranks() -> None:
    g = Group()
    g.send(gat(1, 0))
    g.send(gat(3, 0))
    g.now += TIMEOUT - 0.01
    assert g.c.on_deadline(g.now) == ()
    g.now += 0.01
    msg = failed(list(g.c.on_deadline(g.now)), StepTimeout([0, 2], TIMEOUT), to=all_peers(),
                 seq=0)
    assert msg.kind is StepKind.GATHER


def test_a_lost_rank_fails_the_gather_round() -> None:
    g = Group()
    g.send(gat(0, 0))
    sends = list(g.c.peer_lost(peer(2), g.now))
    failed(sends, RankLost([2], "disconnected"), to=[peer(0), peer(1), peer(3)],
           reported=[peer(0)], seq=0)


def test_neutralize_leaves_a_lost_rank_out_with_an_empty_row() -> None:
    g = Group(on_rank_loss=OnRankLoss.NEUTRALIZE)
    g.send(gat(0, 0))
    g.send(gat(2, 0))  # rank 2 reported, then is lost: withdrawn
    assert list(g.c.peer_lost(peer(2), g.now)) == []
    g.send(gat(1, 0))
    (to, result), = g.send(gat(3, 0))
    assert to == (peer(0), peer(1), peer(3))
    assert result == GatherResult(epoch=EPOCH, seq=0, site=SITE,
                                  rows=[values(0, 0), values(1, 0), [], values(3, 0)],
                                  dead_ranks=[2])
    # The next round goes on without rank 2; policy rounds count it as neutral the same way.
    result = gather_round(g, 1, order=[0, 1, 3])
    assert result.rows[2] == [] and result.dead_ranks == [2]
    decision, _ = g.round(2, F, ranks=[0, 1, 3])
    assert isinstance(decision, StepDecision) and decision.dead_ranks == [2]


def test_neutralize_the_loss_of_the_last_missing_rank_completes_the_round() -> None:
    g = Group(on_rank_loss=OnRankLoss.NEUTRALIZE)
    for r in (0, 1, 2):
        g.send(gat(r, 0))
    (to, result), = g.c.peer_lost(peer(3), g.now)
    assert to == (peer(0), peer(1), peer(2))
    assert isinstance(result, GatherResult)
    assert result.rows == [values(0, 0), values(1, 0), values(2, 0), []]
    assert result.dead_ranks == [3]
    assert g.c.snapshot().last_round.last_rank is None


def test_a_new_epoch_gathers_from_the_next_seq() -> None:
    g = Group()
    g.send(gat(0, 0))
    g.send(gat(1, 0, site=OTHER))
    g.send(gat(2, 0))
    failure = g.send(gat(3, 0))[0].message
    assert isinstance(failure, StepFailed)
    for r in range(DP):
        (_, welcome), = g.hello(r)
        assert welcome.epoch == EPOCH + 1 and welcome.next_seq == 1
    # A report of the old epoch gets the old failure; the new epoch gathers at seq 1.
    assert g.send(gat(2, 0)) == [Send((peer(2),), failure)]
    for r in range(DP - 1):
        assert g.send(gat(r, 1, epoch=EPOCH + 1)) == []
    (_, result), = g.send(gat(DP - 1, 1, epoch=EPOCH + 1))
    assert isinstance(result, GatherResult)
    assert result.epoch == EPOCH + 1 and result.seq == 1
    assert result.rows == [values(r, 1) for r in range(DP)]


def test_a_policy_report_of_kind_gather_is_refused_to_its_sender() -> None:
    g = Group()
    g.send(rep(1, 0))
    sends = g.send(rep(0, 0, kind=StepKind.GATHER))
    failed(sends, ProtocolError("a StepReport of kind gather (a gather round takes a "
                                "GatherReport)", rank=0), to=[peer(0)], seq=0)
    assert g.c.state is GroupState.ROUND_OPEN
