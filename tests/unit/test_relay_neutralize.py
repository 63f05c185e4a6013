"""`--on-rank-loss neutralize` through relays, sans-IO: a rank (or a whole relay) lost under
a relay is left out as a flat coordd leaves it out, so every rank gets what a flat group's rank
would get for the same reports and losses."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import pytest

from coordd.ops.status_doc import group_readiness
from coordd.proto.coordinator import Coordinator, Send
from coordd.proto.group_state import GroupState
from coordd.proto.messages import (
    FromCoordinator,
    GatherReport,
    GatherResult,
    Goodbye,
    Hello,
    StepDecision,
    StepFailed,
    StepReport,
    Welcome,
)
from coordd.proto.policy import decide
from coordd.proto.relay_messages import RelayBundle
from coordd.proto.snapshot import OnRankLoss
from tests.unit.relay_harness import Tree, peer

NEUTRALIZE = OnRankLoss.NEUTRALIZE
EPOCH = 1000


class Flat:
    """A flat coordd's group driven as `Tree` is: the reference the tree must match."""

    def __init__(self, dp: int) -> None:
        self.dp = dp
        self.coord = Coordinator(dp, epoch=EPOCH, step_timeout=5.0, on_rank_loss=NEUTRALIZE)
        self.inbox: dict[int, list[FromCoordinator]] = defaultdict(list)

    def _deliver(self, sends: list[Send] | tuple[Send, ...]) -> None:
        for peers, msg in sends:
            for p in peers:
                self.inbox[int(p.split(b"-")[1])].append(msg)

    def hello(self, rank: int, now: float = 0.0) -> None:
        h = Hello(dp_rank=rank, dp_size=self.dp, config_fingerprint="f", incarnation="i")
        self._deliver(self.coord.receive(peer(rank), h, now))

    def send(self, rank: int, report: object, now: float = 0.0) -> None:
        self._deliver(self.coord.receive(peer(rank), report, now))  # type: ignore[arg-type]

    def lose_rank(self, rank: int, now: float = 0.0) -> None:
        self._deliver(self.coord.peer_lost(peer(rank), now))


def step(rank: int, seq: int, variant: str) -> StepReport:
    """Reports whose decision differs by rank: padded (cudagraph), micro-batched, or neither."""
    tokens = 5 + 7 * rank
    fields: dict[str, object] = {"num_tokens": tokens, "num_tokens_padded": tokens + 3}
    if variant == "graph":
        fields["cudagraph_mode"] = 2 if rank % 2 else 1
    elif variant == "ubatch":
        fields.update(want_ubatch=True, num_tokens=40 + rank, num_tokens_padded=48 + rank)
    fields["has_unfinished"] = rank == 1
    fields["want_pause"] = rank != 3
    return StepReport(dp_rank=rank, seq=seq, epoch=EPOCH, **fields)  # type: ignore[arg-type]


def gather(rank: int, seq: int) -> GatherReport:
    return GatherReport(site="s", values=[rank, 100 + rank], dp_rank=rank, seq=seq, epoch=EPOCH)


Script = Callable[["Tree | Flat"], None]


def both(layout: list[list[int]], script: Script) -> tuple[Tree, Flat]:
    """Run `script` on a relayed group under a neutralize root and on a flat one."""
    tree = Tree(layout, on_rank_loss=NEUTRALIZE)
    flat = Flat(tree.dp)
    script(tree)
    script(flat)
    return tree, flat


def same_inboxes(tree: Tree, flat: Flat, ranks: range | list[int]) -> None:
    for r in ranks:
        assert tree.inbox[r] == flat.inbox[r], f"rank {r}"


LAYOUTS = [[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 1, 2, 3], [4, 5]], [[0], [1, 2, 3]]]


@pytest.mark.parametrize("variant", ["plain", "graph", "ubatch"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_rank_lost_under_a_relay_is_left_out_as_flat(layout, variant) -> None:  # type: ignore[no-untyped-def]
    def script(g: Tree | Flat) -> None:
        for r in range(g.dp):
            g.hello(r)
        for r in range(g.dp):
            g.send(r, step(r, 0, variant))
        g.lose_rank(1)  # between rounds
        for r in range(g.dp):
            if r not in (1, 2):
                g.send(r, step(r, 1, variant))
        g.lose_rank(2)  # mid-round: the last rank the round waits for
        for r in range(g.dp):
            if r not in (1, 2):
                g.send(r, step(r, 2, variant))

    tree, flat = both(layout, script)
    same_inboxes(tree, flat, range(tree.dp))
    last = tree.inbox[0][-1]
    assert type(last) is StepDecision and last.seq == 2 and last.dead_ranks == [1, 2]
    reports = [None if r in (1, 2) else step(r, 2, variant) for r in range(tree.dp)]
    assert last == decide(reports, epoch=EPOCH, seq=2)
    snap = tree.root.snapshot()
    assert snap.dead == {1, 2} and set(snap.members) == set(range(tree.dp)) - {1, 2}
    assert group_readiness(snap) == (
        True, f"{tree.dp - 2}/{tree.dp} ranks registered, left out: [1, 2]"
    )
    assert tree.root.snapshot().on_rank_loss is NEUTRALIZE
    assert all(relay.on_rank_loss is NEUTRALIZE for relay in tree.relays.values())


def test_a_bundle_carries_only_the_live_ranks() -> None:
    tree = Tree([[0, 1, 2], [3]], on_rank_loss=NEUTRALIZE)
    for r in range(4):
        tree.hello(r)
    tree.lose_rank(1)
    sent: list[RelayBundle] = []
    relay = tree.relay_of[0]
    uplink = relay._uplink
    relay._uplink = lambda m: (sent.append(m), uplink(m))  # type: ignore[assignment, func-returns-value]
    for r in (0, 2):
        tree.send(r, step(r, 0, "plain"))
    assert [b.ranks for b in sent] == [[0, 2]]
    assert sent[0].padded == [8, 22]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_rows_of_ranks_left_out_are_empty_as_flat(layout) -> None:  # type: ignore[no-untyped-def]
    def script(g: Tree | Flat) -> None:
        for r in range(g.dp):
            g.hello(r)
        for r in range(g.dp):
            g.send(r, gather(r, 0))
        g.lose_rank(2)
        for r in range(g.dp):
            if r != 2:
                g.send(r, gather(r, 1))

    tree, flat = both(layout, script)
    same_inboxes(tree, flat, range(tree.dp))
    result = tree.inbox[0][-1]
    assert type(result) is GatherResult and result.dead_ranks == [2]
    assert result.rows[2] == [] and result.rows[3] == [3, 103]


def test_a_relay_lost_leaves_all_its_ranks_out_and_the_others_decide() -> None:
    tree = Tree([[0, 1], [2, 3]], on_rank_loss=NEUTRALIZE)
    flat = Flat(4)
    for g in (tree, flat):
        for r in range(4):
            g.hello(r)
        for r in (2, 3):  # relay 1's bundle is in, then the relay is lost mid-round
            g.send(r, step(r, 0, "plain"))
    tree.lose_relay(1)
    flat.lose_rank(2)
    flat.lose_rank(3)
    for g in (tree, flat):
        for seq in (0, 1):
            for r in (0, 1):
                g.send(r, step(r, seq, "plain"))
    same_inboxes(tree, flat, [0, 1])
    decisions = [m for m in tree.inbox[0] if type(m) is StepDecision]
    assert [d.dead_ranks for d in decisions] == [[2, 3], [2, 3]]
    assert decisions[-1] == decide(
        [step(0, 1, "plain"), step(1, 1, "plain"), None, None], seq=1, epoch=EPOCH
    )
    assert tree.root.state is GroupState.IDLE


def test_every_rank_of_a_relay_lost_leaves_them_out_and_one_rejoins() -> None:
    def script(g: Tree | Flat) -> None:
        for r in range(4):
            g.hello(r)
        for r in range(4):
            g.send(r, step(r, 0, "graph"))
        g.lose_rank(2)
        g.lose_rank(3)  # the relay's last rank: it leaves the group at the root (lost)
        for r in (0, 1):
            g.send(r, step(r, 1, "graph"))
        g.hello(2)  # back between rounds: in from the next round, 3 still out
        for r in (0, 1, 2):
            g.send(r, step(r, 2, "graph"))

    tree, flat = both([[0, 1], [2, 3]], script)
    same_inboxes(tree, flat, range(4))
    rejoined = tree.inbox[2][-2]
    assert type(rejoined) is Welcome and rejoined.next_seq == 2
    last = tree.inbox[0][-1]
    assert type(last) is StepDecision and last.seq == 2 and last.dead_ranks == [3]


def test_a_rank_back_mid_round_rejoins_when_the_round_ends() -> None:
    def script(g: Tree | Flat) -> None:
        for r in range(4):
            g.hello(r)
        g.lose_rank(1)
        g.send(0, step(0, 0, "plain"))
        g.hello(1)  # the round is open: it waits for the round's end
        for r in (2, 3):
            g.send(r, step(r, 0, "plain"))
        for r in range(4):
            g.send(r, step(r, 1, "plain"))

    tree, flat = both([[0, 1], [2, 3]], script)
    same_inboxes(tree, flat, range(4))
    assert [type(m) for m in tree.inbox[1]] == [Welcome, Welcome, StepDecision]
    assert tree.inbox[1][1].next_seq == 1  # type: ignore[union-attr]
    first, second = (m for m in tree.inbox[0] if type(m) is StepDecision)
    assert first.dead_ranks == [1] and second.dead_ranks == []  # type: ignore[union-attr]
    assert tree.root.snapshot().dead == frozenset()


def test_a_relay_registering_again_is_told_which_of_its_ranks_are_out() -> None:
    tree = Tree([[0, 1], [2, 3]], on_rank_loss=NEUTRALIZE)
    for r in range(4):
        tree.hello(r)
    tree.lose_rank(2)
    tree.lose_rank(3)
    assert tree.relay_of[2].state is GroupState.EMPTY
    tree.hello(3)
    assert tree.relay_of[3].snapshot().dead == {2}
    for r in (0, 1, 3):
        tree.send(r, step(r, 0, "plain"))
    last = tree.inbox[3][-1]
    assert type(last) is StepDecision and last.dead_ranks == [2]


def test_ranks_saying_goodbye_under_a_relay_are_left_out_as_flat() -> None:
    def script(g: Tree | Flat) -> None:
        for r in range(4):
            g.hello(r)
        g.send(3, Goodbye())
        for r in (0, 1, 2):
            g.send(r, step(r, 0, "plain"))
        g.send(2, Goodbye())  # the relay's last rank: the relay leaves the group
        for r in (0, 1):
            g.send(r, step(r, 1, "plain"))

    tree, flat = both([[0, 1], [2, 3]], script)
    same_inboxes(tree, flat, range(4))
    decisions = [m for m in tree.inbox[0] if type(m) is StepDecision]
    assert [d.dead_ranks for d in decisions] == [[3], [2, 3]]


def test_under_a_fail_root_a_rank_lost_still_fails_the_group() -> None:
    tree = Tree([[0, 1], [2, 3]])
    for r in range(4):
        tree.hello(r)
    tree.lose_rank(1)
    tree.send(0, step(0, 0, "plain"))
    failed = tree.inbox[0][-1]
    assert type(failed) is StepFailed and failed.culprits == [1]
    assert tree.relay_of[0].on_rank_loss is OnRankLoss.FAIL


def test_a_fail_root_refuses_a_bundle_that_leaves_ranks_out() -> None:
    tree = Tree([[0, 1], [2, 3]])
    for r in range(4):
        tree.hello(r)
    bundle = RelayBundle(
        group="g",
        epoch=EPOCH,
        seq=0,
        kind=step(0, 0, "plain").kind,
        ranks=[2],
        padded=[3],
        max_padded=3,
    )
    (answer,) = tree.root.receive(b"relay-1", bundle, 0.0)
    failed = answer.message.message
    assert type(failed) is StepFailed and failed.reason.value == "protocol"


def test_a_relay_cut_off_and_back_goes_on_without_the_ranks_not_yet_back() -> None:
    tree = Tree([[0, 1], [2, 3]], on_rank_loss=NEUTRALIZE)
    for r in range(4):
        tree.hello(r)
    for r in range(4):
        tree.send(r, step(r, 0, "plain"))
    tree.cut(1)  # relay 1's ranks are left out at the root
    for r in (0, 1):
        tree.send(r, step(r, 1, "plain"))
    assert tree.inbox[0][-1].dead_ranks == [2, 3]  # type: ignore[union-attr]
    tree.send(2, step(2, 1, "plain"))  # the relay failed its node's group when the root went
    assert type(tree.inbox[2][-1]) is StepFailed
    tree.relays[b"relay-1"].root_back()
    tree.hello(2)  # rank 2 registers again, rank 3 (still connected) has not yet
    welcome = tree.inbox[2][-1]
    assert type(welcome) is Welcome and welcome.next_seq == 2
    for r in (0, 1, 2):
        tree.send(r, step(r, 2, "plain"))
    assert [tree.last(r).dead_ranks for r in (0, 1, 2)] == [[3]] * 3  # type: ignore[union-attr]
    tree.send(3, step(3, 1, "plain"))  # its old epoch's report: it learns to register again
    assert type(tree.inbox[3][-1]) is StepFailed
    tree.hello(3)
    for r in range(4):
        tree.send(r, step(r, 3, "plain"))
    last = tree.last(0)
    assert type(last) is StepDecision and last.seq == 3 and last.dead_ranks == []
    assert all(tree.last(r) == last for r in range(4))


def test_a_rank_queued_to_rejoin_when_the_round_fails_opens_the_next_epoch_as_flat() -> None:
    def script(g: Tree | Flat) -> None:
        for r in range(4):
            g.hello(r)
        g.lose_rank(1)
        g.send(0, step(0, 0, "plain"))
        g.hello(1)  # queued: the round is open
        g.send(2, step(2, 5, "plain"))  # a skipped seq fails the round

    tree, flat = both([[0, 1], [2, 3]], script)
    same_inboxes(tree, flat, range(4))
    welcome = tree.inbox[1][-1]
    assert type(welcome) is Welcome and welcome.epoch == EPOCH + 1
    assert type(tree.inbox[0][-1]) is StepFailed
