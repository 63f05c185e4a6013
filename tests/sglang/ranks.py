"""SGLang rank processes for the conformance tests and the sync-cost benchmark: each builds
SGLang's real groups (its ServerArgs published, `init_distributed_environment` and
`initialize_model_parallel` on gloo) and calls SGLang's own sync functions with seeded rows,
with the plugin off (stock gloo) or on (loaded by SGLang's `load_plugins()`).

The ranks are forked from a process that imported SGLang's DP attention module already (its
import is ~10 s of CPU per process here). Runs in the SGLang venv (`.ci/sglang-env`).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from sglang.srt.managers.scheduler_components import dp_attn

#: Seconds the parent waits for every rank's result (a rank blocked in gloo never sends one).
RESULT_WAIT = 60.0
#: The row SGLang's MLPSyncBatchInfo sends (its `_get_local_tensor`): 11 int64 values.
WIDTH = 11
#: The syncs of one step, in order: SGLang's all_gather on the TP group (gather path),
#: exchange_sync_rows called directly, and the elastic WORLD all-reduce path.
SYNCS = ("tp", "rows", "world")


@dataclass(frozen=True)
class Fault:
    """What the culprit (the last rank) does at step `step`: "skip" its TP sync, "stop" for
    `pause` seconds before it, make it from "another" call site, or send "tworows" in its
    WORLD all-reduce (a tensor SGLang never makes: two rows written)."""

    kind: str
    step: int
    pause: float = 0.0


@dataclass(frozen=True)
class Spec:
    world: int
    dp: int
    port: int
    model: str
    steps: int
    seed: int
    #: None: the stock run (the plugin never loaded); else coordd's address
    address: str | None
    fault: Fault | None = None
    #: the benchmark: rounds of all_gather alternating stock and plugin (0: conformance)
    bench: int = 0


@dataclass
class Outcome:
    rank: int
    #: one entry per sync made: (step, sync, what SGLang computed from it)
    results: list[tuple[int, str, Any]] = field(default_factory=list)
    #: the typed error, if any: (class name, ranks it names, text, seconds since the faulty step
    #: began on this rank)
    error: tuple[str, tuple[int, ...], str, float] | None = None
    #: coordd rounds by group, when the plugin was on
    rounds: dict[str, int] = field(default_factory=dict)
    #: bench: seconds per all_gather, by path ("stock", "coordd")
    times: dict[str, list[float]] = field(default_factory=dict)
    #: seconds each completed step took on this rank
    step_times: list[float] = field(default_factory=list)
    crash: str = ""


def local_row(seed: int, step: int, rank: int) -> list[int]:
    """A rank's MLPSyncBatchInfo fields at a step: seeded, now and then all zeros (the
    all-reduce path then decodes the row as idle), else varied."""
    rng = random.Random(seed * 1_000_003 + step * 1009 + rank)
    if rng.random() < 0.15:
        return [0] * 10
    return [
        rng.randrange(0, 4096),  # num_tokens
        rng.randrange(0, 4096),  # num_tokens_for_logprob
        rng.randrange(2),  # can_run_decode_cuda_graph
        rng.randrange(2),  # can_run_draft_cuda_graph
        rng.randrange(2),  # can_run_prefill_cuda_graph
        rng.randrange(2),  # is_extend_in_batch
        rng.randrange(2),  # local_can_run_tbo
        rng.randrange(0, 8),  # local_forward_mode
        rng.randrange(0, 1 << 20),  # prefill_cuda_graph_max_prefix_len
        rng.randrange(0, 1 << 40),  # attention_pairs
    ]


def raw_row(seed: int, step: int, rank: int) -> list[int]:
    """Any int64 values, for exchange_sync_rows called directly."""
    rng = random.Random(seed * 7_000_003 + step * 31 + rank)
    return [rng.randrange(-(1 << 63), 1 << 63) for _ in range(WIDTH)]


def _info(spec: Spec, step: int, rank: int) -> Any:
    f = local_row(spec.seed, step, rank)
    return dp_attn.MLPSyncBatchInfo(
        num_dp_ranks=spec.dp,
        tp_size=spec.world // spec.dp,
        cp_size=1,
        num_tokens=f[0],
        num_tokens_for_logprob=f[1],
        can_run_decode_cuda_graph=bool(f[2]),
        can_run_draft_cuda_graph=bool(f[3]),
        can_run_prefill_cuda_graph=bool(f[4]),
        is_extend_in_batch=bool(f[5]),
        local_can_run_tbo=bool(f[6]),
        local_forward_mode=f[7],
        prefill_cuda_graph_max_prefix_len=f[8],
        attention_pairs=f[9],
    )


def _computed(info: Any) -> tuple[Any, ...]:
    """What SGLang reads from the gathered rows (every field all_gather sets)."""
    return (
        info.tp0_info_cpu.tolist(),
        str(info.tp0_info_cpu.dtype),
        info.global_num_tokens,
        info.global_num_tokens_for_logprob,
        info.can_run_decode_cuda_graph,
        info.is_extend_in_batch,
        info.can_run_prefill_cuda_graph,
        info.prefill_cuda_graph_max_prefix_len,
        info.can_run_draft_cuda_graph,
        info.any_health_check,
        info.global_attention_pairs,
    )


def setup_sglang(spec: Spec, rank: int) -> Any:
    """SGLang's real config and groups in this process, as its scheduler builds them; returns
    SGLang's TP group. NCCL is pointed at nothing: pynccl then disables itself, as on a host
    without NCCL."""
    os.environ["SGLANG_NCCL_SO_PATH"] = "/nonexistent/libnccl.so"
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=spec.model,
        tp_size=spec.world,
        dp_size=spec.dp,
        enable_dp_attention=True,
        device="cpu",
    )
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank))
    ps.init_distributed_environment(
        world_size=spec.world,
        rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{spec.port}",
        local_rank=rank,
        backend="gloo",
    )
    ps.initialize_model_parallel(backend="gloo")
    return ps.get_tp_group()


def load_plugin(address: str) -> None:
    """The plugin, loaded as SGLang loads it: its entry point, through `load_plugins()`."""
    os.environ.update(COORDD_SGLANG="1", COORDD_ADDRESS=address, SGLANG_PLUGINS="coordd")
    from sglang.srt.plugins import load_plugins

    from coordd.sglang import patches

    load_plugins()
    assert patches.installed(), "SGLang's load_plugins() did not install the coordd plugin"


def tp_sync(spec: Spec, step: int, rank: int, group: Any) -> Any:
    info = _info(spec, step, rank)
    info.all_gather("cpu", group)
    return _computed(info)


def tp_sync_elsewhere(spec: Spec, step: int, rank: int, group: Any) -> Any:
    """The same sync from another call site (a code path only one rank took)."""
    info = _info(spec, step, rank)
    info.all_gather("cpu", group)
    return _computed(info)


def run_step(spec: Spec, step: int, rank: int, group: Any, out: Outcome) -> None:
    fault = spec.fault if rank == spec.world - 1 and spec.fault else None
    at_fault = fault is not None and fault.step == step
    if at_fault and fault is not None and fault.kind == "stop":
        time.sleep(fault.pause)
    if not (at_fault and fault is not None and fault.kind == "skip"):
        sync = tp_sync_elsewhere if at_fault and fault and fault.kind == "another" else tp_sync
        out.results.append((step, "tp", sync(spec, step, rank, group)))
    row = torch.tensor(raw_row(spec.seed, step, rank), dtype=torch.int64)
    flat = torch.full((spec.world * WIDTH,), -1, dtype=torch.int64)
    dp_attn.exchange_sync_rows(flat, row, group)
    out.results.append((step, "rows", flat.tolist()))
    if at_fault and fault is not None and fault.kind == "tworows":
        world_sync_two_rows(spec)
        return
    info = _info(spec, step, rank)
    info.all_gather("cpu", torch.distributed.group.WORLD, use_all_reduce=True)
    out.results.append((step, "world", _computed(info)))


def world_sync_two_rows(spec: Spec) -> None:
    """The WORLD all-reduce as dp_attn makes it, of a tensor with two rows written."""
    tensor = torch.zeros(spec.dp, spec.world // spec.dp, WIDTH, dtype=torch.int64)
    tensor.view(-1, WIDTH)[:2] = 1
    dp_attn.torch.distributed.all_reduce(tensor, group=torch.distributed.group.WORLD)


def bench(spec: Spec, rank: int, group: Any, out: Outcome) -> None:
    """`spec.bench` all_gathers on the TP group, stock and through the plugin in turn (which
    goes first alternates), each timed on this rank."""
    from coordd.sglang import patches

    paths = {"stock": patches.original("exchange_sync_rows"), "coordd": dp_attn.exchange_sync_rows}
    out.times = {name: [] for name in paths}
    order = list(paths)
    for i in range(spec.bench):
        for name in order if i % 2 == 0 else reversed(order):
            dp_attn.exchange_sync_rows = paths[name]
            info = _info(spec, i, rank)
            began = time.perf_counter()
            info.all_gather("cpu", group)
            out.times[name].append(time.perf_counter() - began)
    dp_attn.exchange_sync_rows = paths["coordd"]


def rank_main(spec: Spec, rank: int, queue: Any) -> None:
    out = Outcome(rank)
    began = time.monotonic()
    try:
        group = setup_sglang(spec, rank)
        if spec.address is not None:
            load_plugin(spec.address)
        if spec.bench:
            bench(spec, rank, group.cpu_group, out)
        for step in range(spec.steps):
            began = time.monotonic()
            run_step(spec, step, rank, group.cpu_group, out)
            out.step_times.append(time.monotonic() - began)
    except Exception as error:
        from coordd.proto.errors import CoordError

        if not isinstance(error, CoordError):
            out.crash = traceback.format_exc()
        else:
            out.error = (
                type(error).__name__,
                tuple(getattr(error, "ranks", ())),
                str(error),
                time.monotonic() - began,
            )
    if spec.address is not None:
        from coordd.sglang import patches

        out.rounds = patches.rounds()
    queue.put(out)


class Ranks:
    """`world` forked rank processes, started at once; `collect` ends them all."""

    def __init__(self, specs: Callable[[int], Spec], world: int) -> None:
        ctx = multiprocessing.get_context("fork")
        self.world = world
        self.queue = ctx.Queue()
        self.procs = [
            ctx.Process(target=rank_main, args=(specs(r), r, self.queue)) for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def collect(self, wait: float = RESULT_WAIT) -> tuple[list[Outcome], list[int]]:
        """The outcomes that came within `wait` and the ranks that sent none (blocked), every
        process ended on return."""
        outcomes: list[Outcome] = []
        try:
            deadline = time.monotonic() + wait
            while len(outcomes) < self.world:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    outcomes.append(self.queue.get(timeout=left))
                except Exception:  # queue.Empty: the rest are blocked
                    break
        finally:
            for p in self.procs:
                p.join(timeout=5 if len(outcomes) == self.world else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
            self.queue.close()
        outcomes.sort(key=lambda o: o.rank)
        got = {o.rank for o in outcomes}
        return outcomes, [r for r in range(self.world) if r not in got]


def run_ranks(
    specs: Callable[[int], Spec], world: int, wait: float = RESULT_WAIT
) -> tuple[list[Outcome], list[int]]:
    """`Ranks(specs, world).collect(wait)`."""
    return Ranks(specs, world).collect(wait)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tiny_model(directory: Path) -> str:
    """A config-only model directory (SGLang's ServerArgs reads its config)."""
    from coordd.tools.vllm_e2e.tiny_model import write_tiny_model

    return str(write_tiny_model(directory))


def check_crashes(outcomes: Sequence[Outcome]) -> None:
    crashed = [f"rank {o.rank}:\n{o.crash}" for o in outcomes if o.crash]
    assert not crashed, "\n".join(crashed)
