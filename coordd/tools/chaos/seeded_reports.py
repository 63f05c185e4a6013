"""What the chaos ranks report: seeded per (seed, rank, seq), and a kind schedule all ranks share.

Deriving every value from the round's coordinates (not from a running generator) keeps a rank
that re-registers, or a replacement process, reporting exactly what its predecessor would have.
"""

from __future__ import annotations

import random

import msgspec

from coordd.proto.messages import StepKind, StepReport

_KINDS = (StepKind.FORWARD, StepKind.FORWARD, StepKind.FORWARD, StepKind.DRAFT, StepKind.STATE)


def kind_for(seed: int, seq: int) -> StepKind:
    """The kind of round `seq`: every rank's step loop derives the same one from the seed."""
    return random.Random(f"kind:{seed}:{seq}").choice(_KINDS)


def report_for(seed: int, rank: int, seq: int, salt: str = "") -> StepReport:
    """The report rank `rank` makes for round `seq`: every process can recompute it."""
    return random_report(random.Random(f"report:{seed}:{rank}:{seq}:{salt}"))


def random_report(rng: random.Random) -> StepReport:
    """A valid report drawn from `rng`: decode-heavy, with prefills and idle ranks."""
    tokens = rng.choice([0, rng.randint(1, 16), rng.randint(1, 300), rng.randint(256, 8192)])
    padded = tokens + rng.choice([0, 0, rng.randint(0, 64)])
    return StepReport(
        num_tokens=tokens,
        num_tokens_padded=padded,
        want_ubatch=rng.random() < 0.7,
        cudagraph_mode=rng.choice([0, 1, 2]),
        has_unfinished=rng.random() < 0.8,
        want_pause=rng.random() < 0.05,
    )


def other_report(report: StepReport) -> StepReport:
    """A valid report that differs from `report` (for repeated and conflicting sends)."""
    return msgspec.structs.replace(
        report, num_tokens=report.num_tokens + 1, num_tokens_padded=report.num_tokens_padded + 1
    )
