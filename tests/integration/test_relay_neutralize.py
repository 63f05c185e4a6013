"""`--on-rank-loss neutralize` through relays, for real: a root coordd in elastic mode, two
relay processes (their own setting left at the default: the root's holds) and real clients over
ipc://. A rank's client lost under a relay, or a whole relay killed, is left out: the other
ranks keep deciding, as `decide` decides with the lost ranks neutral, and a rank back rejoins."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordd.client import CoordClient
from coordd.proto.messages import StepDecision
from coordd.proto.policy import decide
from coordd.tools.chaos.seeded_reports import kind_for, report_for
from tests.integration.scrape import free_port
from tests.integration.test_relays import (
    DP,
    TreeProcs,
    clients,
    connect_all,
    on_every_rank,
    readyz,
)


@pytest.fixture
def elastic_tree(tmp_path: Path) -> Iterator[TreeProcs]:
    procs = TreeProcs(tmp_path)
    procs.port = free_port()
    try:
        procs.start_root(
            "--step-timeout", "5", "--on-rank-loss", "neutralize",
            "--metrics-port", str(procs.port),
        )
        procs.start_relay(0)
        procs.start_relay(1)
        yield procs
    finally:
        for proc in procs.started:
            proc.stop()


def rounds(
    cs: list[CoordClient], ranks: list[int], first: int, count: int, epoch: int, dead: list[int]
) -> int:
    """`count` rounds of `ranks` from seq `first`: each rank's decision is `decide`'s with the
    `dead` ranks neutral, and lists them. Returns the next seq."""

    def steps(rank: int) -> list[StepDecision]:
        return [
            cs[rank].start(report_for(7, rank, seq), kind_for(7, seq)).wait(10)
            for seq in range(first, first + count)
        ]

    results = on_every_rank(ranks, steps)
    for r in ranks:
        assert not isinstance(results[r], Exception), (r, results[r])
    for i, seq in enumerate(range(first, first + count)):
        expected = decide(
            [None if r in dead else report_for(7, r, seq) for r in range(DP)],
            epoch=epoch,
            seq=seq,
            kind=kind_for(7, seq),
        )
        assert expected.dead_ranks == dead
        for r in ranks:
            assert results[r][i] == expected, (r, seq, results[r][i], expected)  # type: ignore[index]
    return first + count


@pytest.mark.timeout(60)
def test_a_rank_lost_under_a_relay_is_left_out_and_rejoins(elastic_tree: TreeProcs) -> None:
    cs = clients(elastic_tree)
    try:
        seq, epoch = connect_all(cs)
        seq = rounds(cs, list(range(DP)), seq, 3, epoch, [])
        cs[3].close(goodbye=False)  # the process dies: its relay sees the connection close
        seq = rounds(cs, [0, 1, 2], seq, 20, epoch, [3])
        rows = on_every_rank([0, 1, 2], lambda r: cs[r].gather("site", [r, r * 10]))
        for r in (0, 1, 2):
            assert rows[r] == [[0, 0], [1, 10], [2, 20], []], (r, rows[r])
        seq += 1
        cs[3] = CoordClient(
            elastic_tree.address_of(3), dp_rank=3, dp_size=DP, config_fingerprint="it"
        )
        welcome = cs[3].connect(timeout=10)
        assert (welcome.epoch, welcome.next_seq) == (epoch, seq)
        rounds(cs, list(range(DP)), seq, 3, epoch, [])
    finally:
        for c in cs:
            c.close()


@pytest.mark.timeout(60)
def test_a_relay_killed_leaves_all_its_ranks_out(elastic_tree: TreeProcs) -> None:
    cs = clients(elastic_tree)
    try:
        seq, epoch = connect_all(cs)
        seq = rounds(cs, list(range(DP)), seq, 2, epoch, [])
        relay = elastic_tree.relays[1]
        assert relay.proc is not None
        os.kill(relay.proc.pid, signal.SIGKILL)
        relay.proc.wait(timeout=10)
        rounds(cs, [0, 1], seq, 10, epoch, [2, 3])
        # the root's /readyz counts ranks left out as a flat elastic coordd does
        assert readyz(elastic_tree.port) == (
            200, "1/1 groups formed (default: 2/4 ranks registered, left out: [2, 3])"
        )
        # and its /status says which ranks are left out, and the mode
        from tests.integration.test_relay_status import status

        (group,) = status(elastic_tree.port)["groups"]
        assert group["on_rank_loss"] == "neutralize", group
        assert [r["state"] for r in group["ranks"]] == [
            "registered", "registered", "left out", "left out",
        ]
        assert group["ranks_summary"]["left out"] == 2
    finally:
        for c in cs:
            c.close(goodbye=False)
