"""The checker: reads every process's history of one scenario and holds it to the rules.

For every round (epoch, seq) that any rank saw an outcome of:
- a decision must be the same for every rank that got one, be of that round (epoch, seq, kind),
  and equal the policy applied to the first report each rank sent for that round; a decision
  built without some rank's report, or reaching a rank for a round it did not report for, is a
  wrong decision;
- otherwise every rank must have got the same typed failure, of a type the fault explains, naming
  the injected culprit; a mix of decisions and failures in one round is a violation (except when
  coordd itself crashed mid-broadcast, or for the culprit's own view of a process fault);
- no failure before the fault was injected, and none at all where the fault must be absorbed;
  an `InvalidReport` names the field the fault set out of range.
Across the run: every rank that took part saw the failure, within the step timeout plus the
heartbeat timeout (plus a grace for scheduling); the culprit was refused where it must be; no
rank is left waiting (a round begun and never ended, a wait that coordd never answered, a process
still running at the deadline: each is a hang); every surviving rank finished its rounds; no
process logged a "violation" note (a rule it checked itself: a client misuse answered wrongly,
a stranger that received a rank's decision).
"""

from __future__ import annotations

import os

import msgspec

from coordd.testing.detection import check_detection
from coordd.testing.history import (
    Begin,
    Done,
    End,
    Inject,
    Note,
    Record,
    iter_logs,
    read_history,
    report_of,
)
from coordd.testing.round_rules import check_rounds
from coordd.testing.scenario import ScenarioInfo
from coordd.testing.verdict import PARTICIPANTS, Findings, ProcessLog, ScenarioResult, Sync

__all__ = ["ProcessLog", "ScenarioInfo", "ScenarioResult", "check_history", "check_scenario"]


def check_scenario(directory: str) -> ScenarioResult:
    """Load a scenario directory and check it: `scenario.json` (a `ScenarioInfo`), one history
    (`*.jsonl`) per process, the runner's among them (role "runner"), and `coordd.log`."""
    with open(os.path.join(directory, "scenario.json"), "rb") as f:
        info = msgspec.json.decode(f.read(), type=ScenarioInfo)
    logs: list[ProcessLog] = []
    runner: list[Record] = []
    for path in iter_logs(directory):
        header, records = read_history(path)
        if header is None:
            continue
        if header.role == "runner":
            runner = records
        else:
            logs.append(ProcessLog(header.name, header, records))
    coordd_log = ""
    coordd_path = os.path.join(directory, "coordd.log")
    if os.path.exists(coordd_path):
        with open(coordd_path, errors="replace") as f:
            coordd_log = f.read()
    result = check_history(info, logs, runner, coordd_log)
    result.directory = directory
    return result


def check_history(
    info: ScenarioInfo, logs: list[ProcessLog], runner: list[Record], coordd_log: str = ""
) -> ScenarioResult:
    """Judge one scenario's histories (pure: the unit tests feed it fabricated ones)."""
    result = ScenarioResult(fault=info.fault, seed=info.seed, dp=info.dp, transport=info.transport)
    if info.skipped:
        result.skipped = info.skipped
        return result
    found = Findings()
    by_name = {log.name: log for log in logs}
    deadline_kills = {
        r.detail for r in runner if isinstance(r, Note) and r.what == "killed at deadline"
    }
    for r in runner:
        if isinstance(r, Note) and r.what in ("harness error", "coordd died", "crashed", "gave up"):
            found.violations.append(f"{r.what}: {r.detail}".rstrip(": "))
    for log in logs:
        for r in log.records:
            if isinstance(r, Note) and r.what == "violation":
                # a rule the process checked itself (a second wait() that blocked, a start()
                # while open that went through, a taker that received a rank's decision)
                found.violations.append(f"{log.name}: {r.detail}")
    if "Traceback" in coordd_log:
        found.violations.append("coordd logged a traceback")

    injects = [r for log in logs for r in log.records if isinstance(r, Inject)]
    injects += [r for r in runner if isinstance(r, Inject)]
    t_inject = min((r.t for r in injects), default=None)
    result.injected = t_inject is not None
    if t_inject is None:
        found.violations.append("the fault was never injected")

    syncs = _syncs(logs, info, deadline_kills, found)
    culprit_log = by_name.get(info.culprit_name)
    # only a crash can cut a broadcast short; coordd that shuts down cleanly (SIGTERM) cannot
    crashed = any(isinstance(r, Inject) and "SIGKILL" in r.detail for r in runner)
    check_rounds(info, syncs, t_inject, culprit_log, crashed, result, found)
    check_detection(info, logs, syncs, t_inject, culprit_log, coordd_log, result, found)
    _check_finished(info, logs, deadline_kills, found)
    _check_switches(logs, found)

    result.wrong_decisions = len(found.wrong)
    result.hangs = len(found.hangs)
    result.violations = found.wrong + found.hangs + found.violations
    result.notes = found.notes
    return result


# -- the syncs of every rank ------------------------------------------------------------------


def _syncs(
    logs: list[ProcessLog], info: ScenarioInfo, deadline_kills: set[str], found: Findings
) -> list[Sync]:
    out: list[Sync] = []
    for log in logs:
        if log.role not in PARTICIPANTS:
            if log.name in deadline_kills:
                found.hangs.append(f"{log.name} was still running at the deadline")
            continue
        open_sync: Sync | None = None
        for record in log.records:
            if isinstance(record, Begin):
                if open_sync is not None:
                    found.hangs.append(
                        f"{log.name} began seq {record.seq} with seq {open_sync.seq} still open"
                    )
                open_sync = Sync(
                    log.name,
                    log.rank,
                    record.epoch,
                    record.seq,
                    record.kind,
                    [report_of(d) for d in record.sent],
                    record.t,
                )
                out.append(open_sync)
            elif isinstance(record, End):
                if open_sync is None:
                    open_sync = Sync(log.name, log.rank, record.epoch, record.seq, "", [], record.t)
                    out.append(open_sync)
                open_sync.end = record
                if record.no_answer:
                    found.hangs.append(
                        f"{log.name}: coordd never answered epoch {record.epoch} seq "
                        f"{record.seq} (waited {info.wait_timeout:g}s)"
                    )
                open_sync = None
        if log.name in deadline_kills:
            found.hangs.append(
                f"{log.name} was still running at the deadline"
                + (f" (waiting on seq {open_sync.seq})" if open_sync else "")
            )
        elif open_sync is not None and log.name not in info.harness_kills:
            found.hangs.append(f"{log.name} began seq {open_sync.seq} and never saw its outcome")
    return out


# -- the end ----------------------------------------------------------------------------------


def _check_finished(
    info: ScenarioInfo, logs: list[ProcessLog], deadline_kills: set[str], found: Findings
) -> None:
    """Every rank that was not killed on purpose ran to the end."""
    for log in logs:
        if log.role not in PARTICIPANTS or log.name in info.harness_kills:
            continue
        if log.name in deadline_kills:
            continue  # counted as a hang already
        done = [r for r in log.records if isinstance(r, Done)]
        if not done:
            found.violations.append(f"{log.name} exited without finishing its rounds")
        elif done[-1].reason != "end":
            found.violations.append(
                f"{log.name} stopped early: {done[-1].reason} at seq {done[-1].next_seq}"
            )


def _check_switches(logs: list[ProcessLog], found: Findings) -> None:
    """Ranks on a `FallbackClient` switch paths at the same rounds (their "switch" notes)."""
    seen = {
        log.name: [
            r.detail.split(":")[0]
            for r in log.records
            if isinstance(r, Note) and r.what == "switch"
        ]
        for log in logs
        if log.role == "fallback"
    }
    if len({tuple(rounds) for rounds in seen.values()}) > 1:
        found.violations.append(f"the ranks switched paths at different rounds: {seen}")
