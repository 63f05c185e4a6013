"""The fault-injection fake answers its last round to the chosen ranks only, then is gone."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from coordd.client import CoordClient
from coordd.proto.errors import CoordError, CoordinatorUnavailable
from coordd.proto.messages import StepDecision, StepReport
from coordd.proto.policy import decide
from coordd.testing.dying_coordd import DyingCoordd

pytestmark = pytest.mark.timeout(60)


def _report(rank: int, seq: int) -> StepReport:
    return StepReport(num_tokens=rank + seq, num_tokens_padded=rank + seq + 1,
                      has_unfinished=True)


@pytest.mark.parametrize("then", ["exit", "close"])
def test_answers_the_last_round_to_some_ranks_then_goes(tmp_path: Path, then: str) -> None:
    fake = DyingCoordd(2, f"ipc://{tmp_path}/coordd.sock", die_at=3, answer_to=[0], then=then)
    fake.start()
    outcomes: dict[int, list[StepDecision | CoordError]] = {0: [], 1: []}
    try:
        clients = [CoordClient(fake.address, dp_rank=r, dp_size=2, wait_timeout=20,
                               heartbeat_interval=0.2, heartbeat_timeout=1.0) for r in (0, 1)]

        def run(rank: int) -> None:
            client = clients[rank]
            client.connect(timeout=10)
            for seq in range(4):
                try:
                    outcomes[rank].append(client.coordinate(_report(rank, seq)))
                except CoordError as error:
                    outcomes[rank].append(error)
                    return

        threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        for client in clients:
            client.close(goodbye=False)
    finally:
        fake.stop()
    for seq in range(3):
        want = decide([_report(0, seq), _report(1, seq)])
        for rank in (0, 1):
            got = outcomes[rank][seq]
            assert isinstance(got, StepDecision)
            assert got.num_tokens_across_dp == want.num_tokens_across_dp and got.seq == seq
    assert isinstance(outcomes[0][3], StepDecision) and outcomes[0][3].seq == 3
    assert isinstance(outcomes[1][3], CoordinatorUnavailable)
