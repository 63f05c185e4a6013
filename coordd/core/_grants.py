"""What a CURVE client key may register as: a group (name or fnmatch pattern) and a dp_rank,
either one open. Pure: the key files are read in `coordd.io._curve`; the registry asks
`refusal` at each Hello.

A `--curve-client-keys` entry binds its keys with a head before `=`: `N=PATH` (dp_rank N, any
group), `A-B=PATH` (dp_ranks A..B: a relay's node), `@GROUP=PATH` (any rank of GROUP),
`N@GROUP=PATH` or `A-B@GROUP=PATH` (those ranks of GROUP); a file named `rank<N>.key` is
bound to rank N unless the head names one. A key given in several entries
holds each grant; one grant open on both sides admits it as anything.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase

_HEAD = re.compile(r"(?:(?P<rank>\d+)(?:-(?P<last>\d+))?)?(?:@(?P<group>[^\s=]+))?")


@dataclass(frozen=True, slots=True)
class Grant:
    """One binding of a key: `group` an fnmatch pattern (None: any), `rank` (None: any) and,
    for a range, its `last` rank (None: `rank` alone)."""

    group: str | None = None
    rank: int | None = None
    last: int | None = None

    def allows(self, group: str, rank: int) -> bool:
        if self.rank is not None and not self.rank <= rank <= (self.last or self.rank):
            return False
        return self.group is None or fnmatchcase(group, self.group)

    def __str__(self) -> str:
        if self.rank is None:
            rank = "any dp_rank"
        elif self.last is None:
            rank = f"dp_rank {self.rank}"
        else:
            rank = f"dp_ranks {self.rank}-{self.last}"
        return rank if self.group is None else f"{rank} of group {self.group}"


#: A key given without a binding: it may register as any rank of any group.
ANY = Grant()


def split_entry(entry: str) -> tuple[Grant | None, str]:
    """A `--curve-client-keys` entry -> (the grant its head gives, None: none given; PATH)."""
    head, sep, tail = entry.partition("=")
    if sep:
        match = _HEAD.fullmatch(head.strip())
        if match is not None and head.strip():
            rank, last = match["rank"], match["last"]
            if rank is None:
                return Grant(match["group"]), tail.strip()
            first, end = int(rank), int(last) if last is not None else None
            if end is not None and end < first:
                raise ValueError("a range of dp_ranks runs low to high (A-B with A <= B)")
            return Grant(match["group"], first, end if end != first else None), tail.strip()
    return None, entry


def refusal(grants: Iterable[Grant], group: str, rank: int) -> str | None:
    """Why a key holding `grants` may not register as `rank` of `group`, or None if it may."""
    held = tuple(grants)
    if any(g.allows(group, rank) for g in held):
        return None
    return "bound to " + "; ".join(sorted({str(g) for g in held}))
