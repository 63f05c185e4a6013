"""RankSession on its own: no sockets, no clocks. Feed it messages (or bytes) and disconnects,
and check which round resolves, which fails, and what connect() clears."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from coordd.client._config import ClientConfig
from coordd.client._session import (
    MAX_ASKED,
    SUPERSEDED,
    GroupFailed,
    Pong,
    RankSession,
    Registered,
    RegistrationFailed,
    Resolved,
)
from coordd.proto.errors import (
    CoordinatorUnavailable,
    InvalidAnswer,
    InvalidReport,
    ProtocolError,
    RankLost,
    Rejected,
    StepMismatch,
    StepTimeout,
)
from coordd.proto.messages import (
    INT64_MAX,
    INT64_MIN,
    MAX_GATHER_VALUES,
    GatherReport,
    GatherResult,
    Goodbye,
    Heartbeat,
    StepDecision,
    StepKind,
    StepReport,
    Welcome,
    encode,
    failure_message,
    reject_message,
)
from coordd.proto.policy import decide, decision_misfit

FORWARD = StepKind.FORWARD
REPORT = StepReport(num_tokens=3, num_tokens_padded=4, has_unfinished=True)
CONFIG = ClientConfig(dp_rank=1, dp_size=2, config_fingerprint="fp", address="ipc:///x.sock")


def decision(epoch: int, seq: int) -> StepDecision:
    return decide([REPORT, REPORT], epoch=epoch, seq=seq, kind=FORWARD)


def registered(epoch: int = 3, next_seq: int = 10) -> RankSession:
    session = RankSession(CONFIG)
    session.hello()
    event = session.receive(Welcome(epoch=epoch, next_seq=next_seq, dp_size=2))
    assert isinstance(event, Registered)
    return session


def started(session: RankSession) -> tuple[int, int]:
    """Report one round; (seq, registration) as a shell keeps them."""
    return session.report(REPORT, FORWARD).seq, session.registration


# -- what to send -------------------------------------------------------------------------------


def test_the_hello_and_identity_come_from_the_config() -> None:
    session = RankSession(CONFIG)
    hello = session.hello()
    assert (hello.dp_rank, hello.dp_size, hello.config_fingerprint) == (1, 2, "fp")
    assert (hello.group, hello.num_ubatches) == ("default", 2)
    assert session.registering
    # the routing id is random, not derived from the rank or a configured incarnation (a peer
    # that could guess it could present it), and stable for the session
    again = RankSession(dataclasses.replace(CONFIG, incarnation="pod-7"))
    assert session.identity == session.identity
    assert session.identity != again.identity
    for ident in (session.identity, again.identity):
        assert len(ident) >= 16 and not ident.startswith(b"\x00")
        assert b"pod-7" not in ident and hello.incarnation.encode() not in ident
    # keywords build the same config
    assert RankSession(dp_rank=1, dp_size=2, config_fingerprint="fp").config == dataclasses.replace(
        CONFIG, address=None
    )


def test_nothing_is_reported_before_a_welcome() -> None:
    session = RankSession(CONFIG)
    with pytest.raises(ProtocolError, match="call connect"):
        session.report(REPORT, FORWARD)


def test_reports_are_stamped_with_the_welcomes_epoch_and_seq() -> None:
    session = registered(epoch=3, next_seq=10)
    first = session.report(REPORT, FORWARD)
    second = session.report(REPORT, StepKind.DRAFT)
    assert (first.dp_rank, first.epoch, first.seq, first.kind) == (1, 3, 10, FORWARD)
    assert (second.seq, second.kind) == (11, StepKind.DRAFT)
    # stamp() does not take the seq, and lets a test peer put what a real rank would not
    forged = session.stamp(REPORT, FORWARD, seq=99, dp_rank=0)
    assert (forged.seq, forged.dp_rank, session.next_seq) == (99, 0, 12)


# -- which round resolves -----------------------------------------------------------------------


def test_a_decision_resolves_its_own_round_once() -> None:
    session = registered()
    a, b = started(session), started(session)
    assert session.outcome(*a) is None and not session.settled(*a)
    event = session.receive(decision(3, a[0]))
    assert event == Resolved(a[0], decision(3, a[0]))
    assert session.settled(*a) and not session.settled(*b)
    assert session.outcome(*a) == decision(3, a[0])
    assert session.outcome(*a) is None, "taken once"
    assert session.outcome(*b) is None


def test_bytes_are_decoded_and_garbage_is_dropped() -> None:
    session = registered()
    seq, registration = started(session)
    assert session.receive_frame(b"\xc1 not msgpack") is None
    assert session.receive_frame(encode(Heartbeat(nonce=7))) == Pong(7)
    assert isinstance(session.receive_frame(encode(decision(3, seq))), Resolved)
    assert session.outcome(seq, registration) == decision(3, seq)


def test_answers_of_an_older_epoch_are_ignored() -> None:
    session = registered(epoch=3)
    seq, registration = started(session)
    assert session.receive(decision(2, seq)) is None
    old_failure = failure_message(RankLost([0]), epoch=2, seq=seq, kind=FORWARD)
    assert session.receive(old_failure) is None
    assert session.outcome(seq, registration) is None and session.failed is None


def test_a_protocol_error_answers_one_report_and_the_group_goes_on() -> None:
    session = registered()
    seq, registration = started(session)
    spoofed = ProtocolError("report for another rank", rank=1)
    event = session.receive(failure_message(spoofed, epoch=3, seq=seq, kind=FORWARD))
    assert isinstance(event, Resolved)
    # a test peer that sent one seq three times gets three answers, taken in order, one per
    # wait; a fourth answer is for no report: dropped and counted
    for _ in range(2):
        session.sent(session.stamp(REPORT, FORWARD, seq=seq))
    session.receive(decision(3, seq))
    session.receive(failure_message(spoofed, epoch=3, seq=seq, kind=FORWARD))
    assert session.receive(decision(3, seq)) is None and session.dropped_answers == 1
    assert session.settled(seq, registration)
    assert session.outcome(seq, registration) == spoofed
    assert session.outcome(seq, registration) == decision(3, seq)
    assert session.outcome(seq, registration) == spoofed
    assert not session.settled(seq, registration)
    assert session.outcome(seq, registration) is None
    assert session.failed is None


# -- what fails the group -----------------------------------------------------------------------


def test_a_group_failure_fails_every_open_and_later_round_until_connect() -> None:
    session = registered()
    done, open_a, open_b = started(session), started(session), started(session)
    session.receive(decision(3, done[0]))  # came before the failure: still its round's
    error = StepMismatch(0, open_a[0], "forward", open_a[0] + 1, "forward")
    event = session.receive(failure_message(error, epoch=3, seq=open_a[0], kind=FORWARD))
    assert event == GroupFailed(error)
    assert session.outcome(*done) == decision(3, done[0])
    assert session.outcome(*open_a) == session.outcome(*open_b) == error
    with pytest.raises(StepMismatch):
        session.report(REPORT, FORWARD)
    assert session.connection_lost() is None, "the first failure stays the one reported"
    session.hello()
    session.receive(Welcome(epoch=4, next_seq=open_a[0], dp_size=2))
    assert session.failed is None and session.report(REPORT, FORWARD).epoch == 4


def test_coordd_unavailable_fails_the_group_whatever_the_epoch() -> None:
    session = registered(epoch=3)
    seq, registration = started(session)
    gone = CoordinatorUnavailable("coordd restarted")
    assert isinstance(
        session.receive(failure_message(gone, epoch=1, seq=seq, kind=FORWARD)), GroupFailed
    )
    assert session.outcome(seq, registration) == gone


def test_goodbye_fails_the_group_with_its_text() -> None:
    session = registered()
    seq, registration = started(session)
    event = session.receive(Goodbye(text="coordd stopping"))
    assert isinstance(event, GroupFailed)
    outcome = session.outcome(seq, registration)
    assert isinstance(outcome, CoordinatorUnavailable)
    assert "goodbye: coordd stopping" in str(outcome)


def test_a_disconnect_fails_the_group_only_while_registered() -> None:
    session = RankSession(CONFIG)
    assert session.connection_lost() is None, "never registered"
    session.hello()
    assert session.connection_lost() is None, "registering: libzmq reconnects"
    session.receive(Welcome(epoch=3, next_seq=0, dp_size=2))
    event = session.connection_lost()  # with no round open: a later wait gets it at once
    assert isinstance(event, GroupFailed)
    assert str(event.error) == "connection to coordd at ipc:///x.sock dropped"
    with pytest.raises(CoordinatorUnavailable, match="dropped"):
        session.report(REPORT, FORWARD)


# -- what connect() clears ----------------------------------------------------------------------


def test_connect_supersedes_the_old_rounds_and_drops_their_answers() -> None:
    session = registered()
    answered, unanswered = started(session), started(session)
    session.receive(decision(3, answered[0]))
    session.hello()
    assert session.outcome(*answered) == CoordinatorUnavailable(SUPERSEDED)
    assert session.outcome(*unanswered) == CoordinatorUnavailable(SUPERSEDED)
    session.receive(Welcome(epoch=4, next_seq=answered[0], dp_size=2))
    fresh = started(session)
    assert fresh[0] == answered[0], "the new epoch may reuse a seq: the old answer is gone"
    assert session.outcome(*fresh) is None


def test_a_refused_or_unanswered_hello_fails_the_session_with_its_error() -> None:
    session = registered()
    seq, registration = started(session)
    refused = Rejected("rank_taken", "rank 1 is registered", expected="", got="")
    session.hello()
    event = session.receive(reject_message(refused))
    assert isinstance(event, RegistrationFailed) and event.error == refused
    assert not session.registering
    assert session.outcome(seq, registration) == CoordinatorUnavailable(SUPERSEDED)
    with pytest.raises(Rejected):
        session.report(REPORT, FORWARD)
    session.hello()
    silence = CoordinatorUnavailable("no answer from coordd within 5s")
    assert session.registration_failed(silence) == GroupFailed(silence)
    assert not session.registering
    with pytest.raises(CoordinatorUnavailable, match="no answer"):
        session.report(REPORT, FORWARD)


def test_a_timeout_answers_a_round_that_fails_the_group() -> None:
    session = registered()
    seq, registration = started(session)
    timeout = StepTimeout([0], 0.5)
    session.receive(failure_message(timeout, epoch=3, seq=seq, kind=FORWARD))
    assert session.outcome(seq, registration) == timeout


# -- gather rounds ------------------------------------------------------------------------------

SITE = "vllm.gpu.dp_utils"


def gathered(epoch: int, seq: int, rows: list[list[int]] | None = None) -> GatherResult:
    return GatherResult(epoch=epoch, seq=seq, site=SITE, rows=rows or [[1, 2], [3, 4]])


def test_a_gather_takes_the_next_seq_like_any_round() -> None:
    session = registered(epoch=3, next_seq=10)
    step = session.report(REPORT, FORWARD)
    report = session.gather(SITE, [3, 4])
    assert report == GatherReport(site=SITE, values=[3, 4], dp_rank=1, epoch=3, seq=11)
    assert session.report(REPORT, FORWARD).seq == 12
    assert step.seq == 10
    forged = session.stamp(GatherReport(site=SITE, values=[]), StepKind.GATHER, seq=99, dp_rank=0)
    assert (forged.seq, forged.dp_rank, forged.epoch, session.next_seq) == (99, 0, 3, 13)


def test_a_gather_result_resolves_its_own_round() -> None:
    session = registered()
    step = started(session)
    gather = session.gather(SITE, [3, 4]).seq, session.registration
    assert session.receive(gathered(3, gather[0])) == Resolved(gather[0], gathered(3, gather[0]))
    assert session.outcome(*step) is None
    assert session.receive_frame(encode(decision(3, step[0]))) == Resolved(
        step[0], decision(3, step[0])
    )
    assert session.outcome(*gather) == gathered(3, gather[0])
    assert session.outcome(*step) == decision(3, step[0])
    assert session.receive(gathered(2, gather[0])) is None, "an older epoch's"


def test_a_failure_fails_a_gather_as_any_round() -> None:
    session = registered()
    seq, registration = session.gather(SITE, [1]).seq, session.registration
    error = StepMismatch(0, seq, f"gather:{SITE}", seq, "gather:other")
    assert session.receive(
        failure_message(error, epoch=3, seq=seq, kind=StepKind.GATHER)
    ) == GroupFailed(error)
    assert session.outcome(seq, registration) == error
    with pytest.raises(StepMismatch):
        session.gather(SITE, [1])
    session.hello()
    assert session.outcome(seq, registration) == CoordinatorUnavailable(SUPERSEDED)
    session.receive(Welcome(epoch=4, next_seq=seq + 1, dp_size=2))
    assert session.gather(SITE, [1]).epoch == 4


def test_values_are_plain_int64s_or_refused_before_sending() -> None:
    session = registered(next_seq=10)

    class Index:
        def __index__(self) -> int:
            return 7

    assert session.gather(SITE, (True, Index(), INT64_MIN, INT64_MAX)).values == [
        1,
        7,
        INT64_MIN,
        INT64_MAX,
    ]
    refusals = [
        (SITE, [1.5], "values"),
        (SITE, ["1"], "values"),
        (SITE, [INT64_MAX + 1], "values"),
        (SITE, [INT64_MIN - 1], "values"),
        (SITE, [0] * (MAX_GATHER_VALUES + 1), "values"),
        ("x" * 257, [1], "site"),
    ]
    for site, values, field in refusals:
        with pytest.raises(InvalidReport) as info:
            session.gather(site, values)
        assert (info.value.rank, info.value.field) == (1, field)
    assert session.next_seq == 11, "a refused gather takes no seq"
    assert session.failed is None


def test_a_step_of_kind_gather_is_refused_before_sending() -> None:
    session = registered(next_seq=10)
    with pytest.raises(InvalidReport) as info:
        session.report(REPORT, StepKind.GATHER)
    assert info.value.field == "kind"
    assert session.next_seq == 10


# -- the config ---------------------------------------------------------------------------------


def test_client_config_takes_keywords_a_config_or_both(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (
        ClientConfig.of(dp_rank=1, dp_size=2, config_fingerprint="fp", address="ipc:///x.sock")
        == CONFIG
    )
    assert ClientConfig.of(CONFIG) is CONFIG
    assert ClientConfig.of(CONFIG, address=None).address == "ipc:///x.sock", "None: not given"
    assert ClientConfig.of(CONFIG, address="tcp://h:1", wait_timeout=2.0) == dataclasses.replace(
        CONFIG, address="tcp://h:1", wait_timeout=2.0
    )
    with pytest.raises(TypeError):
        ClientConfig.of(CONFIG, no_such_option=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        CONFIG.dp_rank = 0  # type: ignore[misc]
    monkeypatch.setenv("COORDD_ADDRESS", "ipc:///from/env.sock")
    assert ClientConfig(dp_rank=0, dp_size=1).resolved().address == "ipc:///from/env.sock"
    assert CONFIG.resolved() is CONFIG


def test_take_frame_hands_back_the_awaited_answer_and_receives_the_rest() -> None:
    """The blocking client's wait: the awaited round's decision comes back without being kept
    (as `outcome` would give it); others' answers are kept; stale and garbage frames dropped."""
    session = registered()
    (a, registration), (b, _) = started(session), started(session)
    for _ in range(2):
        session.sent(session.stamp(REPORT, FORWARD, seq=a))
    assert session.outcome(a, registration) is None
    assert session.take_frame(encode(decision(3, a)), a) == decision(3, a)
    assert not session.settled(a, registration)
    assert isinstance(session.take_frame(encode(decision(3, b)), a), Resolved)
    assert session.outcome(b, registration) == decision(3, b)
    assert session.take_frame(encode(decision(2, a)), a) is None  # an older epoch's
    assert session.take_frame(b"\xc1 garbage", a) is None
    assert isinstance(session.take_frame(encode(Goodbye(text="bye")), a), GroupFailed)
    # a seq reported three times (a test peer, above): the answer kept for the round comes
    # first, the new one is kept behind it
    session.receive(decision(3, a))
    assert isinstance(session.take_frame(encode(decision(3, a)), a), Resolved)
    assert session.outcome(a, registration) == decision(3, a)
    assert session.outcome(a, registration) == decision(3, a)


# -- a superseded round settles -----------------------------------------------------------------


def test_a_superseded_round_settles_the_moment_connect_begins() -> None:
    """An engine that polls `done()` (`settled`) on a round of the old registration must see it
    settle when connect() begins a new one: the new registration holds no answer for it and has
    not failed, so only the registration number tells (else it polls for ever)."""
    session = registered()
    old = started(session)
    assert not session.settled(*old)
    session.hello()
    assert session.settled(*old), "superseded: settled before the Welcome"
    session.receive(Welcome(epoch=4, next_seq=old[0], dp_size=2))
    assert session.settled(*old), "and after it, though the new epoch reuses its seq"
    fresh = started(session)
    assert fresh[0] == old[0] and not session.settled(*fresh)
    assert session.outcome(*old) == CoordinatorUnavailable(SUPERSEDED)
    assert session.outcome(*fresh) is None


# -- answers are checked against the round asked ------------------------------------------------


def _as(msg: StepDecision | GatherResult, **changes: object) -> StepDecision | GatherResult:
    return msgspec.structs.replace(msg, **changes)


def _fed(session: RankSession, msg: object, seq: int, route: str) -> object:
    """Feed `msg` the way a shell would: `receive`, `receive_frame`, or the blocking client's
    `take_frame` while it waits for `seq`."""
    if route == "receive":
        return session.receive(msg)  # type: ignore[arg-type]
    if route == "frame":
        return session.receive_frame(encode(msg))
    return session.take_frame(encode(msg), seq)


ROUTES = ["receive", "frame", "take"]
DECISION_MISFITS = [
    ("num_tokens_across_dp", {"num_tokens_across_dp": [4]}),
    ("num_tokens_across_dp", {"num_tokens_across_dp": [4, 4, 4]}),
    ("kind", {"kind": StepKind.DRAFT}),
    ("cudagraph_mode", {"cudagraph_mode": 9}),
    ("cudagraph_mode", {"cudagraph_mode": -1}),
    ("dead_ranks", {"dead_ranks": [7]}),
    ("dead_ranks", {"dead_ranks": [-1]}),
    # issue 28, defect 7: answers that contradict this rank's own report (3 tokens, padded 4,
    # mode 0, no micro-batching, unfinished requests), each returned by wait() before
    ("num_tokens_across_dp[1]", {"num_tokens_across_dp": [4, 0]}),  # its own count 0
    ("num_tokens_across_dp", {"num_tokens_across_dp": [-5, 4]}),
    ("num_tokens_across_dp", {"num_tokens_across_dp": [2**40, 4]}),
    ("should_pad", {"should_pad": True, "num_tokens_across_dp": [2**40, 2**40]}),
    ("dead_ranks", {"dead_ranks": [1]}),  # itself, though it reported
    ("all_idle", {"all_idle": True}),  # while it runs 3 tokens
    ("any_unfinished", {"any_unfinished": False}),  # while it has unfinished requests
    ("should_ubatch", {"should_ubatch": True, "should_pad": True}),  # it did not want it
    ("cudagraph_mode", {"cudagraph_mode": 1, "should_pad": True}),  # higher than its own 0
    ("should_pause", {"should_pause": True, "any_pause": True}),
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("field", "changes"), DECISION_MISFITS)
def test_a_decision_that_does_not_fit_its_round_fails_the_group_naming_coordd(
    field: str, changes: dict[str, object], route: str
) -> None:
    session = registered()
    seq, registration = started(session)
    misfit = _as(decision(3, seq), **changes)
    event = _fed(session, misfit, seq, route)
    assert isinstance(event, GroupFailed)
    error = event.error
    assert isinstance(error, InvalidAnswer) and isinstance(error, ProtocolError)
    assert (error.seq, error.field, error.at_fault, error.rank) == (seq, field, "coordd", None)
    assert str(error).startswith(f"coordd answered round seq={seq} with {field}=")
    assert session.outcome(seq, registration) == error, "none of the answer is used"
    with pytest.raises(InvalidAnswer):
        session.report(REPORT, FORWARD)
    assert session.receive(decision(3, seq)) is None, "the first failure stays"


@pytest.mark.parametrize("route", ROUTES)
def test_a_decision_for_a_round_not_yet_reported_fails_the_group(route: str) -> None:
    session = registered(next_seq=10)
    seq, registration = started(session)
    event = _fed(session, decision(3, seq + 1), seq, route)
    assert isinstance(event, GroupFailed) and isinstance(event.error, InvalidAnswer)
    assert (event.error.field, event.error.value) == ("seq", seq + 1)
    assert session.outcome(seq, registration) == event.error
    # and before any report: seq 10 decided though this rank has not reported it
    session = registered(next_seq=10)
    assert isinstance(session.receive(decision(3, 10)), GroupFailed)


def test_a_decision_that_fits_is_the_rounds_answer() -> None:
    session = registered()
    seq, registration = started(session)
    fits = decide([None, REPORT], epoch=3, seq=seq, kind=FORWARD)  # rank 0 left out
    assert fits.dead_ranks == [0] and fits.num_tokens_across_dp == [0, 4]
    assert session.receive(fits) == Resolved(seq, fits)
    assert session.outcome(seq, registration) == fits and session.failed is None


GATHER_MISFITS = [
    ("site", {"site": "vllm.other"}),
    ("rows", {"rows": [[1, 2]]}),
    ("rows", {"rows": [[1, 2], [3, 4], [5, 6]]}),
    ("rows[1]", {"rows": [[1, 2], [3, 5]]}),  # this rank's own row altered
    ("rows[0]", {"rows": [[1], [3, 4]]}),  # another rank's row of another length
    ("rows[0]", {"rows": [[1, 2], [3, 4]], "dead_ranks": [0]}),  # a dead rank's row not empty
    ("dead_ranks", {"dead_ranks": [2]}),
    ("dead_ranks", {"rows": [[1, 2], []], "dead_ranks": [1]}),  # this rank, which reported
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("field", "changes"), GATHER_MISFITS)
def test_gathered_rows_that_do_not_fit_the_round_fail_the_group_naming_coordd(
    field: str, changes: dict[str, object], route: str
) -> None:
    session = registered()
    seq = session.gather(SITE, [3, 4]).seq
    registration = session.registration
    event = _fed(session, _as(gathered(3, seq), **changes), seq, route)
    assert isinstance(event, GroupFailed) and isinstance(event.error, InvalidAnswer)
    assert (event.error.seq, event.error.field) == (seq, field)
    assert session.outcome(seq, registration) == event.error


def test_an_answer_of_the_other_kind_fails_the_group() -> None:
    session = registered()
    seq = session.gather(SITE, [3, 4]).seq
    event = session.receive(decision(3, seq))
    assert isinstance(event, GroupFailed) and isinstance(event.error, InvalidAnswer)
    assert event.error.field == "kind" and "gather" in event.error.expected
    session = registered()
    seq, _ = started(session)
    event = session.receive(gathered(3, seq))
    assert isinstance(event, GroupFailed) and isinstance(event.error, InvalidAnswer)
    assert (event.error.field, event.error.expected) == ("kind", "forward")


def test_gathered_rows_that_fit_are_the_rounds_answer() -> None:
    session = registered()
    seq = session.gather(SITE, [3, 4]).seq
    fits = gathered(3, seq, rows=[[], [3, 4]])
    fits = msgspec.structs.replace(fits, dead_ranks=[0])
    assert session.receive(fits) == Resolved(seq, fits)
    seq = session.gather(SITE, []).seq
    empty = gathered(3, seq, rows=[[], []])
    assert session.receive(empty) == Resolved(seq, empty)
    assert session.failed is None


def test_unsolicited_answers_are_dropped_and_counted_not_kept() -> None:
    """A coordd that sends answers for rounds this rank did not ask (300k of them kept 106 MB
    before): an older epoch's, a round already answered, one of a past registration."""
    session = registered(next_seq=10)
    seq, registration = started(session)
    assert session.receive(decision(3, seq)) == Resolved(seq, decision(3, seq))
    for k in range(10_000):
        session.receive(decision(3, k % (seq + 1)))  # answered already, or before the Welcome
        session.receive_frame(encode(decision(2, seq + 1 + k)))  # an older epoch's
    spoofed = ProtocolError("for no report", rank=1)
    session.receive(failure_message(spoofed, epoch=3, seq=seq, kind=FORWARD))
    assert session.dropped_answers == 20_001
    assert session.failed is None
    assert session.outcome(seq, registration) == decision(3, seq)
    assert session._answers == {} and session._later == {}, "nothing kept"
    session.hello()  # registering: the old registration's answers are not this one's
    assert session.receive(decision(3, seq + 5)) is None and session.failed is None
    assert session.dropped_answers == 20_002


def test_a_session_that_never_collects_keeps_a_bounded_number_of_asks() -> None:
    session = registered(next_seq=0)
    for _ in range(10 * MAX_ASKED):
        session.report(REPORT, FORWARD)
    assert MAX_ASKED <= len(session._asked) < 2 * MAX_ASKED
    assert session.receive(decision(3, 0)) is None, "forgotten: its answer is unsolicited"
    last = session.next_seq - 1
    assert session.receive(decision(3, last)) == Resolved(last, decision(3, last))


def test_the_default_wait_outlives_coordds_step_timeout() -> None:
    """Issue 30: the README's `wait(timeout=30)` equalled coordd's default --step-timeout 30,
    and a client whose default wait was shorter than coordd's step timeout raised "no decision
    within 60s" naming nobody before coordd's StepTimeout named the late rank. coordd's Welcome
    now says its step timeout, and a default wait outlives it."""
    from coordd.client._config import DEFAULT_WAIT_TIMEOUT, default_wait_timeout
    from coordd.client._session import SessionView

    class View(SessionView):
        def __init__(self, config: ClientConfig) -> None:
            self.config = config
            self.session = RankSession(config)

    view = View(CONFIG)
    assert CONFIG.wait_timeout is None
    assert view.wait_timeout == DEFAULT_WAIT_TIMEOUT == 60.0  # before a Welcome
    view.session.hello()
    view.session.receive(Welcome(epoch=1, next_seq=0, dp_size=2, step_timeout=90.0))
    assert view.wait_timeout > 90.0 + CONFIG.heartbeat_timeout
    view.session.receive(Welcome(epoch=2, next_seq=0, dp_size=2, step_timeout=30.0))
    assert view.wait_timeout == 60.0 > 30.0 + CONFIG.heartbeat_timeout
    view.session.receive(Welcome(epoch=3, next_seq=0, dp_size=2))  # an older coordd: not said
    assert view.wait_timeout == 60.0
    assert default_wait_timeout(600.0, 5.0) == 610.0
    # what a Welcome says is believed up to a day: a peer cannot make a wait endless
    assert default_wait_timeout(1e300, 5.0) == 86_400.0 + 10.0
    for nonsense in (float("nan"), float("inf"), -1.0):
        assert default_wait_timeout(nonsense, 5.0) == 60.0
    # a wait_timeout given is kept, whatever coordd says
    given = View(dataclasses.replace(CONFIG, wait_timeout=2.0))
    given.session.hello()
    given.session.receive(Welcome(epoch=1, next_seq=0, dp_size=2, step_timeout=90.0))
    assert given.wait_timeout == 2.0


def test_a_timeout_that_names_no_rank_says_why_not() -> None:
    """Issue 30: the client's own timeout ("no decision within 30s") said "find why the named
    ranks are late", naming none."""
    from coordd.proto.errors import StepTimeout

    mine = StepTimeout((), 30.0)
    assert str(mine) == "no decision within 30s"
    assert "named" not in mine.hint and "--step-timeout" in mine.hint
    assert "wait()" in mine.hint and any("coordd status" in n for n in mine.__notes__)
    coordds = StepTimeout([1], 30.0)
    assert "named ranks" in coordds.hint


PADDED = StepReport(
    num_tokens=3, num_tokens_padded=8, cudagraph_mode=2, want_ubatch=True, want_pause=True
)


@pytest.mark.parametrize(
    ("field", "changes"),
    [
        (None, {}),
        (None, {"num_tokens_across_dp": [9, 9]}),  # another rank's padded count is higher
        (None, {"cudagraph_mode": 1}),  # another rank's mode is lower
        ("num_tokens_across_dp", {"num_tokens_across_dp": [7, 7]}),  # below its own 8
        ("num_tokens_across_dp", {"num_tokens_across_dp": [9, 8]}),  # padded: one count
        ("num_tokens_across_dp", {"num_tokens_across_dp": [2**31, 2**31]}),  # past int32
        ("should_pad", {"should_pad": False}),  # mode 2: padding is on
        ("any_pause", {"any_pause": False}),  # it wants to pause
        ("kind", {"kind": StepKind.STATE}),
    ],
)
def test_a_decision_is_checked_against_the_report_this_rank_sent(
    field: str | None, changes: dict[str, object]
) -> None:
    """Issue 28, defect 7: the pure rule both clients and the adapter apply
    (`decision_misfit`), on a padded round."""
    sent = _as_report(PADDED, seq=5)
    honest = decide([PADDED, sent], epoch=3, seq=5, kind=FORWARD)
    assert honest.should_pad and honest.num_tokens_across_dp == [8, 8]
    error = decision_misfit(_as(honest, **changes), sent, 1, 2)  # type: ignore[arg-type]
    if field is None:
        assert error is None
    else:
        assert isinstance(error, InvalidAnswer) and (error.field, error.seq) == (field, 5)
        assert error.at_fault == "coordd"


def _as_report(report: StepReport, **changes: object) -> StepReport:
    return msgspec.structs.replace(report, dp_rank=1, epoch=3, kind=FORWARD, **changes)
