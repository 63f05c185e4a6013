"""One vLLM DP rank for the conformance tests: vLLM's real sync functions (0.32 or 0.33),
called with seeded inputs, first on vLLM's own gloo collectives, then with the coordd plugin
installed.

Runs in a spawned process (vLLM's distributed state is per process). Every call's outputs are
recorded in a canonical form that keeps types, enum classes, dataclass fields and tensors'
dtype, device, shape and values, so the two passes compare exactly. The runner's CUDA-graph
dispatcher and MRV2's graph manager are deterministic stand-ins with vLLM's `dispatch`
signatures (inputs to the syncs, not what is tested); the runner and proposer objects carry
only the attributes their `_determine_batch_execution_and_padding` reads.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import inspect
import os
import random
import time
import traceback
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

#: The engine-state syncs' group name (coordd.vllm.groups.ENGINE_GROUP).
ENGINE = "enginecore"


@dataclass
class RankSpec:
    """What one rank process runs (picklable: it crosses the spawn)."""

    idx: int
    tp: int
    rounds: int
    seed: int
    #: (address, sync parts) per plugin phase; parts are "worker" and/or "engine".
    phases: list[tuple[str, tuple[str, ...]]]
    #: This DP rank skips one drafter sync at the end (None: no skip test).
    skip_rank: int | None = None
    skip_delay: float = 1.0


@dataclass
class RankResult:
    idx: int
    dp_rank: int = -1
    tp_rank: int = -1
    worker_group: str = ""
    ref: list[tuple[str, int, Any]] = field(default_factory=list)
    got: list[tuple[str, int, Any]] = field(default_factory=list)
    expected_rounds: dict[str, int] = field(default_factory=dict)
    rounds: dict[str, int] = field(default_factory=dict)
    skip: tuple[Any, ...] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    error: str = ""


def canon(x: Any) -> Any:
    """A comparable form that keeps what a caller could observe."""
    import torch

    if isinstance(x, torch.Tensor):
        return ("Tensor", str(x.dtype), str(x.device), tuple(x.shape), x.tolist())
    if isinstance(x, enum.Enum):
        return (type(x).__qualname__, x.name, x.value)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (
            type(x).__qualname__,
            tuple((f.name, canon(getattr(x, f.name))) for f in dataclasses.fields(x)),
        )
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, tuple(canon(v) for v in x))
    return (type(x).__name__, x)


# -- stand-in inputs --------------------------------------------------------------------------

_CAPTURE = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def _capture_size(n: int) -> int | None:
    return next((c for c in _CAPTURE if n <= c), None)


class StubDispatcher:
    """vllm.v1.cudagraph_dispatcher.CudagraphDispatcher.dispatch's signature, deterministic."""

    def dispatch(
        self,
        num_tokens: int,
        uniform_decode: bool = False,
        has_lora: bool = False,
        num_active_loras: int = 0,
        valid_modes: Any = None,
        invalid_modes: Any = None,
    ) -> Any:
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import BatchDescriptor

        size = _capture_size(num_tokens) if num_tokens > 0 else None
        if size is None:
            mode = CUDAGraphMode.NONE
        elif size <= 64 and uniform_decode:
            mode = CUDAGraphMode.FULL
        else:
            mode = CUDAGraphMode.PIECEWISE
        if valid_modes is not None and mode not in valid_modes:
            mode = min(valid_modes, key=lambda m: m.value) if size else CUDAGraphMode.NONE
        if invalid_modes and mode in invalid_modes:
            mode = CUDAGraphMode.PIECEWISE if size else CUDAGraphMode.NONE
        n = num_tokens if mode == CUDAGraphMode.NONE or size is None else size
        return mode, BatchDescriptor(num_tokens=n, uniform=bool(uniform_decode))


class StubGraphManager:
    """vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager.dispatch's signature."""

    def dispatch(
        self,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
        num_ubatches: int = 1,
    ) -> Any:
        from vllm.config.compilation import CUDAGraphMode
        from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor as Desc

        size = _capture_size(num_tokens) if num_tokens > 0 else None
        if size is not None and size <= 128 and uniform_token_count:
            return Desc(
                cg_mode=CUDAGraphMode.FULL,
                num_tokens=size,
                num_reqs=max(1, size // uniform_token_count),
                uniform_token_count=uniform_token_count,
                max_query_len=max_query_len,
                num_active_loras=num_active_loras,
                num_ubatches=num_ubatches,
            )
        if size is not None and num_ubatches == 1:
            return Desc(
                cg_mode=CUDAGraphMode.PIECEWISE,
                num_tokens=size,
                num_reqs=None,
                num_active_loras=num_active_loras,
            )
        return Desc(
            cg_mode=CUDAGraphMode.NONE,
            num_tokens=num_tokens,
            num_reqs=num_reqs,
            num_active_loras=num_active_loras,
            num_ubatches=num_ubatches,
        )


def _bare(cls: type, **attrs: Any) -> Any:
    obj = object.__new__(cls)
    obj.__dict__.update(attrs)
    return obj


def _config_variants(pc: Any) -> list[Any]:
    """DBO off/on, 3 and 4 micro-batches, and both V1 paths (gloo cpu_group, device_group)."""
    out = []
    for dbo, ubatch_size in ((False, 0), (True, 0), (False, 3), (False, 4)):
        for no_nccl in (True, False):
            c = copy.deepcopy(pc)
            c.enable_dbo = dbo
            c.ubatch_size = ubatch_size
            c.dbo_decode_token_threshold = 4
            c.dbo_prefill_token_threshold = 64
            c.disable_nccl_for_dp_synchronization = no_nccl
            out.append(c)
    return out


@contextlib.contextmanager
def _maybe(cm: Any, on: bool) -> Iterator[None]:
    if on:
        with cm:
            yield
    else:
        yield


# -- the cases --------------------------------------------------------------------------------


def worker_cases(ctx: dict[str, Any], rounds: int, seed: int, counts: dict[str, int]) -> list:
    """Every worker DP sync call shape; `counts[group]` += the collectives vLLM makes."""
    import numpy as np
    from vllm.config.compilation import CUDAGraphMode
    from vllm.forward_context import get_forward_context, set_forward_context
    from vllm.v1.worker import dp_utils as v1
    from vllm.v1.worker.gpu import dp_utils as v2
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor as Desc
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from coordd.vllm import early, patches

    rank, dp, group = ctx["dp_rank"], ctx["dp"], ctx["worker_group"]
    out: list = []

    def made(n: int = 1) -> None:
        counts[group] = counts.get(group, 0) + n

    for i in range(rounds):
        shared = random.Random(seed * 7919 + i)  # the same on every rank
        mine = random.Random(f"{seed}-{i}-{rank}")  # this rank's own load
        pc = shared.choice(ctx["variants"])
        all_idle = shared.random() < 0.08
        n = 0
        if not all_idle and mine.random() >= 0.1:
            n = mine.choice([mine.randint(1, 40), mine.randint(1, 700)])
        if not all_idle and shared.random() < 0.3:  # similar loads reach the ubatch branch
            n = shared.randint(64, 600) + mine.randint(0, 16)
        padded = n + (mine.randint(0, 40) if mine.random() < 0.5 else 0)
        mode = mine.randint(0, 2) if shared.random() < 0.7 else shared.randint(0, 2)
        skip = shared.random() < 0.08

        # V1 coordinate_batch_across_dp, the runner's keyword call shape (also under skip)
        with _maybe(v1.skip_dp_coordination(), skip):
            r = v1.coordinate_batch_across_dp(
                num_tokens_unpadded=n,
                parallel_config=pc,
                allow_microbatching=mine.random() < 0.7,
                num_tokens_padded=padded,
                uniform_decode=mine.random() < 0.5,
                cudagraph_mode=mode,
            )
        made(0 if skip else 1)
        out.append(("v1.coordinate_batch_across_dp", i, canon(r)))
        # ... the forward context's shape (no padded count, mode 0)
        r = v1.coordinate_batch_across_dp(
            num_tokens_unpadded=n, parallel_config=pc, allow_microbatching=False
        )
        made()
        out.append(("v1.coordinate_batch_across_dp[forward-context shape]", i, canon(r)))

        # V1 call sites, each through its own module's bound name
        runner = ctx["runner"]
        runner.parallel_config = pc
        args = dict(
            num_tokens=n,
            num_reqs=max(1, n // mine.randint(1, 4)),
            num_scheduled_tokens_np=np.zeros(1),
            max_num_scheduled_tokens=mine.choice([1, 2, 4]),
            allow_microbatching=mine.random() < 0.5,
        )
        if mine.random() < 0.6 and patches.overlapping():
            # the plugin's early start (coordd.vllm.runner.start_sync): the same function with
            # the same arguments in starting mode; the call below collects its round
            with contextlib.suppress(early.Started, early.NotStarted), early.StartingMode():
                GPUModelRunner._determine_batch_execution_and_padding(runner, **args)
        r = GPUModelRunner._determine_batch_execution_and_padding(runner, **args)
        made()
        out.append(("GPUModelRunner._determine_batch_execution_and_padding", i, canon(r)))
        for name in ("SpecDecodeBaseProposer", "ExtractHiddenStatesProposer"):
            proposer = ctx[name]
            r = type(proposer)._determine_batch_execution_and_padding(
                proposer, mine.randint(0, 300), use_cudagraphs=mine.random() < 0.8
            )
            made()
            out.append((f"{name}._determine_batch_execution_and_padding", i, canon(r)))
        with set_forward_context(None, ctx["cfg"], num_tokens=n):
            r = get_forward_context().dp_metadata
        made()
        out.append(("set_forward_context.dp_metadata", i, canon(r)))

        # Model Runner V2
        manager = ctx["manager"] if shared.random() < 0.85 else None
        uniform = mine.choice([None, 1, 2, 4]) if n else None
        if uniform and mine.random() < 0.6:
            uniform = shared.choice([1, 2, 4])
        num_reqs = max(1, n // (uniform or 1)) if n else 0
        max_query_len = mine.choice([None, uniform, mine.randint(1, 8)])
        desired = (
            manager.dispatch(num_reqs, n, uniform, num_active_loras=0, max_query_len=max_query_len)
            if manager is not None
            else Desc(cg_mode=CUDAGraphMode.NONE, num_tokens=n, num_reqs=num_reqs)
        )
        kw = dict(
            max_query_len=max_query_len,
            num_active_loras=mine.randint(0, 2),
            parallel_config=pc,
            allow_ubatching=mine.random() < 0.7,
            uniform_decode=uniform is not None,
        )
        skip_drafts = mine.random() < 0.6
        if ctx["v2_skip_drafts"]:  # vLLM 0.33 (0.32's MRV2 sync has no such row)
            kw["allow_skip_drafts"] = skip_drafts
        with _maybe(v1.skip_dp_coordination(), skip):
            r = v2.sync_cudagraph_and_dp_padding(
                manager, desired, n, num_reqs, uniform, dp, rank, **kw
            )
        made(0 if skip else 1)
        out.append(("v2.sync_cudagraph_and_dp_padding", i, canon(r)))
        r2 = v2.dispatch_cg_and_sync_dp(
            manager, num_reqs, n, uniform, dp, rank, need_eager=manager is None, **kw
        )
        made()
        out.append(("v2.dispatch_cg_and_sync_dp", i, canon(r2)))
        if r2[1] is not None:  # a speculator's shape: reuse the target's DPSyncState
            r3 = v2.dispatch_cg_and_sync_dp(
                ctx["manager"],
                num_reqs,
                int(r2[1].num_tokens_across_dp[rank]),
                r2[1].uniform_token_count,
                dp_size=dp,
                dp_rank=rank,
                need_eager=False,
                dp_sync_state=r2[1],
            )
            out.append(("v2.dispatch_cg_and_sync_dp[reused DPSyncState]", i, canon(r3)))
    return out


def engine_cases(ctx: dict[str, Any], rounds: int, seed: int, counts: dict[str, int]) -> list:
    """The engine-state syncs on the engine-core DP group (only ranks that hold one)."""
    from vllm.config import ParallelConfig

    group = ctx.get("engine_group")
    if group is None:
        return []
    rank, pc = ctx["dp_rank"], ctx["pc"]
    out: list = []
    for i in range(rounds):
        shared = random.Random(seed * 104729 + i)
        mine = random.Random(f"engine-{seed}-{i}-{rank}")
        r = pc.sync_dp_state(
            group,
            has_unfinished=mine.random() < 0.3,
            pending_pause=shared.random() < 0.5 and mine.random() < 0.8,
        )
        out.append(("ParallelConfig.sync_dp_state", i, canon(r)))
        r = ParallelConfig.has_unfinished_dp(group, mine.random() < 0.3)
        out.append(("ParallelConfig.has_unfinished_dp", i, canon(r)))
        made = 2
        if i % 4 == 0:
            r = ParallelConfig.sync_kv_cache_memory_size(
                group, mine.choice([-1, mine.randint(1, 1 << 40)])
            )
            out.append(("ParallelConfig.sync_kv_cache_memory_size", i, canon(r)))
            made += 1
        counts[ENGINE] = counts.get(ENGINE, 0) + made
    return out


def _skip_test(ctx: dict[str, Any], spec: RankSpec) -> tuple[Any, ...]:
    """The skip rank leaves out one drafter sync and goes on to the runner's; every rank must
    get a typed error naming it, well before any timeout."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from coordd.proto.errors import CoordError, StepMismatch

    began = time.monotonic()
    proposer, runner = ctx["SpecDecodeBaseProposer"], ctx["runner"]
    try:
        if ctx["dp_rank"] == spec.skip_rank:
            time.sleep(spec.skip_delay)  # the others open the round with the drafter's site
        else:
            type(proposer)._determine_batch_execution_and_padding(proposer, 7)
        GPUModelRunner._determine_batch_execution_and_padding(
            runner,
            num_tokens=5,
            num_reqs=5,
            num_scheduled_tokens_np=None,
            max_num_scheduled_tokens=1,
        )
        return ("no error", time.monotonic() - began)
    except StepMismatch as e:
        return ("StepMismatch", e.rank, e.expected_kind, e.got_kind, time.monotonic() - began)
    except CoordError as e:
        return (type(e).__name__, str(e), time.monotonic() - began)


def rank_main(spec: RankSpec, cfg: Any, queue: Any) -> None:
    """Spawned entry point: set up vLLM's distributed state, run both passes, report."""
    result = RankResult(spec.idx)
    try:
        _run(spec, cfg, result)
    except BaseException:
        result.error = traceback.format_exc()
    finally:
        try:
            from coordd.vllm import patches

            patches.uninstall()
        except Exception:
            pass
        queue.put(result)


def _run(spec: RankSpec, cfg: Any, result: RankResult) -> None:
    import torch

    torch.set_num_threads(1)
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu import dp_utils as v2_dp_utils
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from coordd.vllm import patches
    from coordd.vllm.enable import PluginSettings

    began = time.monotonic()
    dp_rank, tp_rank = divmod(spec.idx, spec.tp)
    result.dp_rank, result.tp_rank = dp_rank, tp_rank
    pc = cfg.parallel_config
    pc.data_parallel_rank = pc.data_parallel_rank_local = dp_rank
    # vLLM 0.32's CPU communicator names its shared-memory group from this (its CPU worker
    # sets it before init): one name per DP rank's TP group, unique to this test run
    os.environ.setdefault("VLLM_DIST_IDENT", f"coordd-test-{os.getppid()}-dp{dp_rank}")
    with set_current_vllm_config(cfg):
        ps.init_distributed_environment(
            world_size=spec.tp,
            rank=tp_rank,
            local_rank=spec.idx,
            backend="gloo",
            distributed_init_method=None,
        )
        ps.initialize_model_parallel(spec.tp, 1, backend="gloo")
        # the engine cores' group: one per DP rank (the TP rank 0 process plays it here)
        engine_group = pc.stateless_init_dp_group() if tp_rank == 0 else None
        from coordd.vllm.groups import worker_group

        ctx: dict[str, Any] = dict(
            dp_rank=ps.get_dp_group().rank_in_group,
            dp=pc.data_parallel_size,
            cfg=cfg,
            pc=pc,
            variants=_config_variants(pc),
            engine_group=engine_group,
            manager=StubGraphManager(),
            worker_group=worker_group().name,
            v2_skip_drafts="allow_skip_drafts"
            in inspect.signature(v2_dp_utils.sync_cudagraph_and_dp_padding).parameters,
        )
        result.worker_group = ctx["worker_group"]
        ctx["runner"] = _bare(
            GPUModelRunner,
            uniform_decode_query_len=1,
            cudagraph_dispatcher=StubDispatcher(),
            model_config=types.SimpleNamespace(is_encoder_decoder=False),
            input_batch=types.SimpleNamespace(lora_id_to_lora_request={}),
            vllm_config=cfg,
            parallel_config=pc,
        )
        for cls in (SpecDecodeBaseProposer, ExtractHiddenStatesProposer):
            ctx[cls.__name__] = _bare(
                cls, cudagraph_dispatcher=StubDispatcher(), vllm_config=cfg, dp_rank=dp_rank
            )
        parts = {"worker": worker_cases, "engine": engine_cases}
        result.timings["setup"] = time.monotonic() - began

        t = time.monotonic()
        for _, names in spec.phases:  # vLLM's own collectives (gloo)
            for name in names:
                result.ref += parts[name](ctx, spec.rounds, spec.seed, {})
        result.timings["gloo pass"] = time.monotonic() - t

        t = time.monotonic()
        for address, names in spec.phases:  # the same calls through coordd
            settings = PluginSettings(address, connect_timeout=30, sync_timeout=60, overlap=True)
            assert patches.install(settings)
            for name in names:
                result.got += parts[name](ctx, spec.rounds, spec.seed, result.expected_rounds)
            exchange = patches.exchange()
            assert exchange is not None
            for group, n in exchange.rounds().items():
                key = ENGINE if group == ENGINE else group
                result.rounds[key] = result.rounds.get(key, 0) + n
            patches.uninstall()
        result.timings["coordd pass"] = time.monotonic() - t

        if spec.skip_rank is not None:
            address = spec.phases[0][0]
            assert patches.install(PluginSettings(address, connect_timeout=30, sync_timeout=60))
            result.skip = _skip_test(ctx, spec)
            patches.uninstall()
