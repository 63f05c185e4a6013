"""When a group leaves coordd for its own collective, and when it comes back: the rules, pure.

A group that loses coordd goes on over its own process group (the device path; inside vLLM,
vLLM's own collective). The shells (the vLLM plugin, `FallbackClient`) run two small
exchanges over that process group, each a SUM all-reduce in which every rank fills its own row,
and hand the gathered rows here; nothing here touches a socket, a tensor or a clock.

- The settlement, the first thing every rank does once it has lost coordd: each rank says how
  many rounds it has completed, and what the round it lacks and the round it last completed
  were (site and answer length). coordd answers a round only once every rank has reported it,
  so the counts differ by at most one: a rank one behind takes the answer it missed from the
  lowest rank ahead, and from then on every rank runs the same rounds on the device path.
- The vote, every `VOTE_EVERY` rounds on the device path: each rank says the epoch of the
  coordd it has registered with again (0: none yet); all the same and nonzero, and the whole
  group returns to coordd at that round.
- The pace of returns (`RejoinPacing`): a coordd that flaps does not make the group flap
  faster than a doubling back-off allows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from coordd.proto.errors import StepMismatch

#: Rounds on the device path between two votes on returning to coordd (a group whose rounds
#: are rare, such as vLLM's engine cores', may vote at each).
VOTE_EVERY = 8
#: The first wait before a rank tries coordd again after a fallback, and the longest.
REJOIN_FIRST = 1.0
REJOIN_LONGEST = 30.0
#: A group that stayed on coordd this long since its last return starts its back-off afresh.
REJOIN_CALM = 60.0

#: A settlement row: present, completed, pending site, pending length, last site, last length.
SETTLE_FIELDS = 6
_PRESENT, _COMPLETED, _PENDING_SITE, _PENDING_LEN, _LAST_SITE, _LAST_LEN = range(SETTLE_FIELDS)


def site_code(site: str) -> int:
    """A 62-bit code of a round's site label: fits an int64 slot, equal on every rank."""
    digest = hashlib.blake2b(site.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def settle_row(completed: int, pending: tuple[str, int], last: tuple[str, int] | None) -> list[int]:
    """This rank's row of the settlement: `completed` rounds done, the round it lacks
    (`pending`: site and answer length) and the last one it completed (None if none)."""
    last_site, last_len = (site_code(last[0]), last[1]) if last is not None else (0, -1)
    return [1, completed, site_code(pending[0]), pending[1], last_site, last_len]


@dataclass(frozen=True)
class Settlement:
    """What the group does on the device path, the same on every rank.

    `completed`: rounds every rank has completed once the behind ranks took their answer (the
    round the group switched at is the next one). `behind`: ranks that lack the answer of round
    `completed - 1`, and `source`, the rank that gives it (-1 and () when no rank is behind);
    `answer_len`: that answer's length."""

    completed: int
    behind: tuple[int, ...] = ()
    source: int = -1
    answer_len: int = 0


def settle(rows: Sequence[Sequence[int]]) -> Settlement:
    """The group's settlement from every rank's `settle_row`, or `StepMismatch` naming the
    lowest rank that cannot be where it says (two rounds apart from another, or at another
    site than the others' round): a group never guesses an answer."""
    for rank, row in enumerate(rows):
        if row[_PRESENT] != 1:
            raise StepMismatch(rank, -1, "settlement", -1, "no row")
    counts = [row[_COMPLETED] for row in rows]
    top = max(counts)
    for rank, count in enumerate(counts):
        if count < top - 1:
            raise StepMismatch(rank, top - 1, "settlement", count, "settlement")
    behind = tuple(rank for rank, count in enumerate(counts) if count == top - 1)
    if not behind:  # every rank lacks the same round: the device path runs it
        first = (rows[0][_PENDING_SITE], rows[0][_PENDING_LEN])
        _check_round(rows, range(len(rows)), (_PENDING_SITE, _PENDING_LEN), first, top)
        return Settlement(top)
    ahead = [rank for rank, count in enumerate(counts) if count == top]
    source = ahead[0]
    want = (rows[source][_LAST_SITE], rows[source][_LAST_LEN])
    # the round the ranks behind lack is the one the ranks ahead completed last
    _check_round(rows, ahead, (_LAST_SITE, _LAST_LEN), want, top - 1)
    _check_round(rows, behind, (_PENDING_SITE, _PENDING_LEN), want, top - 1)
    return Settlement(top, behind, source, want[1])


def _check_round(
    rows: Sequence[Sequence[int]],
    ranks: Sequence[int],
    fields: tuple[int, int],
    expected: tuple[int, int],
    index: int,
) -> None:
    """Every rank of `ranks` has round `index` at the site and answer length `expected`."""
    site, length = fields
    for rank in ranks:
        got = (rows[rank][site], rows[rank][length])
        if got != expected:
            raise StepMismatch(rank, index, _round_name(*expected), index, _round_name(*got))


def _round_name(site: int, length: int) -> str:
    return f"site {site:x} len {length}"


def votes_now(completed: int, switched_at: int, every: int = VOTE_EVERY) -> bool:
    """Whether the round after `completed` ones opens with a vote, for a group that switched to
    the device path when it had completed `switched_at` and votes `every` so many rounds (the
    same answer on every rank)."""
    since = completed - switched_at
    return since > 0 and since % every == 0


def returns(epochs: Sequence[int]) -> bool:
    """The vote: every rank registered again with the same coordd (one epoch, not 0)."""
    return epochs[0] != 0 and all(epoch == epochs[0] for epoch in epochs)


class RejoinPacing:
    """When a rank on the device path may next try coordd (time passed in, in seconds).

    Each fallback that comes within `REJOIN_CALM` of the last return doubles the wait before the
    next try, up to `REJOIN_LONGEST`; a calm spell starts it afresh."""

    def __init__(self) -> None:
        self.wait = REJOIN_FIRST
        self.returned_at: float | None = None
        self.not_before = 0.0

    def fell_back(self, now: float) -> None:
        if self.returned_at is not None and now - self.returned_at < REJOIN_CALM:
            self.wait = min(self.wait * 2, REJOIN_LONGEST)
        else:
            self.wait = REJOIN_FIRST
        self.not_before = now + self.wait

    def came_back(self, now: float) -> None:
        self.returned_at = now

    def may_try(self, now: float) -> bool:
        return now >= self.not_before
