"""The relay cores, sans-IO (fake clock, no sockets): relays (`RelayCoordinator`) under a root
(`TreeCoordinator`) decide as one flat coordinator would, and name the same culprits."""

from __future__ import annotations

import random

import pytest

from coordd.proto.errors import RankLost, StepMismatch, StepTimeout
from coordd.proto.messages import (
    FailReason,
    GatherReport,
    GatherResult,
    Reject,
    RejectReason,
    StepDecision,
    StepFailed,
    StepKind,
    Welcome,
    error_from_failure,
)
from coordd.proto.policy import decide
from coordd.proto.relay import parse_ranks
from coordd.proto.relay_messages import RelayHello
from coordd.proto.tree import TreeCoordinator
from tests.unit.relay_harness import Tree


def formed(layout: list[list[int]], step_timeout: float = 5.0) -> tuple[Tree, Welcome]:
    tree = Tree(layout, step_timeout)
    for r in range(tree.dp):
        tree.hello(r)
    welcome = tree.last(0)
    assert isinstance(welcome, Welcome)
    assert all(tree.last(r) == welcome for r in range(tree.dp))
    return tree, welcome


def failure_at_every_rank(tree: Tree, but: tuple[int, ...] = ()) -> StepFailed:
    failures = [tree.last(r) for r in range(tree.dp) if r not in but]
    assert all(type(f) is StepFailed for f in failures), failures
    assert all(f == failures[0] for f in failures), failures
    return failures[0]  # type: ignore[return-value]


@pytest.mark.parametrize(
    "layout",
    [[[0, 1], [2, 3]], [[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 2, 4], [1, 3, 5], [6, 7]], [[0, 1, 2]]],
)
def test_decisions_are_the_flat_policy_and_the_root_sees_one_message_per_relay(layout) -> None:
    rng = random.Random(len(layout))
    tree, welcome = formed(layout)
    seq = welcome.next_seq
    for _ in range(60):
        kind = rng.choice([StepKind.FORWARD, StepKind.DRAFT, StepKind.STATE, StepKind.GATHER])
        tree.root_inputs = 0
        if kind is StepKind.GATHER:
            rows = [[rng.randint(-5, 99) for _ in range(3)] for _ in range(tree.dp)]
            for r in range(tree.dp):
                g = GatherReport(site="s", values=rows[r], dp_rank=r, epoch=welcome.epoch, seq=seq)
                tree.send(r, g, 1.0)
            expected: object = GatherResult(epoch=welcome.epoch, seq=seq, site="s", rows=rows)
        else:
            reports = []
            for r in range(tree.dp):
                tokens = rng.choice([0, rng.randint(0, 300)])
                rep = tree.report(
                    r,
                    seq,
                    welcome.epoch,
                    kind=kind,
                    num_tokens=tokens,
                    num_tokens_padded=tokens + rng.randint(0, 8),
                    cudagraph_mode=rng.randint(0, 2),
                    want_ubatch=rng.random() < 0.8,
                    has_unfinished=rng.random() < 0.3,
                    want_pause=rng.random() < 0.5,
                )
                reports.append(rep)
            rng.shuffle(order := list(range(tree.dp)))
            for r in order:
                tree.send(r, reports[r], 1.0)
            expected = decide(reports, epoch=welcome.epoch, seq=seq, kind=kind)
        assert all(tree.last(r) == expected for r in range(tree.dp)), (tree.last(0), expected)
        assert tree.root_inputs == len(layout)
        seq += 1


def test_a_rank_lost_under_a_relay_is_named_at_every_rank() -> None:
    tree, w = formed([[0, 1], [2, 3]])
    tree.send(0, tree.report(0, w.next_seq, w.epoch))
    tree.send(2, tree.report(2, w.next_seq, w.epoch))
    tree.lose_rank(3)
    tree.send(1, tree.report(1, w.next_seq, w.epoch))
    failure = failure_at_every_rank(tree, but=(3,))
    error = error_from_failure(failure)
    assert isinstance(error, RankLost) and tuple(error.ranks) == (3,)


def test_a_relay_lost_is_rank_lost_naming_all_its_ranks() -> None:
    tree, w = formed([[0, 1], [2, 3], [4, 5]])
    for r in (0, 1, 2):
        tree.send(r, tree.report(r, w.next_seq, w.epoch))
    tree.lose_relay(2)
    for r in range(4):  # the lost relay's ranks hear from nobody: their relay is gone
        failure = tree.last(r)
        assert type(failure) is StepFailed
        error = error_from_failure(failure)
        assert isinstance(error, RankLost) and tuple(error.ranks) == (4, 5,)


def test_a_late_rank_is_named_by_its_relays_timeout_before_the_roots() -> None:
    tree, w = formed([[0, 1], [2, 3]], step_timeout=2.0)
    for r in (0, 1, 2):
        tree.send(r, tree.report(r, w.next_seq, w.epoch), 10.0)
    tree.deadlines(12.0)
    error = error_from_failure(failure_at_every_rank(tree))
    assert isinstance(error, StepTimeout) and tuple(error.ranks) == (3,)


def test_a_silent_relay_is_a_timeout_naming_its_ranks_at_the_root() -> None:
    tree, w = formed([[0, 1], [2, 3]], step_timeout=2.0)
    for r in (0, 1):
        tree.send(r, tree.report(r, w.next_seq, w.epoch), 10.0)
    tree.deadlines(12.1)  # the root's grace is not over: nothing yet
    assert all(type(tree.last(r)) is Welcome for r in range(4))
    tree.deadlines(12.6)
    for r in (0, 1):
        error = error_from_failure(tree.last(r))  # type: ignore[arg-type]
        assert isinstance(error, StepTimeout) and tuple(error.ranks) == (2, 3,)


def test_a_kind_dispute_across_relays_names_the_rank_off_the_majority() -> None:
    tree, w = formed([[0, 1], [2, 3], [4, 5]])
    for r in range(6):
        kind = StepKind.DRAFT if r == 3 else StepKind.FORWARD
        tree.send(r, tree.report(r, w.next_seq, w.epoch, kind=kind))
    error = error_from_failure(failure_at_every_rank(tree))
    assert isinstance(error, StepMismatch) and error.rank == 3


def test_a_whole_relay_on_another_kind_is_named_by_its_lowest_rank() -> None:
    tree, w = formed([[0, 1], [2, 3], [4, 5]])
    for r in range(6):
        kind = StepKind.DRAFT if r in (4, 5) else StepKind.FORWARD
        tree.send(r, tree.report(r, w.next_seq, w.epoch, kind=kind))
    error = error_from_failure(failure_at_every_rank(tree))
    assert isinstance(error, StepMismatch) and error.rank == 4


def test_a_skipped_seq_is_named_and_the_group_reforms_with_a_new_epoch() -> None:
    tree, w = formed([[0, 1], [2, 3]])
    tree.send(0, tree.report(0, w.next_seq, w.epoch))
    tree.send(2, tree.report(2, w.next_seq + 1, w.epoch))
    error = error_from_failure(tree.last(2))  # type: ignore[arg-type]
    assert isinstance(error, StepMismatch) and error.rank == 2
    assert tree.last(0) == tree.last(2)
    for r in range(4):
        tree.hello(r, 1.0)
    again = tree.last(0)
    assert isinstance(again, Welcome) and again.epoch > w.epoch
    assert again.next_seq == w.next_seq + 1
    for r in range(4):
        tree.send(r, tree.report(r, again.next_seq, again.epoch), 2.0)
    assert all(type(tree.last(r)) is StepDecision for r in range(4))


def test_a_rank_outside_the_relays_ranks_is_refused() -> None:
    tree = Tree([[0, 1], [2, 3]])
    tree._deliver(tree.relay_of[0].receive(b"rank-2", _hello(4, 2), 0.0))
    refusal = tree.last(2)
    assert type(refusal) is Reject and refusal.reason is RejectReason.RANK_RANGE


def test_a_relay_cannot_claim_ranks_another_relay_holds() -> None:
    root = TreeCoordinator(4, group="g", epoch=1)
    hello = RelayHello(group="g", dp_size=4, ranks=[0, 1], config_fingerprint="f",
                       incarnation="i", relay="node0")
    assert type(root.receive(b"a", hello, 0.0)[0].message.message) is Welcome  # type: ignore[attr-defined]
    thief = RelayHello(group="g", dp_size=4, ranks=[1, 2], config_fingerprint="f",
                       incarnation="i", relay="node1")
    answer = root.receive(b"b", thief, 0.0)[0].message.message  # type: ignore[attr-defined]
    assert type(answer) is Reject and answer.reason is RejectReason.RANK_TAKEN
    assert "node1" in answer.text and "node0" in answer.text and answer.got == "[1]"


def test_a_relay_fault_blaming_another_relays_rank_is_its_own_protocol_error() -> None:
    tree, w = formed([[0, 1], [2, 3]])
    from coordd.proto.messages import failure_message
    from coordd.proto.relay_messages import RelayFault

    lie = failure_message(RankLost([3], "x"), epoch=w.epoch, seq=w.next_seq, kind=StepKind.FORWARD)
    tree.up.append((b"relay-0", RelayFault(group="g", failure=lie)))
    tree.send(2, tree.report(2, w.next_seq, w.epoch))
    tree.send(3, tree.report(3, w.next_seq, w.epoch))
    failure = tree.last(2)
    assert type(failure) is StepFailed and failure.reason is FailReason.PROTOCOL
    assert failure.culprits == [0]


def test_rank_lists_parse() -> None:
    assert parse_ranks("0-3,8") == {0, 1, 2, 3, 8}
    assert parse_ranks("8@2") == set(range(16, 24))
    for bad in ("", "3-1", "a", "1-", "0@1", "8@", "@2"):
        with pytest.raises(ValueError):
            parse_ranks(bad)


def _hello(dp: int, rank: int):  # type: ignore[no-untyped-def]
    from coordd.proto.messages import Hello

    return Hello(dp_size=dp, dp_rank=rank, config_fingerprint="f", incarnation="i")


def test_a_bundle_whose_labels_agree_is_invalid_and_the_timer_still_runs() -> None:
    """A bundle may carry `labels` only when its ranks disagree on the round's kind. One whose
    labels agree used to reach the disputed-round path, whose `next()` had no default: the
    exception left the group open for good and its deadline never fired (issue 36, #4)."""
    from coordd.proto.relay_messages import RelayBundle

    root = TreeCoordinator(4, group="g", epoch=1, step_timeout=1.0)
    for name, ranks in ((b"a", [0, 1]), (b"b", [2, 3])):
        hello = RelayHello(group="g", dp_size=4, ranks=ranks, config_fingerprint="f",
                           incarnation="i")
        welcome = root.receive(name, hello, 0.0)[0].message.message  # type: ignore[attr-defined]
        assert type(welcome) is Welcome
    agreeing = RelayBundle(group="g", epoch=welcome.epoch, seq=0, kind=StepKind.FORWARD,
                           ranks=[0, 1], labels=["forward", "forward"])
    sends = root.receive(b"a", agreeing, 0.1)
    failure = sends[0].message.message  # type: ignore[attr-defined]
    assert type(failure) is StepFailed and failure.reason is FailReason.INVALID
    assert failure.culprits == [0] and root.state.value == "failed"
    assert root.next_deadline() is None  # nothing left open for the timer to wedge on


def test_the_root_ignores_a_relays_leave_of_an_older_epoch() -> None:
    """Planted (issue 36, item 5): a RelayLeave of an older epoch dropped a live relay."""
    from coordd.proto.relay_messages import RelayLeave

    tree, w = formed([[0, 1], [2, 3]])
    tree.root.receive(b"relay-0", RelayLeave(group="g", epoch=w.epoch - 1), 1.0)
    assert list(tree.root.relays()) == [b"relay-0", b"relay-1"]
    for r in range(4):
        tree.send(r, tree.report(r, w.next_seq, w.epoch), 1.0)
    assert all(type(tree.last(r)) is StepDecision for r in range(4))


def test_a_relay_ignores_a_failure_of_an_older_epoch() -> None:
    """Planted (issue 36, item 5): a relay took the root's failure of an older epoch as its
    group's."""
    from coordd.proto.messages import failure_message
    from coordd.proto.relay_messages import RelayAnswer

    tree, w = formed([[0, 1], [2, 3]])
    relay = tree.relays[b"relay-0"]
    old = failure_message(RankLost([2], "x"), epoch=w.epoch - 1, seq=0, kind=StepKind.FORWARD)
    assert list(relay.from_root(RelayAnswer(group="g", message=old), 1.0)) == []
    assert relay.stale_answers == 1 and relay.state.value == "idle"


def test_a_bundle_with_a_negative_padded_count_does_not_decode() -> None:
    """Planted (issue 36, item 5): the count constraint of `RelayBundle.padded` was untested."""
    from coordd.proto.errors import ProtocolError
    from coordd.proto.messages import encode
    from coordd.proto.relay_messages import RelayBundle, decode_from_relay

    good = RelayBundle(group="g", epoch=1, seq=0, kind=StepKind.FORWARD, ranks=[0], padded=[4])
    assert decode_from_relay(encode(good)) == good
    bad = RelayBundle(group="g", epoch=1, seq=0, kind=StepKind.FORWARD, ranks=[0], padded=[-1])
    with pytest.raises(ProtocolError):
        decode_from_relay(encode(bad))
