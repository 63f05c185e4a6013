"""The checker's rules for every round (epoch, seq): one decision, the same for every rank and
equal to the policy applied to the reports, or one typed error that the fault explains."""

from __future__ import annotations

from coordd.proto.messages import StepReport
from coordd.proto.policy import decide
from coordd.testing.history import Begin, ErrorInfo, Inject, decision_of
from coordd.testing.scenario import ScenarioInfo
from coordd.testing.verdict import Findings, ProcessLog, ScenarioResult, Sync


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


def check_rounds(
    info: ScenarioInfo,
    syncs: list[Sync],
    t_inject: float | None,
    culprit_log: ProcessLog | None,
    crashed: bool,
    result: ScenarioResult,
    found: Findings,
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
        culprits = {info.culprit_name, *info.also_culprits}
        group_failed = [s for s in failed if not (own_view and s.process in culprits)]
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
    found: Findings,
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
    found: Findings,
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
    field = error.fields.get("field")
    if error.type == "InvalidReport" and info.culprit_field and field != info.culprit_field:
        found.violations.append(f"{what}: it names field {field}, not {info.culprit_field}")
        return
    if not expect.names_culprit or info.culprit in error.culprits:
        return
    if (
        expect.mirror_ok
        and info.dp == 2
        and info.culprit == 0
        and error.type == "StepMismatch"
        and error.fields.get("expected_kind") == injected_kind
        and error.fields.get("got_kind") != injected_kind
    ):
        found.notes.append(
            f"{where}: no majority at dp=2, the tie goes to rank 0's kind, so the mismatch "
            f"names rank {error.culprits} (expected {injected_kind})"
        )
        return
    found.violations.append(f"{what}: it does not name the culprit rank {info.culprit}")
