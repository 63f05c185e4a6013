"""The coordinator snapshot's rounds: the open round's arrivals and the last completed round,
what metrics and status read."""

from __future__ import annotations

from coordd.proto.coordinator import CompletedRound, Coordinator, OnRankLoss
from coordd.proto.messages import Hello, StepDecision, StepFailed, StepKind, StepReport

DP = 3
EPOCH = 5


def peer(rank: int) -> bytes:
    return f"p{rank}".encode()


def joined(dp: int = DP, **kw: object) -> Coordinator:
    c = Coordinator(dp, epoch=EPOCH, step_timeout=10.0, **kw)  # type: ignore[arg-type]
    for r in range(dp):
        c.receive(peer(r), Hello(dp_size=dp, dp_rank=r, config_fingerprint="", incarnation=f"i{r}"),
                  0.0)
    return c


def arrivals(c: Coordinator) -> list[float | None]:
    """Each rank's report time in the open round (all None between rounds)."""
    rnd = c.snapshot().round
    return [None] * c.dp_size if rnd is None else list(rnd.arrivals)


def last_round(c: Coordinator) -> CompletedRound | None:
    return c.snapshot().last_round


def report(rank: int, seq: int, kind: StepKind = StepKind.FORWARD) -> StepReport:
    return StepReport(num_tokens=rank + 1, num_tokens_padded=rank + 1, dp_rank=rank, epoch=EPOCH,
                      seq=seq, kind=kind)


def test_no_round_yet() -> None:
    c = joined()
    assert last_round(c) is None
    assert arrivals(c) == [None] * DP


def test_the_completing_rank_and_the_arrivals_are_recorded() -> None:
    c = joined()
    c.receive(peer(2), report(2, 0, StepKind.DRAFT), 10.0)
    c.receive(peer(0), report(0, 0, StepKind.DRAFT), 10.5)
    assert last_round(c) is None
    assert arrivals(c) == [10.5, None, 10.0]
    sends = c.receive(peer(1), report(1, 0, StepKind.DRAFT), 12.0)
    assert type(sends[0].message) is StepDecision
    assert last_round(c) == CompletedRound(
        seq=0, kind=StepKind.DRAFT, started=10.0, completed=12.0, last_rank=1,
        arrivals=[10.5, 12.0, 10.0],
    )
    assert arrivals(c) == [None] * DP, "the next round starts with no arrivals"
    # the next round replaces it, and the recorded list is not reused
    first = last_round(c)
    for r in (1, 0, 2):
        c.receive(peer(r), report(r, 1), 20.0 + r)
    assert last_round(c).seq == 1 and last_round(c).last_rank == 2
    assert last_round(c).started == 21.0 and last_round(c).completed == 22.0
    assert first.arrivals == [10.5, 12.0, 10.0]


def test_a_repeated_report_keeps_the_first_arrival() -> None:
    c = joined()
    c.receive(peer(0), report(0, 0), 1.0)
    c.receive(peer(0), report(0, 0), 3.0)  # identical re-send: harmless
    assert arrivals(c)[0] == 1.0


def test_a_failure_clears_the_arrivals_and_keeps_the_last_round() -> None:
    c = joined()
    for r in range(DP):
        c.receive(peer(r), report(r, 0), 1.0)
    done = last_round(c)
    c.receive(peer(0), report(0, 1), 2.0)
    sends = c.receive(peer(1), report(1, 5), 2.5)  # wrong seq: the round fails
    assert type(sends[0].message) is StepFailed
    assert arrivals(c) == [None] * DP
    assert last_round(c) is done


def test_a_loss_that_completes_the_round_has_no_straggler() -> None:
    c = joined(on_rank_loss=OnRankLoss.NEUTRALIZE)
    c.receive(peer(0), report(0, 0), 1.0)
    c.receive(peer(1), report(1, 0), 1.5)
    sends = c.peer_lost(peer(2), 4.0)
    assert type(sends[0].message) is StepDecision
    assert last_round(c) == CompletedRound(0, StepKind.FORWARD, 1.0, 4.0, None, [1.0, 1.5, None])


def test_a_lost_rank_that_had_reported_loses_its_arrival() -> None:
    c = joined(on_rank_loss=OnRankLoss.NEUTRALIZE)
    c.receive(peer(2), report(2, 0), 1.0)
    c.peer_lost(peer(2), 1.5)
    assert arrivals(c) == [None] * DP
    rnd = c.snapshot().round
    assert rnd is not None and rnd.reported == 0, "the round stays open: its kind and deadline hold"
    c.receive(peer(0), report(0, 0), 2.0)
    c.receive(peer(1), report(1, 0), 3.0)
    assert last_round(c) is not None
    assert last_round(c).arrivals == [2.0, 3.0, None]
    assert last_round(c).last_rank == 1
    assert last_round(c).started == 1.0, "the round started with the lost rank's report"
