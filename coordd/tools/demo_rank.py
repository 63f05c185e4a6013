"""One simulated engine rank of `coordd demo`: a vLLM-like step loop over the vLLM adapter.

Each step the rank schedules a batch the way a vLLM scheduler would shape it (running decodes
with one speculative token each, chunked prefills under a token budget), pads it to a CUDA-graph
capture size, starts the forward round, "runs" the previous step on the GPU (sleeps its time)
while the round is in flight, finishes the round, then runs the drafter's own round
(synchronous, as the drafter needs its answer at once). The run ends by pause consensus: every
rank wants to stop at the same round, so all stop together.

Workload shapes, with the vLLM source they follow:
- CUDA-graph capture sizes 1, 2, 4, 8..248 by 8, 256..512 by 16, and the runtime mode
  FULL for uniform decode batches, PIECEWISE for mixed ones, NONE above the largest size
  (vllm/config/compilation.py defaults; `FULL_AND_PIECEWISE`, docs/design/cuda_graphs.md);
- micro-batching enabled (`enable_dbo`) with the default thresholds 32 (decode) and 512
  (prefill) (vllm/config/parallel.py);
- chunked prefill under `max_num_batched_tokens` 2048 and at most 256 running requests
  (vllm/config/scheduler.py defaults for serving).
"""

from __future__ import annotations

import bisect
import math
import random
import signal
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec

from coordd.client.dp_coordination import (
    CUDAGRAPH_FULL,
    CUDAGRAPH_NONE,
    CUDAGRAPH_PIECEWISE,
    DPGroupConfig,
    VllmAdapter,
)
from coordd.proto.messages import StepDecision, StepKind, StepReport

CAPTURE_SIZES = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
MAX_NUM_BATCHED_TOKENS = 2048
MAX_NUM_SEQS = 256
NUM_SPECULATIVE_TOKENS = 1
PROGRESS_EVERY_S = 0.2


def demo_config(dp: int) -> DPGroupConfig:
    return DPGroupConfig(data_parallel_size=dp, enable_dbo=True, extra_fingerprint="coordd-demo")


# -- messages to the parent (msgpack over a pipe, never pickle) -------------------------------


class Progress(msgspec.Struct, array_like=True, tag="progress"):
    rank: int
    steps: int
    exposed: list[float]  # forward rounds: seconds blocked in finish, after the GPU time
    latency: list[float]  # draft rounds: start to decision, nothing overlapped
    tokens_run: int  # this rank's entry of num_tokens_across_dp, summed
    tokens_real: int  # the unpadded tokens, summed
    ubatched: int  # steps the group micro-batched
    votes: int  # steps this rank voted to micro-batch


class RoundRecord(msgspec.Struct, array_like=True):
    report: StepReport
    decision: StepDecision


class Finished(msgspec.Struct, array_like=True, tag="finished"):
    rank: int
    steps: int
    records: list[RoundRecord]
    error: str = ""


RankMessage = Progress | Finished


# -- the workload -------------------------------------------------------------------------------


@dataclass
class Batch:
    num_tokens: int
    num_tokens_padded: int
    uniform_decode: bool
    cudagraph_mode: int
    num_reqs: int


def pad_to_graph(num_tokens: int, uniform_decode: bool) -> tuple[int, int]:
    """(padded count, runtime CUDA-graph mode) for a batch of `num_tokens`."""
    if num_tokens == 0:
        return 0, CUDAGRAPH_FULL  # an idle rank's dummy step never lowers the group's mode
    if num_tokens > CAPTURE_SIZES[-1]:
        return num_tokens, CUDAGRAPH_NONE
    size = CAPTURE_SIZES[bisect.bisect_left(CAPTURE_SIZES, num_tokens)]
    return size, CUDAGRAPH_FULL if uniform_decode else CUDAGRAPH_PIECEWISE


class Workload:
    """Requests arriving, prefilling in chunks, decoding, finishing; one rank's scheduler."""

    def __init__(self, rng: random.Random, rank: int, dp: int) -> None:
        self.rng = rng
        self.phase = 2 * math.pi * rank / max(1, dp)  # ranks' load peaks at different times
        self.decodes: list[int] = [rng.randint(8, 400) for _ in range(rng.randint(16, 96))]
        self.prefills: deque[list[int]] = deque()  # [prompt tokens left, output length]
        self.step = 0

    def _arrivals(self) -> None:
        rate = 0.45 * (1 + 0.3 * math.sin(2 * math.pi * self.step / 600 + self.phase))
        while self.rng.random() < rate / (1 + rate):  # about `rate` arrivals per step
            prompt = min(8192, max(16, int(self.rng.lognormvariate(math.log(400), 1.0))))
            self.prefills.append([prompt, self.rng.randint(16, 512)])

    def next_batch(self) -> Batch:
        self._arrivals()
        self.step += 1
        decodes = min(len(self.decodes), MAX_NUM_SEQS)
        decode_tokens = decodes * (1 + NUM_SPECULATIVE_TOKENS)
        budget = MAX_NUM_BATCHED_TOKENS - decode_tokens
        prefill_tokens = prefill_reqs = 0
        for request in self.prefills:
            if budget <= 0 or decodes + prefill_reqs >= MAX_NUM_SEQS:
                break
            chunk = min(request[0], budget)
            request[0] -= chunk
            budget -= chunk
            prefill_tokens += chunk
            prefill_reqs += 1
        num_tokens = decode_tokens + prefill_tokens
        uniform = prefill_tokens == 0 and decodes > 0
        padded, mode = pad_to_graph(num_tokens, uniform)
        self._advance(decodes)
        return Batch(num_tokens, padded, uniform, mode, decodes + prefill_reqs)

    def _advance(self, decodes: int) -> None:
        """After the step: decodes emit 1-2 tokens (the speculative one is often accepted)."""
        left = []
        for i, remaining in enumerate(self.decodes):
            if i < decodes:
                remaining -= 1 + (self.rng.random() < 0.7)
            if remaining > 0:
                left.append(remaining)
        self.decodes = left
        while self.prefills and self.prefills[0][0] == 0:
            self.decodes.append(self.prefills.popleft()[1])

    @property
    def has_unfinished(self) -> bool:
        return bool(self.decodes or self.prefills)


def gpu_seconds(tokens: int, step_ms: float) -> float:
    """The simulated forward time: a fixed part plus one that grows with the tokens run."""
    return step_ms * (0.6 + tokens / 1024) / 1000


# -- the rank process ------------------------------------------------------------------------


def run_rank(
    address: str,
    rank: int,
    dp: int,
    rounds: int | None,
    seconds: float | None,
    step_ms: float,
    seed: int,
    conn: Connection,
) -> None:
    """The process body: connect, step until the group agrees to pause, report everything."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it ends the ranks
    encoder = msgspec.msgpack.Encoder()
    records: list[RoundRecord] = []
    steps = 0
    try:
        adapter = VllmAdapter.connect(
            demo_config(dp), rank, address, as_tensor=False, connect_timeout=30
        )
    except Exception as exc:
        conn.send_bytes(encoder.encode(Finished(rank, 0, [], f"{type(exc).__name__}: {exc}")))
        return
    try:
        steps = _step_loop(adapter, rank, dp, rounds, seconds, step_ms, seed, conn, records)
        conn.send_bytes(encoder.encode(Finished(rank, steps, records)))
    except Exception as exc:
        conn.send_bytes(
            encoder.encode(Finished(rank, steps, records, f"{type(exc).__name__}: {exc}"))
        )
    finally:
        adapter.close()


def _step_loop(
    adapter: VllmAdapter,
    rank: int,
    dp: int,
    rounds: int | None,
    seconds: float | None,
    step_ms: float,
    seed: int,
    conn: Connection,
    records: list[RoundRecord],
) -> int:
    encoder = msgspec.msgpack.Encoder()
    workload = Workload(random.Random(seed * 7919 + rank), rank, dp)
    progress = Progress(rank, 0, [], [], 0, 0, 0, 0)
    next_progress = time.monotonic() + PROGRESS_EVERY_S
    deadline: float | None = None
    previous_gpu_s = 0.0
    step = 0
    while True:
        batch = workload.next_batch()
        now = time.monotonic()
        want_pause = (rounds is not None and step + 1 >= rounds) or (
            deadline is not None and now >= deadline
        )
        handle = adapter.start_dp_coordination_async(
            batch.num_tokens,
            True,
            num_tokens_padded=batch.num_tokens_padded,
            uniform_decode=batch.uniform_decode,
            cudagraph_mode=batch.cudagraph_mode,
            has_unfinished=workload.has_unfinished,
            want_pause=want_pause,
        )
        time.sleep(previous_gpu_s)  # the previous step's GPU work, overlapping the round
        t_gpu_done = time.perf_counter()
        should_ubatch, across, _ = adapter.finish_dp_coordination(handle, 30)
        progress.exposed.append(time.perf_counter() - t_gpu_done)
        decision = handle.decision
        assert decision is not None
        records.append(RoundRecord(handle.report, decision))
        step += 1
        if deadline is None and seconds is not None:
            deadline = time.monotonic() + seconds  # from the group's first decision
        run = across[rank]
        progress.tokens_run += run
        progress.tokens_real += batch.num_tokens
        progress.ubatched += should_ubatch
        progress.votes += handle.report.want_ubatch
        previous_gpu_s = gpu_seconds(run, step_ms)
        if decision.should_pause:
            break
        # The drafter's round: synchronous, so its time is the plain round latency.
        draft_padded, draft_mode = pad_to_graph(batch.num_reqs, True)
        t_draft = time.perf_counter()
        draft = adapter.start_dp_coordination_async(
            batch.num_reqs,
            False,
            num_tokens_padded=draft_padded,
            cudagraph_mode=draft_mode,
            kind=StepKind.DRAFT,
        )
        adapter.finish_dp_coordination(draft, 30)
        progress.latency.append(time.perf_counter() - t_draft)
        assert draft.decision is not None
        records.append(RoundRecord(draft.report, draft.decision))
        previous_gpu_s += 0.15 * step_ms / 1000
        if time.monotonic() >= next_progress:
            progress.steps = step
            conn.send_bytes(encoder.encode(progress))
            progress = Progress(rank, step, [], [], 0, 0, 0, 0)
            next_progress = time.monotonic() + PROGRESS_EVERY_S
    progress.steps = step
    conn.send_bytes(encoder.encode(progress))
    return step
