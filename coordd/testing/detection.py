"""The checker's rules across the run: every rank saw the failure, soon enough; the culprit was
turned away where it had to be, and the group went on."""

from __future__ import annotations

from coordd.testing.history import Done, End, Inject, Note, Refused, Registered
from coordd.testing.rogue import APP_LEVEL
from coordd.testing.scenario import ScenarioInfo
from coordd.testing.verdict import PARTICIPANTS, Findings, ProcessLog, ScenarioResult, Sync


def check_detection(
    info: ScenarioInfo,
    logs: list[ProcessLog],
    syncs: list[Sync],
    t_inject: float | None,
    culprit_log: ProcessLog | None,
    coordd_log: str,
    result: ScenarioResult,
    found: Findings,
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
    if expect.refusal == "forged_answer":
        ok, t = _forged_answers(info, logs, culprit_log, found)
        detected.append(ok)
        if t is not None:
            times.append(t)
    elif expect.refusal:
        ok, t = _refusal(info, culprit_log, t_inject, coordd_log, found, logs)
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
        if result.ttd > info.detection_bound:
            found.violations.append(
                f"detected after {result.ttd:.3f}s, beyond the step timeout + heartbeat "
                f"timeout + grace ({info.detection_bound:g}s)"
            )


def _group_detection(
    info: ScenarioInfo,
    logs: list[ProcessLog],
    syncs: list[Sync],
    t_inject: float,
    found: Findings,
) -> tuple[bool, float | None]:
    """Every rank process that was running at the injection saw a typed error after it."""
    latest: list[float] = []
    missed: list[str] = []
    for log in logs:
        if log.role not in PARTICIPANTS or log.name == info.culprit_name:
            continue
        if log.name in info.also_culprits:
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
    found: Findings,
    logs: list[ProcessLog],
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
    if want == "stranger":
        return _stranger_refused(culprit, refused, coordd_log, found), None
    if want == "takeover":
        return _takeover_refused(culprit, refused, coordd_log, found), None
    if want == "id_claims":
        return _claims_refused(culprit, refused, coordd_log, found), None
    if want == "junk_groups":
        return _junk_refused(culprit, refused, coordd_log, logs, found), None
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
    rogue: ProcessLog, refused: list[Refused], coordd_log: str, found: Findings
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


def _stranger_refused(
    stranger: ProcessLog, refused: list[Refused], coordd_log: str, found: Findings
) -> bool:
    """A peer that never registered, sending forged reports for the live rounds amid garbage:
    every forged report answered to it alone with a typed error, the garbage dropped and
    counted, coordd still answering (the burst after the probe is judged by the group's
    rounds alone: a cut-off stranger cannot say what became of it)."""
    notes = [r for r in stranger.records if isinstance(r, Note)]
    ok = _rogue_refused(stranger, refused, coordd_log, found)
    forged = [r for r in refused if r.what == "forged report"]
    wrong = [r for r in forged if r.error.type not in ("ProtocolError", "CoordinatorUnavailable")]
    if not forged:
        found.violations.append("coordd did not refuse the stranger's forged reports")
        ok = False
    for r in wrong:
        found.violations.append(f"a forged report was answered with {r.error.type}: {r.error.text}")
        ok = False
    sent = sum(n.count for n in notes if n.what == "sent" and n.detail == "forged")
    answered = sum(n.count for n in notes if n.what == "answered" and n.detail == "forged")
    found.notes.append(f"stranger: {sent} forged reports, {answered} answered with an error")
    if "flooding peer cut off" in coordd_log:
        found.notes.append("coordd cut the stranger's burst off")
    return ok and not wrong


def _takeover_refused(
    taker: ProcessLog, refused: list[Refused], coordd_log: str, found: Findings
) -> bool:
    """A peer that tried to speak for a live rank (its leaked routing id, a Hello for the rank,
    a report claiming it): refused at each door, counted and logged."""
    notes = [r for r in taker.records if isinstance(r, Note)]
    ok = True
    if not any(n.what == "id taken: nothing received" for n in notes):
        found.violations.append("the taker never finished its attempt over the leaked id")
        ok = False
    if not any(r.what == "hello" and r.error.reason == "rank_taken" for r in refused):
        got = [f"{r.what}:{r.error.type}:{r.error.reason}" for r in refused]
        found.violations.append(f"a Hello for a held rank was not refused rank_taken ({got})")
        ok = False
    if not any(r.what == "claimed report" and r.error.type == "ProtocolError" for r in refused):
        found.violations.append("a report claiming a held rank from a stranger was not refused")
        ok = False
    if "rank takeover refused" not in coordd_log:
        found.violations.append("coordd did not log the refused takeover")
        ok = False
    return ok


def _claims_refused(
    claimer: ProcessLog, refused: list[Refused], coordd_log: str, found: Findings
) -> bool:
    """The routing-id attack (names held amid id-less handshakes; see coordd.io._gate), then a
    Hello from a zero-led routing id: refused `routing_id` (admitted, its name would be exempt
    from the stranger grace) and logged. The attack's own numbers (random names, a machine's
    speed) are noted, not judged: the group's rounds and coordd's life are the rules there."""
    notes = {(n.what, n.detail): n.count for n in claimer.records if isinstance(n, Note)}
    ok = True
    if not any(what == "attack" for what, _ in notes):
        found.violations.append("the claimer never finished its attack")
        ok = False
    if not any(r.what == "hello" and r.error.reason == "routing_id" for r in refused):
        got = [f"{r.what}:{r.error.type}:{r.error.reason}" for r in refused]
        found.violations.append(f"a Hello from a zero-led routing id was not refused ({got})")
        ok = False
    elif "reason=routing_id" not in coordd_log:
        found.violations.append("coordd did not log the routing_id refusal")
        ok = False
    found.notes.append(
        f"claimer: {notes.get(('admitted', 'id-less'), 0)} id-less handshakes admitted, "
        f"{notes.get(('refused', 'id-less'), 0)} refused; "
        f"{notes.get(('held', 'names, most at once'), 0)} names held at most"
    )
    return ok


def _junk_refused(
    squatter: ProcessLog,
    refused: list[Refused],
    coordd_log: str,
    logs: list[ProcessLog],
    found: Findings,
) -> bool:
    """Membership is earned: every Hello for a group the deployment does not expect refused
    `group_unexpected`, every one past --max-groups refused `group_limit` (the squatter's junk
    held every slot), the group (named exactly) registered at that limit all the same, and the
    junk member that sent far more than one report a round cut off (coordd logged it), with
    nothing else: the squatter's other members still answered pings. A Hello coordd had to
    refuse and welcomed is the "admitted" violation (`_refusal`); the group's own rounds are
    judged as any group's (every one decided by the policy, no error)."""
    notes = [r for r in squatter.records if isinstance(r, Note)]
    asked = {n.detail: n.count for n in notes if n.what == "asked"}
    ok = True

    def refusals(what: str, reason: str, want: int | None) -> int:
        nonlocal ok
        mine = [r for r in refused if r.what == what]
        right = [r for r in mine if r.error.type == "Rejected" and r.error.reason == reason]
        if not want or len(right) != want:
            got = [f"{r.error.type}:{r.error.reason}" for r in mine]
            found.violations.append(
                f"{len(right)} of {want or 0} Hellos ({what}) were refused {reason} (got {got})"
            )
            ok = False
        return len(right)

    unexpected = refusals("unexpected group", "group_unexpected", asked.get("unexpected"))
    limited = refusals("over the limit", "group_limit", asked.get("over the limit"))
    filled = [n for n in notes if n.what == "filled"]
    if not filled or not filled[0].count:
        found.violations.append("the squatter never held the group slots")
        ok = False
    else:
        for log in logs:
            if log.role not in PARTICIPANTS:
                continue
            first = next((r.t for r in log.records if isinstance(r, Registered)), None)
            if first is not None and first < filled[0].t:
                found.violations.append(
                    f"{log.name} registered before the junk groups held every slot"
                )
                ok = False
    cut = [n for n in notes if n.what == "cut"]
    if not cut:
        why = [f"{n.what}: {n.detail}" for n in notes if n.what in ("not cut", "no member")]
        found.violations.append(f"the flooding junk member was not cut off {why}")
        ok = False
    elif "member cut off" not in coordd_log:
        found.violations.append("coordd did not log the member it cut off")
        ok = False
    pongs = sum(n.what == "pong" for n in notes)
    if pongs != asked.get("pings", 0):
        lost = [n.detail for n in notes if n.what == "no pong"]
        found.violations.append(
            f"{pongs} of the squatter's {asked.get('pings', 0)} other members answered a ping "
            f"after the cut: coordd cut more than the flooding member {lost}"
        )
        ok = False
    found.notes.append(
        f"squatter: {filled[0].count if filled else 0} junk groups held, {unexpected} Hellos "
        f"refused group_unexpected, {limited} group_limit; "
        + (cut[0].detail if cut else "the flood was not cut")
    )
    return ok


def _forged_answers(
    info: ScenarioInfo, logs: list[ProcessLog], victim: ProcessLog | None, found: Findings
) -> tuple[bool, float | None]:
    """forged_answers: the rank handed a misfit of its round's decision (the proxy's Inject
    naming it) raised a typed `InvalidAnswer` naming coordd and the misfit field, at once and
    as its only error (a decision it returned instead is a wrong decision: the rounds' rule),
    then registered again and decided rounds on; the rank sent an answer for no round it had
    open dropped and counted it ("dropped answers"), with no error. The time to detect is from
    the misfit's injection to the victim's error."""
    proxy = next((log for log in logs if log.role == "proxy"), None)
    if proxy is None or victim is None:
        found.violations.append("no history from the proxy or the rank it forged answers to")
        return False, None
    injects = [r for r in proxy.records if isinstance(r, Inject)]
    misfit = next((r for r in injects if r.rank == info.culprit), None)
    extra = next((r for r in injects if r.rank != info.culprit), None)
    ok = True
    ttd: float | None = None
    if misfit is None:
        found.violations.append(f"the proxy never forged {info.culprit_name}'s decision")
        ok = False
    else:
        errors = [r for r in victim.records if isinstance(r, End) and r.error is not None]
        first = errors[0].error if errors else None
        if first is None:
            found.violations.append(
                f"{info.culprit_name} raised nothing for the misfit answer ({misfit.detail})"
            )
            ok = False
        elif errors[0].t < misfit.t:
            found.violations.append(
                f"{info.culprit_name} got {first.type} ({first.text}) before the misfit answer"
            )
            ok = False
        elif (
            first.type != "InvalidAnswer"
            or first.fields.get("field") != info.culprit_field
            or not first.text.startswith("coordd answered")
        ):
            found.violations.append(
                f"{info.culprit_name} raised {first.type} ({first.text}) for a misfit of "
                f"{info.culprit_field}, not an InvalidAnswer naming coordd and that field"
            )
            ok = False
        else:
            ttd = errors[0].t - misfit.t
        for r in errors[1:]:
            assert r.error is not None
            found.violations.append(
                f"{info.culprit_name} got a second error, {r.error.type} ({r.error.text})"
            )
            ok = False
        if errors and not any(
            isinstance(r, End) and r.decision is not None and r.t > errors[0].t
            for r in victim.records
        ):
            found.violations.append(f"{info.culprit_name} decided no round after its error")
            ok = False
    if extra is None:
        found.violations.append("the proxy never sent its unsolicited answer")
        ok = False
    else:
        target = next((log for log in logs if log.name == f"rank{extra.rank}"), None)
        dropped = [
            n.count
            for n in (target.records if target else [])
            if isinstance(n, Note) and n.what == "dropped answers"
        ]
        if not dropped or dropped[-1] < 1:
            found.violations.append(
                f"rank{extra.rank} did not count the unsolicited answer as dropped ({extra.detail})"
            )
            ok = False
    return ok, ttd
