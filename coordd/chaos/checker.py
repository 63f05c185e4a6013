"""The checker: reads every process's history of one scenario and holds it to the rules.

For every round (epoch, seq) that any rank saw an outcome of:
- a decision must be the same for every rank that got one, be of that round (epoch, seq, kind),
  and equal the policy applied to the first report each rank sent for that round; a decision
  built without some rank's report, or reaching a rank for a round it did not report for, is a
  wrong decision;
- otherwise every rank must have got the same typed failure, of a type the fault explains, naming
  the injected culprit; a mix of decisions and failures in one round is a violation (except when
  coordd itself crashed mid-broadcast, or for the culprit's own view of a process fault);
- no failure before the fault was injected, and none at all where the fault must be absorbed.
Across the run: every rank that took part saw the failure, within the step timeout plus the
heartbeat timeout (plus a grace for scheduling); the culprit was refused where it must be; no
rank is left waiting (a round begun and never ended, a wait that coordd never answered, a process
still running at the deadline: each is a hang); every surviving rank finished its rounds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import msgspec

from coordd.chaos.history import (
    Begin,
    Done,
    End,
    ErrorInfo,
    Header,
    Inject,
    Note,
    Record,
    Refused,
    Registered,
    decision_of,
    iter_logs,
    read_history,
    report_of,
)
from coordd.chaos.rogue import APP_LEVEL
from coordd.chaos.scenarios import ScenarioInfo
from proto.messages import StepReport
from proto.policy import decide

PARTICIPANTS = ("rank", "raw")


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
class _Findings:
    wrong: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def check_scenario(directory: str) -> ScenarioResult:
    """Load a scenario directory written by the runner and check it."""
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
    found = _Findings()
    by_name = {log.name: log for log in logs}
    deadline_kills = {
        r.detail for r in runner if isinstance(r, Note) and r.what == "killed at deadline"
    }
    for r in runner:
        if isinstance(r, Note) and r.what in ("harness error", "coordd died", "crashed", "gave up"):
            found.violations.append(f"{r.what}: {r.detail}".rstrip(": "))
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
    _check_rounds(info, syncs, t_inject, culprit_log, crashed, result, found)
    _check_detection(info, logs, syncs, t_inject, culprit_log, coordd_log, result, found)
    _check_finished(info, logs, deadline_kills, found)

    result.wrong_decisions = len(found.wrong)
    result.hangs = len(found.hangs)
    result.violations = found.wrong + found.hangs + found.violations
    result.notes = found.notes
    return result


# -- the syncs of every rank ------------------------------------------------------------------


def _syncs(
    logs: list[ProcessLog], info: ScenarioInfo, deadline_kills: set[str], found: _Findings
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
                        f"{record.seq} (waited {info.settings.wait_timeout:g}s)"
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


# -- every round ------------------------------------------------------------------------------


def _first_reports(syncs: list[Sync]) -> dict[tuple[int, int], dict[int, StepReport]]:
    """For each round, the first report each rank sent for it (what coordd could have used)."""
    sent: list[tuple[float, int, int, StepReport]] = []
    for sync in syncs:
        for i, report in enumerate(sync.sent):
            if report.dp_rank == sync.rank:  # a report claiming another rank is never its
                sent.append((sync.t_begin, i, sync.rank, report))
    sent.sort(key=lambda x: (x[0], x[1]))
    out: dict[tuple[int, int], dict[int, StepReport]] = {}
    for _, _, rank, report in sent:
        out.setdefault((report.epoch, report.seq), {}).setdefault(rank, report)
    return out


def _check_rounds(
    info: ScenarioInfo,
    syncs: list[Sync],
    t_inject: float | None,
    culprit_log: ProcessLog | None,
    crashed: bool,
    result: ScenarioResult,
    found: _Findings,
) -> None:
    expect = info.expect
    reports = _first_reports(syncs)
    rounds: dict[tuple[int, int], list[Sync]] = {}
    for sync in syncs:
        if sync.end is not None and not sync.end.no_answer:
            rounds.setdefault((sync.epoch, sync.seq), []).append(sync)
    injected_kind = _injected_kind(culprit_log)
    own_view = expect.culprit_view in ("any", "gone")
    for (epoch, seq), members in sorted(rounds.items()):
        where = f"epoch {epoch} seq {seq}"
        decided = [s for s in members if s.end and s.end.decision is not None]
        failed = [s for s in members if s.end and s.end.error is not None]
        if decided:
            result.rounds += 1
            _check_decisions(info, epoch, seq, decided, reports.get((epoch, seq), {}), found)
        if failed:
            result.failed_rounds += 1
        group_failed = [s for s in failed if not (own_view and s.process == info.culprit_name)]
        if decided and group_failed:
            types = {s.end.error.type for s in group_failed if s.end and s.end.error}
            if expect.split_allowed and crashed and types == {"CoordinatorUnavailable"}:
                found.notes.append(
                    f"{where}: coordd died mid-broadcast (decision for "
                    f"{len(decided)}, unavailable for {len(group_failed)})"
                )
            else:
                found.violations.append(
                    f"{where}: split outcome: decision for "
                    f"{sorted(s.process for s in decided)}, errors for "
                    f"{sorted(s.process for s in group_failed)}"
                )
        errors = [(s.process, s.end.error) for s in group_failed if s.end and s.end.error]
        signatures = {e.signature() for _, e in errors}
        if len(signatures) > 1:
            found.violations.append(
                f"{where}: ranks got different errors: "
                + "; ".join(f"{p}: {e.type}{e.culprits}" for p, e in errors)
            )
        for process, error in {e.signature(): (p, e) for p, e in errors}.values():
            t = min(s.end.t for s in group_failed if s.end and s.process == process)
            _attribute(info, where, process, error, t, t_inject, injected_kind, found)


def _check_decisions(
    info: ScenarioInfo,
    epoch: int,
    seq: int,
    decided: list[Sync],
    reports: dict[int, StepReport],
    found: _Findings,
) -> None:
    where = f"epoch {epoch} seq {seq}"
    decisions = [(s, decision_of(s.end.decision)) for s in decided if s.end and s.end.decision]
    first = decisions[0][1]
    for sync, decision in decisions:
        if (decision.epoch, decision.seq) != (epoch, seq) or (
            sync.kind and decision.kind.value != sync.kind
        ):
            found.wrong.append(
                f"{where}: {sync.process} got the decision of epoch {decision.epoch} seq "
                f"{decision.seq} kind {decision.kind.value} for its {sync.kind} round"
            )
            return
        if not any(r.dp_rank == sync.rank and r.seq == seq for r in sync.sent):
            found.wrong.append(
                f"{where}: {sync.process} got a decision for a round it did not report for"
            )
            return
        if decision != first:
            found.wrong.append(
                f"{where}: ranks got different decisions ({decided[0].process} vs {sync.process})"
            )
            return
    missing = [r for r in range(info.dp) if r not in reports]
    if missing:
        found.wrong.append(f"{where}: decided without the reports of ranks {missing}")
        return
    expected = decide([reports[r] for r in range(info.dp)], epoch=epoch, seq=seq, kind=first.kind)
    if expected != first:
        found.wrong.append(
            f"{where}: the decision differs from the policy applied to the "
            f"reports: got {first}, the policy says {expected}"
        )


def _injected_kind(culprit_log: ProcessLog | None) -> str:
    if culprit_log is None:
        return ""
    injected = False
    for record in culprit_log.records:
        injected = injected or isinstance(record, Inject)
        if injected and isinstance(record, Begin) and record.sent:
            return str(record.sent[0]["kind"])
    return ""


def _attribute(
    info: ScenarioInfo,
    where: str,
    process: str,
    error: ErrorInfo,
    t: float,
    t_inject: float | None,
    injected_kind: str,
    found: _Findings,
) -> None:
    """Is this failure explained by the injected fault?"""
    expect = info.expect
    what = f"{where}: {process} got {error.type}{error.culprits} ({error.text})"
    if t_inject is None or t < t_inject:
        found.violations.append(f"{what} before the fault was injected")
        return
    if error.type not in expect.errors:
        found.violations.append(f"{what}, which {info.fault} does not explain")
        return
    if not expect.names_culprit or info.culprit in error.culprits:
        return
    if (
        expect.mirror_ok
        and error.type == "StepMismatch"
        and error.fields.get("expected_kind") == injected_kind
        and error.fields.get("got_kind") != injected_kind
    ):
        found.notes.append(
            f"{where}: the culprit reported first, so the mismatch names rank "
            f"{error.culprits} (expected {injected_kind})"
        )
        return
    found.violations.append(f"{what}: it does not name the culprit rank {info.culprit}")


# -- detection --------------------------------------------------------------------------------


def _check_detection(
    info: ScenarioInfo,
    logs: list[ProcessLog],
    syncs: list[Sync],
    t_inject: float | None,
    culprit_log: ProcessLog | None,
    coordd_log: str,
    result: ScenarioResult,
    found: _Findings,
) -> None:
    expect = info.expect
    if t_inject is None:
        result.detected = False if (expect.failure or expect.refusal) else None
        return
    detected: list[bool] = []
    times: list[float] = []
    if expect.failure:
        ok, t = _group_detection(info, logs, syncs, t_inject, found)
        detected.append(ok)
        if t is not None:
            times.append(t)
    if expect.culprit_must_fail:
        failed = [
            s
            for s in syncs
            if s.process == info.culprit_name and s.end and s.end.error and s.end.t >= t_inject
        ]
        if not failed:
            found.violations.append(
                f"the culprit {info.culprit_name} never got a typed error after the fault"
            )
    if expect.refusal:
        ok, t = _refusal(info, culprit_log, t_inject, coordd_log, found)
        detected.append(ok)
        if t is not None and not expect.failure:
            times.append(t)
        if ok and not expect.failure and culprit_log is not None:
            # unaffected: the group went on deciding rounds after the culprit was done
            last = [r.t for r in culprit_log.records if not isinstance(r, Done)]
            if culprit_log.role in PARTICIPANTS:  # a member: from its refusal on
                last = [r.t for r in culprit_log.records if isinstance(r, Refused)]
            t_after = max(last)
            if not any(s.end and s.end.decision and s.end.t > t_after for s in syncs):
                found.violations.append(
                    f"no round was decided after {info.culprit_name} was turned away: the "
                    "scenario did not show the group going on"
                )
    if detected:
        result.detected = all(detected)
    if times and result.detected:
        result.ttd = max(times)
        if result.ttd > info.settings.detection_bound:
            found.violations.append(
                f"detected after {result.ttd:.3f}s, beyond the step timeout + heartbeat "
                f"timeout + grace ({info.settings.detection_bound:g}s)"
            )


def _group_detection(
    info: ScenarioInfo,
    logs: list[ProcessLog],
    syncs: list[Sync],
    t_inject: float,
    found: _Findings,
) -> tuple[bool, float | None]:
    """Every rank process that was running at the injection saw a typed error after it."""
    latest: list[float] = []
    missed: list[str] = []
    for log in logs:
        if log.role not in PARTICIPANTS or log.name == info.culprit_name:
            continue
        if log.header.t > t_inject or not log.records or log.records[-1].t < t_inject:
            continue  # started after the fault (a replacement), or ended before it
        errors = [
            s.end.t
            for s in syncs
            if s.process == log.name and s.end and s.end.error and s.end.t >= t_inject
        ]
        if errors:
            latest.append(min(errors) - t_inject)
        else:
            missed.append(log.name)
    if missed:
        found.violations.append(f"the failure never reached {missed}")
        return False, None
    if not latest:
        found.violations.append("no rank was running when the fault was injected")
        return False, None
    return True, max(latest)


def _refusal(
    info: ScenarioInfo,
    culprit: ProcessLog | None,
    t_inject: float,
    coordd_log: str,
    found: _Findings,
) -> tuple[bool, float | None]:
    """The culprit was turned away, with the right typed error, and never let in."""
    want = info.expect.refusal
    if culprit is None:
        found.violations.append(f"no history from the culprit {info.culprit_name}")
        return False, None
    refused = [r for r in culprit.records if isinstance(r, Refused)]
    if want == "rogue":
        return _rogue_refused(culprit, refused, coordd_log, found), None
    if culprit.role not in PARTICIPANTS and any(isinstance(r, Registered) for r in culprit.records):
        found.violations.append(f"coordd admitted {info.culprit_name}, which it must refuse")
        return False, None
    kind, _, reason = want.partition(":")
    for r in refused:
        if r.error.type != kind or (reason and r.error.reason != reason):
            continue
        if kind == "ProtocolError" and r.error.culprits != [info.culprit]:
            found.violations.append(
                f"the refusal names ranks {r.error.culprits}, not the sender {info.culprit}: "
                f"{r.error.text}"
            )
            return False, None
        return True, r.t - t_inject
    got = [f"{r.error.type}:{r.error.reason}" for r in refused]
    found.violations.append(f"{info.culprit_name} was not refused with {want} (got {got})")
    return False, None


def _rogue_refused(
    rogue: ProcessLog, refused: list[Refused], coordd_log: str, found: _Findings
) -> bool:
    notes = [r for r in rogue.records if isinstance(r, Note)]
    sent_app = sum(n.count for n in notes if n.what == "sent" and n.detail in APP_LEVEL)
    dropped = coordd_log.count("dropped a bad frame")
    ok = True
    if not any(n.what == "pong" for n in notes):
        found.violations.append("coordd did not answer a heartbeat after the garbage")
        ok = False
    if not any(r.what == "stranger report" for r in refused):
        found.violations.append("coordd did not refuse a report from an unregistered peer")
        ok = False
    if not any(r.what == "hello" and r.error.reason == "rank_range" for r in refused):
        found.violations.append("coordd did not refuse a Hello for a rank out of range")
        ok = False
    if dropped < sent_app:
        found.violations.append(f"coordd logged {dropped} dropped frames of {sent_app} bad ones")
        ok = False
    found.notes.append(
        f"rogue sent {sum(n.count for n in notes if n.what == 'sent')} bad frames; "
        f"coordd dropped {dropped} at the protocol layer"
    )
    return ok


# -- the end ----------------------------------------------------------------------------------


def _check_finished(
    info: ScenarioInfo, logs: list[ProcessLog], deadline_kills: set[str], found: _Findings
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
