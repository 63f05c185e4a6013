"""What every benchmarked method exchanges: the same per-rank reports, and how a result is checked.

Each rank's report for round i is drawn from a table seeded by its rank, so any process can
rebuild every rank's report and check a decision against the policy after the timed rounds.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence

from coordd.proto.messages import StepDecision, StepReport
from coordd.proto.policy import decide

#: Reports per rank before the table repeats.
TABLE_SIZE = 64
#: The report's fields as the int32 rows of vLLM's [fields x dp] all-reduce matrix.
FIELDS = ("num_tokens", "num_tokens_padded", "want_ubatch", "cudagraph_mode", "has_unfinished")
#: The floor's fixed-size report: the round index and the five fields.
FLOOR_REPORT = struct.Struct("<6i")

Payload = tuple[tuple[int, ...], bool, bool, int, bool, bool]


def _draw(rng: random.Random) -> StepReport:
    """Decode-heavy batches with occasional prefills, as in `coordd demo`."""
    tokens = rng.choice([0, rng.randint(1, 64), rng.randint(1, 256), rng.randint(512, 4096)])
    bucket = next((b for b in (8, 16, 32, 64, 128, 256, 512) if b >= tokens), tokens)
    return StepReport(
        num_tokens=tokens,
        num_tokens_padded=bucket,
        want_ubatch=tokens >= 32,
        cudagraph_mode=rng.choice([0, 1, 2, 2]) if tokens <= 512 else 0,
        has_unfinished=tokens > 0,
    )


def report_table(rank: int, seed: int = 0) -> list[StepReport]:
    rng = random.Random(seed * 1_000_003 + rank)
    return [_draw(rng) for _ in range(TABLE_SIZE)]


def report_for(tables: Sequence[Sequence[StepReport]], rank: int, round_index: int) -> StepReport:
    return tables[rank][round_index % TABLE_SIZE]


def column(report: StepReport) -> list[int]:
    """A report as its column of the all-reduce matrix."""
    return [int(getattr(report, name)) for name in FIELDS]


def decision_from_matrix(rows: Sequence[Sequence[int]], num_ubatches: int = 2) -> StepDecision:
    """The decision from the all-reduced matrix (what a rank on the all-reduce path computes)."""
    tokens, padded, ubatch, mode, unfinished = rows
    return decide(
        [
            StepReport(
                num_tokens=tokens[r],
                num_tokens_padded=padded[r],
                want_ubatch=bool(ubatch[r]),
                cudagraph_mode=mode[r],
                has_unfinished=bool(unfinished[r]),
            )
            for r in range(len(tokens))
        ],
        num_ubatches,
    )


def payload(decision: StepDecision) -> Payload:
    """What every method must agree on (the envelope - epoch, seq - differs by method)."""
    return (
        tuple(decision.num_tokens_across_dp),
        decision.should_ubatch,
        decision.should_pad,
        decision.cudagraph_mode,
        decision.any_unfinished,
        decision.all_idle,
    )


def expected_payload(tables: Sequence[Sequence[StepReport]], round_index: int) -> Payload:
    return payload(decide([report_for(tables, r, round_index) for r in range(len(tables))]))


def floor_report(report: StepReport, round_index: int) -> bytes:
    return FLOOR_REPORT.pack(round_index, *column(report))


def expected_floor_reply(tables: Sequence[Sequence[StepReport]], round_index: int) -> bytes:
    return b"".join(
        floor_report(report_for(tables, r, round_index), round_index) for r in range(len(tables))
    )
