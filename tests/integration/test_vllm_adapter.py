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
from typing import Any

import msgspec
import pytest
import torch

from coordd.client.sync import CoordClient
from coordd.client.vllm import (
    DPGroupConfig,
    VllmAdapter,
    bind,
    coordinate_batch_across_dp,
    finish_dp_coordination,
    start_dp_coordination_async,
)
from coordd.proto.errors import Rejected, StepMismatch
from coordd.proto.messages import StepKind
from coordd.proto.policy import decide
from tests.unit.test_vllm_rules import CASES, Call

WAIT = 20.0
DBO3 = DPGroupConfig(data_parallel_size=3, enable_dbo=True)


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
                a.start_dp_coordination_async(c.tokens, c.allow, c.padded, c.uniform, c.mode)
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
                    c.tokens, c.allow, c.padded, c.uniform, c.mode, timeout=WAIT)
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
            handle = start_dp_coordination_async(64, True, 64, True, 2)
            other_handle = other.start_dp_coordination_async(40, True, 48, True, 2)
            assert finish_dp_coordination(handle, WAIT) == (True, [64, 64], 2)
            assert other.finish_dp_coordination(other_handle, WAIT) == (True, [64, 64], 2)
            results = in_threads([
                lambda: coordinate_batch_across_dp(10, False, 16, None, 0, timeout=WAIT),
                lambda: coordinate_batch_across_dp(12, False, 12, None, 0, adapter=other,
                                                   timeout=WAIT),
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
                a.start_dp_coordination_async(32 + 8 * r + step, True, 64, True, 2)
                for r, a in enumerate(ranks)
            ]
            forward = [a.finish_dp_coordination(h, WAIT) for a, h in zip(ranks, handles,
                                                                          strict=True)]
            assert forward == [forward[0]] * 3 and forward[0][1] == [64, 64, 64]
            drafts = in_threads([
                lambda a=a, r=r: a.pad_batch_across_dp(r + 1, 8, 2, timeout=WAIT)
                for r, a in enumerate(ranks)
            ])
            assert drafts == [(8, [8, 8, 8])] * 3
            kinds = {a.last_decision.kind for a in ranks if a.last_decision is not None}
            assert kinds == {StepKind.DRAFT}


def test_a_rank_that_skips_its_draft_round_fails_every_rank_at_once(start_coordd) -> None:
    coordd = start_coordd(3, "ipc", "--step-timeout", "120")
    with adapters(coordd.address, DBO3, as_tensor=False) as ranks:
        handles = [a.start_dp_coordination_async(40, True, 48, True, 2) for a in ranks]
        for a, h in zip(ranks, handles, strict=True):
            a.finish_dp_coordination(h, WAIT)
        next_seq = handles[0].decision.seq + 1  # type: ignore[union-attr]
        # Ranks 0 and 1 start their drafter's round; rank 2 skips it and starts the next step.
        draft = [a.start_dp_coordination_async(4, False, 8, None, 2, kind="draft")
                 for a in ranks[:2]]
        for a in ranks[:2]:  # a ping behind each report: coordd has the draft reports first
            a.client.ping(WAIT)  # type: ignore[union-attr]
        skipped = ranks[2].start_dp_coordination_async(40, True, 48, True, 2)
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
            handles = [a.start_dp_coordination_async(10, False, 16, None, 2, want_pause=w)
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
        handles = [a.start_dp_coordination_async(5 * (r + 1), False, None, None, 1)
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
                handle = adapter.start_dp_coordination_async(c.tokens, c.allow, c.padded,
                                                             c.uniform, c.mode)
                should_ubatch, across, mode = adapter.finish_dp_coordination(handle, WAIT)
                out.append([name, should_ubatch, across.tolist(), mode])
            out.append([name, *adapter.pad_batch_across_dp(rank + 1, 8, 2, timeout=WAIT)[1:]])
            out[-1][1] = out[-1][1].tolist()
            out.append([name, *adapter.sync_dp_state(False, rank == 0, timeout=WAIT)])
            client.close()
        conn.send_bytes(msgspec.msgpack.encode(out))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_the_adapter_runs_on_the_device_path(tmp_path) -> None:
    """The same table through the device-path client (a gloo group of 2): same results."""
    pytest.importorskip("coordd.client.device", reason="the device path is absent")
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_device_rank, args=(str(tmp_path / "store"), r, pipes[r][1]),
                         daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    for _, sender in pipes:
        sender.close()  # a rank that dies then reads as EOF at once
    try:
        results = []
        for rank, (receiver, _) in enumerate(pipes):
            assert receiver.poll(120), f"device-path rank {rank} sent nothing"
            try:
                results.append(msgspec.msgpack.decode(receiver.recv_bytes()))
            except EOFError:
                pytest.fail(f"device-path rank {rank} died (its traceback is above)")
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    expected = []
    for name, cfg in CONFIGS.items():
        expected += [[name, e[0], e[1], e[2]] for _, _, e in live_cases(cfg)]
        expected += [[name, [8, 8]], [name, True, False]]
    for rank, got in enumerate(results):
        assert len(got) == len(expected), f"rank {rank}"
        for g, e in zip(got, expected, strict=True):
            assert g == e, f"rank {rank}"
