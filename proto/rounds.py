"""A round as records: the open one (`Round`, the coordinator's ledger), and what readers see of
it while open (`OpenRound`) and once it completed (`CompletedRound`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from coordd.proto.messages import GatherReport, Report, StepKind


class Round:
    """One round, from its first report to its decision or failure.

    Its seq, kind (a gather round's: and site) and start are fixed by the first report, which
    the round keeps (`first`: a gather round's reports must match its length); the ledger
    (each rank's report and when it came) only fills in, except that an elastic loss
    withdraws the lost rank's entry. When the round ends the machine drops it whole and the
    next report opens a new one.
    """

    __slots__ = ("arrivals", "first", "kind", "label", "reported", "reports", "seq", "started")

    def __init__(self, seq: int, first: Report, started: float, dp_size: int) -> None:
        self.seq = seq
        self.first = first
        self.kind = first.kind
        #: What a report must say to belong here: the kind's name, or "gather:<site>".
        self.label = first.label
        self.started = started
        self.reports: list[Report | None] = [None] * dp_size
        self.arrivals: list[float | None] = [None] * dp_size
        self.reported = 0

    @property
    def site(self) -> str:
        """A gather round's call site; "" for a policy round."""
        first = self.first
        return first.site if type(first) is GatherReport else ""

    def add(self, rank: int, report: Report, now: float) -> None:
        self.reports[rank] = report
        self.arrivals[rank] = now
        self.reported += 1

    def withdraw(self, rank: int) -> None:
        if self.reports[rank] is not None:
            self.reports[rank] = None
            self.arrivals[rank] = None
            self.reported -= 1

    def view(self) -> OpenRound:
        return OpenRound(
            self.seq, self.kind, self.started, self.reported, tuple(self.arrivals), self.site
        )


class CompletedRound(NamedTuple):
    """The last completed round, for metrics and status (recorded once per round, never read
    on the hot path): when it started (the first report) and completed, and whose report
    completed it (the straggler; None when a rank loss completed it)."""

    seq: int
    kind: StepKind
    started: float
    completed: float
    last_rank: int | None
    arrivals: list[float | None]  # each rank's report time; None for a rank left out
    site: str = ""  # a gather round's call site; "" for a policy round


@dataclass(frozen=True, slots=True)
class OpenRound:
    """The open round as it stood when the snapshot was taken."""

    seq: int
    kind: StepKind
    started: float
    reported: int
    arrivals: tuple[float | None, ...]
    #: A gather round's call site; "" for a policy round.
    site: str = ""
