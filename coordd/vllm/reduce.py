"""A collective's result from every rank's values, and what a rank sends of its tensor.

vLLM's DP syncs are small integer all-reduces in which each worker writes only its own column of
a [..., dp] tensor (`Layout.COLUMN`: that column travels) or, for the engine cores' tiny
vectors, the whole tensor (`Layout.WHOLE`). A gather round brings every rank's values back in
rank order and `reduce_rows` applies the collective's op (SUM, MAX or MIN) locally, in int64:
for integer tensors the same values as gloo's or NCCL's, whatever the layout. Decided by dtype
and shape alone (`can_gather`, `fits`), so every rank of a sync decides the same.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from coordd.proto.messages import max_gather_values

_INTEGER_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
)


class ReduceOp(str, enum.Enum):
    """The collective's op, reproduced locally over the gathered rows."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"


class Layout(str, enum.Enum):
    """What a rank sends: its own column of a [..., dp] tensor, or the whole tensor."""

    COLUMN = "col"
    WHOLE = "whole"


def can_gather(tensor: torch.Tensor) -> bool:
    """An integer tensor (the only kind whose reduce is exact in any order), decided by dtype
    alone, so every rank of a sync decides the same."""
    return isinstance(tensor, torch.Tensor) and tensor.dtype in _INTEGER_DTYPES


def fits(tensor: torch.Tensor, layout: Layout, dp_size: int) -> bool:
    """Whether one rank's values fit a gather round of `dp_size` ranks (the wire's bound,
    lower than MAX_GATHER_VALUES where dp rows would not fit a frame); by shape alone."""
    count = tensor.numel() // dp_size if layout is Layout.COLUMN else tensor.numel()
    return count <= max_gather_values(dp_size)


def own_column_only(tensor: torch.Tensor, dp_rank: int, dp_size: int) -> bool:
    """True if the tensor is [..., dp_size] and zero outside column `dp_rank`."""
    if tensor.dim() == 0 or tensor.shape[-1] != dp_size:
        return False
    # One host list and Python slices: about half the time of copying, zeroing the column
    # and asking torch for any() (this runs on every worker sync).
    if not 0 <= dp_rank < dp_size:  # not a rank of this group: torch's indexing decides
        rest = tensor.detach().to("cpu", copy=True)
        rest[..., dp_rank] = 0
        return not bool(rest.any())
    flat = _host(tensor).reshape(-1).tolist()
    return not any(any(flat[col::dp_size]) for col in range(dp_size) if col != dp_rank)


def _host(tensor: torch.Tensor) -> torch.Tensor:
    src = tensor.detach()
    return src if src.device.type == "cpu" else src.cpu()


def contribution(tensor: torch.Tensor, layout: Layout, dp_rank: int) -> list[int]:
    """The values this rank sends: its column (row-major over the leading dims) or the whole
    tensor (row-major)."""
    src = _host(tensor)
    if layout is Layout.COLUMN:
        if src.dim() and 0 <= dp_rank < src.shape[-1]:
            # src[..., dp_rank], row-major, is every shape[-1]-th value of the flat list.
            return [int(v) for v in src.reshape(-1).tolist()[dp_rank :: src.shape[-1]]]
        src = src[..., dp_rank]
    return [int(v) for v in src.reshape(-1).tolist()]


def reduce_rows(
    rows: Sequence[Sequence[int]],
    like: torch.Tensor,
    layout: Layout,
    op: ReduceOp,
) -> torch.Tensor:
    """The collective's result from every rank's values: a CPU tensor of `like`'s dtype and
    shape. A rank left out of the round (an empty row: coordd's neutralize mode) contributes
    nothing (zeros to a SUM, no candidate to a MAX or MIN)."""
    shape, dtype = tuple(like.shape), like.dtype
    fast = _reduce_rows_fast(rows, shape, dtype, layout, op)
    if fast is not None:
        return fast
    present = [(rank, row) for rank, row in enumerate(rows) if len(row)]
    if layout is Layout.COLUMN and op is ReduceOp.SUM:
        # Every rank's contribution is zero outside its column: the sum is the columns side
        # by side, exactly.
        out = torch.zeros(shape, dtype=dtype)
        for rank, row in present:
            out[..., rank] = torch.tensor(row, dtype=torch.int64).reshape(shape[:-1]).to(dtype)
        return out
    fulls: list[torch.Tensor] = []
    for rank, row in present:
        values = torch.tensor(row, dtype=torch.int64)
        if layout is Layout.COLUMN:
            full = torch.zeros(shape, dtype=torch.int64)
            full[..., rank] = values.reshape(shape[:-1])
        else:
            full = values.reshape(shape)
        fulls.append(full)
    if not fulls:
        return torch.zeros(shape, dtype=dtype)
    acc = fulls[0].clone()
    for full in fulls[1:]:
        if op is ReduceOp.SUM:
            acc.add_(full)
        elif op is ReduceOp.MAX:
            torch.maximum(acc, full, out=acc)
        else:
            torch.minimum(acc, full, out=acc)
    return acc.to(dtype)


def _reduce_rows_fast(
    rows: Sequence[Sequence[int]],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    layout: Layout,
    op: ReduceOp,
) -> torch.Tensor | None:
    """`reduce_rows` with one tensor made instead of one or more per rank (the per-rank
    tensors were most of the plugin's own time per sync, growing with dp), for the
    shapes the syncs send: a COLUMN SUM whose rows are one per column, or a WHOLE
    reduce. The same values (int64 arithmetic, then the same cast to `dtype`); None
    for anything else, including rows of the wrong length, which `reduce_rows`
    handles (and rejects) itself."""
    numel = 1
    for n in shape:
        numel *= n
    if layout is Layout.COLUMN:
        if op is not ReduceOp.SUM or not shape or len(rows) != shape[-1]:
            return None
        count = numel // shape[-1] if shape[-1] else 0
        if count == 0 or any(len(row) not in (0, count) for row in rows):
            return None
        zeros = [0] * count
        # The sum is the columns side by side: value i of rank r lands at flat i * dp + r.
        flat = [
            v
            for values in zip(*(row if len(row) else zeros for row in rows), strict=True)
            for v in values
        ]
        return torch.tensor(flat, dtype=torch.int64).reshape(shape).to(dtype)
    present = [list(row) for row in rows if len(row)]
    if not present or numel == 0 or any(len(row) != numel for row in present):
        return None
    stacked = torch.tensor(present, dtype=torch.int64)
    if op is ReduceOp.SUM:
        acc = stacked.sum(dim=0)
    elif op is ReduceOp.MAX:
        acc = stacked.amax(dim=0)
    else:
        acc = stacked.amin(dim=0)
    return acc.reshape(shape).to(dtype)
