"""coordd.proto.coordinator: membership, rounds, faults and deadlines, driven with a fake clock."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordd.proto import (
    PROTOCOL_VERSION,
    ConflictingReport,
    CoordError,
    Coordinator,
    CoordinatorUnavailable,
    FailReason,
    Goodbye,
    Heartbeat,
    Hello,
    InvalidReport,
    OnRankLoss,
    ProtocolError,
    RankLost,
    Reject,
    RejectReason,
    Send,
    StepDecision,
    StepFailed,
    StepKind,
    StepMismatch,
    StepReport,
    StepTimeout,
    Welcome,
    decide,
    error_from_failure,
)
from coordd.proto.group_state import (
    TRANSITIONS,
    GroupEvent,
    GroupState,
    IllegalTransition,
    next_state,
)
from coordd.proto.messages import POLICY_KINDS, GatherReport, GatherResult, Report
from coordd.proto.snapshot import GroupSnapshot

DP = 4
EPOCH = 7


def welcome(*, epoch: int, next_seq: int, dp_size: int) -> Welcome:
    """coordd's Welcome, which says its step timeout (TIMEOUT here)."""
    return Welcome(epoch=epoch, next_seq=next_seq, dp_size=dp_size, step_timeout=TIMEOUT)


TIMEOUT = 10.0
F, D, S = StepKind.FORWARD, StepKind.DRAFT, StepKind.STATE


def peer(rank: int) -> bytes:
    return f"p{rank}".encode()


def hello(rank: int, dp: int = DP, **kw: object) -> Hello:
    kw.setdefault("incarnation", f"inc{rank}")
    kw.setdefault("config_fingerprint", "fp")
    return Hello(dp_size=dp, dp_rank=rank, **kw)  # type: ignore[arg-type]


def rep(rank: int, seq: int, *, epoch: int = EPOCH, kind: StepKind = F, tokens: int | None = None,
        **kw: object) -> StepReport:
    """A valid report; the values vary with rank and seq so that rounds are told apart."""
    t = (rank * 7 + seq * 3) % 50 + 1 if tokens is None else tokens
    kw.setdefault("num_tokens_padded", t + (rank % 3))
    kw.setdefault("want_ubatch", True)
    kw.setdefault("cudagraph_mode", 2 - rank % 2)
    kw.setdefault("has_unfinished", rank == 1)
    return StepReport(num_tokens=t, dp_rank=rank, epoch=epoch, seq=seq, kind=kind,
                      **kw)  # type: ignore[arg-type]


class Group:
    """A coordinator, its fake clock, and the ranks that registered with it."""

    def __init__(self, dp: int = DP, registered: int | None = None, **kw: object) -> None:
        kw.setdefault("step_timeout", TIMEOUT)
        self.c = Coordinator(dp, epoch=EPOCH, **kw)  # type: ignore[arg-type]
        self.dp = dp
        self.now = 100.0
        for r in range(dp if registered is None else registered):
            sends = self.hello(r)
            assert sends == [Send((peer(r),), welcome(epoch=EPOCH, next_seq=0, dp_size=dp))]

    def hello(self, rank: int, p: bytes | None = None, **kw: object) -> list[Send]:
        return list(self.c.receive(peer(rank) if p is None else p, hello(rank, self.dp, **kw),
                                   self.now))

    def send(self, report: StepReport, p: bytes | None = None) -> list[Send]:
        return list(self.c.receive(peer(report.dp_rank) if p is None else p, report, self.now))

    def round(self, seq: int, kind: StepKind = F, ranks: Sequence[int] | None = None,
              ) -> tuple[StepDecision, list[StepReport]]:
        """Every rank reports `seq`; only the last report completes the round."""
        ranks = list(range(self.dp)) if ranks is None else list(ranks)
        reports = [rep(r, seq, epoch=self.c.snapshot().epoch, kind=kind) for r in ranks]
        for r in reports[:-1]:
            assert self.send(r) == []
        sends = self.send(reports[-1])
        assert len(sends) == 1
        (to, decision), = sends
        assert to == self.c.peers()
        assert isinstance(decision, StepDecision)
        return decision, reports


def all_peers(dp: int = DP) -> tuple[bytes, ...]:
    return tuple(peer(r) for r in range(dp))


def failed(sends: Sequence[Send], error: CoordError, *, to: Sequence[bytes],
           reported: Sequence[bytes] = (), epoch: int = EPOCH, seq: int | None = None,
           ) -> StepFailed:
    """One Send of one StepFailed to exactly `to`, standing for `error`; nobody who reported is
    left without an answer."""
    assert len(sends) == 1, sends
    peers, msg = sends[0]
    assert isinstance(msg, StepFailed), msg
    assert sorted(peers) == sorted(to)
    assert len(set(peers)) == len(peers)
    assert set(reported) <= set(peers), "a rank that reported was left without an answer"
    assert msg.reason is FailReason(error.reason)
    back = error_from_failure(msg)
    assert type(back) is type(error)
    assert back == error
    if isinstance(error, ProtocolError):
        assert msg.culprits == ([] if error.rank is None else [error.rank])
    else:
        assert msg.culprits == list(getattr(error, "ranks", ()))
    assert msg.epoch == epoch
    if seq is not None:
        assert msg.seq == seq
    return msg


# -- happy rounds --------------------------------------------------------------------------


def test_registration_welcomes_each_rank() -> None:
    g = Group(registered=0)
    for r in (2, 0, 3, 1):
        assert g.hello(r) == [Send((peer(r),), welcome(epoch=EPOCH, next_seq=0, dp_size=DP))]
    assert g.c.peers() == all_peers()
    assert g.c.next_deadline() is None


def test_happy_rounds_send_one_decision_to_every_peer() -> None:
    g = Group()
    for seq, kind in enumerate([F, D, F, S, F, F]):
        ranks = [(seq + i) % DP for i in range(DP)]  # arrival order varies
        reports = [rep(r, seq, kind=kind) for r in ranks]
        for r in reports[:-1]:
            assert g.send(r) == []
            assert g.c.next_deadline() == g.now + TIMEOUT
        sends = g.send(reports[-1])
        by_rank = sorted(reports, key=lambda r: r.dp_rank)
        expected = decide(by_rank, 2, epoch=EPOCH, seq=seq, kind=kind)
        assert sends == [Send(all_peers(), expected)]
        assert g.c.next_deadline() is None
        g.now += 1.0


def test_group_num_ubatches_is_used() -> None:
    g = Group(registered=0)
    for r in range(DP):
        g.hello(r, num_ubatches=4)
    # P=16, U=10: n=2 -> 8 >= 10 false (on); n=4 -> 12 >= 10 (off)
    reports = [rep(r, 0, tokens=10 + r, num_tokens_padded=16) for r in range(DP)]
    for r in reports[:-1]:
        assert g.send(r) == []
    (_, d), = g.send(reports[-1])
    assert d == decide(reports, 4, epoch=EPOCH, seq=0, kind=F)
    assert not d.should_ubatch
    assert decide(reports, 2).should_ubatch


def test_single_rank_group() -> None:
    g = Group(dp=1)
    for seq in range(3):
        r = rep(0, seq)
        assert g.send(r) == [Send((peer(0),), decide([r], epoch=EPOCH, seq=seq, kind=F))]


def test_round_waits_for_unregistered_ranks() -> None:
    g = Group(registered=2)
    assert g.send(rep(0, 0)) == []
    assert g.send(rep(1, 0)) == []
    g.hello(2)
    assert g.send(rep(2, 0)) == []
    assert g.hello(3) == [Send((peer(3),), welcome(epoch=EPOCH, next_seq=0, dp_size=DP))]
    (to, d), = g.send(rep(3, 0))
    assert to == all_peers()
    assert d == decide([rep(r, 0) for r in range(DP)], epoch=EPOCH, seq=0, kind=F)


@given(
    st.lists(st.permutations(range(DP)), min_size=1, max_size=5),
    st.lists(st.tuples(st.integers(0, 64), st.integers(0, 64), st.booleans(),
                       st.integers(0, 2), st.booleans()), min_size=DP * 5, max_size=DP * 5),
    st.lists(st.sampled_from(POLICY_KINDS), min_size=5, max_size=5),
    st.lists(st.booleans(), min_size=DP * 5, max_size=DP * 5),
)
def test_random_rounds_match_the_policy(orders, values, kinds, resend) -> None:  # type: ignore[no-untyped-def]
    g = Group()
    for seq, order in enumerate(orders):
        reports = {}
        for i, r in enumerate(order):
            tokens, extra, ub, mode, unf = values[seq * DP + r]
            report = StepReport(num_tokens=tokens, num_tokens_padded=tokens + extra,
                                want_ubatch=ub, cudagraph_mode=mode, has_unfinished=unf,
                                dp_rank=r, epoch=EPOCH, seq=seq, kind=kinds[seq])
            reports[r] = report
            sends = g.send(report)
            if i < DP - 1:
                assert sends == []
                if resend[seq * DP + r]:
                    assert g.send(report) == []  # an identical re-send is harmless
        expected = decide([reports[r] for r in range(DP)], 2, epoch=EPOCH, seq=seq,
                          kind=kinds[seq])
        assert sends == [Send(all_peers(), expected)]


# -- registration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rank", "kw", "reason", "expected", "got"),
    [
        (1, dict(protocol_version=PROTOCOL_VERSION + 1), RejectReason.VERSION,
         str(PROTOCOL_VERSION), str(PROTOCOL_VERSION + 1)),
        (1, dict(dp=DP * 2), RejectReason.DP_SIZE, f"1..{DP}", str(DP * 2)),
        (DP, {}, RejectReason.RANK_RANGE, f"0..{DP - 1}", str(DP)),
        (-1, {}, RejectReason.RANK_RANGE, f"0..{DP - 1}", "-1"),
        (1, dict(group="other"), RejectReason.GROUP, "default", "other"),
        (1, dict(num_ubatches=3), RejectReason.NUM_UBATCHES, "2", "3"),
        (1, dict(num_ubatches=0), RejectReason.NUM_UBATCHES, ">= 1", "0"),
        (1, dict(config_fingerprint="fp2"), RejectReason.FINGERPRINT, "fp", "fp2"),
    ],
)
def test_registration_rejects(rank, kw, reason, expected, got) -> None:  # type: ignore[no-untyped-def]
    g = Group(registered=1)
    dp = kw.pop("dp", DP)
    msg = hello(rank, dp, **kw)
    sends = list(g.c.receive(b"newcomer", msg, g.now))
    assert len(sends) == 1
    (to, reject), = sends
    assert to == (b"newcomer",)
    assert isinstance(reject, Reject)
    assert (reject.reason, reject.expected, reject.got) == (reason, expected, got)
    assert reject.text
    assert g.c.peers() == (peer(0),)  # the group is unaffected


def test_rank_taken_by_a_live_peer() -> None:
    g = Group(registered=2)
    (to, reject), = g.hello(1, p=b"impostor", incarnation="inc-new")
    assert to == (b"impostor",)
    assert isinstance(reject, Reject)
    assert (reject.reason, reject.expected, reject.got) == (
        RejectReason.RANK_TAKEN, "a dp_rank no live connection holds", "1")
    # nothing that identifies the holder's connection is echoed to the asker
    assert "inc1" not in f"{reject.text} {reject.expected} {reject.got}"
    assert g.c.peers() == (peer(0), peer(1))


def test_one_peer_cannot_hold_two_ranks() -> None:
    g = Group(registered=2)
    sends = list(g.c.receive(peer(0), hello(2), g.now))
    (to, reject), = sends
    assert to == (peer(0),)
    assert isinstance(reject, Reject)
    assert (reject.reason, reject.expected, reject.got) == (RejectReason.RANK_TAKEN, "0", "2")


def test_re_hello_from_the_same_peer_is_idempotent() -> None:
    g = Group()
    assert g.send(rep(0, 0)) == []
    assert g.send(rep(1, 0)) == []
    for _ in range(2):
        assert g.hello(1) == [Send((peer(1),), welcome(epoch=EPOCH, next_seq=0, dp_size=DP))]
    assert g.c.peers() == all_peers()
    assert g.send(rep(2, 0)) == []
    (to, d), = g.send(rep(3, 0))
    assert to == all_peers()
    assert d == decide([rep(r, 0) for r in range(DP)], epoch=EPOCH, seq=0, kind=F)
    assert g.hello(0) == [Send((peer(0),), welcome(epoch=EPOCH, next_seq=1, dp_size=DP))]


def test_group_settings_come_from_the_registered_ranks() -> None:
    g = Group(registered=0)
    g.hello(2, group="g", num_ubatches=3, config_fingerprint="x")
    (_, reject), = g.hello(0)
    assert isinstance(reject, Reject) and reject.reason is RejectReason.GROUP
    (_, welcome), = g.hello(0, group="g", num_ubatches=3, config_fingerprint="x")
    assert isinstance(welcome, Welcome)


# -- faults --------------------------------------------------------------------------------


def test_skipped_seq_fails_the_round_for_everyone() -> None:
    g = Group()
    g.round(0)
    assert g.send(rep(0, 1)) == []
    assert g.send(rep(1, 1)) == []
    sends = g.send(rep(2, 2))
    msg = failed(sends, StepMismatch(2, 1, "forward", 2, "forward"), to=all_peers(),
                 reported=[peer(0), peer(1), peer(2)], seq=1)
    assert msg.reason is FailReason.MISMATCH
    assert (msg.expected_seq, msg.got_seq) == (1, 2)


def test_skipped_seq_before_the_round_opens() -> None:
    g = Group()
    g.round(0)
    failed(g.send(rep(3, 2, kind=D)), StepMismatch(3, 1, "draft", 2, "draft"), to=all_peers(),
           seq=1)


def test_repeated_seq_with_other_data() -> None:
    g = Group()
    g.round(0)
    assert g.send(rep(0, 1)) == []
    sends = g.send(rep(1, 0, tokens=99))
    failed(sends, StepMismatch(1, 1, "forward", 0, "forward"), to=all_peers(),
           reported=[peer(0)], seq=1)


def test_wrong_kind() -> None:
    """The round waits for every rank's report, then names the rank off the majority kind."""
    g = Group()
    assert g.send(rep(0, 0, kind=F)) == []
    assert g.send(rep(1, 0, kind=F)) == []
    assert g.send(rep(2, 0, kind=D)) == []
    sends = g.send(rep(3, 0, kind=F))
    failed(sends, StepMismatch(2, 0, "forward", 0, "draft"), to=all_peers(),
           reported=all_peers(), seq=0)


def test_conflicting_duplicate() -> None:
    g = Group()
    assert g.send(rep(0, 0)) == []
    assert g.send(rep(1, 0)) == []
    sends = g.send(rep(1, 0, tokens=42))
    msg = failed(sends, ConflictingReport(1, 0), to=all_peers(), reported=[peer(0), peer(1)],
                 seq=0)
    assert msg.reason is FailReason.CONFLICT


def test_identical_resend_is_harmless() -> None:
    g = Group()
    assert g.send(rep(0, 0)) == []
    assert g.send(rep(0, 0)) == []
    for r in (1, 2):
        assert g.send(rep(r, 0)) == []
    (to, d), = g.send(rep(3, 0))
    assert to == all_peers()
    assert d == decide([rep(r, 0) for r in range(DP)], epoch=EPOCH, seq=0, kind=F)


def test_identical_resend_of_the_completed_round_gets_the_decision_again() -> None:
    g = Group()
    d0, _ = g.round(0)
    assert g.send(rep(1, 1)) == []
    assert g.send(rep(2, 0)) == [Send((peer(2),), d0)]  # to that peer only
    assert g.send(rep(1, 0)) == [Send((peer(1),), d0)]
    for r in (0, 2):
        assert g.send(rep(r, 1)) == []
    (to, d1), = g.send(rep(3, 1))
    assert (to, d1.seq) == (all_peers(), 1)
    # two rounds back is a mismatch, not a re-send
    failed(g.send(rep(0, 0)), StepMismatch(0, 2, "forward", 0, "forward"), to=all_peers(), seq=2)


@pytest.mark.parametrize(
    ("kw", "field", "value"),
    [
        (dict(tokens=-3, num_tokens_padded=0), "num_tokens", -3),
        (dict(tokens=8, num_tokens_padded=4), "num_tokens_padded", 4),
        (dict(cudagraph_mode=5), "cudagraph_mode", 5),
    ],
)
def test_invalid_report(kw, field, value) -> None:  # type: ignore[no-untyped-def]
    g = Group()
    assert g.send(rep(0, 0)) == []
    sends = g.send(rep(2, 0, **kw))
    msg = failed(sends, InvalidReport(2, field, value, _expected_text(field, kw)),
                 to=all_peers(), reported=[peer(0)], seq=0)
    assert (msg.reason, msg.field, msg.culprits) == (FailReason.INVALID, field, [2])
    error = error_from_failure(msg)
    assert isinstance(error, InvalidReport)
    assert (error.rank, error.field, error.value) == (2, field, value)


def _expected_text(field: str, kw: dict[str, object]) -> str:
    return {"num_tokens": ">= 0", "num_tokens_padded": f">= num_tokens ({kw.get('tokens')})",
            "cudagraph_mode": "0, 1 or 2"}[field]


def test_rank_lost() -> None:
    g = Group()
    assert g.send(rep(0, 0)) == []
    assert g.send(rep(3, 0)) == []
    sends = list(g.c.peer_lost(peer(3), g.now))
    failed(sends, RankLost([3], "disconnected"), to=all_peers()[:3], reported=[peer(0)], seq=0)


@pytest.mark.parametrize("how", ["lost", "goodbye"])
def test_rank_lost_between_rounds(how: str) -> None:
    # nobody is waiting between rounds: nothing is sent, but the group has failed and each
    # rank gets the failure when it next reports
    g = Group()
    g.round(0)
    if how == "lost":
        sends = list(g.c.peer_lost(peer(1), g.now, detail="missed 3 heartbeats"))
        error = RankLost([1], "missed 3 heartbeats")
    else:
        sends = list(g.c.receive(peer(1), Goodbye(), g.now))
        error = RankLost([1], "left the group")
    assert sends == []
    assert g.c.next_deadline() is None
    first = failed(g.send(rep(0, 1)), error, to=[peer(0)], seq=1)
    for r in (2, 3):
        assert g.send(rep(r, 1)) == [Send((peer(r),), first)]


def test_every_rank_leaving_cleanly_stops_the_group_without_a_failure() -> None:
    g = Group()
    g.round(0)
    for r in (2, 0, 3):
        assert list(g.c.receive(peer(r), Goodbye(text="rank closed"), g.now)) == []
        snap = g.c.snapshot()
        assert snap.state is GroupState.IDLE and snap.failures == 0
    assert g.c.snapshot().left == frozenset({0, 2, 3})
    assert list(g.c.receive(peer(1), Goodbye(), g.now)) == []
    snap = g.c.snapshot()
    assert snap.state is GroupState.STOPPED and snap.stopped
    assert (snap.failures, snap.departures, snap.stops, snap.failure) == (0, 4, 1, None)
    assert snap.members == {} and snap.left == frozenset() and g.c.next_deadline() is None
    # a restart registers again: a new epoch that goes on from the next seq
    (_, welcome), = g.hello(0)
    assert isinstance(welcome, Welcome) and welcome.epoch == EPOCH + 1 and welcome.next_seq == 1
    assert g.c.state is GroupState.IDLE and g.c.snapshot().failures == 0


def test_a_report_after_a_peer_left_fails_naming_it() -> None:
    """The round could never complete: the reporter is told at once which rank left."""
    g = Group(dp=2)
    g.round(0)
    assert list(g.c.receive(peer(1), Goodbye(), g.now)) == []
    failed(g.send(rep(0, 1)), RankLost([1], "left the group"), to=[peer(0)], seq=1)
    snap = g.c.snapshot()
    assert snap.state is GroupState.FAILED and snap.failures == 1 and snap.departures == 1


def test_a_resent_report_after_a_peer_left_gets_its_decision_again() -> None:
    g = Group(dp=2)
    decision, _ = g.round(0)
    assert list(g.c.receive(peer(1), Goodbye(), g.now)) == []
    assert g.send(rep(0, 0)) == [Send((peer(0),), decision)]
    assert g.c.state is GroupState.IDLE


def test_a_loss_without_goodbye_after_a_clean_departure_is_a_failure() -> None:
    g = Group(dp=2)
    g.round(0)
    assert list(g.c.receive(peer(0), Goodbye(), g.now)) == []
    assert list(g.c.peer_lost(peer(1), g.now)) == []
    snap = g.c.snapshot()
    assert snap.state is GroupState.FAILED and snap.failures == 1 and snap.stops == 0
    assert snap.last_failure is not None and snap.last_failure.culprits == [1]


def test_a_rank_that_left_may_register_again_between_rounds() -> None:
    g = Group(dp=2)
    g.round(0)
    assert list(g.c.receive(peer(1), Goodbye(), g.now)) == []
    (_, welcome), = g.c.receive(b"again", hello(1, 2, incarnation="inc1b"), g.now)
    assert isinstance(welcome, Welcome) and welcome.epoch == EPOCH and welcome.next_seq == 1
    assert g.c.snapshot().left == frozenset()
    assert g.send(rep(0, 1)) == []
    (sent,) = g.c.receive(b"again", rep(1, 1), g.now)
    assert isinstance(sent.message, StepDecision) and sorted(sent.peers) == [b"again", peer(0)]


def test_elastic_a_rank_that_left_is_left_out() -> None:
    g = Group(dp=3, on_rank_loss=OnRankLoss.NEUTRALIZE)
    g.round(0)
    assert list(g.c.receive(peer(2), Goodbye(), g.now)) == []
    assert g.send(rep(0, 1)) == []
    (sent,) = g.send(rep(1, 1))
    assert isinstance(sent.message, StepDecision) and sent.message.dead_ranks == [2]
    for r in (0, 1):
        g.c.receive(peer(r), Goodbye(), g.now)
    assert g.c.state is GroupState.STOPPED and g.c.snapshot().failures == 0


def test_goodbye_mid_group() -> None:
    g = Group()
    assert g.send(rep(0, 0)) == []
    sends = list(g.c.receive(peer(2), Goodbye(text="bye"), g.now))
    failed(sends, RankLost([2], "left the group"), to=(peer(0), peer(1), peer(3)),
           reported=[peer(0)], seq=0)


def test_last_member_leaving_resets_without_failure() -> None:
    g = Group(registered=1)
    assert g.send(rep(0, 0)) == []
    assert list(g.c.peer_lost(peer(0), g.now)) == []
    assert g.c.next_deadline() is None
    assert g.c.peers() == ()
    # a new group may form with other settings
    (_, welcome), = g.hello(1, config_fingerprint="new")
    assert isinstance(welcome, Welcome)


def test_unknown_peer_lost_or_goodbye_is_ignored() -> None:
    g = Group()
    assert list(g.c.peer_lost(b"stranger", g.now)) == []
    assert list(g.c.receive(b"stranger", Goodbye(), g.now)) == []
    g.round(0)


def test_step_timeout() -> None:
    g = Group()
    assert g.c.next_deadline() is None
    assert list(g.c.on_deadline(1e9)) == []  # no round open
    assert g.send(rep(1, 0)) == []
    g.now += 4.0
    assert g.send(rep(3, 0)) == []
    deadline = g.c.next_deadline()
    assert deadline == 100.0 + TIMEOUT  # from the first report of the round
    assert list(g.c.on_deadline(deadline - 0.001)) == []
    assert g.c.next_deadline() == deadline
    sends = list(g.c.on_deadline(deadline))
    msg = failed(sends, StepTimeout([0, 2], TIMEOUT), to=all_peers(),
                 reported=[peer(1), peer(3)], seq=0)
    assert (msg.reason, msg.timeout) == (FailReason.TIMEOUT, TIMEOUT)
    assert g.c.next_deadline() is None
    assert list(g.c.on_deadline(deadline + 100)) == []


def test_step_timeout_names_unregistered_slots() -> None:
    g = Group(registered=2)
    assert g.send(rep(0, 0)) == []
    sends = list(g.c.on_deadline(g.now + TIMEOUT + 1))
    failed(sends, StepTimeout([1, 2, 3], TIMEOUT), to=(peer(0), peer(1)), reported=[peer(0)])


def test_deadline_restarts_with_each_round() -> None:
    g = Group()
    g.round(0)
    g.now = 500.0
    assert g.c.next_deadline() is None
    assert g.send(rep(0, 1)) == []
    assert g.c.next_deadline() == 500.0 + TIMEOUT
    assert list(g.c.on_deadline(100.0 + TIMEOUT)) == []


# -- after a failure -----------------------------------------------------------------------


def _failed_group() -> tuple[Group, StepFailed]:
    g = Group()
    g.round(0)
    g.round(1)
    assert g.send(rep(0, 2)) == []
    (_, failure), = g.send(rep(1, 2, tokens=-1))
    assert isinstance(failure, StepFailed) and failure.seq == 2
    return g, failure


def test_fail_stop_every_later_report_gets_the_same_failure() -> None:
    g, failure = _failed_group()
    for report in (rep(2, 2), rep(3, 2), rep(0, 3), rep(1, 2), rep(3, 9, kind=S), rep(0, 1)):
        assert g.send(report) == [Send((peer(report.dp_rank),), failure)]
    assert g.c.next_deadline() is None
    assert list(g.c.on_deadline(g.now + 1e6)) == []


def test_new_hello_opens_a_new_epoch() -> None:
    g, failure = _failed_group()
    assert g.hello(2) == [Send((peer(2),), welcome(epoch=EPOCH + 1, next_seq=3, dp_size=DP))]
    assert g.c.peers() == (peer(2),)
    # a member of the old epoch that did not re-register gets the old failure
    assert g.send(rep(0, 2)) == [Send((peer(0),), failure)]
    assert g.send(rep(0, 3)) == [Send((peer(0),), failure)]
    for r in (0, 1, 3):
        assert g.hello(r) == [Send((peer(r),), welcome(epoch=EPOCH + 1, next_seq=3, dp_size=DP))]
    reports = [rep(r, 3, epoch=EPOCH + 1) for r in range(DP)]
    for r in reports[:-1]:
        assert g.send(r) == []
    assert g.send(reports[-1]) == [
        Send(all_peers(), decide(reports, epoch=EPOCH + 1, seq=3, kind=F))]
    # still the old failure for the old epoch
    assert g.send(rep(0, 2), p=b"old") == [Send((b"old",), failure)]


def test_new_epoch_may_change_group_settings_once_no_rank_is_connected() -> None:
    g, _ = _failed_group()
    for r in range(DP):
        assert list(g.c.peer_lost(peer(r), g.now)) == []
    (_, welcome), = g.hello(1, config_fingerprint="v2")
    assert isinstance(welcome, Welcome) and welcome.epoch == EPOCH + 1
    (_, reject), = g.hello(0)
    assert isinstance(reject, Reject) and reject.reason is RejectReason.FINGERPRINT


def test_new_hello_after_failure_still_checks_the_basics() -> None:
    g, failure = _failed_group()
    (_, reject), = g.hello(0, protocol_version=PROTOCOL_VERSION + 1)
    assert isinstance(reject, Reject) and reject.reason is RejectReason.VERSION
    assert g.c.snapshot().epoch == EPOCH  # no new epoch from a rejected Hello
    assert g.send(rep(1, 2)) == [Send((peer(1),), failure)]


# -- strangers -----------------------------------------------------------------------------


def test_report_from_an_unregistered_peer() -> None:
    g = Group(registered=3)
    assert g.send(rep(0, 0)) == []
    stranger = rep(3, 0)
    sends = g.send(stranger, p=b"stranger")
    msg = failed(sends, ProtocolError("report from a peer that has not registered", rank=3),
                 to=[b"stranger"], seq=0)
    assert msg.reason is FailReason.PROTOCOL
    # the group is unaffected: rank 3 registers and the round completes
    g.hello(3)
    for r in (1, 2):
        assert g.send(rep(r, 0)) == []
    (to, d), = g.send(rep(3, 0))
    assert to == all_peers()
    assert d == decide([rep(r, 0) for r in range(DP)], epoch=EPOCH, seq=0, kind=F)


def test_spoofed_rank_gets_an_error_alone() -> None:
    g = Group()
    assert g.send(rep(0, 0)) == []
    spoofed = rep(2, 0)
    sends = g.send(spoofed, p=peer(1))
    msg = failed(sends, ProtocolError("peer registered as rank 1 reported as rank 2", rank=1),
                 to=[peer(1)], seq=0)
    assert msg.reason is FailReason.PROTOCOL
    # the group is unaffected
    for r in (1, 2):
        assert g.send(rep(r, 0)) == []
    (to, d), = g.send(rep(3, 0))
    assert to == all_peers()
    assert d == decide([rep(r, 0) for r in range(DP)], epoch=EPOCH, seq=0, kind=F)


@pytest.mark.parametrize("who", [b"stranger", peer(1)])
def test_foreign_epoch(who: bytes) -> None:
    g = Group()
    assert g.send(rep(0, 0)) == []
    sends = g.send(rep(1, 0, epoch=EPOCH - 3), p=who)
    assert len(sends) == 1
    (to, msg), = sends
    assert to == (who,)
    assert isinstance(msg, StepFailed) and msg.reason is FailReason.UNAVAILABLE
    assert isinstance(error_from_failure(msg), CoordinatorUnavailable)
    # the group is unaffected
    for r in (1, 2):
        assert g.send(rep(r, 0)) == []
    (to, _), = g.send(rep(3, 0))
    assert to == all_peers()


# -- other messages ------------------------------------------------------------------------


@pytest.mark.parametrize("who", [peer(0), b"stranger"])
def test_heartbeat_is_echoed_to_the_sender(who: bytes) -> None:
    g = Group()
    hb = Heartbeat(nonce=12345)
    assert list(g.c.receive(who, hb, g.now)) == [Send((who,), hb)]


def test_shutdown_says_goodbye_to_all() -> None:
    g = Group()
    sends = list(g.c.shutdown("bye now"))
    assert sends == [Send(all_peers(), Goodbye(text="bye now"))]
    (_, msg), = g.c.shutdown()
    assert isinstance(msg, Goodbye) and msg.text
    assert list(Group(registered=0).c.shutdown()) == []


def test_not_a_message_to_the_coordinator() -> None:
    g = Group()
    with pytest.raises(TypeError):
        g.c.receive(peer(0), Welcome(epoch=1, next_seq=0, dp_size=DP), g.now)  # type: ignore[arg-type]


def test_bad_dp_size() -> None:
    with pytest.raises(ValueError):
        Coordinator(0, epoch=1)


# -- neutralize ----------------------------------------------------------------------------

N = OnRankLoss.NEUTRALIZE


def test_neutralize_excludes_a_lost_rank() -> None:
    g = Group(on_rank_loss=N)
    assert g.send(rep(0, 0)) == []
    assert list(g.c.peer_lost(peer(2), g.now)) == []
    assert g.send(rep(1, 0)) == []
    sends = g.send(rep(3, 0))
    reports = [rep(0, 0), rep(1, 0), None, rep(3, 0)]
    assert sends == [Send((peer(0), peer(1), peer(3)), decide(reports, epoch=EPOCH, seq=0,
                                                              kind=F))]
    assert sends[0].message.dead_ranks == [2]  # type: ignore[union-attr]
    # later rounds too
    reports = [rep(0, 1), rep(1, 1), None, rep(3, 1)]
    for r in (0, 1):
        assert g.send(rep(r, 1)) == []
    (_, d), = g.send(rep(3, 1))
    assert d == decide(reports, epoch=EPOCH, seq=1, kind=F)
    assert d.dead_ranks == [2]


def test_neutralize_a_lost_rank_that_already_reported() -> None:
    g = Group(on_rank_loss=N)
    assert g.send(rep(2, 0)) == []
    assert g.send(rep(0, 0)) == []
    assert list(g.c.receive(peer(2), Goodbye(), g.now)) == []
    assert g.send(rep(1, 0)) == []  # 2 of 3 live ranks: not complete yet
    (to, d), = g.send(rep(3, 0))
    assert to == (peer(0), peer(1), peer(3))
    assert d == decide([rep(0, 0), rep(1, 0), None, rep(3, 0)], epoch=EPOCH, seq=0, kind=F)


def test_neutralize_loss_completes_a_waiting_round() -> None:
    g = Group(on_rank_loss=N)
    for r in (0, 1, 3):
        assert g.send(rep(r, 0)) == []
    (to, d), = g.c.peer_lost(peer(2), g.now)
    assert to == (peer(0), peer(1), peer(3))
    assert d == decide([rep(0, 0), rep(1, 0), None, rep(3, 0)], epoch=EPOCH, seq=0, kind=F)


def test_neutralize_timeout_does_not_name_dead_ranks() -> None:
    g = Group(on_rank_loss=N)
    assert g.send(rep(0, 0)) == []
    g.c.peer_lost(peer(3), g.now)
    sends = list(g.c.on_deadline(g.now + TIMEOUT))
    failed(sends, StepTimeout([1, 2], TIMEOUT), to=(peer(0), peer(1), peer(2)),
           reported=[peer(0)])


def test_neutralize_rejoin_between_rounds() -> None:
    g = Group(on_rank_loss=N)
    g.c.peer_lost(peer(1), g.now)
    g.round(0, ranks=[0, 2, 3])
    assert g.hello(1) == [Send((peer(1),), welcome(epoch=EPOCH, next_seq=1, dp_size=DP))]
    d, reports = g.round(1)
    assert d == decide(reports, epoch=EPOCH, seq=1, kind=F)
    assert d.dead_ranks == []


def test_neutralize_rejoin_during_a_round_waits_for_its_end() -> None:
    g = Group(on_rank_loss=N)
    g.c.peer_lost(peer(1), g.now)
    assert g.send(rep(0, 0)) == []
    assert g.hello(1) == []  # queued until the open round ends
    assert g.send(rep(2, 0)) == []
    sends = g.send(rep(3, 0))
    assert len(sends) == 2
    assert sends[0] == Send((peer(0), peer(2), peer(3)), decide(
        [rep(0, 0), None, rep(2, 0), rep(3, 0)], epoch=EPOCH, seq=0, kind=F))
    assert sends[1] == Send((peer(1),), welcome(epoch=EPOCH, next_seq=1, dp_size=DP))
    d, _ = g.round(1)
    assert d.dead_ranks == []


def test_neutralize_every_rank_lost_resets() -> None:
    g = Group(dp=2, on_rank_loss=N)
    assert list(g.c.peer_lost(peer(0), g.now)) == []
    assert list(g.c.peer_lost(peer(1), g.now)) == []
    assert g.c.peers() == ()
    g.hello(0)
    g.hello(1)
    d, _ = g.round(0)
    assert d.dead_ranks == []


def test_neutralize_other_faults_still_fail_the_round() -> None:
    g = Group(on_rank_loss=N)
    g.c.peer_lost(peer(3), g.now)
    assert g.send(rep(0, 0)) == []
    sends = g.send(rep(1, 1))
    failed(sends, StepMismatch(1, 0, "forward", 1, "forward"), to=(peer(0), peer(1), peer(2)),
           reported=[peer(0)])


def test_neutralize_a_queued_rejoin_opens_the_next_epoch_when_its_round_fails() -> None:
    """The queued rank took no part in the failed round: it is not left waiting on it, its
    Hello counts as the first after the failure and gets a Welcome into the new epoch."""
    g = Group(on_rank_loss=N)
    g.c.peer_lost(peer(1), g.now)
    assert g.send(rep(0, 0)) == []
    assert g.hello(1) == []
    fail_send, welcome_send = g.c.on_deadline(g.now + TIMEOUT)
    failed([fail_send], StepTimeout([2, 3], TIMEOUT), to=(peer(0), peer(2), peer(3)),
           reported=[peer(0)])
    assert welcome_send.peers == (peer(1),)
    assert welcome_send.message == welcome(epoch=EPOCH + 1, next_seq=1, dp_size=4)
    assert g.c.snapshot().rank_of(peer(1)) == 1
    assert list(g.c.snapshot().members) == [1]


def test_neutralize_a_queued_rejoin_that_leaves_is_forgotten() -> None:
    g = Group(on_rank_loss=N)
    g.c.peer_lost(peer(1), g.now)
    assert g.send(rep(0, 0)) == []
    assert g.hello(1) == []
    assert list(g.c.peer_lost(peer(1), g.now)) == []
    assert g.send(rep(2, 0)) == []
    sends = g.send(rep(3, 0))
    assert [to for to, _ in sends] == [(peer(0), peer(2), peer(3))]


# -- model check: honest ranks, random faults ----------------------------------------------


class Rank:
    """An honest rank: registers, reports its seq, waits; after any failure, registers again."""

    def __init__(self, r: int) -> None:
        self.r = r
        self.incarnation = 0
        self.state = "new"  # new | registering | ready | waiting
        self.epoch = -1
        self.seq = -1
        self.sent: Report | None = None
        self.previous: Report | None = None  # the report of the last decided round

    @property
    def peer(self) -> bytes:
        return f"p{self.r}.{self.incarnation}".encode()


class Recording(Coordinator):
    """A Coordinator that logs every move it makes: (state before, event, state after)."""

    def __init__(self, *args: object, **kw: object) -> None:
        self.moves: list[tuple[GroupState, GroupEvent, GroupState]] = []
        super().__init__(*args, **kw)  # type: ignore[arg-type]

    def _move(self, event: GroupEvent) -> None:
        before = self.state
        super()._move(event)
        self.moves.append((before, event, self.state))


def check_invariants(s: GroupSnapshot) -> None:
    """What each state promises about the rest of the snapshot."""
    # a failure stands while the group is FAILED and while a later epoch re-forms
    assert (s.state is GroupState.FAILED or s.reforming) == (s.failure is not None)
    if s.reforming:
        assert s.state is not GroupState.STOPPED and s.last_failure is not None
    assert (s.state is GroupState.ROUND_OPEN) == (s.round is not None)
    if s.state is GroupState.EMPTY:
        assert not s.members
    if s.state in (GroupState.IDLE, GroupState.ROUND_OPEN):
        assert s.members
    if s.round is not None:
        assert s.round.seq == s.seq
        assert s.round.reported == sum(a is not None for a in s.round.arrivals)
        assert all(s.round.arrivals[r] is None for r in s.dead)
    assert not set(s.members) & s.dead


class Model:
    def __init__(self, dp: int, mode: OnRankLoss) -> None:
        self.c = Recording(dp, epoch=EPOCH, step_timeout=TIMEOUT, on_rank_loss=mode)
        self.ranks = [Rank(r) for r in range(dp)]
        self.now = 0.0
        self.lost: set[bytes] = set()
        self.sent: dict[tuple[int, int], dict[int, Report]] = {}
        self.decided: dict[tuple[int, int], StepDecision | GatherResult] = {}
        self.decisions = 0
        self.welcomes = 0

    def owner(self, p: bytes) -> Rank:
        assert p not in self.lost, f"a message went to lost peer {p!r}"
        (rank,) = [k for k in self.ranks if k.peer == p]
        return rank

    def deliver(self, sends: Sequence[Send]) -> None:
        for peers, msg in sends:
            assert len(set(peers)) == len(peers)
            for p in peers:
                self.on_message(self.owner(p), msg)

    def on_message(self, k: Rank, msg: object) -> None:
        if isinstance(msg, Welcome):
            assert k.state == "registering"
            self.welcomes += 1
            k.state, k.epoch, k.seq = "ready", msg.epoch, msg.next_seq
        elif isinstance(msg, Reject):
            raise AssertionError(f"an honest rank was rejected: {msg}")
        elif isinstance(msg, (StepDecision, GatherResult)) and k.state == "ready":
            # the answer to a re-sent report of the round already decided
            assert k.previous is not None and (msg.epoch, msg.seq) == (k.epoch, k.seq - 1)
            assert msg == self.decided[(msg.epoch, msg.seq)]
        elif isinstance(msg, StepDecision):
            assert k.state == "waiting" and k.sent is not None
            assert (msg.epoch, msg.seq, msg.kind) == (k.epoch, k.seq, k.sent.kind)
            key = (msg.epoch, msg.seq)
            if key in self.decided:
                assert self.decided[key] == msg  # the same decision for every rank
            else:
                reports = self.sent[key]
                dead = set(msg.dead_ranks)
                assert k.r not in dead
                assert set(reports) >= set(range(len(self.ranks))) - dead
                expected = decide(
                    [None if r in dead else reports[r] for r in range(len(self.ranks))],
                    epoch=msg.epoch, seq=msg.seq, kind=msg.kind)
                assert msg == expected
                self.decided[key] = msg
                self.decisions += 1
            k.state, k.seq, k.sent, k.previous = "ready", k.seq + 1, None, k.sent
        elif isinstance(msg, GatherResult):
            assert k.state == "waiting" and isinstance(k.sent, GatherReport)
            assert (msg.epoch, msg.seq, msg.site) == (k.epoch, k.seq, k.sent.site)
            key = (msg.epoch, msg.seq)
            if key in self.decided:
                assert self.decided[key] == msg  # the same rows for every rank
            else:
                reports = self.sent[key]
                dead = set(msg.dead_ranks)
                assert k.r not in dead
                rows = [[] if r in dead else reports[r].values  # type: ignore[union-attr]
                        for r in range(len(self.ranks))]
                assert msg.rows == rows
                self.decided[key] = msg
                self.decisions += 1
            k.state, k.seq, k.sent, k.previous = "ready", k.seq + 1, None, k.sent
        elif isinstance(msg, StepFailed):
            assert msg.reason is not FailReason.PROTOCOL, msg  # honest ranks break no rule
            k.state, k.sent, k.previous = "new", None, None
        else:
            raise AssertionError(f"unexpected {msg!r}")

    def act(self, k: Rank, values: tuple[int, int, bool, int, bool], kind: StepKind,
            invalid: bool = False, resend: bool = False) -> None:
        if resend and k.state == "ready" and k.previous is not None:
            self.deliver(self.c.receive(k.peer, k.previous, self.now))
        elif k.state == "new":
            k.state = "registering"
            self.deliver(self.c.receive(k.peer, hello(k.r, len(self.ranks)), self.now))
        elif k.state == "ready":
            tokens, extra, ub, mode, unf = values
            key = (k.epoch, k.seq)
            first = next(iter(self.sent[key].values())) if self.sent.get(key) else None
            kind = first.kind if first is not None else kind
            report: Report
            if kind is StepKind.GATHER:
                # A gather round follows its first report's site and length (invalid: one
                # value more, which only a later report can get wrong).
                site = first.site if isinstance(first, GatherReport) else f"site{mode}"
                n = len(first.values) if isinstance(first, GatherReport) else extra % 8
                column = [tokens * 100 + k.r * 10 + i for i in range(n + invalid)]
                report = GatherReport(site=site, values=column, dp_rank=k.r, epoch=k.epoch,
                                      seq=k.seq)
            else:
                report = StepReport(num_tokens=-1 if invalid else tokens,
                                    num_tokens_padded=tokens + extra, want_ubatch=ub,
                                    cudagraph_mode=mode, has_unfinished=unf, dp_rank=k.r,
                                    epoch=k.epoch, seq=k.seq, kind=kind)
            self.sent.setdefault(key, {})[k.r] = report
            k.state, k.sent = "waiting", report
            self.deliver(self.c.receive(k.peer, report, self.now))
        elif k.state == "waiting":
            assert k.sent is not None
            self.deliver(self.c.receive(k.peer, k.sent, self.now))  # a harmless re-send

    def lose(self, k: Rank) -> None:
        self.lost.add(k.peer)
        sends = self.c.peer_lost(k.peer, self.now)
        k.incarnation += 1
        k.state, k.sent, k.previous = "new", None, None
        self.deliver(sends)

    def tick(self, dt: float) -> None:
        self.now += dt
        deadline = self.c.next_deadline()
        if deadline is not None and deadline <= self.now:
            self.deliver(self.c.on_deadline(self.now))

    def settle(self) -> None:
        """Past every deadline nobody is left waiting."""
        self.tick(TIMEOUT * 2)
        for k in self.ranks:
            assert k.state != "waiting", f"rank {k.r} was left without an answer"

    @contextmanager
    def checked(self) -> Iterator[None]:
        """Check the machine's moves in the block against the table: each one is in it, they
        follow on from one another, and they account for what the ranks saw."""
        before, welcomes, decisions = self.c.snapshot(), self.welcomes, self.decisions
        self.c.moves.clear()
        yield
        after = self.c.snapshot()
        state = before.state
        for start, event, end in self.c.moves:
            assert start is state, self.c.moves
            assert next_state(start, event) is end
            state = end
        assert state is after.state
        events = Counter(event for _, event, _ in self.c.moves)
        assert events[GroupEvent.JOIN] == self.welcomes - welcomes
        assert events[GroupEvent.DECIDE] == self.decisions - decisions
        assert events[GroupEvent.DECIDE] == after.decisions - before.decisions
        assert events[GroupEvent.FAIL] == after.failures - before.failures
        assert events[GroupEvent.REFORM] == after.epoch - before.epoch
        check_invariants(after)


report_values = st.tuples(st.integers(0, 40), st.integers(0, 40), st.booleans(),
                          st.integers(0, 2), st.booleans())
# mostly honest progress, now and then a lost rank, a late one, or a bad report
events = st.lists(
    st.tuples(st.integers(0, 39), st.integers(0, 2), report_values,
              st.sampled_from([*POLICY_KINDS, StepKind.GATHER]),
              st.sampled_from([0.5, 3.0, TIMEOUT])),
    max_size=80,
)


def run_events(m: Model, events) -> None:  # type: ignore[no-untyped-def]
    for what, r, values, kind, dt in events:
        with m.checked():
            if what == 0:
                m.lose(m.ranks[r])
            elif what == 1:
                m.tick(dt)
            else:
                m.act(m.ranks[r], values, kind, invalid=what == 2, resend=what == 3)
    with m.checked():
        m.settle()


@pytest.mark.parametrize("mode", list(OnRankLoss))
@given(events=events)
def test_model_honest_ranks_with_faults(mode: OnRankLoss, events) -> None:  # type: ignore[no-untyped-def]
    run_events(Model(3, mode), events)


def test_model_without_faults_makes_progress() -> None:
    m = Model(3, OnRankLoss.FAIL)
    for _ in range(20):
        for k in m.ranks:
            m.act(k, (3, 1, True, 1, False), F, False)
    m.settle()
    assert m.decisions >= 5


def test_a_failure_before_the_round_opens_carries_the_faulty_reports_kind() -> None:
    """No report has set the round's kind yet: the failure is tagged with the report's, not a
    default, so logs and metrics name the kind of sync that went wrong."""
    g = Group()
    sends = g.send(rep(0, 1, kind=D))
    msg = failed(sends, StepMismatch(0, 0, "draft", 1, "draft"), to=all_peers(), seq=0)
    assert msg.kind is D
    g2 = Group()
    sends = g2.send(rep(1, 0, kind=S, num_tokens_padded=0))
    assert failed(sends, InvalidReport(1, "num_tokens_padded", 0, ">= num_tokens (8)"),
                  to=all_peers(), seq=0).kind is S


# -- the state table -----------------------------------------------------------------------

ILLEGAL = [(s, e) for s in GroupState for e in GroupEvent if e not in TRANSITIONS[s]]


@pytest.mark.parametrize(("state", "event"), ILLEGAL)
def test_an_event_the_table_does_not_list_is_a_typed_error(state: GroupState,
                                                           event: GroupEvent) -> None:
    with pytest.raises(IllegalTransition) as err:
        next_state(state, event)
    assert (err.value.state, err.value.event) == (state, event)
    assert repr(event.value) in str(err.value) and repr(state.value) in str(err.value)


def _in_each_state() -> dict[GroupState, Coordinator]:
    empty = Coordinator(2, epoch=EPOCH)
    idle = Group(dp=2).c
    open_ = Group(dp=2).c
    open_.receive(peer(0), rep(0, 0), 0.0)
    failed_ = Group(dp=2).c
    failed_.receive(peer(0), rep(0, 3), 0.0)
    stopped = Group(dp=2).c
    for r in (0, 1):
        stopped.receive(peer(r), Goodbye(), 0.0)
    return {GroupState.EMPTY: empty, GroupState.IDLE: idle, GroupState.ROUND_OPEN: open_,
            GroupState.FAILED: failed_, GroupState.STOPPED: stopped}


def test_the_machine_refuses_an_illegal_event_and_stays_where_it_was() -> None:
    machines = _in_each_state()
    for state, c in machines.items():
        assert c.state is state and c.snapshot().state is state
    for state, event in ILLEGAL:
        c = machines[state]
        with pytest.raises(IllegalTransition):
            c._move(event)
        assert c.state is state


def test_every_move_in_the_table_happens() -> None:
    """The table is what the machine does, not a wish: scripted groups take every move."""
    seen: set[tuple[GroupState, GroupEvent, GroupState]] = set()

    def group(dp: int, mode: OnRankLoss = OnRankLoss.FAIL, registered: int | None = None,
              ) -> Recording:
        c = Recording(dp, epoch=EPOCH, step_timeout=TIMEOUT, on_rank_loss=mode)
        for r in range(dp if registered is None else registered):
            c.receive(peer(r), hello(r, dp), 0.0)
        return c

    c = group(2)  # EMPTY join, IDLE join, open, report, decide, a fault between rounds, reform
    c.receive(peer(0), rep(0, 0), 1.0)
    c.receive(peer(1), rep(1, 0), 1.0)
    c.receive(peer(0), rep(0, 2), 2.0)
    c.peer_lost(peer(1), 3.0)
    c.receive(peer(0), hello(0, 2), 4.0)
    seen.update(c.moves)

    c = group(2, registered=1)  # a rank that registers mid-round; the deadline
    c.receive(peer(0), rep(0, 0), 1.0)
    c.receive(peer(1), hello(1, 2), 1.5)
    c.on_deadline(1.0 + TIMEOUT)
    seen.update(c.moves)

    c = group(3, OnRankLoss.NEUTRALIZE)  # leave between rounds and mid-round, queue
    c.peer_lost(peer(2), 1.0)
    c.receive(peer(0), rep(0, 0), 1.0)
    c.receive(b"back", hello(2, 3), 1.5)
    c.peer_lost(peer(1), 2.0)
    seen.update(c.moves)

    for reported in (False, True):  # the last rank leaves between rounds, then mid-round
        c = group(2, registered=1)
        if reported:
            c.receive(peer(0), rep(0, 0), 1.0)
        c.peer_lost(peer(0), 2.0)
        seen.update(c.moves)

    c = group(2)  # a Goodbye mid-round fails the group; the last one leaves it failed
    c.receive(peer(0), rep(0, 0), 1.0)
    c.receive(peer(1), Goodbye(), 1.0)
    c.receive(peer(0), Goodbye(), 1.0)
    seen.update(c.moves)

    c = group(2)  # a clean exit: both say Goodbye between rounds; then a new epoch
    c.receive(peer(0), rep(0, 0), 1.0)
    c.receive(peer(1), rep(1, 0), 1.0)
    c.receive(peer(1), Goodbye(), 2.0)
    c.receive(peer(0), Goodbye(), 2.0)
    c.receive(peer(0), hello(0, 2), 3.0)
    seen.update(c.moves)

    for reported in (False, True):  # a re-forming epoch's last rank leaves: failed again
        c = group(2)
        c.peer_lost(peer(1), 1.0)
        c.receive(b"again", hello(1, 2), 1.5)
        if reported:
            c.receive(b"again", rep(1, 1, epoch=EPOCH + 1), 1.6)
        c.peer_lost(b"again", 2.0)
        seen.update(c.moves)

    table = {(s, e, t) for s, moves in TRANSITIONS.items() for e, t in moves.items()}
    assert seen <= table
    assert table - seen == set()


def test_a_rank_queued_to_rejoin_is_welcomed_when_the_last_member_leaves() -> None:
    """The open round went away with its ranks: the queued Hello counts at once (it is the
    first of a new group) instead of waiting for a decision that will not come."""
    g = Group(dp=3, on_rank_loss=N)
    g.c.peer_lost(peer(2), g.now)
    assert g.send(rep(1, 0)) == []
    assert list(g.c.receive(b"back", hello(2, 3), g.now)) == []  # queued: the round is open
    assert list(g.c.peer_lost(peer(1), g.now)) == []  # its report is withdrawn; still open
    sends = list(g.c.peer_lost(peer(0), g.now))
    assert sends == [Send((b"back",), welcome(epoch=EPOCH, next_seq=0, dp_size=3))]
    snap = g.c.snapshot()
    assert snap.state is GroupState.IDLE and list(snap.members) == [2] and not snap.dead


# -- issue 28 (6): a failed group stays failed until its ranks re-form it ---------------------


@pytest.mark.parametrize("survivor", ["connected", "gone"])
def test_a_strangers_hello_and_goodbye_cannot_turn_a_crash_into_a_clean_stop(
    survivor: str,
) -> None:
    """Issue 28, defect 6: after rank 1 crashed, one peer's Hello for the free rank (it re-forms
    the group: a new epoch; with the survivor gone too, with any fingerprint) and its Goodbye
    made the group STOPPED, `failure` None. The failure now stands until every rank is back;
    the stranger leaving puts the group back to FAILED with the same failure, counted once."""
    g = Group(dp=2)
    g.round(0)
    assert list(g.c.peer_lost(peer(1), g.now)) == []
    crash = g.c.snapshot().last_failure
    assert crash is not None and crash.culprits == [1]
    fingerprint = "fp"
    if survivor == "gone":
        g.c.peer_lost(peer(0), g.now)
        fingerprint = "any"
    (_, welcome), = g.c.receive(b"stranger", hello(1, 2, config_fingerprint=fingerprint), g.now)
    assert isinstance(welcome, Welcome) and welcome.epoch == EPOCH + 1
    snap = g.c.snapshot()
    assert snap.reforming and snap.failure == crash
    assert snap.held == (1 if survivor == "connected" else 0)
    assert list(g.c.receive(b"stranger", Goodbye(), g.now)) == []
    snap = g.c.snapshot()
    assert snap.state is GroupState.FAILED and not snap.stopped
    assert (snap.failure, snap.failures, snap.stops) == (crash, 1, 0)
    # its lost connection instead of a Goodbye: the same
    g.c.receive(b"stranger2", hello(1, 2, config_fingerprint=fingerprint), g.now)
    assert list(g.c.peer_lost(b"stranger2", g.now)) == []
    snap = g.c.snapshot()
    assert snap.state is GroupState.FAILED and (snap.failure, snap.failures) == (crash, 1)


def test_a_failure_stands_until_every_rank_is_back_then_a_clean_exit_is_a_stop() -> None:
    g = Group(dp=2)
    g.round(0)
    g.c.peer_lost(peer(1), g.now)
    crash = g.c.snapshot().last_failure
    g.hello(0)  # the survivor registers again: a new epoch, still re-forming
    snap = g.c.snapshot()
    assert snap.state is GroupState.IDLE and snap.failure == crash
    g.c.receive(b"restarted", hello(1, 2, incarnation="inc1b"), g.now)
    snap = g.c.snapshot()
    assert not snap.reforming and snap.failure is None and snap.last_failure == crash
    for p in (peer(0), b"restarted"):
        assert list(g.c.receive(p, Goodbye(), g.now)) == []
    snap = g.c.snapshot()
    assert snap.state is GroupState.STOPPED and snap.failure is None and snap.stops == 1


def test_the_last_rank_of_a_re_forming_epoch_leaving_leaves_the_group_failed() -> None:
    g = Group(dp=2)
    g.round(0)
    g.c.peer_lost(peer(1), g.now)
    crash = g.c.snapshot().last_failure
    g.hello(0)
    assert list(g.c.receive(peer(0), Goodbye(), g.now)) == []
    snap = g.c.snapshot()
    assert snap.state is GroupState.FAILED and snap.failure == crash and snap.stops == 0
    # and the ranks can still re-form it
    g.hello(0)
    (_, welcome), = g.c.receive(b"restarted", hello(1, 2), g.now)
    assert isinstance(welcome, Welcome) and (welcome.epoch, welcome.next_seq) == (EPOCH + 2, 2)
    assert g.c.snapshot().failure is None
