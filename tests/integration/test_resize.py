"""A DP group re-formed at another size against a real coordd (vLLM's elastic EP scales DP up
and down): `--dp` bounds the size, the re-formed group is a new epoch, never `Rejected
dp_size`; a rank whose size is wrong while the group's ranks stay is refused, naming them."""

from __future__ import annotations

import threading

import pytest

from coordd.client import CoordClient
from coordd.proto import Rejected, StepDecision, StepReport

STEP_TIMEOUT = "2"


def report(rank: int) -> StepReport:
    return StepReport(num_tokens=3 + rank, num_tokens_padded=4 + rank, has_unfinished=True)


def one_round(ranks: list[CoordClient]) -> list[StepDecision]:
    pending = [c.start(report(c.dp_rank)) for c in ranks]
    return [p.wait(timeout=10) for p in pending]


def rank(address: str, r: int, dp: int) -> CoordClient:
    return CoordClient(address, dp_rank=r, dp_size=dp, config_fingerprint=f"dp={dp}")


def connect_in_thread(client: CoordClient, errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            client.connect(timeout=10)
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(60)
def test_scale_up_then_down_through_new_epochs(start_coordd) -> None:  # type: ignore[no-untyped-def]
    coordd = start_coordd(4, "ipc", "--step-timeout", STEP_TIMEOUT)
    old = [rank(coordd.address, r, 2) for r in range(2)]
    made = list(old)
    try:
        for c in old:
            c.connect(timeout=10)
        first = one_round(old)
        assert [len(d.num_tokens_across_dp) for d in first] == [2, 2]
        epoch = old[0].epoch
        # Scale up 2 -> 4: the new engines register first and wait; the old ones rebuild.
        errors: list[BaseException] = []
        new = [rank(coordd.address, r, 4) for r in (2, 3)]
        made += new
        waiting = [connect_in_thread(c, errors) for c in new]
        one_round(old)  # the old epoch goes on while the new ranks wait
        for c in old:
            c.close()
        rebuilt = [rank(coordd.address, r, 4) for r in (0, 1)]
        made += rebuilt
        for c in rebuilt:
            c.connect(timeout=10)
        for t in waiting:
            t.join(10)
        assert not errors
        four = [*rebuilt, *new]
        assert {c.epoch for c in four} == {rebuilt[0].epoch} and rebuilt[0].epoch > epoch
        decisions = one_round(four)
        assert {tuple(d.num_tokens_across_dp) for d in decisions} == {(4, 5, 6, 7)}
        # A rank at a wrong size while the group stays: refused after the step timeout.
        stray = rank(coordd.address, 1, 3)
        made.append(stray)
        with pytest.raises(Rejected) as refused:
            stray.connect(timeout=10)
        assert (refused.value.reason, refused.value.expected, refused.value.got) == (
            "dp_size", "4", "3")
        assert "ranks [0, 1, 2, 3] still hold it" in refused.value.detail
        one_round(four)  # the group never noticed
        # Scale down 4 -> 2.
        for c in four:
            c.close()
        two = [rank(coordd.address, r, 2) for r in range(2)]
        made += two
        for c in two:
            c.connect(timeout=10)
        assert two[0].epoch > rebuilt[0].epoch
        assert [len(d.num_tokens_across_dp) for d in one_round(two)] == [2, 2]
    finally:
        for c in made:
            c.close()
