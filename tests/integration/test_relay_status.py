"""The operator's view of a group served through relays, at the root: /status has a document
for it (its relays, which relay speaks for each rank, its rounds and failure), `coordd status`
prints it, and /metrics has its state, its relays and its rounds. Real root and relay
processes over ipc://, real clients."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from typing import Any

import pytest

from coordd.cli.status import render
from coordd.proto.errors import RankLost
from coordd.tools.chaos.seeded_reports import kind_for, report_for
from tests.integration.scrape import metric_value
from tests.integration.test_relays import (
    DP,
    TreeProcs,
    clients,
    connect_all,
    on_every_rank,
    tree,  # noqa: F401 - the fixture
)


def status(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as answer:
        return json.loads(answer.read())  # type: ignore[no-any-return]


@pytest.mark.timeout(90)
def test_the_root_shows_a_relayed_group_its_relays_and_a_lost_relays_ranks(
    tree: TreeProcs,  # noqa: F811 - the fixture
) -> None:
    cs = clients(tree)
    try:
        first, epoch = connect_all(cs)
        rounds = 5

        def steps(rank: int) -> object:
            for seq in range(first, first + rounds):
                cs[rank].start(report_for(3, rank, seq), kind_for(3, seq)).wait(10)
            return None

        assert all(v is None for v in on_every_rank(list(range(DP)), steps).values())
        doc = status(tree.port)
        (group,) = doc["groups"]
        assert group["served"] == "relays" and group["name"] == "default"
        assert (group["dp_size"], group["epoch"], group["members"]) == (DP, epoch, DP)
        assert group["ready"] and group["rounds"] == {"decided": rounds, "failed": 0}
        assert [(r["name"], r["ranks"]) for r in group["relays"]] == [
            ("node0", "0-1"), ("node1", "2-3"),
        ]
        pids = {r["name"]: r["address"] for r in group["relays"]}
        assert pids["node1"].endswith(f":{tree.relays[1].proc.pid}"), pids  # type: ignore[union-attr]
        assert [(r["rank"], r["relay"]) for r in group["ranks"]] == [
            (0, "node0"), (1, "node0"), (2, "node1"), (3, "node1"),
        ]
        shown = render(doc)
        assert "through 2 relays" in shown and "node1  2-3" in shown, shown
        assert doc["coordd"]["relay_root"] is True and "root: takes relays" in shown, shown
        labels = '{group="default"}'
        assert metric_value(tree.port, f"coordd_group_relays{labels}") == 2
        assert metric_value(tree.port, f"coordd_registered_ranks{labels}") == DP
        decided = '{group="default",outcome="decided"}'
        assert metric_value(tree.port, f"coordd_relayed_rounds_total{decided}") == rounds

        relay = tree.relays[1]
        assert relay.proc is not None
        os.kill(relay.proc.pid, signal.SIGKILL)
        relay.proc.wait(timeout=10)
        seq = first + rounds
        lost = on_every_rank(
            [0, 1], lambda r: cs[r].start(report_for(3, r, seq), kind_for(3, seq)).wait(10)
        )
        assert all(isinstance(e, RankLost) for e in lost.values()), lost
        (group,) = status(tree.port)["groups"]
        assert not group["ready"] and group["failure"]["ranks"] == [2, 3], group["failure"]
        assert [r["name"] for r in group["relays"]] == ["node0"]
        assert [r["rank"] for r in group["ranks"] if r["state"] == "missing"] == [2, 3]
        assert "no relay speaks for ranks [2, 3]" in render(status(tree.port))
        assert metric_value(tree.port, f"coordd_group_relays{labels}") == 1
        assert metric_value(tree.port, f'coordd_group_failed{labels}') == 1
    finally:
        for c in cs:
            c.close(goodbye=False)
