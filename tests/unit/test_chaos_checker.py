"""The chaos checker must be able to fail: fabricated histories with a wrong decision, a hang, a
mismatched or misattributed error, a late or missing detection, each reported as such."""

from __future__ import annotations

import msgspec
import pytest

from coordd.proto.policy import decide
from coordd.testing import (
    Begin,
    Done,
    End,
    ErrorInfo,
    Header,
    Inject,
    Note,
    ProcessLog,
    Record,
    Refused,
    Registered,
    ScenarioInfo,
    check_history,
    decision_dict,
    report_dict,
)
from coordd.tools.chaos.scenarios import SCENARIOS
from coordd.tools.chaos.seeded_reports import kind_for, report_for
from coordd.tools.chaos.spec import Fault, Settings

SEED = 3
DP = 2
E1, E2 = 100, 101
FAIL_SEQ = 5
END_SEQ = 8
T_INJECT = 10.0 + FAIL_SEQ


def info(fault: Fault = Fault.SKIPPED_SEQ, culprit: int = 0, **kw: object) -> ScenarioInfo:
    fields: dict[str, object] = dict(
        fault=fault.value,
        seed=SEED,
        dp=DP,
        transport="ipc",
        culprit=culprit,
        culprit_name=f"rank{culprit}",
        inject_seq=FAIL_SEQ,
        end_seq=END_SEQ,
        expect=SCENARIOS[fault].expect,
        wait_timeout=Settings().wait_timeout,
        detection_bound=Settings().detection_bound,
    )
    fields.update(kw)
    return ScenarioInfo(**fields)  # type: ignore[arg-type]


def stamped(rank: int, epoch: int, seq: int) -> dict[str, object]:
    report = msgspec.structs.replace(
        report_for(SEED, rank, seq), dp_rank=rank, epoch=epoch, seq=seq, kind=kind_for(SEED, seq)
    )
    return report_dict(report)


def decision(epoch: int, seq: int) -> dict[str, object]:
    reports = [report_for(SEED, r, seq) for r in range(DP)]
    return decision_dict(decide(reports, epoch=epoch, seq=seq, kind=kind_for(SEED, seq)))


MISMATCH = ErrorInfo(
    type="StepMismatch",
    reason="mismatch",
    culprits=[0],
    text="rank 0 reported seq=6, the round expects seq=5",
    fields={
        "rank": 0,
        "expected_seq": 5,
        "expected_kind": "forward",
        "got_seq": 6,
        "got_kind": "forward",
    },
)


def rank_history(rank: int) -> list[Record]:
    """Rounds 0..4 decided, round 5 fails (the culprit skipped), recovery runs 6..7."""
    out: list[Record] = [Registered(t=9.0, epoch=E1, next_seq=0)]
    for seq in range(END_SEQ):
        epoch = E1 if seq <= FAIL_SEQ else E2
        t = 10.0 + seq
        if seq == FAIL_SEQ + 1:
            out.append(Registered(t=t - 0.5, epoch=E2, next_seq=seq))
        out.append(
            Begin(
                t=t,
                epoch=epoch,
                seq=seq,
                kind=kind_for(SEED, seq).value,
                sent=[stamped(rank, epoch, seq)],
            )
        )
        if seq == FAIL_SEQ:
            if rank == 0:
                out.insert(-1, Inject(t=T_INJECT, fault="skipped_seq", rank=0))
            out.append(End(t=t + 0.01, epoch=epoch, seq=seq, error=MISMATCH))
        else:
            out.append(End(t=t + 0.01, epoch=epoch, seq=seq, decision=decision(epoch, seq)))
    out.append(Done(t=20.0, next_seq=END_SEQ))
    return out


def logs(h0: list[Record] | None = None, h1: list[Record] | None = None) -> list[ProcessLog]:
    return [
        ProcessLog(
            "rank0",
            Header(t=8.0, role="raw", rank=0, pid=1, name="rank0"),
            h0 if h0 is not None else rank_history(0),
        ),
        ProcessLog(
            "rank1",
            Header(t=8.0, role="rank", rank=1, pid=2, name="rank1"),
            h1 if h1 is not None else rank_history(1),
        ),
    ]


def replace_end(history: list[Record], seq: int, **changes: object) -> list[Record]:
    return [
        msgspec.structs.replace(r, **changes) if isinstance(r, End) and r.seq == seq else r
        for r in history
    ]


def test_a_clean_history_passes() -> None:
    result = check_history(info(), logs(), [])
    assert result.ok, result.violations
    assert result.injected and result.detected
    assert result.ttd == pytest.approx(0.01)
    assert (result.rounds, result.failed_rounds) == (END_SEQ - 1, 1)


def test_ranks_that_disagree_are_a_wrong_decision() -> None:
    other = decision(E1, 2)
    other["num_tokens_across_dp"] = [1, 1]
    result = check_history(info(), logs(h1=replace_end(rank_history(1), 2, decision=other)), [])
    assert result.wrong_decisions == 1
    assert any("different decisions" in v for v in result.violations)


def test_a_decision_the_policy_would_not_make_is_wrong() -> None:
    bad = decision(E1, 3)
    bad["should_pad"] = not bad["should_pad"]
    h0 = replace_end(rank_history(0), 3, decision=bad)
    h1 = replace_end(rank_history(1), 3, decision=bad)
    result = check_history(info(), logs(h0, h1), [])
    assert result.wrong_decisions == 1
    assert any("differs from the policy" in v for v in result.violations)


def test_a_decision_of_another_round_is_wrong() -> None:
    result = check_history(
        info(), logs(h1=replace_end(rank_history(1), 4, decision=decision(E1, 3))), []
    )
    assert result.wrong_decisions == 1
    assert any("got the decision of epoch" in v for v in result.violations)


def test_a_decision_built_without_a_rank_report_is_wrong() -> None:
    """rank1's only message for seq 1 claims rank 0: no report of rank 1 was ever sent."""
    spoofed = [
        msgspec.structs.replace(r, sent=[{**r.sent[0], "dp_rank": 0}])
        if isinstance(r, Begin) and r.seq == 1
        else r
        for r in rank_history(1)
    ]
    result = check_history(info(), logs(h1=spoofed), [])
    assert result.wrong_decisions >= 1
    assert any("did not report for" in v or "without the reports" in v for v in result.violations)


def test_a_round_begun_and_never_ended_is_a_hang() -> None:
    h1 = [
        r
        for r in rank_history(1)
        if not (isinstance(r, End) and r.seq == END_SEQ - 1) and not isinstance(r, Done)
    ]
    result = check_history(info(), logs(h1=h1), [])
    assert result.hangs == 1
    assert not result.ok


def test_a_wait_coordd_never_answered_is_a_hang() -> None:
    h1 = replace_end(rank_history(1), 6, decision=None, no_answer=True)
    result = check_history(info(), logs(h1=h1), [])
    assert result.hangs == 1


def test_a_process_killed_at_the_deadline_is_a_hang() -> None:
    runner: list[Record] = [Note(t=30.0, what="killed at deadline", detail="rank1")]
    result = check_history(info(), logs(), runner)
    assert result.hangs == 1


def test_ranks_with_different_errors_for_one_round_are_reported() -> None:
    lost = ErrorInfo(type="RankLost", reason="lost", culprits=[0], text="rank(s) [0] lost")
    result = check_history(info(), logs(h1=replace_end(rank_history(1), FAIL_SEQ, error=lost)), [])
    assert any("different errors" in v for v in result.violations)


def test_an_error_that_names_someone_else_is_reported() -> None:
    wrong = msgspec.structs.replace(MISMATCH, culprits=[1])
    h0 = replace_end(rank_history(0), FAIL_SEQ, error=wrong)
    h1 = replace_end(rank_history(1), FAIL_SEQ, error=wrong)
    result = check_history(info(), logs(h0, h1), [])
    assert any("does not name the culprit" in v for v in result.violations)


def test_an_error_the_fault_does_not_explain_is_reported() -> None:
    timeout = ErrorInfo(type="StepTimeout", reason="timeout", culprits=[0], text="late")
    h0 = replace_end(rank_history(0), FAIL_SEQ, error=timeout)
    h1 = replace_end(rank_history(1), FAIL_SEQ, error=timeout)
    result = check_history(info(), logs(h0, h1), [])
    assert any("does not explain" in v for v in result.violations)


def test_a_failure_before_the_injection_is_a_false_alarm() -> None:
    h1 = replace_end(rank_history(1), 2, decision=None, error=MISMATCH)
    h0 = replace_end(rank_history(0), 2, decision=None, error=MISMATCH)
    result = check_history(info(), logs(h0, h1), [])
    assert any("before the fault was injected" in v for v in result.violations)


def test_a_split_round_is_reported() -> None:
    h1 = replace_end(rank_history(1), 4, decision=None, error=MISMATCH)
    result = check_history(info(), logs(h1=h1), [])
    assert any("split outcome" in v for v in result.violations)


def test_late_detection_is_reported() -> None:
    late = settings_bound = Settings().detection_bound
    h1 = replace_end(rank_history(1), FAIL_SEQ, t=T_INJECT + late + 0.5)
    result = check_history(info(), logs(h1=h1), [])
    assert any(f"{settings_bound:g}s" in v and "detected after" in v for v in result.violations)


def test_a_failure_that_never_reached_a_rank_is_missed_detection() -> None:
    h1 = replace_end(rank_history(1), FAIL_SEQ, error=None, decision=decision(E1, FAIL_SEQ))
    h0 = replace_end(rank_history(0), FAIL_SEQ, error=None, decision=decision(E1, FAIL_SEQ))
    result = check_history(info(), logs(h0, h1), [])
    assert result.detected is False
    assert any("never reached" in v for v in result.violations)


def test_a_fault_never_injected_fails_the_scenario() -> None:
    h0 = [r for r in rank_history(0) if not isinstance(r, Inject)]
    result = check_history(info(), logs(h0=h0), [])
    assert not result.injected
    assert any("never injected" in v for v in result.violations)


def test_a_refusal_must_name_the_sender() -> None:
    """A spoofer (registered as rank 0, claiming rank 1) must be named itself, not its victim."""
    clean0 = [r for r in rank_history(0) if not (isinstance(r, (Begin, End)) and r.seq >= FAIL_SEQ)]
    clean1 = [r for r in rank_history(1) if not (isinstance(r, (Begin, End)) and r.seq >= FAIL_SEQ)]

    def with_refusal(culprits: list[int]) -> list[Record]:
        refusal = ErrorInfo(
            type="ProtocolError",
            reason="protocol",
            culprits=culprits,
            text="peer registered as rank 0 reported as rank 1",
        )
        return [
            *clean0[:-1],
            Inject(t=T_INJECT, fault="spoofed_rank", rank=0),
            Refused(t=T_INJECT + 0.001, error=refusal, what="spoofed report"),
            clean0[-1],
        ]

    later = [
        Begin(
            t=T_INJECT + 1,
            epoch=E1,
            seq=FAIL_SEQ,
            kind=kind_for(SEED, FAIL_SEQ).value,
            sent=[stamped(r, E1, FAIL_SEQ)],
        )
        for r in range(DP)
    ]
    ends = [End(t=T_INJECT + 1.01, epoch=E1, seq=FAIL_SEQ, decision=decision(E1, FAIL_SEQ))] * DP

    def history(h: list[Record], rank: int) -> list[Record]:
        return [*h[:-1], later[rank], ends[rank], h[-1]]

    spoof = info(Fault.SPOOFED_RANK)
    good = check_history(spoof, logs(history(with_refusal([0]), 0), history(clean1, 1)), [])
    assert good.ok, good.violations
    bad = check_history(spoof, logs(history(with_refusal([1]), 0), history(clean1, 1)), [])
    assert any("not the sender" in v for v in bad.violations)


def test_a_split_is_excused_only_when_coordd_crashed() -> None:
    """coordd killed mid-broadcast (SIGKILL) may leave one round decided for some ranks only;
    a coordd that shuts down cleanly (SIGTERM) must not."""
    down = ErrorInfo(
        type="CoordinatorUnavailable",
        reason="unavailable",
        culprits=[],
        text="connection to coordd dropped",
    )

    def history(rank: int, got_seq1: bool) -> list[Record]:
        def sync(epoch: int, seq: int, t: float, outcome: dict[str, object]) -> list[Record]:
            return [
                Begin(
                    t=t,
                    epoch=epoch,
                    seq=seq,
                    kind=kind_for(SEED, seq).value,
                    sent=[stamped(rank, epoch, seq)],
                ),
                End(t=t + 0.01, epoch=epoch, seq=seq, **outcome),
            ]  # type: ignore[arg-type]

        out: list[Record] = [Registered(t=9.0, epoch=E1, next_seq=0)]
        out += sync(E1, 0, 10.0, {"decision": decision(E1, 0)})
        out += sync(E1, 1, 10.6, {"decision": decision(E1, 1)} if got_seq1 else {"error": down})
        if got_seq1:
            out += sync(E1, 2, 10.7, {"error": down})
        out.append(Registered(t=10.9, epoch=E2, next_seq=0))
        out += sync(E2, 0, 11.0, {"decision": decision(E2, 0)})
        return [*out, Done(t=12.0, next_seq=1)]

    def check(signal_name: str):  # type: ignore[no-untyped-def]
        runner: list[Record] = [
            Inject(t=10.5, fault="coordd_restart", detail=f"coordd {signal_name}")
        ]
        restart = info(Fault.COORDD_RESTART, culprit=-1, culprit_name="coordd", end_seq=1)
        return check_history(restart, logs(history(0, True), history(1, False)), runner)

    crashed = check("SIGKILL")
    assert crashed.ok, crashed.violations
    assert any("mid-broadcast" in n for n in crashed.notes)
    clean = check("SIGTERM")
    assert any("split outcome" in v for v in clean.violations)


# -- the classes of issue 11: values, misuse, hostile peers -------------------------------------


def clean_history(rank: int) -> list[Record]:
    """Every round decided, one epoch: what a group a peer outside it cannot disturb shows."""
    out: list[Record] = [Registered(t=9.0, epoch=E1, next_seq=0)]
    for seq in range(END_SEQ):
        out += [
            Begin(
                t=10.0 + seq,
                epoch=E1,
                seq=seq,
                kind=kind_for(SEED, seq).value,
                sent=[stamped(rank, E1, seq)],
            ),
            End(t=10.01 + seq, epoch=E1, seq=seq, decision=decision(E1, seq)),
        ]
    return [*out, Done(t=20.0, next_seq=END_SEQ)]


def test_a_rule_a_process_checked_itself_and_saw_broken_fails_the_scenario() -> None:
    """client_misuse: the rank checks the client's rules (a second wait() answered at once, a
    start() while open refused) and logs a "violation" note where one breaks."""
    h1 = [
        *rank_history(1)[:-1],
        Note(t=19.0, what="violation", detail="second wait() blocked"),
        rank_history(1)[-1],
    ]
    result = check_history(info(), logs(h1=h1), [])
    assert "rank1: second wait() blocked" in result.violations


def test_an_invalid_report_must_name_the_injected_field() -> None:
    def invalid(field: str) -> ErrorInfo:
        return ErrorInfo(
            type="InvalidReport",
            reason="invalid",
            culprits=[0],
            text=f"rank 0: invalid {field}=2147483648",
            fields={"rank": 0, "field": field, "value": 2**31},
        )

    def history(rank: int, field: str) -> list[Record]:
        out = replace_end(rank_history(rank), FAIL_SEQ, error=invalid(field))
        return [
            Inject(t=r.t, fault="invalid_value", rank=0, detail=f"num_tokens={2**31}")
            if isinstance(r, Inject)
            else r
            for r in out
        ]

    scenario = info(Fault.INVALID_VALUE, culprit_field="num_tokens")
    good = check_history(scenario, logs(history(0, "num_tokens"), history(1, "num_tokens")), [])
    assert good.ok, good.violations
    bad = check_history(
        scenario, logs(history(0, "cudagraph_mode"), history(1, "cudagraph_mode")), []
    )
    assert any("names field cudagraph_mode, not num_tokens" in v for v in bad.violations)


def culprit_log(role: str, inject: Inject, *records: Record, pid: int = 3) -> ProcessLog:
    """The history of a culprit process that holds no rank (taker, claimer)."""
    return ProcessLog(
        role,
        Header(t=8.0, role=role, rank=0, pid=pid, name=role),
        [inject, *records, Done(t=T_INJECT + 1.5, next_seq=0, reason=role)],
    )


def taker(*records: Record) -> ProcessLog:
    return culprit_log("taker", Inject(t=T_INJECT, fault="takeover_attempt", rank=0), *records)


TAKEN = ErrorInfo(
    type="Rejected",
    reason="rank_taken",
    culprits=[],
    text="dp_rank 0 is held by another live connection",
)
STRANGER = ErrorInfo(
    type="ProtocolError",
    reason="protocol",
    culprits=[0],
    text="rank 0: report from a peer that has not registered",
)


def test_a_takeover_must_be_refused_at_every_door_and_logged() -> None:
    scenario = info(Fault.TAKEOVER_ATTEMPT, culprit=-1, culprit_name="taker")
    ranks = logs(clean_history(0), clean_history(1))
    quiet = Note(t=T_INJECT + 0.1, what="id taken: nothing received", count=13)
    hello = Refused(t=T_INJECT + 0.2, error=TAKEN, what="hello")
    claim = Refused(t=T_INJECT + 0.3, error=STRANGER, what="claimed report")
    logged = "WARNING coordd: rank takeover refused group=default kind=rank_held rank=0"
    good = check_history(scenario, [*ranks, taker(quiet, hello, claim)], [], logged)
    assert good.ok, good.violations
    admitted = taker(quiet, Registered(t=T_INJECT + 0.2, epoch=E1, next_seq=3), claim)
    bad = check_history(scenario, [*ranks, admitted], [], logged)
    assert any("admitted taker" in v for v in bad.violations)
    unlogged = check_history(scenario, [*ranks, taker(quiet, hello, claim)], [], "")
    assert any("did not log the refused takeover" in v for v in unlogged.violations)
    received = Note(t=T_INJECT + 0.1, what="violation", detail="the victim's id received ...")
    heard = check_history(scenario, [*ranks, taker(received, quiet, hello, claim)], [], logged)
    assert any("the victim's id received" in v for v in heard.violations)


def test_a_forged_report_counted_for_a_rank_is_a_wrong_decision() -> None:
    """stranger_noise/takeover: a decision built from a forged report differs from the policy
    applied to the ranks' own reports."""
    forged = msgspec.structs.replace(
        report_for(SEED, 0, 3), num_tokens=9999, num_tokens_padded=9999
    )
    wrong = decision_dict(
        decide([forged, report_for(SEED, 1, 3)], epoch=E1, seq=3, kind=kind_for(SEED, 3))
    )
    ranks = [replace_end(clean_history(r), 3, decision=wrong) for r in range(DP)]
    scenario = info(Fault.STRANGER_NOISE, culprit=-1, culprit_name="stranger")
    result = check_history(scenario, logs(*ranks), [])
    assert any("differs from the policy" in v for v in result.violations)


def claimer(*records: Record) -> ProcessLog:
    inject = Inject(t=T_INJECT, fault="id_claims", detail="50 names held")
    return culprit_log("claimer", inject, *records, pid=4)


ROUTING_ID = ErrorInfo(
    type="Rejected",
    reason="routing_id",
    culprits=[],
    text="registration rejected (routing_id): this connection set no routing id of its own",
)


def test_a_hello_from_a_zero_led_routing_id_must_be_refused_routing_id_and_logged() -> None:
    """id_claims: the attack ran (its numbers are noted, not judged), then the zero-led Hello
    got Rejected(routing_id), which coordd logged; admitted, or refused for another reason
    (rank_taken, group), or not answered at all, it is a violation."""
    scenario = info(Fault.ID_CLAIMS, culprit=-1, culprit_name="claimer")
    ranks = logs(clean_history(0), clean_history(1))
    attacked = [
        Note(t=T_INJECT + 1.0, what="admitted", detail="id-less", count=976),
        Note(t=T_INJECT + 1.0, what="refused", detail="id-less", count=120),
        Note(t=T_INJECT + 1.0, what="held", detail="names, most at once", count=50),
        Note(t=T_INJECT + 1.0, what="attack", detail="id-less handshakes admitted 976/s ..."),
    ]
    refused = Refused(t=T_INJECT + 1.4, error=ROUTING_ID, what="hello")
    logged = "WARNING coordd: registration rejected group=id-claims ... reason=routing_id"
    good = check_history(scenario, [*ranks, claimer(*attacked, refused)], [], logged)
    assert good.ok, good.violations
    assert good.ttd is None
    assert any("976 id-less handshakes admitted" in n for n in good.notes)

    admitted = Registered(t=T_INJECT + 1.4, epoch=E1 + 7, next_seq=0)
    bad = check_history(scenario, [*ranks, claimer(*attacked, admitted)], [], logged)
    assert any("admitted claimer" in v for v in bad.violations)
    other = Refused(t=T_INJECT + 1.4, error=TAKEN, what="hello")
    wrong = check_history(scenario, [*ranks, claimer(*attacked, other)], [], logged)
    assert any("zero-led routing id was not refused" in v for v in wrong.violations)
    silent = check_history(scenario, [*ranks, claimer(*attacked)], [], logged)
    assert any("zero-led routing id was not refused" in v for v in silent.violations)
    unlogged = check_history(scenario, [*ranks, claimer(*attacked, refused)], [], "")
    assert any("did not log the routing_id refusal" in v for v in unlogged.violations)
    unfinished = check_history(scenario, [*ranks, claimer(refused)], [], logged)
    assert any("never finished its attack" in v for v in unfinished.violations)
    died: list[Record] = [Note(t=T_INJECT + 2.0, what="coordd died", count=-6)]
    aborted = check_history(scenario, [*ranks, claimer(*attacked, refused)], died, logged)
    assert any("coordd died" in v for v in aborted.violations)


def rejected(reason: str, text: str) -> ErrorInfo:
    return ErrorInfo(type="Rejected", reason=reason, culprits=[], text=text)


UNEXPECTED = rejected("group_unexpected", "group 'junk' is not one this deployment expects")
LIMIT = rejected("group_limit", "coordd serves 3 groups, its limit (--max-groups 3)")
CUT = "WARNING coordd: member cut off peer=conn-1 detail=\"protocol violation: 2048 messages\""


def squatter(*changed: Record, drop: tuple[str, ...] = ()) -> ProcessLog:
    """junk_groups' culprit: the slots filled before the group registers (t 9), two Hellos for
    unexpected groups and one over the limit while it runs, its member's flood cut off, its
    two other members answering pings; `changed` records replace those of their `what` (or
    are added), `drop` leaves records of those `what`s out."""
    t = T_INJECT
    records: list[Record] = [
        Note(t=8.1, what="welcomed", detail="dp-tp1-pp4"),
        Note(t=8.2, what="welcomed", detail="dp-tp2-pp4"),
        Note(t=8.3, what="welcomed", detail="dp-tp3-pp4"),
        Refused(t=8.4, error=LIMIT, what="over the limit"),
        Note(t=8.5, what="filled", detail="junk groups held", count=3),
        Inject(t=t, fault="junk_groups", detail="2 unexpected groups, then a member's flood"),
        Refused(t=t + 0.1, error=UNEXPECTED, what="unexpected group"),
        Refused(t=t + 0.2, error=UNEXPECTED, what="unexpected group"),
        Refused(t=t + 0.3, error=LIMIT, what="over the limit"),
        Note(t=t + 0.3, what="asked", detail="unexpected", count=2),
        Note(t=t + 0.3, what="asked", detail="over the limit", count=2),
        Note(t=t + 0.4, what="cut", detail="after 5999 copies of one report", count=5999),
        Note(t=t + 0.4, what="asked", detail="pings", count=2),
        Note(t=t + 0.5, what="pong", detail="dp-tp1-pp4"),
        Note(t=t + 0.5, what="pong", detail="dp-tp2-pp4"),
    ]
    records = [r for r in records if getattr(r, "what", "") not in drop]
    records += changed
    records.append(Done(t=t + 1.0, next_seq=0, reason="squatter"))
    return ProcessLog("squatter", Header(t=8.0, role="squatter", rank=0, pid=5, name="squatter"),
                      records)


def test_junk_groups_must_be_refused_the_slot_kept_and_only_the_flooder_cut() -> None:
    """junk_groups: every Hello for an unexpected group refused group_unexpected, every one
    past the limit group_limit, the group registered at the limit, the flooding member cut
    off (and logged) and nothing else; each broken, it is reported."""
    scenario = info(Fault.JUNK_GROUPS, culprit=-1, culprit_name="squatter")
    ranks = logs(clean_history(0), clean_history(1))
    good = check_history(scenario, [*ranks, squatter()], [], CUT)
    assert good.ok, good.violations
    assert good.ttd is None
    assert any("3 junk groups held, 2 Hellos refused group_unexpected" in n for n in good.notes)

    def violations(*logs_: ProcessLog, coordd_log: str = CUT) -> list[str]:
        result = check_history(scenario, [*ranks, *logs_], [], coordd_log)
        assert not result.ok
        return result.violations

    admitted = Registered(t=T_INJECT + 0.25, epoch=E1 + 9, next_seq=0)
    assert any("admitted squatter" in v for v in violations(squatter(admitted)))
    wrong = squatter(
        Refused(t=T_INJECT + 0.1, error=UNEXPECTED, what="unexpected group"),
        Refused(t=T_INJECT + 0.2, error=LIMIT, what="unexpected group"),
        drop=("unexpected group",),
    )
    assert any(
        "1 of 2 Hellos (unexpected group) were refused group_unexpected" in v
        for v in violations(wrong)
    )
    unanswered = squatter(drop=("over the limit",))
    assert any("0 of 2 Hellos (over the limit)" in v for v in violations(unanswered))
    not_cut = squatter(Note(t=T_INJECT + 8, what="not cut", count=90000), drop=("cut",))
    assert any("flooding junk member was not cut off" in v for v in violations(not_cut))
    assert any("did not log the member" in v for v in violations(squatter(), coordd_log=""))
    lost = squatter(
        Note(t=T_INJECT + 0.5, what="pong", detail="dp-tp1-pp4"),
        Note(t=T_INJECT + 0.5, what="no pong", detail="dp-tp2-pp4: connection dropped"),
        drop=("pong",),
    )
    assert any("cut more than the flooding member" in v for v in violations(lost))
    early = logs(rank_history_registered_at(0, 8.2), clean_history(1))
    result = check_history(scenario, [*early, squatter()], [], CUT)
    assert any("registered before the junk groups held every slot" in v for v in result.violations)
    failed = replace_end(clean_history(1), 6, decision=None, error=MISMATCH)
    result = check_history(scenario, [*logs(clean_history(0), failed), squatter()], [], CUT)
    assert any("junk_groups does not explain" in v for v in result.violations)


def rank_history_registered_at(rank: int, t: float) -> list[Record]:
    return [Registered(t=t, epoch=E1, next_seq=0), *clean_history(rank)[1:]]


def invalid_answer(field: str) -> ErrorInfo:
    return ErrorInfo(
        type="InvalidAnswer",
        reason="protocol",
        culprits=[],
        text=f"coordd answered round seq={FAIL_SEQ} with {field}=[1] (expected 2 values)",
        fields={"seq": FAIL_SEQ, "field": field, "expected": "2 values, one per rank"},
    )


def proxy(*injects: Inject) -> ProcessLog:
    return ProcessLog(
        "proxy",
        Header(t=8.0, role="proxy", rank=1, pid=6, name="proxy"),
        [*injects, Done(t=T_INJECT + 5, next_seq=0, reason="proxy")],
    )


MISFIT = Inject(t=T_INJECT, fault="forged_answers", rank=1, detail="num_tokens_across_dp")
EXTRA = Inject(t=T_INJECT, fault="forged_answers", rank=0, detail="unsolicited (again)")


def victim(error: ErrorInfo | None, *, registered: bool = True) -> list[Record]:
    """rank1, handed the misfit at FAIL_SEQ: its error (None: it took the decision), then
    registered again in the same epoch, on with the rounds."""
    out = clean_history(1)
    if error is not None:
        out = replace_end(out, FAIL_SEQ, t=T_INJECT + 0.002, decision=None, error=error)
    if registered:
        at = next(i for i, r in enumerate(out) if isinstance(r, Begin) and r.seq == FAIL_SEQ + 1)
        out.insert(at, Registered(t=T_INJECT + 0.5, epoch=E1, next_seq=FAIL_SEQ + 1))
    return out


def dropping(count: int) -> list[Record]:
    out = clean_history(0)
    return [*out[:-1], Note(t=19.5, what="dropped answers", count=count), out[-1]]


def test_a_forged_answer_must_raise_invalid_answer_and_an_unsolicited_one_be_dropped() -> None:
    """forged_answers: the rank handed a misfit raises InvalidAnswer naming coordd and the
    field, once, and goes on; the other counts the unsolicited answer as dropped. A rank that
    took the misfit, raised something else or for another field, stopped, or did not count the
    extra answer: each is reported."""
    scenario = info(
        Fault.FORGED_ANSWERS, culprit=1, culprit_field="num_tokens_across_dp"
    )
    error = invalid_answer("num_tokens_across_dp")

    def check(h0: list[Record], h1: list[Record], *injects: Inject) -> list[str]:
        result = check_history(scenario, [*logs(h0, h1), proxy(*injects)], [])
        return result.violations

    good = check_history(scenario, [*logs(dropping(1), victim(error)), proxy(EXTRA, MISFIT)], [])
    assert good.ok, good.violations
    assert good.detected and good.ttd == pytest.approx(0.002)

    # the misfit handed over as the round's decision: a wrong decision, and nothing raised
    forged = decision(E1, FAIL_SEQ)
    forged["num_tokens_across_dp"] = forged["num_tokens_across_dp"][:-1]
    took = replace_end(clean_history(1), FAIL_SEQ, decision=forged)
    result = check_history(scenario, [*logs(dropping(1), took), proxy(EXTRA, MISFIT)], [])
    assert result.wrong_decisions == 1
    assert any("raised nothing for the misfit" in v for v in result.violations)
    other = invalid_answer("cudagraph_mode")
    assert any(
        "not an InvalidAnswer naming coordd and that field" in v
        for v in check(dropping(1), victim(other), EXTRA, MISFIT)
    )
    timeout = ErrorInfo(type="StepTimeout", reason="timeout", culprits=[], text="no answer")
    assert any(
        "raised StepTimeout" in v for v in check(dropping(1), victim(timeout), EXTRA, MISFIT)
    )
    twice = replace_end(victim(error), FAIL_SEQ + 1, decision=None, error=error)
    assert any("a second error" in v for v in check(dropping(1), twice, EXTRA, MISFIT))
    assert any(
        "did not count the unsolicited answer" in v
        for v in check(dropping(0), victim(error), EXTRA, MISFIT)
    )
    assert any("never forged" in v for v in check(dropping(1), victim(None), EXTRA))
    assert any("never sent its unsolicited" in v for v in check(dropping(1), victim(error), MISFIT))
    # the other rank failing too is no part of a forged answer to one rank
    failed = replace_end(dropping(1), FAIL_SEQ + 1, decision=None, error=MISMATCH)
    twice_failed = replace_end(victim(error), FAIL_SEQ + 1, decision=None, error=MISMATCH)
    assert any(
        "forged_answers does not explain" in v
        for v in check(failed, twice_failed, EXTRA, MISFIT)
    )


def test_the_ranks_behind_a_lost_relay_have_the_culprits_own_view() -> None:
    """relay_killed: the other relay's ranks get RankLost naming the lost relay's ranks; the
    lost relay's own ranks (`also_culprits`) any typed error, here CoordinatorUnavailable.
    Without `also_culprits` the same history is two errors for one round."""
    lost = ErrorInfo(type="RankLost", reason="lost", culprits=[0], text="rank(s) [0] lost")
    gone = ErrorInfo(type="CoordinatorUnavailable", reason="unavailable", culprits=[],
                     text="connection to coordd dropped")
    h0 = replace_end(rank_history(0), FAIL_SEQ, error=gone)
    h1 = replace_end(rank_history(1), FAIL_SEQ, error=lost)
    relayed = info(Fault.RELAY_KILLED, culprit_name="relay0", also_culprits=["rank0"])
    result = check_history(relayed, logs(h0, h1), [])
    assert result.ok, result.violations
    flat = info(Fault.RELAY_KILLED, culprit_name="relay0")
    result = check_history(flat, logs(h0, h1), [])
    assert any("different errors" in v for v in result.violations), result.violations


def fallback_history(rank: int, switched_at: int) -> list[Record]:
    """Every round decided; a "switch" note (a FallbackClient's) at `switched_at`."""
    out: list[Record] = [Registered(t=9.0, epoch=E1, next_seq=0)]
    for seq in range(END_SEQ):
        t = 10.0 + seq
        if seq == switched_at:
            out.append(Note(t=t - 0.5, what="switch", detail=f"{seq} device: coordd gone"))
        out.append(Begin(t=t, epoch=E1, seq=seq, kind=kind_for(SEED, seq).value,
                         sent=[stamped(rank, E1, seq)]))
        out.append(End(t=t + 0.01, epoch=E1, seq=seq, decision=decision(E1, seq)))
    out.append(Done(t=20.0, next_seq=END_SEQ))
    return out


@pytest.mark.parametrize(("at0", "at1", "ok"), [(4, 4, True), (4, 5, False)])
def test_fallback_ranks_that_switch_paths_apart_are_reported(at0: int, at1: int, ok: bool) -> None:
    fault = Fault.COORDD_LOST_FALLBACK
    histories = [
        ProcessLog(f"rank{r}", Header(t=8.0, role="fallback", rank=r, pid=r + 1, name=f"rank{r}"),
                   fallback_history(r, at))
        for r, at in ((0, at0), (1, at1))
    ]
    runner: list[Record] = [Inject(t=T_INJECT, fault=fault.value, detail="coordd SIGKILL")]
    result = check_history(info(fault, culprit=-1, culprit_name="coordd"), histories, runner)
    assert result.ok is ok, result.violations
    if not ok:
        assert result.violations == [
            "the ranks switched paths at different rounds: {'rank0': ['4 device'], "
            "'rank1': ['5 device']}"
        ]
