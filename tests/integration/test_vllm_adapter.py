"""The vLLM adapter over a real coordd: both entry points, drafter rounds, pause consensus.

The rule table is the unit tests' (tests/unit/test_vllm_rules.py), whose rows are checked there
against a transcription of vLLM's dp_utils; here every row runs as a real round between real
clients, through `start_dp_coordination_async`/`finish_dp_coordination` and through the blocking
`coordinate_batch_across_dp` (one thread per rank, as each rank is its own process in vLLM).
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch

from coordd.client.dp_coordination import (
    DPGroupConfig,
    VllmAdapter,
    bind,
    coordinate_batch_across_dp,
    finish_dp_coordination,
    skip_dp_coordination,
    start_dp_coordination_async,
)
from coordd.client.sync import CoordClient
from coordd.proto.errors import Rejected, StepMismatch
from coordd.proto.messages import StepKind
from coordd.proto.policy import decide
from tests.unit.test_vllm_rules import CASES, Call

WAIT = 20.0
DBO3 = DPGroupConfig(data_parallel_size=3, enable_dbo=True)


def parallel_config(cfg: DPGroupConfig, dp_rank: int) -> SimpleNamespace:
    """What vLLM passes as `parallel_config=` (the attributes the adapter reads)."""
    return SimpleNamespace(data_parallel_size=cfg.data_parallel_size, data_parallel_rank=dp_rank,
                           enable_dbo=cfg.enable_dbo, ubatch_size=cfg.ubatch_size)


@contextmanager
def adapters(address: str, cfg: DPGroupConfig, **kw: Any) -> Iterator[list[VllmAdapter]]:
    out: list[VllmAdapter] = []
    try:
        for r in range(cfg.data_parallel_size):
            out.append(VllmAdapter.connect(cfg, r, address, connect_timeout=WAIT, **kw))
        yield out
    finally:
        for a in out:
            a.close()


def in_threads(fns: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run one blocking call per rank at once; each result or error comes back in rank order."""
    with ThreadPoolExecutor(len(fns)) as pool:
        futures = [pool.submit(fn) for fn in fns]
        out = []
        for f in futures:
            try:
                out.append(f.result(timeout=WAIT + 10))
            except Exception as exc:  # the test inspects it
                out.append(exc)
        return out


def live_cases(cfg: DPGroupConfig) -> list[tuple[str, list[Call], Any]]:
    return [
        (name, [c for c in calls if c is not None], expected)
        for name, case_cfg, calls, expected in CASES
        if case_cfg == cfg and None not in calls
    ]


CONFIGS = {
    "dbo": DPGroupConfig(data_parallel_size=2, enable_dbo=True),
    "off": DPGroupConfig(data_parallel_size=2),
    "ubatch3": DPGroupConfig(data_parallel_size=2, ubatch_size=3),
}


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_rule_table_over_coordd_through_both_entry_points(start_coordd, config_name: str) -> None:
    cfg = CONFIGS[config_name]
    cases = live_cases(cfg)
    assert len(cases) >= 2
    coordd = start_coordd(cfg.data_parallel_size, "ipc", "--step-timeout", "60")
    with adapters(coordd.address, cfg, as_tensor=False) as ranks:
        for name, calls, expected in cases:
            handles = [
                a.start_dp_coordination_async(c.tokens, c.allow, None, c.padded, c.uniform,
                                              c.mode)
                for a, c in zip(ranks, calls, strict=True)
            ]
            got = [a.finish_dp_coordination(h, WAIT) for a, h in zip(ranks, handles, strict=True)]
            assert got == [expected] * len(ranks), name
            decision = handles[0].decision
            assert decision is not None
            assert all(h.decision == decision for h in handles), name
            assert decision == decide(
                [h.report for h in handles],
                cfg.num_ubatches,
                epoch=decision.epoch,
                seq=decision.seq,
                kind=StepKind.FORWARD,
            )
        # The blocking call, one thread per rank, results as int32 CPU tensors.
        tensor_ranks = [VllmAdapter(cfg, a.client, dp_rank=a.dp_rank, as_tensor=True)
                        for a in ranks]
        for name, calls, expected in cases:
            results = in_threads([
                lambda a=a, c=c: a.coordinate_batch_across_dp(
                    c.tokens, c.allow, None, c.padded, c.uniform, c.mode, timeout=WAIT)
                for a, c in zip(tensor_ranks, calls, strict=True)
            ])
            for should_ubatch, across, mode in results:
                assert isinstance(across, torch.Tensor) and across.dtype == torch.int32
                assert (should_ubatch, across.tolist(), mode) == expected, name


def test_module_level_functions_use_the_bound_adapter(start_coordd) -> None:
    coordd = start_coordd(2, "ipc")
    cfg = CONFIGS["dbo"]
    with adapters(coordd.address, cfg, as_tensor=False) as (mine, other):
        bind(mine)
        try:
            handle = start_dp_coordination_async(64, True, parallel_config(cfg, 0), 64, True, 2)
            other_handle = other.start_dp_coordination_async(40, True, None, 48, True, 2)
            assert finish_dp_coordination(handle, WAIT) == (True, [64, 64], 2)
            assert other.finish_dp_coordination(other_handle, WAIT) == (True, [64, 64], 2)
            # vLLM's call shape (gpu_model_runner.py): every argument by keyword
            results = in_threads([
                lambda: coordinate_batch_across_dp(
                    num_tokens_unpadded=10, parallel_config=parallel_config(cfg, 0),
                    allow_microbatching=False, num_tokens_padded=16, uniform_decode=False,
                    cudagraph_mode=0, timeout=WAIT),
                lambda: coordinate_batch_across_dp(
                    num_tokens_unpadded=12, parallel_config=parallel_config(cfg, 1),
                    allow_microbatching=False, adapter=other, timeout=WAIT),
            ])
            assert results == [(False, [16, 12], 0)] * 2
        finally:
            bind(None)


def test_a_spec_decode_step_loop_forward_then_draft(start_coordd) -> None:
    """Each step: a forward round overlapped with the GPU, then the drafter's own round."""
    coordd = start_coordd(3, "ipc")
    with adapters(coordd.address, DBO3, as_tensor=False) as ranks:
        for step in range(6):
            handles = [
                a.start_dp_coordination_async(32 + 8 * r + step, True, None, 64, True, 2)
                for r, a in enumerate(ranks)
            ]
            forward = [a.finish_dp_coordination(h, WAIT) for a, h in zip(ranks, handles,
                                                                          strict=True)]
            assert forward == [forward[0]] * 3 and forward[0][1] == [64, 64, 64]
            drafts = in_threads([
                lambda a=a, r=r: a.coordinate_draft_batch_across_dp(r + 1, 8, 2, timeout=WAIT)
                for r, a in enumerate(ranks)
            ])
            assert drafts == [(2, 8, [8, 8, 8])] * 3
            kinds = {a.last_decision.kind for a in ranks if a.last_decision is not None}
            assert kinds == {StepKind.DRAFT}


def _drafter_rank(address: str, rank: int, dp: int, steps: list[list[tuple[int, int, int]]],
                  conn: Connection) -> None:
    """One rank process: the drafter's sync each step, as vLLM's proposer makes it."""
    from coordd.client.dp_coordination import DPGroupConfig, VllmAdapter

    cfg = DPGroupConfig(data_parallel_size=dp)
    adapter = VllmAdapter.connect(cfg, rank, address, as_tensor=True, connect_timeout=WAIT)
    try:
        out = []
        for step in steps:
            unpadded, padded, mode = step[rank]
            got = adapter.coordinate_draft_batch_across_dp(
                unpadded, padded, mode, parallel_config=parallel_config(cfg, rank), timeout=WAIT)
            across = got.num_tokens_across_dp
            out.append([got.cudagraph_mode, got.num_tokens_padded, across.tolist(),
                        str(across.dtype), across.device.type])
        conn.send_bytes(msgspec.msgpack.encode(out))
    finally:
        adapter.close()


def run_rank_processes(target: Callable[..., None], args: Sequence[tuple[Any, ...]]
                       ) -> list[Any]:
    """One spawned process per rank; each sends one msgpack result back (or dies: a failure)."""
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in args]
    procs = [ctx.Process(target=target, args=(*a, pipes[i][1]), daemon=True)
             for i, a in enumerate(args)]
    for p in procs:
        p.start()
    for _, sender in pipes:
        sender.close()  # a rank that dies then reads as EOF at once
    try:
        results = []
        for rank, (receiver, _) in enumerate(pipes):
            assert receiver.poll(120), f"rank {rank} sent nothing"
            try:
                results.append(msgspec.msgpack.decode(receiver.recv_bytes()))
            except EOFError:
                pytest.fail(f"rank {rank} died (its traceback is above)")
        return results
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()


@pytest.mark.timeout(180)
def test_drafter_rounds_with_padding_off_give_each_rank_its_own_count(start_coordd) -> None:
    """Padding off (mode NONE, no micro-batching) with different counts per rank: each rank
    re-dispatches at its own entry. A helper that returned rank 0's count to every rank (or the
    maximum) fails here; the padded steps around them check the other branch."""
    dp = 3
    coordd = start_coordd(dp, "ipc")
    steps = [
        [(3, 4, 0), (9, 16, 0), (1, 1, 0)],     # NONE everywhere: own counts
        [(3, 4, 2), (9, 16, 1), (1, 1, 2)],     # a graph mode everywhere: the max, PIECEWISE
        [(7, 8, 2), (2, 2, 0), (30, 32, 1)],    # one NONE: padding off again, rank 2 largest
    ]
    expected = [
        [0, [4, 16, 1]],
        [1, [16, 16, 16]],
        [0, [8, 2, 32]],
    ]
    results = run_rank_processes(
        _drafter_rank, [(coordd.address, r, dp, steps) for r in range(dp)])
    for rank, got in enumerate(results):
        for step, (mode, own, across, dtype, device) in enumerate(got):
            synced, counts = expected[step]
            assert (mode, across) == (synced, counts), f"rank {rank} step {step}"
            assert own == counts[rank], f"rank {rank} step {step}: its own entry"
            assert (dtype, device) == ("torch.int32", "cpu")


def test_skip_dp_coordination_runs_no_round(start_coordd) -> None:
    """Under skip every rank answers locally: coordd sees no round (the next seq is the next)."""
    coordd = start_coordd(2, "ipc")
    cfg = CONFIGS["dbo"]
    with adapters(coordd.address, cfg, as_tensor=False) as ranks:

        def step(a: VllmAdapter, tokens: int) -> Any:
            return a.coordinate_batch_across_dp(tokens, True, parallel_config(cfg, a.dp_rank),
                                                64, True, 2, timeout=WAIT)

        def skipped(a: VllmAdapter, tokens: int) -> Any:
            with skip_dp_coordination():  # a context variable: entered in the rank's thread
                return [step(a, tokens) for _ in range(5)]

        first = in_threads([lambda a=a: step(a, 40) for a in ranks])
        assert first == [(True, [64, 64], 2)] * 2
        seq = ranks[0].last_decision.seq  # type: ignore[union-attr]
        local = in_threads([lambda a=a, t=t: skipped(a, t) for a, t in zip(ranks, (40, 10),
                                                                           strict=True)])
        assert local == [[(True, [64, 64], 2)] * 5, [(False, [64, 64], 2)] * 5]
        after = in_threads([lambda a=a: step(a, 40) for a in ranks])
        assert after == first
        assert ranks[0].last_decision.seq == seq + 1  # type: ignore[union-attr]


def test_the_engine_loop_syncs_state_every_dp_sync_interval(start_coordd) -> None:
    coordd = start_coordd(2, "ipc")
    cfg = DPGroupConfig(data_parallel_size=2, dp_sync_interval=4)
    with adapters(coordd.address, cfg, as_tensor=False) as ranks:
        seqs = []
        for step in range(1, 10):
            before = [a.last_decision for a in ranks]
            states = in_threads([
                lambda a=a: a.has_global_unfinished_reqs(a.dp_rank == 1, False, timeout=WAIT)
                for a in ranks
            ])
            assert states == [(True, False)] * 2, step
            if ranks[0].last_decision is not before[0]:
                seqs.append((step, ranks[0].last_decision.seq))  # type: ignore[union-attr]
        assert [s for s, _ in seqs] == [1, 4, 8]
        assert [q for _, q in seqs] == [seqs[0][1], seqs[0][1] + 1, seqs[0][1] + 2]


def test_a_rank_that_skips_its_draft_round_fails_every_rank_at_once(start_coordd) -> None:
    coordd = start_coordd(3, "ipc", "--step-timeout", "120")
    with adapters(coordd.address, DBO3, as_tensor=False) as ranks:
        handles = [a.start_dp_coordination_async(40, True, None, 48, True, 2) for a in ranks]
        for a, h in zip(ranks, handles, strict=True):
            a.finish_dp_coordination(h, WAIT)
        next_seq = handles[0].decision.seq + 1  # type: ignore[union-attr]
        # Ranks 0 and 1 start their drafter's round; rank 2 skips it and starts the next step.
        draft = [a.start_dp_coordination_async(4, False, None, 8, None, 2, kind="draft")
                 for a in ranks[:2]]
        for a in ranks[:2]:  # a ping behind each report: coordd has the draft reports first
            a.client.ping(WAIT)  # type: ignore[union-attr]
        skipped = ranks[2].start_dp_coordination_async(40, True, None, 48, True, 2)
        errors = []
        for a, h in zip(ranks, [*draft, skipped], strict=True):
            with pytest.raises(StepMismatch) as info:
                a.finish_dp_coordination(h, WAIT)
            errors.append(info.value)
        expected = StepMismatch(2, next_seq, "draft", next_seq, "forward")
        assert errors == [expected] * 3
        assert errors[0].ranks == (2,)


def test_pause_consensus_in_forward_and_state_rounds(start_coordd) -> None:
    coordd = start_coordd(3, "ipc")
    with adapters(coordd.address, DBO3, as_tensor=False) as ranks:
        for wants, agreed in [([True, False, True], False), ([True, True, True], True),
                              ([False, False, False], False)]:
            handles = [a.start_dp_coordination_async(10, False, None, 16, None, 2, want_pause=w)
                       for a, w in zip(ranks, wants, strict=True)]
            for a, h in zip(ranks, handles, strict=True):
                a.finish_dp_coordination(h, WAIT)
                assert h.decision is not None and h.decision.should_pause is agreed
        # vLLM's sync_dp_state: work anywhere, or a pause not all want yet, keeps all running.
        for unfinished, wants, expected in [
            ([False, False, True], [True, True, True], (True, True)),
            ([False, False, False], [True, False, True], (True, False)),
            ([False, False, False], [True, True, True], (False, True)),
            ([False, False, False], [False, False, False], (False, False)),
        ]:
            results = in_threads([
                lambda a=a, u=u, w=w: a.sync_dp_state(u, w, timeout=WAIT)
                for a, u, w in zip(ranks, unfinished, wants, strict=True)
            ])
            assert results == [expected] * 3
            assert all(a.last_decision is not None and a.last_decision.kind is StepKind.STATE
                       for a in ranks)
        results = in_threads([lambda a=a, u=u: a.has_unfinished_dp(u, timeout=WAIT)
                              for a, u in zip(ranks, [False, True, False], strict=True)])
        assert results == [True] * 3


def test_ranks_with_other_group_settings_are_refused(start_coordd) -> None:
    coordd = start_coordd(2, "ipc")
    other = DPGroupConfig(data_parallel_size=2, enable_dbo=True, dbo_decode_token_threshold=64)
    first = VllmAdapter.connect(CONFIGS["dbo"], 0, coordd.address, as_tensor=False)
    try:
        with pytest.raises(Rejected) as info:
            VllmAdapter.connect(other, 1, coordd.address, as_tensor=False)
        assert info.value.reason == "fingerprint"
        assert (info.value.expected, info.value.got) == (CONFIGS["dbo"].fingerprint(),
                                                         other.fingerprint())
    finally:
        first.close()


def test_the_adapter_takes_any_client_with_the_same_surface(start_coordd) -> None:
    """The adapter only calls start/wait: a CoordClient built by hand serves as well."""
    coordd = start_coordd(2, "ipc")
    cfg = CONFIGS["off"]
    clients = [CoordClient(coordd.address, dp_rank=r, **cfg.client_options()) for r in range(2)]
    try:
        for c in clients:
            c.connect(timeout=WAIT)
        ranks = [VllmAdapter(cfg, c, dp_rank=r, as_tensor=False) for r, c in enumerate(clients)]
        handles = [a.start_dp_coordination_async(5 * (r + 1), False, None, None, None, 1)
                   for r, a in enumerate(ranks)]
        assert [h.finish(WAIT) for h in handles] == [(False, [10, 10], 1)] * 2
    finally:
        for c in clients:
            c.close()


def _device_rank(store: str, rank: int, conn: Connection) -> None:
    """One rank of a gloo group running the rule table through the adapter on the device path."""
    import torch.distributed as dist

    from coordd.client.device import DeviceCoordClient

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        out = []
        for name, cfg in CONFIGS.items():
            client = DeviceCoordClient(dp_rank=rank, **cfg.client_options())
            client.connect(timeout=WAIT)
            adapter = VllmAdapter(cfg, client, dp_rank=rank, as_tensor=True)
            for _, calls, _ in live_cases(cfg):
                c = calls[rank]
                handle = adapter.start_dp_coordination_async(c.tokens, c.allow, None, c.padded,
                                                             c.uniform, c.mode)
                should_ubatch, across, mode = adapter.finish_dp_coordination(handle, WAIT)
                out.append([name, should_ubatch, across.tolist(), mode])
            draft = adapter.coordinate_draft_batch_across_dp(rank + 1, 8, 2, timeout=WAIT)
            out.append([name, draft.num_tokens_across_dp.tolist()])
            out.append([name, *adapter.sync_dp_state(False, rank == 0, timeout=WAIT)])
            client.close()
        conn.send_bytes(msgspec.msgpack.encode(out))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_the_adapter_runs_on_the_device_path(tmp_path) -> None:
    """The same table through the device-path client (a gloo group of 2): same results."""
    pytest.importorskip("coordd.client.device", reason="the device path is absent")
    results = run_rank_processes(_device_rank, [(str(tmp_path / "store"), r) for r in range(2)])
    expected = []
    for name, cfg in CONFIGS.items():
        expected += [[name, e[0], e[1], e[2]] for _, _, e in live_cases(cfg)]
        expected += [[name, [8, 8]], [name, True, False]]
    for rank, got in enumerate(results):
        assert len(got) == len(expected), f"rank {rank}"
        for g, e in zip(got, expected, strict=True):
            assert g == e, f"rank {rank}"
