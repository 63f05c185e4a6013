"""Elastic mode over a real coordd (`--on-rank-loss neutralize`): a rank SIGKILLed mid-run is left
out of every later round, a lost rank's peer gets an error instead of a decision, and a returning
rank is admitted at a round boundary. Ranks 0 and 1 run in the test; rank 2 is a real process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection

import msgspec
import pytest
import zmq

from coordd.client.dp_coordination import DPGroupConfig, VllmAdapter, build_report
from coordd.client.sync import CoordClient
from coordd.proto.errors import RankLost, StepTimeout
from coordd.proto.messages import (
    FailReason,
    StepDecision,
    StepFailed,
    StepKind,
    StepReport,
    decode_from_coordinator,
    encode,
)
from coordd.proto.policy import decide

WAIT = 20.0
CFG = DPGroupConfig(data_parallel_size=3, enable_dbo=True)
VICTIM = "victim"


def batch(rank: int, step: int) -> tuple[int, int]:
    """Each rank's (unpadded, padded) token count at a step: differs per rank and step."""
    tokens = 30 + 7 * rank + step
    return tokens, -(-tokens // 8) * 8


def _rank_loop(address: str, conn: Connection) -> None:
    """Rank 2: step after step as fast as the group goes, each decision sent back as msgpack."""
    adapter = VllmAdapter.connect(CFG, 2, address, as_tensor=False, incarnation=VICTIM)
    # Its routing id first (random, known only to it and coordd): the test's stray presents it.
    conn.send_bytes(adapter.client.session.identity)  # type: ignore[union-attr]
    step = 0
    while True:
        tokens, padded = batch(2, step)
        handle = adapter.start_dp_coordination_async(tokens, True, None, padded, True, 2)
        adapter.finish_dp_coordination(handle, 60)
        conn.send_bytes(encode(handle.decision))
        step += 1


def victim_routing_id(from_victim: Connection) -> bytes:
    """The victim's first message: its connection's routing id."""
    assert from_victim.poll(WAIT), "rank 2 did not register"
    return from_victim.recv_bytes()


@contextmanager
def victim_rank(address: str) -> Iterator[tuple[mp.process.BaseProcess, Connection]]:
    ctx = mp.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_rank_loop, args=(address, sender), daemon=True)
    proc.start()
    try:
        yield proc, receiver
    finally:
        proc.kill()
        proc.join(timeout=10)


@contextmanager
def live_ranks(address: str) -> Iterator[list[VllmAdapter]]:
    ranks: list[VllmAdapter] = []
    try:
        for r in (0, 1):
            ranks.append(VllmAdapter.connect(CFG, r, address, as_tensor=False,
                                             connect_timeout=WAIT))
        yield ranks
    finally:
        for a in ranks:
            a.close()


def run_step(ranks: list[VllmAdapter], step: int, pause_before_last: float = 0.0
             ) -> tuple[StepDecision, list[StepReport]]:
    """Ranks 0 and 1 take one step; both get the same decision, which is returned."""
    handles = []
    for r, a in enumerate(ranks):
        if r == len(ranks) - 1 and pause_before_last:
            time.sleep(pause_before_last)
        tokens, padded = batch(r, step)
        handles.append(a.start_dp_coordination_async(tokens, True, None, padded, True, 2))
    results = [a.finish_dp_coordination(h, WAIT) for a, h in zip(ranks, handles, strict=True)]
    assert results[0] == results[1]
    decisions = [h.decision for h in handles]
    assert decisions[0] is not None and decisions[0] == decisions[1]
    return decisions[0], [h.report for h in handles]


def assert_left_out(decision: StepDecision, reports: list[StepReport]) -> None:
    assert decision.dead_ranks == [2]
    assert decision == decide([*reports, None], CFG.num_ubatches, epoch=decision.epoch,
                              seq=decision.seq, kind=StepKind.FORWARD)
    across = decision.num_tokens_across_dp
    assert across[2] == (max(across) if decision.should_pad else 0)


@pytest.mark.timeout(180)
def test_sigkilled_rank_is_left_out_then_returns_at_a_round_boundary(start_coordd) -> None:
    coordd = start_coordd(3, "ipc", "--on-rank-loss", "neutralize", "--step-timeout", "60")
    with victim_rank(coordd.address) as (victim, from_victim), live_ranks(coordd.address) as ranks:
        victim_id = victim_routing_id(from_victim)
        # Healthy rounds: the victim's decisions are the live ranks' decisions.
        for step in range(4):
            decision, _ = run_step(ranks, step)
            assert from_victim.poll(WAIT), "rank 2 sent no decision"
            assert msgspec.msgpack.decode(from_victim.recv_bytes(), type=StepDecision) == decision
            assert decision.dead_ranks == []
        # Rank 2 has (almost surely) reported step 4 already and waits: kill it mid-round.
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=10)
        decision, reports = run_step(ranks, 4, pause_before_last=0.5)
        if decision.dead_ranks:  # its report was dropped with it (the usual case)
            assert_left_out(decision, reports)
        else:  # its report had completed the round before the loss was seen: a valid round
            tokens, padded = batch(2, 4)
            victims = build_report(CFG, tokens, True, padded, True, 2)
            assert decision == decide([*reports, victims], CFG.num_ubatches,
                                      epoch=decision.epoch, seq=decision.seq)
        for step in range(5, 9):
            decision, reports = run_step(ranks, step)
            assert_left_out(decision, reports)
        epoch, next_seq = decision.epoch, decision.seq + 1

        # Its routing id comes back without a Hello (its connection is known closed, so the id
        # is free): an error, never a decision.
        tokens, padded = batch(2, 9)
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as stray:
            stray.setsockopt(zmq.ROUTING_ID, victim_id)
            stray.setsockopt(zmq.LINGER, 0)
            stray.connect(coordd.address)
            stray.send(encode(StepReport(num_tokens=tokens, num_tokens_padded=padded, dp_rank=2,
                                         epoch=epoch, seq=next_seq)))
            assert stray.poll(int(WAIT * 1000)), "no answer to the stray report"
            answer = decode_from_coordinator(stray.recv())
        assert isinstance(answer, StepFailed) and answer.reason is FailReason.LOST
        assert answer.culprits == [2] and answer.epoch == epoch

        # A new rank 2 registers while step 9's round is open: admitted only when it ends.
        first = ranks[0]
        tokens0, padded0 = batch(0, 9)
        open_round = first.start_dp_coordination_async(tokens0, True, None, padded0, True, 2)
        returning = CoordClient(coordd.address, dp_rank=2, incarnation="returned",
                                **CFG.client_options())
        welcome: list[object] = []
        joiner = threading.Thread(target=lambda: welcome.append(returning.connect(timeout=WAIT)))
        try:
            joiner.start()
            joiner.join(timeout=1.0)
            assert joiner.is_alive(), "a returning rank was admitted in the middle of a round"
            tokens1, padded1 = batch(1, 9)
            second = ranks[1].start_dp_coordination_async(tokens1, True, None, padded1, True, 2)
            first.finish_dp_coordination(open_round, WAIT)
            ranks[1].finish_dp_coordination(second, WAIT)
            assert open_round.decision is not None and open_round.decision.dead_ranks == [2]
            joiner.join(timeout=WAIT)
            assert not joiner.is_alive() and len(welcome) == 1
            assert welcome[0].next_seq == next_seq + 1  # type: ignore[attr-defined]
            # From the next round on, all three ranks count again.
            back = VllmAdapter(CFG, returning, dp_rank=2, as_tensor=False)
            handles = []
            for r, a in enumerate([*ranks, back]):
                tokens, padded = batch(r, 10)
                handles.append(a.start_dp_coordination_async(tokens, True, None, padded, True, 2))
            for a, h in zip([*ranks, back], handles, strict=True):
                a.finish_dp_coordination(h, WAIT)
            decisions = [h.decision for h in handles]
            assert decisions[0] is not None and decisions == [decisions[0]] * 3
            assert decisions[0].dead_ranks == []
            assert decisions[0] == decide([h.report for h in handles], CFG.num_ubatches,
                                          epoch=epoch, seq=next_seq + 1, kind=StepKind.FORWARD)
        finally:
            joiner.join(timeout=WAIT)
            returning.close()


@pytest.mark.timeout(120)
def test_step_timeout_names_only_live_ranks(start_coordd) -> None:
    coordd = start_coordd(3, "ipc", "--on-rank-loss", "neutralize", "--step-timeout", "1.5")
    with victim_rank(coordd.address) as (victim, from_victim), live_ranks(coordd.address) as ranks:
        victim_routing_id(from_victim)
        run_step(ranks, 0)
        assert from_victim.poll(WAIT)
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=10)
        decision, reports = run_step(ranks, 1, pause_before_last=0.5)
        decision, reports = run_step(ranks, 2)
        assert_left_out(decision, reports)
        tokens, padded = batch(0, 3)
        handle = ranks[0].start_dp_coordination_async(tokens, True, None, padded, True, 2)
        with pytest.raises(StepTimeout) as info:  # rank 1 never reports; rank 2 is dead
            ranks[0].finish_dp_coordination(handle, WAIT)
        assert info.value.ranks == (1,)


@pytest.mark.timeout(120)
def test_fail_stop_stays_the_default(start_coordd) -> None:
    coordd = start_coordd(3, "ipc", "--step-timeout", "60")
    with victim_rank(coordd.address) as (victim, from_victim), live_ranks(coordd.address) as ranks:
        victim_routing_id(from_victim)
        run_step(ranks, 0)
        assert from_victim.poll(WAIT)
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=10)
        with pytest.raises(RankLost) as info:
            run_step(ranks, 1, pause_before_last=0.5)
        assert info.value.ranks == (2,)
