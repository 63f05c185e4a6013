"""Test an engine's coordination against a real coordd, faults included (as `trio.testing` is
to trio): the pieces coordd's own chaos suite is built from.

- `CoorddProcess`: a real `coordd serve` child process (`with CoorddProcess(dp=2, bind=...)`).
- `FakeClock`: time a test moves by hand, for the pieces that take their time passed in.
- `RawRank`: a rank that speaks the real wire format but sends whatever report or Hello it is
  given (a skipped seq, the wrong kind, another rank's id), and judges the answers as the real
  client does.
- `RoguePeer` and `bad_frame`: garbage, truncated, oversized and misdirected frames.
- The history: each process logs what it sent and what came back with a `HistoryWriter`
  (`Begin` before a round, `End` with its decision or typed error, `Inject` at the fault).
- The checker: `check_history(ScenarioInfo(...), logs, runner_records)` holds every process's
  history to the rules (one decision per round, equal to the policy, or one typed error the
  fault explains; every rank saw the failure in time; no rank left waiting) and returns a
  `ScenarioResult` whose `.violations` say what broke.

This package imports coordd.proto and coordd.client only; the daemon runs as a subprocess.
coordd's own load and attack generators are tools, not this kit: `python -m coordd.tools.load`.
"""

from coordd.testing.checker import check_history, check_scenario
from coordd.testing.clock import FakeClock
from coordd.testing.history import (
    Begin,
    Done,
    End,
    ErrorInfo,
    Header,
    HistoryWriter,
    Inject,
    Note,
    Record,
    Refused,
    Registered,
    decision_dict,
    error_info,
    read_history,
    report_dict,
)
from coordd.testing.process import CoorddProcess
from coordd.testing.rawrank import RawRank
from coordd.testing.rogue import CATEGORIES, RoguePeer, bad_frame
from coordd.testing.scenario import Expect, ScenarioInfo
from coordd.testing.verdict import ProcessLog, ScenarioResult

__all__ = [
    # processes
    "CoorddProcess",
    "FakeClock",
    "RawRank",
    "RoguePeer",
    "bad_frame",
    "CATEGORIES",
    # the history each process writes
    "HistoryWriter",
    "read_history",
    "Header",
    "Record",
    "Registered",
    "Refused",
    "Begin",
    "End",
    "Inject",
    "Note",
    "Done",
    "ErrorInfo",
    "error_info",
    "report_dict",
    "decision_dict",
    # the checker
    "Expect",
    "ScenarioInfo",
    "ProcessLog",
    "ScenarioResult",
    "check_history",
    "check_scenario",
]
