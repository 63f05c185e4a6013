"""A relayed group re-formed at another size with real processes (a root coordd, two relays
`coordd serve --relay-to`, real clients over ipc://): shrink 4 -> 2 and grow 2 -> 3 are new
epochs that decide rounds at their size; a rank at another size while the group's ranks stay
is refused naming them (by the root, or by the relay whose own ranks stay), and a size over
--dp at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordd.client import CoordClient
from coordd.proto import Rejected, StepDecision, StepReport
from tests.integration.scrape import free_port
from tests.integration.test_relays import TreeProcs, readyz

STEP_TIMEOUT = 2.0


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[TreeProcs]:
    procs = TreeProcs(tmp_path)
    try:
        procs.port = free_port()
        procs.start_root("--step-timeout", str(STEP_TIMEOUT), "--metrics-port", str(procs.port))
        procs.start_relay(0)  # ranks 0-1
        procs.start_relay(1)  # ranks 2-3
        yield procs
    finally:
        for proc in procs.started:
            proc.stop()


def report(rank: int) -> StepReport:
    return StepReport(num_tokens=3 + rank, num_tokens_padded=4 + rank, has_unfinished=True)


def one_round(ranks: list[CoordClient]) -> list[StepDecision]:
    pending = [c.start(report(c.dp_rank)) for c in ranks]
    return [p.wait(timeout=10) for p in pending]


def rounds_at(ranks: list[CoordClient], count: int) -> None:
    """`count` rounds: every rank gets the decision over every rank's report, at the size."""
    for _ in range(count):
        decisions = one_round(ranks)
        assert {tuple(d.num_tokens_across_dp) for d in decisions} == {
            tuple(4 + c.dp_rank for c in ranks)
        }, decisions


@pytest.mark.timeout(60)
def test_a_relayed_group_shrinks_and_grows_through_new_epochs(tree: TreeProcs) -> None:
    made: list[CoordClient] = []

    def rank(r: int, dp: int) -> CoordClient:
        client = CoordClient(
            tree.address_of(r), dp_rank=r, dp_size=dp, config_fingerprint=f"dp={dp}"
        )
        made.append(client)
        return client

    try:
        four = [rank(r, 4) for r in range(4)]
        for c in four:
            c.connect(timeout=10)
        rounds_at(four, 3)
        # Shrink 4 -> 2: relay 1 (ranks 2-3) holds no rank of the new group.
        for c in four:
            c.close()
        two = [rank(r, 2) for r in range(2)]
        for c in two:
            c.connect(timeout=10)
        assert two[0].epoch == two[1].epoch and two[0].epoch > four[0].epoch
        rounds_at(two, 3)
        assert readyz(tree.port) == (200, "1/1 groups formed (default: 2/2 ranks registered)")
        # A rank at another size while the group's ranks stay: refused after the step timeout,
        # naming the ranks and the relay that hold the group.
        stray = rank(2, 3)
        began = time.monotonic()
        with pytest.raises(Rejected) as refused:
            stray.connect(timeout=10)
        assert time.monotonic() - began >= STEP_TIMEOUT - 0.1
        assert (refused.value.reason, refused.value.expected, refused.value.got) == (
            "dp_size", "2", "3")
        assert "ranks [0, 1] still hold it" in refused.value.detail
        assert "relay node0: [0, 1]" in refused.value.detail
        stray.close()
        # The same on the node whose own ranks hold the group: its relay refuses it.
        stray = rank(1, 3)
        began = time.monotonic()
        with pytest.raises(Rejected) as refused:
            stray.connect(timeout=10)
        assert time.monotonic() - began >= STEP_TIMEOUT - 0.1
        assert (refused.value.expected, refused.value.got) == ("2", "3")
        assert "ranks [0, 1] still hold it" in refused.value.detail
        stray.close()
        rounds_at(two, 1)  # the group never noticed
        # Over --dp: refused at once.
        over = rank(0, 5)
        with pytest.raises(Rejected) as bound:
            over.connect(timeout=10)
        assert (bound.value.reason, bound.value.expected, bound.value.got) == (
            "dp_size", "1..4", "5")
        over.close()
        # Grow 2 -> 3: the new engine registers first and waits; the old ones rebuild.
        errors: list[BaseException] = []
        new = rank(2, 3)

        def connect_new() -> None:
            try:
                new.connect(timeout=10)
            except BaseException as error:  # the test reads it
                errors.append(error)

        waiting = threading.Thread(target=connect_new, daemon=True)
        waiting.start()
        rounds_at(two, 1)  # the old epoch goes on while the new rank waits
        for c in two:
            c.close()
        rebuilt = [rank(r, 3) for r in range(2)]
        for c in rebuilt:
            c.connect(timeout=10)
        waiting.join(10)
        assert not waiting.is_alive() and not errors, errors
        three = [*rebuilt, new]
        assert {c.epoch for c in three} == {rebuilt[0].epoch} and rebuilt[0].epoch > two[0].epoch
        rounds_at(three, 3)
        assert readyz(tree.port) == (200, "1/1 groups formed (default: 3/3 ranks registered)")
    finally:
        for c in made:
            c.close()
