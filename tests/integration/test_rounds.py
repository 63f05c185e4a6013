"""A real coordd and N real rank processes: every rank gets the same, policy-given decision."""

from __future__ import annotations

import statistics

import pytest

from coordd.proto.policy import decide
from tests.integration.clients import CLIENT_KINDS
from tests.integration.ranks import RankLog, run_ranks


def assert_agreement(logs: list[RankLog], rounds: int) -> None:
    for log in logs:
        assert log.error is None, f"rank {log.rank}: {log.error}"
        assert len(log.rounds) == rounds, f"rank {log.rank} finished {len(log.rounds)} rounds"
        assert all(r.error is None for r in log.rounds), [r.error for r in log.rounds if r.error]
    for i in range(rounds):
        entries = [log.rounds[i] for log in logs]
        seqs = {e.seq for e in entries}
        assert len(seqs) == 1, f"round {i}: ranks disagree on seq: {seqs}"
        decisions = [e.decision for e in entries]
        assert all(d == decisions[0] for d in decisions), f"seq {entries[0].seq}: decisions differ"
        first = decisions[0]
        assert first is not None
        expected = decide([e.report for e in entries], epoch=first.epoch, seq=entries[0].seq,
                          kind=entries[0].kind)
        assert first == expected, f"seq {entries[0].seq}: {first} != policy {expected}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("client", CLIENT_KINDS)
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
@pytest.mark.parametrize("dp", [2, 4, 8])
def test_every_rank_gets_the_policy_decision(start_coordd, dp: int, transport: str,
                                             client: str) -> None:
    rounds = 300 if dp < 8 else 150
    coordd = start_coordd(dp, transport)
    logs = run_ranks(coordd.address, dp, rounds, seed=dp, client=client)
    assert_agreement(logs, rounds)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("client", CLIENT_KINDS)
def test_overlapped_rounds_agree_and_hide_the_exchange(start_coordd, client: str) -> None:
    """start, 1 ms of 'GPU work', wait: the decision is usually there by the time we look."""
    dp, rounds = 4, 200
    coordd = start_coordd(dp, "ipc")
    logs = run_ranks(coordd.address, dp, rounds, seed=11, work_s=0.001, client=client)
    assert_agreement(logs, rounds)
    exposed = [r.exposed for log in logs for r in log.rounds]
    latency = [r.latency for log in logs for r in log.rounds]
    # Not a speed assertion: just that the wait was measured after the work.
    assert statistics.median(latency) >= 0.001 > 0
    assert all(e >= 0 for e in exposed)
