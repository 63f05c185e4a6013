"""A relayed group re-formed at another size (elastic EP scaling DP), sans-IO with a fake clock:
the root's --dp bounds the size, the re-formed group is a new epoch, a relay speaks only for
its ranks that exist at the new size, and a registration at another size while relays hold the
group waits for them, or is refused after the step timeout naming them."""

from __future__ import annotations

import pytest

from coordd.proto.errors import RankLost
from coordd.proto.messages import (
    Hello,
    Reject,
    RejectReason,
    StepDecision,
    StepFailed,
    Welcome,
    error_from_failure,
)
from coordd.proto.policy import decide
from coordd.proto.relay_messages import RelayHello, RelayLeave
from coordd.proto.tree import TreeCoordinator
from tests.unit.relay_harness import Tree

TIMEOUT = 5.0


def formed_at(tree: Tree, dp: int, now: float = 0.0) -> Welcome:
    for r in range(dp):
        tree.hello(r, now, dp_size=dp)
    welcome = tree.last(0)
    assert isinstance(welcome, Welcome) and welcome.dp_size == dp, welcome
    assert all(tree.last(r) == welcome for r in range(dp))
    return welcome


def one_round(tree: Tree, w: Welcome, seq: int, now: float = 0.0) -> StepDecision:
    reports = [tree.report(r, seq, w.epoch) for r in range(w.dp_size)]
    for r in range(w.dp_size):
        tree.send(r, reports[r], now)
    expected = decide(reports, epoch=w.epoch, seq=seq, kind=reports[0].kind)
    assert all(tree.last(r) == expected for r in range(w.dp_size)), (tree.last(0), expected)
    assert len(expected.num_tokens_across_dp) == w.dp_size
    return expected


def relay_hello(dp: int, ranks: list[int], relay: str) -> RelayHello:
    return RelayHello(group="g", dp_size=dp, ranks=ranks, config_fingerprint="f",
                      incarnation="i", relay=relay)


def answer(root: TreeCoordinator, peer: bytes, message: object, now: float = 0.0) -> object:
    (sent,) = root.receive(peer, message, now)  # type: ignore[arg-type]
    assert sent.peers == (peer,)
    return sent.message.message


def test_grow_2_to_3_waits_for_the_old_epoch_then_reforms_as_a_new_one() -> None:
    tree = Tree([[0, 1], [2, 3]], TIMEOUT, dp=4)
    two = formed_at(tree, 2)
    assert tree.root.dp_size == 2 and list(tree.root.relays()) == [b"relay-0"]
    one_round(tree, two, two.next_seq)
    # The new engine (rank 2 at dp 3) registers first: its relay asks the root, which waits.
    tree.hello(2, 1.0, dp_size=3)
    assert tree.inbox[2] == [] and b"relay-1" in tree.root.holders()
    one_round(tree, two, two.next_seq + 1, 1.5)  # the old epoch goes on meanwhile
    tree.goodbye(0, 2.0)
    assert tree.inbox[2] == []  # rank 1 still holds the old epoch
    tree.goodbye(1, 2.0)
    three = tree.last(2)
    assert isinstance(three, Welcome) and three.dp_size == 3 and three.epoch > two.epoch
    # the relay of ranks 2-3 speaks only for rank 2, the one that exists at dp 3
    assert tree.root.relays()[b"relay-1"].ranks == (2,)
    assert tree.relays[b"relay-1"].serving == (2,)
    tree.hello(0, 3.0, dp_size=3)
    tree.hello(1, 3.0, dp_size=3)
    assert tree.last(0) == tree.last(1) == three
    tree.root_inputs = 0
    one_round(tree, three, three.next_seq, 4.0)
    assert tree.root_inputs == 2  # one bundle per relay


@pytest.mark.parametrize(
    ("layout", "old", "new"),
    [
        ([[0, 1], [2, 3]], 4, 2),
        # DP 16 -> 8 across two nodes of 8: the second node's relay holds no rank of the new
        # group and blocks nothing
        ([list(range(8)), list(range(8, 16))], 16, 8),
    ],
)
def test_shrink_reforms_a_new_epoch_without_the_relays_past_the_new_size(
    layout: list[list[int]], old: int, new: int
) -> None:
    tree = Tree(layout, TIMEOUT, dp=old)
    big = formed_at(tree, old)
    one_round(tree, big, big.next_seq)
    for r in range(old):
        tree.goodbye(r, 1.0)
    small = formed_at(tree, new, 2.0)
    assert small.epoch > big.epoch and tree.root.dp_size == new
    assert list(tree.root.relays()) == [b"relay-0"]
    tree.root_inputs = 0
    one_round(tree, small, small.next_seq, 3.0)
    assert tree.root_inputs == 1


def test_shrink_with_the_new_ranks_first_waits_at_the_relay_then_at_the_root() -> None:
    """vLLM's rebuilt rank registers over a new connection before the old one has left."""
    tree = Tree([[0, 1], [2, 3]], TIMEOUT, dp=4)
    four = formed_at(tree, 4)
    relay0 = tree.relays[b"relay-0"]

    def rebuilt(rank: int, now: float) -> None:
        h = Hello(dp_size=2, dp_rank=rank, config_fingerprint="f", incarnation="new")
        tree._deliver(relay0.receive(b"rank-%d" % (100 + rank), h, now))
        tree.pump(now)

    rebuilt(0, 1.0)
    assert tree.inbox[100] == [] and tree.up == []  # the node's own old ranks hold it
    tree.goodbye(0, 2.0)
    tree.goodbye(1, 2.0)  # relay 0 leaves the root and asks at dp 2; relay 1 still holds
    assert tree.inbox[100] == [] and tree.root.dp_size == 4
    tree.goodbye(2, 3.0)
    tree.goodbye(3, 3.0)
    two = tree.last(100)
    assert isinstance(two, Welcome) and two.dp_size == 2 and two.epoch > four.epoch
    rebuilt(1, 3.0)
    assert tree.last(101) == two
    reports = [tree.report(r, two.next_seq, two.epoch) for r in (0, 1)]
    for r in (0, 1):
        tree._deliver(relay0.receive(b"rank-%d" % (100 + r), reports[r], 4.0))
        tree.pump(4.0)
    expected = decide(reports, epoch=two.epoch, seq=two.next_seq, kind=reports[0].kind)
    assert tree.last(100) == tree.last(101) == expected


def test_holders_that_stay_get_the_waiting_ranks_refused_naming_them() -> None:
    tree = Tree([[0, 1], [2, 3]], TIMEOUT, dp=4)
    two = formed_at(tree, 2)
    tree.hello(2, 1.0, dp_size=3)
    tree.deadlines(1.0 + TIMEOUT - 0.01)
    assert tree.inbox[2] == []
    tree.deadlines(1.0 + TIMEOUT)
    refused = tree.last(2)
    assert type(refused) is Reject and refused.reason is RejectReason.DP_SIZE
    assert (refused.expected, refused.got) == ("2", "3")
    assert "ranks [0, 1] still hold it" in refused.text and "relay node0: [0, 1]" in refused.text
    assert b"relay-1" not in tree.root.holders()
    one_round(tree, two, two.next_seq, 7.0)  # the group never noticed


def test_a_size_over_the_bound_is_refused_at_once_by_the_relay_or_the_root() -> None:
    tree = Tree([[0, 1], [2, 3]], TIMEOUT, dp=4)
    tree.hello(0, 0.0, dp_size=5)
    refused = tree.last(0)
    assert type(refused) is Reject and refused.reason is RejectReason.DP_SIZE
    assert (refused.expected, refused.got) == ("1..4", "5") and tree.root_inputs == 0
    # relays of --dp 8 under a root of --dp 4: the root's bound holds
    tree = Tree([[0, 1], [2, 3]], TIMEOUT, dp=8, root_dp=4)
    tree.hello(0, 0.0, dp_size=6)
    refused = tree.last(0)
    assert type(refused) is Reject and refused.reason is RejectReason.DP_SIZE
    assert (refused.expected, refused.got) == ("1..4", "6") and "--dp 4" in refused.text


def test_the_root_refuses_claims_past_the_size_and_a_holder_asking_another() -> None:
    root = TreeCoordinator(8, group="g", epoch=1, step_timeout=TIMEOUT)
    past = answer(root, b"b", relay_hello(4, [2, 3, 4, 5], "node1"))
    assert type(past) is Reject and past.reason is RejectReason.RANK_RANGE
    assert past.expected == "distinct ranks in 0..3" and "node1" in past.text
    assert type(answer(root, b"a", relay_hello(4, [0, 1, 2, 3], "node0"))) is Welcome
    holder = answer(root, b"a", relay_hello(2, [0, 1], "node0"))
    assert type(holder) is Reject and holder.reason is RejectReason.DP_SIZE
    assert (holder.expected, holder.got) == ("4", "2") and "node0" in holder.text


def test_a_waiting_relay_lost_waits_no_more_and_a_leave_admits_the_next() -> None:
    root = TreeCoordinator(8, group="g", epoch=1, step_timeout=TIMEOUT)
    welcome = answer(root, b"a", relay_hello(4, [0, 1, 2, 3], "node0"))
    assert type(welcome) is Welcome
    assert root.receive(b"b", relay_hello(2, [0, 1], "node1"), 1.0) == ()
    assert root.receive(b"c", relay_hello(6, [4, 5], "node2"), 1.5) == ()
    assert root.next_deadline() == 1.0 + TIMEOUT
    assert root.relay_lost(b"b", 2.0) == [] and b"b" not in root.holders()
    assert root.next_deadline() == 1.5 + TIMEOUT
    (sent,) = root.receive(b"a", RelayLeave(group="g", epoch=welcome.epoch), 3.0)
    six = sent.message.message
    assert sent.peers == (b"c",) and type(six) is Welcome and six.dp_size == 6
    assert six.epoch > welcome.epoch and root.snapshot().max_dp_size == 8


def test_after_a_failure_relays_whose_ranks_left_block_no_reform_at_another_size() -> None:
    tree = Tree([[0, 1], [2, 3]], TIMEOUT, dp=4)
    four = formed_at(tree, 4)
    tree.send(0, tree.report(0, four.next_seq, four.epoch))
    tree.lose_rank(3, 1.0)
    failure = tree.last(0)
    assert type(failure) is StepFailed
    error = error_from_failure(failure)
    assert isinstance(error, RankLost) and list(error.ranks) == [3]
    for r in (0, 1, 2):
        tree.lose_rank(r, 2.0)
    assert tree.root.holders() == []  # each relay left once none of its ranks held the group
    two = formed_at(tree, 2, 3.0)
    assert two.epoch > four.epoch and two.next_seq == four.next_seq + 1
    one_round(tree, two, two.next_seq, 4.0)


def test_the_last_rank_lost_under_a_relay_is_rank_lost_at_once_and_blocks_no_reform() -> None:
    tree = Tree([[0, 1], [2, 3]], TIMEOUT, dp=4)
    three = formed_at(tree, 3)  # relay 1 serves rank 2 alone
    tree.lose_rank(2, 1.0)
    assert b"relay-1" not in tree.root.holders()
    for r in (0, 1):  # no round waits out the step timeout: the root heard of the loss
        tree.send(r, tree.report(r, three.next_seq, three.epoch), 1.5)
    failure = failure_at(tree, (0, 1))
    error = error_from_failure(failure)
    assert isinstance(error, RankLost) and list(error.ranks) == [2]
    assert "node1" in error.detail
    for r in (0, 1):
        tree.goodbye(r, 2.0)
    two = formed_at(tree, 2, 3.0)
    assert two.epoch > three.epoch
    one_round(tree, two, two.next_seq, 4.0)


def test_dp_16_to_8_after_the_second_node_was_killed() -> None:
    tree = Tree([list(range(8)), list(range(8, 16))], TIMEOUT, dp=16)
    big = formed_at(tree, 16)
    for r in range(8, 16):
        tree.lose_rank(r, 1.0)
    for r in range(8):
        tree.goodbye(r, 2.0)
    assert tree.root.holders() == []
    eight = formed_at(tree, 8, 3.0)
    assert eight.epoch > big.epoch
    one_round(tree, eight, eight.next_seq, 4.0)


def failure_at(tree: Tree, ranks: tuple[int, ...]) -> StepFailed:
    failures = [tree.last(r) for r in ranks]
    assert all(type(f) is StepFailed for f in failures) and len(set(map(repr, failures))) == 1
    return failures[0]  # type: ignore[return-value]


def test_the_nodes_own_ranks_that_stay_get_a_waiting_rank_refused_by_its_relay() -> None:
    tree = Tree([[0, 1], [2, 3]], TIMEOUT, dp=4)
    four = formed_at(tree, 4)
    tree.root_inputs = 0
    relay0 = tree.relays[b"relay-0"]
    h = Hello(dp_size=2, dp_rank=0, config_fingerprint="f", incarnation="new")
    tree._deliver(relay0.receive(b"rank-100", h, 1.0))
    assert relay0.next_deadline() == 1.0 + TIMEOUT and tree.up == []
    tree.deadlines(1.0 + TIMEOUT - 0.01)
    assert tree.inbox[100] == []
    tree.deadlines(1.0 + TIMEOUT)
    refused = tree.last(100)
    assert type(refused) is Reject and refused.reason is RejectReason.DP_SIZE
    assert (refused.expected, refused.got) == ("4", "2")
    assert "ranks [0, 1] still hold it" in refused.text
    assert relay0.next_deadline() is None and tree.root_inputs == 0
    one_round(tree, four, four.next_seq, 7.0)


def test_a_relay_welcomed_after_its_waiting_rank_went_tells_the_root_nothing_more() -> None:
    """A peer that never registered going away is no loss of the relay's ranks."""
    tree = Tree([[0, 1], [2, 3]], TIMEOUT, dp=4)
    relay0 = tree.relays[b"relay-0"]
    h = Hello(dp_size=4, dp_rank=0, config_fingerprint="f", incarnation="i")
    relay0.receive(b"rank-0", h, 0.0)
    tree._deliver(relay0.peer_lost(b"rank-0", 0.5))
    tree.pump(1.0)  # the root's Welcome comes after the rank went: nobody to admit
    assert relay0.registered and b"relay-0" in tree.root.holders()
    tree._deliver(relay0.peer_lost(b"rank-9", 2.0))
    assert tree.up == [] and b"relay-0" in tree.root.holders()


def test_a_relay_welcomed_with_no_rank_asks_again_at_another_size() -> None:
    tree = Tree([[0, 1], [2, 3]], TIMEOUT, dp=4)
    relay0 = tree.relays[b"relay-0"]
    h = Hello(dp_size=4, dp_rank=0, config_fingerprint="f", incarnation="i")
    relay0.receive(b"rank-0", h, 0.0)
    tree._deliver(relay0.peer_lost(b"rank-0", 0.5))
    tree.pump(1.0)
    assert relay0.registered and tree.root.dp_size == 4
    two = formed_at(tree, 2, 2.0)
    assert tree.root.dp_size == 2 and tree.root.relays()[b"relay-0"].ranks == (0, 1)
    one_round(tree, two, two.next_seq, 3.0)
