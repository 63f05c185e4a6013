"""What one rank sends for each of SGLang's DP attention syncs, and the result rebuilt from every
rank's values: pure functions over lists of ints (no torch, no sockets).

Both syncs write only this rank's row, so a coordd gather round of that row carries them
exactly:

- `exchange_sync_rows(global_flat, local_row, group)` fills `global_flat` with every rank's
  `local_row` in group-rank order (gloo's all_gather, or gather + broadcast): the rows side by
  side (`concat`).
- The elastic WORLD path of `MLPSyncBatchInfo.all_gather` zeroes a [slots, width] tensor, writes
  its row at slot = its WORLD rank (none when that is past the slots) and SUM-all-reduces it. A
  rank sends `[slot, *row]` (`slot_row`; slot -1 when its tensor is all zeros) and every rank
  adds the rows into their slots (`sum_slots`), wrapping as int64 does, in rank order: the
  all-reduce's result to the bit.
"""

from __future__ import annotations

from collections.abc import Sequence

from coordd.proto.errors import InvalidAnswer, InvalidReport

_WRAP = 1 << 64
_HALF = 1 << 63


def concat(rows: Sequence[Sequence[int]], width: int, seq: int) -> list[int]:
    """Every rank's row, in rank order, as one flat list; a row of another length (a rank left
    out of the round by coordd's neutralize mode) is coordd's misfit: SGLang's gather has no
    such case."""
    flat: list[int] = []
    for rank, row in enumerate(rows):
        if len(row) != width:
            raise InvalidAnswer(seq, f"rows[{rank}]", len(row), f"{width} values")
        flat += row
    return flat


def slot_row(values: Sequence[int], width: int, rank: int) -> list[int]:
    """`[slot, *row]` for a flat [slots, width] tensor that is zero outside one row; `[-1, 0...]`
    for an all-zero tensor. A tensor with two nonzero rows does not fit the layout:
    `InvalidReport` naming `rank` (SGLang's code writes one row, so this is a changed SGLang)."""
    slot = -1
    for start in range(0, len(values), width):
        if any(values[start : start + width]):
            if slot != -1:
                raise InvalidReport(rank, "nonzero rows", f"{slot} and {start // width}", "one")
            slot = start // width
    if slot == -1:
        return [-1, *([0] * width)]
    return [slot, *values[slot * width : (slot + 1) * width]]


def sum_slots(rows: Sequence[Sequence[int]], slots: int, width: int, seq: int) -> list[int]:
    """The SUM of every rank's one-row tensor, from their `slot_row`s: a flat [slots, width]."""
    out = [0] * (slots * width)
    for rank, row in enumerate(rows):
        if len(row) != width + 1:
            raise InvalidAnswer(seq, f"rows[{rank}]", len(row), f"{width + 1} values")
        slot = row[0]
        if slot == -1:
            continue
        if not 0 <= slot < slots:
            raise InvalidAnswer(seq, f"rows[{rank}][0]", slot, f"a slot in -1..{slots - 1}")
        base = slot * width
        for i, value in enumerate(row[1:]):
            total = out[base + i] + value
            out[base + i] = (total + _HALF) % _WRAP - _HALF
    return out
