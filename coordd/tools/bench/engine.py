"""The engine-level figure: a vLLM-shaped step loop, and how much of its step time DP sync takes.

Each rank runs the step loop of `coordd demo` (coordd/tools/demo_rank.py): a scheduler with
chunked prefills under a 2048-token budget and decodes with one speculative token, the batch
padded to a CUDA-graph capture size, a forward round, the simulated GPU time of the step
(sleeping; `step_ms * (0.6 + tokens / 1024)` for the group's largest batch, as the all-to-alls of
expert parallelism hold every rank to the slowest, times a per-step factor in [0.85, 1.15] that
every rank draws alike: about 0.5x..2.9x `step_ms`), the drafter's round (synchronous), its GPU
time (0.15x `step_ms`), and a state round (has unfinished / wants to pause) every 16 steps, as
vLLM's engine core does. Four ways to run the same rounds, same batches, same GPU times:

- gloo sync: `torch.distributed.all_reduce` (gloo) of the int32 [fields x dp] matrix, blocking;
  vLLM's V1 runner with `disable_nccl_for_dp_synchronization`;
- vLLM cpu_all_reduce_ sync: vLLM 0.33's recursive doubling over MRV2's [7 x dp] matrix (and
  its [2] state vector), blocking, as Model Runner V2 and `sync_dp_state` run it;
- coordd sync: the blocking client, start then wait at once;
- coordd overlap: start the forward round, run the previous step's GPU time, then finish: the
  round hides behind the GPU work (the drafter and state rounds stay synchronous).

Blocked = time in round calls (for overlap: only the wait left after the GPU work).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import msgspec

from coordd.proto.messages import StepDecision, StepKind, StepReport
from coordd.tools.bench.methods import (
    COORDD_IPC,
    GLOO,
    VLLM,
    VLLM_PLUGIN,
    VLLM_ROWS,
    decision_from_vllm_matrix,
    import_cpu_all_reduce,
    vllm_column,
)
from coordd.tools.bench.workload import FIELDS, column, decision_from_matrix

GLOO_SYNC = "gloo sync"
VLLM_SYNC = "vLLM cpu_all_reduce_ sync"
PLUGIN_SYNC = "vLLM plugin sync"
COORDD_SYNC = "coordd sync"
COORDD_OVERLAP = "coordd overlap"
#: Every engine mode, in table order, with the bench method whose connection it uses.
MODES = {
    GLOO_SYNC: GLOO,
    VLLM_SYNC: VLLM,
    PLUGIN_SYNC: VLLM_PLUGIN,
    COORDD_SYNC: COORDD_IPC,
    COORDD_OVERLAP: COORDD_IPC,
}
#: vLLM's `dp_sync_interval` default: the engine core's state round every 16 steps.
STATE_EVERY = 16
WARMUP_STEPS = 4
#: The drafter's GPU time, as a share of `step_ms` (as in `coordd demo`).
DRAFT_GPU_SHARE = 0.15
#: Micro-batching thresholds (vLLM's defaults with enable_dbo: 32 decode, 512 prefill tokens).
UBATCH_DECODE, UBATCH_PREFILL = 32, 512


class EnginePhase(msgspec.Struct, frozen=True, tag="engine"):
    modes: list[str]
    steps: int
    step_ms: float
    seed: int = 0


class EngineResult(msgspec.Struct):
    mode: str
    steps: int = 0
    total_ns: int = 0
    blocked_ns: int = 0
    gpu_ns: int = 0
    rounds: int = 0
    step_ns: list[int] = []


class EngineResults(msgspec.Struct, frozen=True, tag="engine_result"):
    rank: int
    results: list[EngineResult]


class Exchange:
    """One way to run a round: `start(report, kind)` then `finish(handle)` -> decision."""

    def start(self, report: StepReport, kind: StepKind) -> Any:
        raise NotImplementedError

    def finish(self, handle: Any) -> StepDecision | None:
        raise NotImplementedError


class CoorddExchange(Exchange):
    def __init__(self, client: Any) -> None:
        self.client = client

    def start(self, report: StepReport, kind: StepKind) -> Any:
        return self.client.start(report, kind)

    def finish(self, handle: Any) -> StepDecision | None:
        return handle.wait()


class AllReduceExchange(Exchange):
    """A blocking in-place SUM all-reduce of the rank's own column (start() does it all); state
    rounds reduce a [2] vector (has unfinished, wants to pause) as `sync_dp_state` does."""

    def __init__(
        self,
        rank: int,
        dp: int,
        reduce: Callable[[Any], Any],
        rows: int,
        to_column: Callable[[StepReport], list[int]],
        to_decision: Callable[[Any], StepDecision],
        reduce_state: Callable[[Any], Any] | None = None,
    ) -> None:
        import torch

        self.torch = torch
        self.rank, self.dp = rank, dp
        self.reduce, self.rows = reduce, rows
        self.reduce_state = reduce if reduce_state is None else reduce_state
        self.to_column, self.to_decision = to_column, to_decision

    def start(self, report: StepReport, kind: StepKind) -> Any:
        torch = self.torch
        if kind is StepKind.STATE:
            state = torch.tensor(
                [int(report.has_unfinished), int(report.want_pause)], dtype=torch.int32
            )
            self.reduce_state(state)
            return None
        matrix = torch.zeros(self.rows, self.dp, dtype=torch.int32)
        matrix[:, self.rank] = torch.tensor(self.to_column(report), dtype=torch.int32)
        self.reduce(matrix)
        return self.to_decision(matrix.tolist())

    def finish(self, handle: Any) -> StepDecision | None:
        return handle


def exchange_for(mode: str, rank: int, dp: int, coordd_client: Any, plugin: Any = None) -> Exchange:
    """`plugin`: the vLLM plugin method's `plugin_sync` (for PLUGIN_SYNC)."""
    if mode in (COORDD_SYNC, COORDD_OVERLAP):
        return CoorddExchange(coordd_client)
    if mode == PLUGIN_SYNC:
        return AllReduceExchange(
            rank,
            dp,
            plugin,
            VLLM_ROWS,
            vllm_column,
            decision_from_vllm_matrix,
            reduce_state=lambda t: plugin(t, whole=True),  # sync_dp_state: the engine group
        )
    import torch.distributed as dist

    if mode == GLOO_SYNC:
        return AllReduceExchange(
            rank, dp, dist.all_reduce, len(FIELDS), column, decision_from_matrix
        )
    if mode == VLLM_SYNC:
        cpu_all_reduce_ = import_cpu_all_reduce()
        group = dist.group.WORLD
        return AllReduceExchange(
            rank,
            dp,
            lambda t: cpu_all_reduce_(t, group),
            VLLM_ROWS,
            vllm_column,
            decision_from_vllm_matrix,
        )
    raise ValueError(f"unknown engine mode {mode!r}")


def _gpu_factor(seed: int, step: int) -> float:
    """The step's GPU-time jitter, identical on every rank (so no rank is slow by chance)."""
    return random.Random(seed * 1_000_003 + step).uniform(0.85, 1.15)


class EngineLoop:
    """One way to sync, with its own scheduler state, run a block of steps at a time (the
    modes take turns block by block, so a shared machine's drift spreads over all of them)."""

    def __init__(
        self, exchange: Exchange, mode: str, rank: int, dp: int, step_ms: float, seed: int
    ) -> None:
        from coordd.tools.demo_rank import Workload

        self.exchange, self.mode, self.rank = exchange, mode, rank
        self.step_ms, self.seed = step_ms, seed
        self.overlap = mode == COORDD_OVERLAP
        self.workload = Workload(random.Random(seed * 7919 + rank), rank, dp)
        self.step = 0
        self.out = EngineResult(mode=mode)

    def run(self, n: int, timed: bool) -> None:
        from coordd.tools.demo_rank import gpu_seconds, pad_to_graph

        exchange, workload, out, overlap = self.exchange, self.workload, self.out, self.overlap
        clock = time.perf_counter_ns
        sleep = time.sleep
        previous_gpu_s = 0.0
        t_begin = clock()
        for _ in range(n):
            step = self.step
            self.step += 1
            t_step = clock()
            blocked = 0
            rounds = 0
            batch = workload.next_batch()
            threshold = UBATCH_DECODE if batch.uniform_decode else UBATCH_PREFILL
            report = StepReport(
                num_tokens=batch.num_tokens,
                num_tokens_padded=batch.num_tokens_padded,
                want_ubatch=batch.num_tokens >= threshold,
                cudagraph_mode=batch.cudagraph_mode,
                has_unfinished=workload.has_unfinished,
            )
            if step % STATE_EVERY == 0:
                state = StepReport(0, 0, has_unfinished=workload.has_unfinished)
                t0 = clock()
                exchange.finish(exchange.start(state, StepKind.STATE))
                blocked += clock() - t0
                rounds += 1
            if overlap:
                handle = exchange.start(report, StepKind.FORWARD)
                sleep(previous_gpu_s)  # the previous step's GPU work, overlapping the round
                t0 = clock()
                decision = exchange.finish(handle)
                blocked += clock() - t0
            else:
                t0 = clock()
                decision = exchange.finish(exchange.start(report, StepKind.FORWARD))
                blocked += clock() - t0
            rounds += 1
            assert decision is not None
            # The group's largest batch sets the step's GPU time on every rank: with expert
            # parallelism the forward pass's all-to-alls make each rank wait for the slowest.
            gpu_s = gpu_seconds(max(decision.num_tokens_across_dp), self.step_ms) * _gpu_factor(
                self.seed, step
            )
            draft_gpu_s = DRAFT_GPU_SHARE * self.step_ms / 1000
            if not overlap:
                sleep(gpu_s)
            draft_padded, draft_mode = pad_to_graph(batch.num_reqs, True)
            draft = StepReport(batch.num_reqs, draft_padded, cudagraph_mode=draft_mode)
            t0 = clock()
            exchange.finish(exchange.start(draft, StepKind.DRAFT))
            blocked += clock() - t0
            rounds += 1
            if overlap:
                previous_gpu_s = gpu_s + draft_gpu_s
            else:
                sleep(draft_gpu_s)
            if timed:
                out.steps += 1
                out.blocked_ns += blocked
                out.gpu_ns += int((gpu_s + draft_gpu_s) * 1e9)
                out.rounds += rounds
                out.step_ns.append(clock() - t_step)
        if overlap:
            sleep(previous_gpu_s)  # the block's last GPU work: every mode runs the same GPU time
        if timed:
            out.total_ns += clock() - t_begin


#: Blocks the engine phase's steps are split into (modes take turns per block).
ENGINE_BLOCKS = 5


def run_phase(
    phase: EnginePhase, rank: int, dp: int, coordd_client: Any, plugin: Any = None
) -> EngineResults:
    loops = [
        EngineLoop(
            exchange_for(mode, rank, dp, coordd_client, plugin),
            mode,
            rank,
            dp,
            phase.step_ms,
            phase.seed,
        )
        for mode in phase.modes
    ]
    for loop in loops:
        loop.run(WARMUP_STEPS, timed=False)
    blocks = max(1, min(ENGINE_BLOCKS, phase.steps))
    per_block = [phase.steps // blocks + (b < phase.steps % blocks) for b in range(blocks)]
    for block, n in enumerate(per_block):
        shift = block % len(loops)
        for loop in loops[shift:] + loops[:shift]:
            loop.run(n, timed=True)
    return EngineResults(rank=rank, results=[loop.out for loop in loops])


def merge(dp: int, per_rank: list[EngineResults], step_ms: float) -> list[dict[str, Any]]:
    """Per mode, over all ranks: mean step time, the share blocked in DP sync, vs gloo sync."""
    rows: list[dict[str, Any]] = []
    modes = [r.mode for r in per_rank[0].results]
    for i, mode in enumerate(modes):
        parts = [r.results[i] for r in per_rank]
        steps = sum(p.steps for p in parts)
        total = sum(p.total_ns for p in parts)
        step_all = sorted(x for p in parts for x in p.step_ns)
        rows.append(
            {
                "dp": dp,
                "mode": mode,
                "steps": parts[0].steps,
                "step_ms": step_ms,
                "mean_step_ms": total / steps / 1e6,
                "p50_step_ms": step_all[len(step_all) // 2] / 1e6,
                "gpu_ms_per_step": sum(p.gpu_ns for p in parts) / steps / 1e6,
                "blocked_ms_per_step": sum(p.blocked_ns for p in parts) / steps / 1e6,
                "blocked_share": sum(p.blocked_ns for p in parts) / total,
                "rounds_per_step": sum(p.rounds for p in parts) / steps,
            }
        )
    for key, mode in (("step_vs_gloo", GLOO_SYNC), ("step_vs_coordd_sync", COORDD_SYNC)):
        base = next((r for r in rows if r["mode"] == mode), None)
        for row in rows:
            row[key] = row["mean_step_ms"] / base["mean_step_ms"] - 1 if base else None
    return rows
