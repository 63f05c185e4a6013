"""Elastic mode (`--on-rank-loss neutralize`) in the sans-IO coordinator, with a fake clock.

The basics (a lost rank is left out and named in `dead_ranks`; a returning rank is admitted at a
round boundary) are in test_coordinator.py; these are the edges: a lost rank that comes back
without registering, two peers racing for one dead rank, a loss while the group is failed, and
the re-formed group after a failure going on without the dead.
"""

from __future__ import annotations

from coordd.proto import (
    Coordinator,
    FailReason,
    Goodbye,
    Hello,
    OnRankLoss,
    RankLost,
    Reject,
    RejectReason,
    Send,
    StepDecision,
    StepFailed,
    StepKind,
    StepReport,
    StepTimeout,
    Welcome,
    decide,
    error_from_failure,
)

DP = 3
EPOCH = 11


def welcome(*, epoch: int, next_seq: int, dp_size: int) -> Welcome:
    """coordd's Welcome, which says its step timeout (TIMEOUT here)."""
    return Welcome(epoch=epoch, next_seq=next_seq, dp_size=dp_size, step_timeout=TIMEOUT)


TIMEOUT = 5.0
NEUTRALIZE = OnRankLoss.NEUTRALIZE


def peer(rank: int, tag: str = "") -> bytes:
    return f"p{rank}{tag}".encode()


def hello(rank: int, incarnation: str = "") -> Hello:
    return Hello(
        dp_size=DP, dp_rank=rank, config_fingerprint="fp", incarnation=incarnation or f"i{rank}"
    )


def report(rank: int, seq: int, epoch: int = EPOCH, **kw: object) -> StepReport:
    tokens = 10 + rank + seq
    kw = {"want_ubatch": True, "cudagraph_mode": 2, "has_unfinished": True, **kw}
    return StepReport(
        num_tokens=tokens,
        num_tokens_padded=tokens + 6,
        dp_rank=rank,
        epoch=epoch,
        seq=seq,
        **kw,  # type: ignore[arg-type]
    )


def group(on_rank_loss: OnRankLoss = NEUTRALIZE) -> Coordinator:
    c = Coordinator(DP, epoch=EPOCH, step_timeout=TIMEOUT, on_rank_loss=on_rank_loss)
    for r in range(DP):
        c.receive(peer(r), hello(r), 0.0)
    return c


def run_round(c: Coordinator, seq: int, ranks: list[int], now: float = 1.0) -> list[Send]:
    sends: list[Send] = []
    for r in ranks:
        sends = list(c.receive(peer(r), report(r, seq, c.snapshot().epoch), now))
    return sends


def test_a_lost_rank_back_without_registering_gets_rank_lost_not_a_decision() -> None:
    c = group()
    c.peer_lost(peer(2), 1.0, "connection closed")
    (to, decision), = run_round(c, 0, [0, 1])
    assert isinstance(decision, StepDecision) and decision.dead_ranks == [2]
    assert to == (peer(0), peer(1))
    # The same peer (a ZeroMQ reconnect keeps its routing id) reports seq 1 without a Hello.
    (to, msg), = c.receive(peer(2), report(2, 1), 2.0)
    assert to == (peer(2),)
    assert isinstance(msg, StepFailed) and msg.reason is FailReason.LOST
    assert msg.epoch == EPOCH and msg.culprits == [2]
    error = error_from_failure(msg)
    assert isinstance(error, RankLost) and error.ranks == (2,)
    # ...and the live ranks' round is not disturbed by it.
    (to, decision), = run_round(c, 1, [0, 1])
    assert isinstance(decision, StepDecision) and decision.seq == 1
    assert decision.dead_ranks == [2] and to == (peer(0), peer(1))


def test_fail_stop_keeps_the_protocol_error_for_strangers() -> None:
    c = group(OnRankLoss.FAIL)
    c.receive(peer(9), hello(0, "other"), 0.0)  # rejected: rank 0 is held
    (_, msg), = c.receive(peer(9), report(1, 0), 1.0)
    assert isinstance(msg, StepFailed) and msg.reason is FailReason.PROTOCOL


def test_two_peers_racing_for_one_dead_rank() -> None:
    c = group()
    c.peer_lost(peer(1), 1.0)
    assert list(c.receive(peer(0), report(0, 0), 1.0)) == []  # the round is open
    assert list(c.receive(peer(1, "a"), hello(1, "a"), 1.1)) == []  # queued
    assert list(c.receive(peer(1, "a"), hello(1, "a"), 1.2)) == []  # a resend: still one entry
    (to, msg), = c.receive(peer(1, "b"), hello(1, "b"), 1.3)
    assert to == (peer(1, "b"),)
    assert isinstance(msg, Reject) and msg.reason is RejectReason.RANK_TAKEN
    assert (msg.expected, msg.got) == ("a dp_rank no live connection holds", "1")
    assert "a" not in msg.got  # the holder's incarnation is not echoed
    sends = list(c.receive(peer(2), report(2, 0), 2.0))
    assert [type(s.message) for s in sends] == [StepDecision, Welcome]
    assert sends[1] == Send((peer(1, "a"),), welcome(epoch=EPOCH, next_seq=1, dp_size=DP))
    assert c.snapshot().members[1].joined_at == 2.0  # admitted at the round's end, not back-dated
    assert run_round(c, 1, [0, 2]) == []  # rank 1 is live again: two reports are not enough
    (_, decision), = c.receive(peer(1, "a"), report(1, 1), 3.0)
    assert isinstance(decision, StepDecision) and decision.dead_ranks == []


def test_a_returning_rank_must_match_the_group_config() -> None:
    c = group()
    c.peer_lost(peer(2), 1.0)
    bad = Hello(dp_size=DP, dp_rank=2, config_fingerprint="other", incarnation="x")
    (_, msg), = c.receive(peer(2, "x"), bad, 1.5)
    assert isinstance(msg, Reject) and msg.reason is RejectReason.FINGERPRINT


def test_the_group_reformed_after_a_failure_goes_on_without_the_dead() -> None:
    c = group()
    c.peer_lost(peer(2), 1.0)  # left out
    c.receive(peer(0), report(0, 0), 1.0)
    (_, failure), = c.on_deadline(1.0 + TIMEOUT)  # rank 1 never reported: timeout
    assert isinstance(failure, StepFailed)
    assert error_from_failure(failure) == StepTimeout([1], TIMEOUT)
    # Ranks 0 and 1 register again: a new epoch that does not wait for rank 2.
    for r in (0, 1):
        (_, welcome), = c.receive(peer(r), hello(r), 7.0)
        assert isinstance(welcome, Welcome) and welcome.epoch == EPOCH + 1
    seq = welcome.next_seq
    (_, decision), = run_round(c, seq, [0, 1], 8.0)
    assert isinstance(decision, StepDecision) and decision.dead_ranks == [2]


def test_a_rank_lost_while_the_group_is_failed_is_left_out_of_the_next_epoch() -> None:
    c = group()
    c.receive(peer(0), report(0, 0), 1.0)
    c.receive(peer(1), report(1, 5), 1.0)  # mismatch: the group fails
    assert c.snapshot().failure is not None
    c.receive(peer(2), Goodbye(), 2.0)  # rank 2 leaves while failed
    for r in (0, 1):
        c.receive(peer(r), hello(r), 3.0)
    (_, decision), = run_round(c, c.snapshot().seq, [0, 1], 4.0)
    assert isinstance(decision, StepDecision) and decision.dead_ranks == [2]


def test_every_rank_lost_while_failed_forgets_the_dead() -> None:
    c = group()
    c.peer_lost(peer(2), 1.0)
    c.receive(peer(0), report(0, 0), 1.0)
    c.on_deadline(1.0 + TIMEOUT)
    for r in (0, 1):
        c.peer_lost(peer(r), 7.0)
    assert c.snapshot().dead == frozenset()
    for r in range(DP):
        c.receive(peer(r), hello(r), 8.0)
    (_, decision), = run_round(c, c.snapshot().seq, [0, 1, 2], 9.0)
    assert isinstance(decision, StepDecision) and decision.dead_ranks == []


def test_neutral_values_follow_the_padding_rule() -> None:
    """A dead rank's entry: the max when padding, 0 when not (as vLLM's neutral columns give)."""
    c = group()
    c.peer_lost(peer(1), 0.5)
    c.receive(peer(0), report(0, 0, cudagraph_mode=0, want_ubatch=False), 1.0)
    (_, d), = c.receive(peer(2), report(2, 0, cudagraph_mode=0, want_ubatch=False), 1.0)
    assert isinstance(d, StepDecision) and not d.should_pad
    assert d.num_tokens_across_dp == [16, 0, 18]
    run = run_round(c, 1, [0, 2])
    (_, d), = run
    assert isinstance(d, StepDecision) and d.should_pad
    assert d.num_tokens_across_dp == [19, 19, 19]
    assert d == decide(
        [report(0, 1), None, report(2, 1)], 2, epoch=EPOCH, seq=1, kind=StepKind.FORWARD
    )
