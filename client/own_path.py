"""The two exchanges of a group switching paths, run over the group's own process group.

Each is one SUM all-reduce of an int64 vector in which every rank fills only its own part (so
the sum is a gather), bounded by a deadline: `gather_rows` for the settlement and the vote
(`coordd.client.switch`), `take_answer` for the answer a rank behind missed. A rank that does
not join in time ends them with `CoordinatorUnavailable`: the group lost coordd and could not
meet on its own path, and no rank goes on alone.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from coordd.client.switch import SETTLE_FIELDS, Settlement, settle, settle_row
from coordd.proto.errors import CoordinatorUnavailable


def _sum(group: Any, vector: torch.Tensor, timeout: float, what: str) -> torch.Tensor:
    work = dist.all_reduce(vector, group=group, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        raise CoordinatorUnavailable(
            f"coordd was lost and the group's {what} on its own process group did not "
            f"complete within {timeout:g}s: {exc}"
        ) from None
    return vector


def gather_rows(
    group: Any, row: Sequence[int], rank: int, size: int, timeout: float, what: str
) -> list[list[int]]:
    """Every rank's `row` (all of one length), in rank order."""
    matrix = torch.zeros((size, len(row)), dtype=torch.int64)
    matrix[rank] = torch.tensor(row, dtype=torch.int64)
    return _sum(group, matrix, timeout, what).tolist()


def take_answer(
    group: Any, settlement: Settlement, rank: int, answer: Sequence[int] | None, timeout: float
) -> list[int]:
    """The answer of the round the ranks behind lack, from `settlement.source` (which passes
    its `answer`; every other rank passes None)."""
    vector = torch.zeros(settlement.answer_len, dtype=torch.int64)
    if rank == settlement.source:
        assert answer is not None and len(answer) == settlement.answer_len
        vector += torch.tensor(list(answer), dtype=torch.int64)
    return _sum(group, vector, timeout, "catch-up").tolist()


def settle_over(
    group: Any,
    rank: int,
    size: int,
    completed: int,
    pending: tuple[str, int],
    last: tuple[str, Sequence[int]] | None,
    timeout: float,
) -> tuple[Settlement, list[int] | None]:
    """The settlement (`coordd.client.switch.settle`) and, for a rank behind, the answer of
    the round it lacks (None for the others). `last`: this rank's last completed round's
    site and answer."""
    row = settle_row(completed, pending, None if last is None else (last[0], len(last[1])))
    assert len(row) == SETTLE_FIELDS
    settlement = settle(gather_rows(group, row, rank, size, timeout, "settlement"))
    if not settlement.behind:
        return settlement, None
    answer = take_answer(
        group, settlement, rank, last[1] if rank == settlement.source and last else None, timeout
    )
    return settlement, (answer if rank in settlement.behind else None)
