"""Culprit naming when the ranks of a round disagree on its kind (or gather site).

The round's kind is no longer the first report's: a round whose reports disagree waits for
every live rank (or the step timeout) and names the lowest rank off the majority label, ties
going to the lowest rank's label, which is the device path's rule (`resolve_round`), so both
paths raise equal errors whoever reported first.
"""

from __future__ import annotations

import itertools

import pytest

from coordd.proto import Coordinator, Hello, StepFailed, StepKind, StepMismatch, StepReport
from coordd.proto.messages import GatherReport, error_from_failure
from coordd.proto.rounds import majority

F, D, S, G = StepKind.FORWARD, StepKind.DRAFT, StepKind.STATE, StepKind.GATHER
EPOCH = 5
TIMEOUT = 10.0


def peer(rank: int) -> bytes:
    return f"p{rank}".encode()


def group(dp: int) -> Coordinator:
    c = Coordinator(dp, epoch=EPOCH, step_timeout=TIMEOUT)
    for r in range(dp):
        c.receive(peer(r), Hello(dp_size=dp, dp_rank=r, config_fingerprint="fp",
                                 incarnation=f"i{r}"), 0.0)
    return c


def report(rank: int, kind: StepKind, seq: int = 0) -> StepReport:
    return StepReport(num_tokens=4, num_tokens_padded=4, dp_rank=rank, epoch=EPOCH, seq=seq,
                      kind=kind)


def play(c: Coordinator, reports: list[StepReport | GatherReport], now: float = 1.0) -> object:
    """Send the reports in order; the one answer to the group (a decision or an error)."""
    answers = []
    for r in reports:
        answers.extend(c.receive(peer(r.dp_rank), r, now))
    assert len(answers) == 1, answers
    (peers, message), = answers
    assert peers == c.peers() or isinstance(message, StepFailed)
    return error_from_failure(message) if isinstance(message, StepFailed) else message


@pytest.mark.parametrize("dp", [3, 4, 5])
def test_the_rogue_is_named_whoever_reports_first(dp: int) -> None:
    """vLLM's drafter-skip: one rank reports forward where the others run a drafter round.
    Every arrival order names that rank (the old rule named an honest rank when the rogue
    came first)."""
    for rogue in range(dp):
        for order in itertools.islice(itertools.permutations(range(dp)), 24):
            c = group(dp)
            kinds = {r: (F if r == rogue else D) for r in range(dp)}
            error = play(c, [report(r, kinds[r]) for r in order])
            assert error == StepMismatch(rogue, 0, "draft", 0, "forward"), (rogue, order)


def test_rogue_first_is_named_not_the_honest_rank() -> None:
    """The regression: rogue first at dp=4 (the old code named rank 1, the first honest one)."""
    c = group(4)
    error = play(c, [report(0, F), report(1, D), report(2, D), report(3, D)])
    assert error == StepMismatch(0, 0, "draft", 0, "forward")


def test_a_tie_goes_to_the_lowest_ranks_kind() -> None:
    """dp=2 has no majority: the lowest rank's kind is the round's (as on the device path)."""
    for order in ([0, 1], [1, 0]):
        c = group(2)
        kinds = {0: D, 1: F}
        assert play(c, [report(r, kinds[r]) for r in order]) == StepMismatch(
            1, 0, "draft", 0, "forward")


def test_three_kinds_the_lowest_minority_rank_is_named() -> None:
    c = group(5)
    kinds = [S, D, D, F, D]
    error = play(c, [report(r, kinds[r]) for r in (4, 3, 2, 1, 0)])
    assert error == StepMismatch(0, 0, "draft", 0, "state")


def test_gather_site_first_report_wrong() -> None:
    """A gather round's site is judged by the evidence too (a rogue site first)."""
    c = group(3)

    def g(rank: int, site: str, n: int = 2) -> GatherReport:
        return GatherReport(site=site, values=list(range(n)), dp_rank=rank, epoch=EPOCH, seq=0)

    error = play(c, [g(2, "b"), g(0, "a"), g(1, "a")])
    assert error == StepMismatch(2, 0, "gather:a", 0, "gather:b")


def test_gather_lengths_are_checked_against_the_majority_sites_reports() -> None:
    """With a rogue site first, the honest reports are still held to each other's length."""
    c = group(3)
    first = GatherReport(site="b", values=[1], dp_rank=2, epoch=EPOCH, seq=0)
    assert not c.receive(peer(2), first, 1.0)
    ok = GatherReport(site="a", values=[1, 2], dp_rank=0, epoch=EPOCH, seq=0)
    assert not c.receive(peer(0), ok, 1.0)
    bad = GatherReport(site="a", values=[1, 2, 3], dp_rank=1, epoch=EPOCH, seq=0)
    (_, failure), = c.receive(peer(1), bad, 1.0)
    assert isinstance(failure, StepFailed)
    assert failure.culprits == [1]


def test_a_disputed_round_at_the_step_timeout_names_the_minority() -> None:
    c = group(4)
    for r, kind in ((0, F), (1, D), (2, D)):  # rank 3 never reports
        assert not c.receive(peer(r), report(r, kind), 1.0)
    (_, failure), = c.on_deadline(1.0 + TIMEOUT)
    assert isinstance(failure, StepFailed)
    assert error_from_failure(failure) == StepMismatch(0, 0, "draft", 0, "forward")
    assert failure.kind is D  # the round's kind by the evidence


def test_agreeing_rounds_are_unchanged() -> None:
    c = group(3)
    decision = play(c, [report(r, D) for r in (2, 0, 1)])
    assert type(decision).__name__ == "StepDecision"


def test_majority_rule() -> None:
    assert majority(["a", "b", "b"]) == "b"
    assert majority(["a", "b"]) == "a"
    assert majority(["b", "a", "a", "b"]) == "b"
    assert majority([3]) == 3
