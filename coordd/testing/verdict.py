"""What the checker works on and hands back: each process's history, the rank syncs in it,
the findings so far, and the verdict on one scenario."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from coordd.proto.messages import StepReport
from coordd.testing.history import End, Header, Record

PARTICIPANTS = ("rank", "raw", "fallback")


class ScenarioResult(msgspec.Struct, kw_only=True):
    fault: str
    seed: int
    dp: int
    transport: str
    directory: str = ""
    skipped: str = ""
    injected: bool = False
    #: None where there is nothing to detect (a straggler under the timeout)
    detected: bool | None = None
    ttd: float | None = None
    wrong_decisions: int = 0
    hangs: int = 0
    rounds: int = 0
    failed_rounds: int = 0
    violations: list[str] = []
    notes: list[str] = []

    @property
    def ok(self) -> bool:
        return (
            not self.skipped
            and not self.violations
            and not self.wrong_decisions
            and (not self.hangs)
        )


@dataclass
class ProcessLog:
    name: str
    header: Header
    records: list[Record]

    @property
    def role(self) -> str:
        return self.header.role

    @property
    def rank(self) -> int:
        return self.header.rank


@dataclass
class Sync:
    process: str
    rank: int
    epoch: int
    seq: int
    kind: str
    sent: list[StepReport]
    t_begin: float
    end: End | None = None


@dataclass
class Findings:
    wrong: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
