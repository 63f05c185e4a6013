"""A round as records: the open one (`Round`, the coordinator's ledger), and what readers see of
it while open (`OpenRound`) and once it completed (`CompletedRound`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

from coordd.proto.messages import StepKind

_T = TypeVar("_T")


def majority(labels: Sequence[_T]) -> _T:
    """The label most ranks report (`labels` in rank order); a tie goes to the label of the
    lowest rank among the tied ones. Both paths take a disputed round's kind by this rule:
    coordd over the reports it collected, the device path over the gathered matrix."""
    counts = Counter(labels)
    top = max(counts.values())
    return next(label for label in labels if counts[label] == top)


class Part(Protocol):
    """What a member sends for a round: a rank's report, or a relay's bundle for its ranks."""

    @property
    def seq(self) -> int: ...
    @property
    def kind(self) -> StepKind: ...
    @property
    def label(self) -> str: ...


class Verdict(NamedTuple):
    """Who is at fault in a round whose reports disagree on the kind (or gather site)."""

    #: The round's kind by the evidence: the label most reports carry (see `majority`).
    label: str
    kind: StepKind
    #: The lowest rank whose report carries another label, and that label.
    rank: int
    got: str


class Round:
    """One round, from its first report to its decision or failure.

    Its seq, kind (a gather round's: and site) and start are fixed by the first report, which
    the round keeps (`first`: a gather round's reports must match its length); the ledger
    (each rank's report and when it came) only fills in, except that an elastic loss
    withdraws the lost rank's entry. When the round ends the machine drops it whole and the
    next report opens a new one.
    """

    __slots__ = (
        "arrivals",
        "disputed",
        "first",
        "kind",
        "label",
        "reported",
        "reports",
        "seq",
        "started",
    )

    def __init__(self, seq: int, first: Part, started: float, dp_size: int) -> None:
        self.seq = seq
        self.first = first
        self.kind = first.kind
        #: What a report must say to belong here: the kind's name, or "gather:<site>".
        self.label = first.label
        self.started = started
        self.reports: list[Part | None] = [None] * dp_size
        self.arrivals: list[float | None] = [None] * dp_size
        self.reported = 0
        #: A report of another kind (or gather site) than the first came: the round cannot be
        #: decided, and its culprit is named from all its reports (`verdict`) once every live
        #: rank reported or the step timeout passed, never from who happened to come first.
        self.disputed = False

    @property
    def site(self) -> str:
        """A gather round's call site; "" for a policy round."""
        first = self.first
        return first.site if first.kind is StepKind.GATHER else ""  # type: ignore[attr-defined]

    def add(self, rank: int, report: Part, now: float) -> None:
        self.reports[rank] = report
        self.arrivals[rank] = now
        self.reported += 1

    def withdraw(self, rank: int) -> None:
        if self.reports[rank] is not None:
            self.reports[rank] = None
            self.arrivals[rank] = None
            self.reported -= 1

    def first_of(self, label: str) -> Part | None:
        """The earliest-ranked report carrying `label` (a disputed round's length checks)."""
        if label == self.label:
            return self.first
        return next((r for r in self.reports if r is not None and r.label == label), None)

    def verdict(self) -> Verdict | None:
        """The culprit of a disputed round by the evidence: the majority label over the reports
        in hand (rank order; a tie goes to the lowest rank's), and the lowest rank reporting
        another. None if the reports in hand agree (the rank that disagreed was withdrawn): the
        round is then re-based on them and may be decided."""
        present = [(r, rep) for r, rep in enumerate(self.reports) if rep is not None]
        labels = [rep.label for _, rep in present]
        label = majority(labels) if labels else self.label
        for rank, rep in present:
            if rep.label != label:
                kind = next(rep.kind for _, rep in present if rep.label == label)
                return Verdict(label, kind, rank, rep.label)
        if present:
            self.first = present[0][1]
            self.kind = self.first.kind
            self.label = label
        self.disputed = False
        return None

    def view(self) -> OpenRound:
        return OpenRound(
            self.seq, self.kind, self.started, self.reported, tuple(self.arrivals), self.site
        )


class Decided(NamedTuple):
    """The last decided round and its outcome: a member that re-sends its part gets it again."""

    round: Round
    decision: Any


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
