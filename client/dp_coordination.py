"""The vLLM-shaped adapter: vLLM's per-step DP agreement calls, answered by coordd policy rounds.

This is the API for engines that use coordd's start/finish split. (Stock vLLM needs none of it:
the `coordd.vllm` plugin routes vLLM's own all-reduces through coordd gather rounds.)

vLLM 0.33 agrees on each step's batch shape with `coordinate_batch_across_dp`
(vllm/v1/worker/dp_utils.py): one int32 all-reduce of a 4 x dp matrix, after which every rank
applies the same rules. This module keeps that call's exact signature, keywords included
(`num_tokens_unpadded, allow_microbatching, parallel_config, num_tokens_padded=None,
uniform_decode=None, cudagraph_mode=0`) and its `(should_ubatch, num_tokens_after_padding,
synced_cudagraph_mode)` result, and adds the split (`start_dp_coordination_async` now,
`finish_dp_coordination` after the GPU work), so an engine swaps the collective for a coordd round
without rethinking its step loop. tests/unit/test_vllm_signatures.py pins the signatures.

The rules it follows, each with the vLLM 0.33 source it mirrors, and their pure part (the report,
the local answer under skip, the result shapes) are in client/_vllm_rules.py; this module runs
the rounds and re-exports every name from there, so `coordd.client.dp_coordination` stays the
one import path.

The adapter takes any client with `start(report, kind) -> pending` and `pending.wait(timeout)`:
`coordd.client.sync.CoordClient`, or the device-path client, which has the same surface.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Protocol

from coordd.client._vllm_rules import (
    BETWEEN_STATE_SYNCS,
    CUDAGRAPH_FULL,
    CUDAGRAPH_NONE,
    CUDAGRAPH_PIECEWISE,
    VLLM_DP_UTILS,
    DPGroupConfig,
    DPState,
    DraftBatch,
    VllmResult,
    _count,
    build_report,
    dp_state,
    local_result,
    should_skip_dp_coordination,
    skip_dp_coordination,
    state_report,
    vllm_result,
    wants_microbatching,
)
from coordd.proto.messages import StepDecision, StepKind, StepReport
from coordd.proto.policy import decision_misfit, last_ubatch_empty


class PendingDecision(Protocol):
    def wait(self, timeout: float | None = None) -> StepDecision: ...


class StepClient(Protocol):
    """What the adapter needs of a client (CoordClient and the device-path client have it)."""

    def start(self, report: StepReport, kind: StepKind | str = ...) -> PendingDecision: ...


def _load_torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


class DPCoordinationHandle:
    """A started round: pass it to `finish_dp_coordination` once the overlapped work is done.

    A call answered locally (dp=1, or under `skip_dp_coordination()`) has no round: it is done
    at once and its `decision` stays None.
    """

    __slots__ = ("_adapter", "_pending", "_result", "decision", "kind", "report")

    def __init__(
        self,
        adapter: VllmAdapter,
        report: StepReport,
        kind: StepKind,
        pending: PendingDecision | None,
        result: VllmResult | None = None,
    ) -> None:
        self._adapter = adapter
        self._pending = pending
        self._result = result
        self.report = report
        self.kind = kind
        #: The full decision (any_unfinished, should_pause, dead_ranks...) once finished.
        self.decision: StepDecision | None = None

    def done(self) -> bool:
        """True if finishing would not block (the decision or an error is in)."""
        if self._result is not None or self._pending is None:
            return True
        done = getattr(self._pending, "done", None)
        return bool(done()) if done is not None else False

    def finish(self, timeout: float | None = None) -> VllmResult:
        """The agreed result; raises the round's typed error. Idempotent."""
        if self._result is None:
            assert self._pending is not None
            decision = self._pending.wait(timeout)
            adapter = self._adapter
            # Checked against this rank's report whatever the client (coordd's clients check it
            # too; a device-path or other client may not): a count past int32 would otherwise
            # come out of torch as a bare RuntimeError, a wrong one as a wrong batch.
            error = decision_misfit(
                decision, self.report, adapter.dp_rank, adapter.config.data_parallel_size, self.kind
            )
            if error is not None:
                raise error
            self.decision = decision
            adapter.last_decision = decision
            self._result = vllm_result(decision, adapter.torch_module)
        return self._result


class VllmAdapter:
    """One DP rank's vLLM-shaped view of coordd (or of the device path)."""

    def __init__(
        self,
        config: DPGroupConfig,
        client: StepClient | None = None,
        *,
        dp_rank: int = 0,
        as_tensor: bool | None = None,
    ) -> None:
        if config.data_parallel_size > 1 and client is None:
            raise ValueError(
                f"dp={config.data_parallel_size} needs a client (CoordClient or the device-path "
                "client); only dp=1 runs without one"
            )
        if not 0 <= dp_rank < config.data_parallel_size:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..{config.data_parallel_size - 1}")
        self.config = config
        self.client = client
        self.dp_rank = dp_rank
        #: torch when results are tensors (`as_tensor` True, or None and torch importable).
        self.torch_module: Any = None
        if as_tensor or as_tensor is None:
            self.torch_module = _load_torch()
            if as_tensor and self.torch_module is None:
                raise ImportError("as_tensor=True needs torch")
        self.last_decision: StepDecision | None = None
        #: Steps seen by `has_global_unfinished_reqs` (vLLM's `step_counter`).
        self.step_counter = 0

    @classmethod
    def connect(
        cls,
        config: DPGroupConfig,
        dp_rank: int,
        address: str | None = None,
        *,
        as_tensor: bool | None = None,
        connect_timeout: float = 10.0,
        client_factory: Callable[..., Any] | None = None,
        **client_kwargs: Any,
    ) -> VllmAdapter:
        """Register a client for `dp_rank` with the group's settings; dp=1 needs none.

        `client_factory(address, dp_rank=, dp_size=, config_fingerprint=, num_ubatches=,
        **client_kwargs)` builds the client: `CoordClient` by default; the path-choosing
        factory (`coordd.client._factory.connect_coordinator`) takes the same arguments.
        """
        if config.data_parallel_size == 1:
            return cls(config, None, dp_rank=dp_rank, as_tensor=as_tensor)
        if client_factory is None:
            from coordd.client.sync import CoordClient

            client_factory = CoordClient
        client = client_factory(
            address, dp_rank=dp_rank, **config.client_options(), **client_kwargs
        )
        try:
            client.connect(timeout=connect_timeout)
        except BaseException:
            client.close()
            raise
        return cls(config, client, dp_rank=dp_rank, as_tensor=as_tensor)

    def close(self) -> None:
        close = getattr(self.client, "close", None)
        if close is not None:
            close()

    def check_parallel_config(self, parallel_config: Any) -> None:
        """vLLM passes its `ParallelConfig`; it must describe this adapter's group and rank.

        Raises TypeError for something that is not one (an int here means a caller passed
        `num_tokens_padded` third, where vLLM's signature has `parallel_config`), ValueError when
        its DP size or rank differs from the adapter's.
        """
        if parallel_config is None:
            return
        size = getattr(parallel_config, "data_parallel_size", None)
        if type(size) is not int:
            raise TypeError(
                "parallel_config: expected vLLM's ParallelConfig (with data_parallel_size) or "
                f"None, got {parallel_config!r}; vLLM's order is (num_tokens_unpadded, "
                "allow_microbatching, parallel_config, num_tokens_padded, uniform_decode, "
                "cudagraph_mode)"
            )
        if size != self.config.data_parallel_size:
            raise ValueError(
                f"parallel_config.data_parallel_size is {size}, but this adapter's group has "
                f"dp={self.config.data_parallel_size}"
            )
        rank = getattr(parallel_config, "data_parallel_rank", None)
        if type(rank) is int and size > 1 and rank != self.dp_rank:
            raise ValueError(
                f"parallel_config.data_parallel_rank is {rank}, but this adapter is dp_rank "
                f"{self.dp_rank}"
            )

    # -- vLLM's calls -------------------------------------------------------------------------

    def start_dp_coordination_async(
        self,
        num_tokens_unpadded: int,
        allow_microbatching: bool,
        parallel_config: Any = None,
        num_tokens_padded: int | None = None,
        uniform_decode: bool | None = None,
        cudagraph_mode: Any = CUDAGRAPH_NONE,
        *,
        has_unfinished: bool | None = None,
        want_pause: bool = False,
        kind: StepKind | str = StepKind.FORWARD,
    ) -> DPCoordinationHandle:
        """Send this rank's report now; the exchange overlaps whatever runs until `finish`.

        The arguments are vLLM's `coordinate_batch_across_dp`'s; `parallel_config` may be None
        (the adapter has its group's settings) and is otherwise checked against them.
        """
        kind = StepKind(kind)
        self.check_parallel_config(parallel_config)
        if self.config.data_parallel_size == 1:
            report = StepReport(
                num_tokens=0, num_tokens_padded=0, want_pause=bool(want_pause), kind=kind
            )
            return DPCoordinationHandle(self, report, kind, None, (False, None, cudagraph_mode))
        report = build_report(
            self.config,
            num_tokens_unpadded,
            allow_microbatching,
            num_tokens_padded,
            uniform_decode,
            cudagraph_mode,
            dp_rank=self.dp_rank,
            has_unfinished=has_unfinished,
            want_pause=want_pause,
        )
        if should_skip_dp_coordination():
            result = local_result(self.config, report, cudagraph_mode, self.torch_module)
            return DPCoordinationHandle(self, report, kind, None, result)
        assert self.client is not None
        return DPCoordinationHandle(self, report, kind, self.client.start(report, kind))

    def finish_dp_coordination(
        self, handle: DPCoordinationHandle, timeout: float | None = None
    ) -> VllmResult:
        """The agreed `(should_ubatch, num_tokens_after_padding, synced_cudagraph_mode)`."""
        return handle.finish(timeout)

    def coordinate_batch_across_dp(
        self,
        num_tokens_unpadded: int,
        allow_microbatching: bool,
        parallel_config: Any = None,
        num_tokens_padded: int | None = None,
        uniform_decode: bool | None = None,
        cudagraph_mode: Any = CUDAGRAPH_NONE,
        *,
        has_unfinished: bool | None = None,
        want_pause: bool = False,
        kind: StepKind | str = StepKind.FORWARD,
        timeout: float | None = None,
    ) -> VllmResult:
        """vLLM's blocking call (same arguments): start and finish in one."""
        handle = self.start_dp_coordination_async(
            num_tokens_unpadded,
            allow_microbatching,
            parallel_config,
            num_tokens_padded,
            uniform_decode,
            cudagraph_mode,
            has_unfinished=has_unfinished,
            want_pause=want_pause,
            kind=kind,
        )
        return handle.finish(timeout)

    def coordinate_draft_batch_across_dp(
        self,
        num_tokens_unpadded: int,
        num_tokens_padded: int,
        cudagraph_mode: Any = CUDAGRAPH_NONE,
        *,
        parallel_config: Any = None,
        timeout: float | None = None,
    ) -> DraftBatch:
        """The drafter's round (kind "draft"), as vLLM 0.33's
        `SpecDecodeBaseProposer._determine_batch_execution_and_padding` (llm_base_proposer.py)
        and `ExtractHiddenStatesProposer`'s make it: never micro-batches; returns the synced
        mode to re-dispatch with, this rank's own entry of the agreed counts, and the counts.
        At dp=1 there is no round, as in vLLM: the mode and count as passed, counts None."""
        if self.config.data_parallel_size == 1:
            self.check_parallel_config(parallel_config)
            return DraftBatch(
                cudagraph_mode, _count(self.dp_rank, "num_tokens_padded", num_tokens_padded), None
            )
        _, across, synced = self.coordinate_batch_across_dp(
            num_tokens_unpadded,
            False,
            parallel_config,
            num_tokens_padded,
            None,
            cudagraph_mode,
            kind=StepKind.DRAFT,
            timeout=timeout,
        )
        if isinstance(cudagraph_mode, enum.Enum) and not isinstance(synced, enum.Enum):
            synced = type(cudagraph_mode)(synced)  # vLLM: CUDAGraphMode(synced_cudagraph_mode)
        return DraftBatch(synced, int(across[self.dp_rank]), across)

    def has_unfinished_dp(self, has_unfinished: bool, timeout: float | None = None) -> bool:
        """Does any live rank have unfinished requests? A state round in place of vLLM's
        `ParallelConfig.has_unfinished_dp` MAX all-reduce (vllm/config/parallel.py)."""
        if self.config.data_parallel_size == 1 or should_skip_dp_coordination():
            return bool(has_unfinished)
        report = StepReport(num_tokens=0, num_tokens_padded=0, has_unfinished=bool(has_unfinished))
        return self._state_round(report, timeout).any_unfinished

    def sync_dp_state(
        self, has_unfinished: bool, pending_pause: bool, timeout: float | None = None
    ) -> DPState:
        """vLLM's `ParallelConfig.sync_dp_state` (vllm/config/parallel.py): one state round
        answers whether the group still has work and whether it pauses. vLLM's engine loop
        calls it on step 1 and every `dp_sync_interval` steps: `has_global_unfinished_reqs`."""
        if self.config.data_parallel_size == 1:
            return DPState(bool(has_unfinished), bool(pending_pause))
        report = state_report(has_unfinished, pending_pause)
        return dp_state(self._state_round(report, timeout))

    def has_global_unfinished_reqs(
        self, has_unfinished: bool, pending_pause: bool = False, timeout: float | None = None
    ) -> DPState:
        """The DP engine loop's rule (`DPEngineCoreProc._has_global_unfinished_reqs`,
        vllm/v1/engine/core.py): a state round on step 1 and then every `dp_sync_interval`
        steps (default 16); on the steps between, no round and `BETWEEN_STATE_SYNCS`."""
        self.step_counter += 1
        if self.step_counter != 1 and self.step_counter % self.config.dp_sync_interval != 0:
            return BETWEEN_STATE_SYNCS
        return self.sync_dp_state(has_unfinished, pending_pause, timeout)

    def _state_round(self, report: StepReport, timeout: float | None) -> StepDecision:
        assert self.client is not None
        pending = self.client.start(report, StepKind.STATE)
        handle = DPCoordinationHandle(self, report, StepKind.STATE, pending)
        handle.finish(timeout)
        assert handle.decision is not None
        return handle.decision


# -- the module-level binding: vLLM calls free functions, one rank per process ---------------

_bound: VllmAdapter | None = None


class AdapterNotBound(RuntimeError):
    """A module-level call came before `bind()` (and named no adapter)."""


def bind(adapter: VllmAdapter | None) -> None:
    """Make `adapter` the one the module-level functions use (None unbinds)."""
    global _bound
    _bound = adapter


def bound() -> VllmAdapter:
    if _bound is None:
        raise AdapterNotBound(
            "no adapter bound: call coordd.client.dp_coordination.bind("
            "VllmAdapter.connect(config, dp_rank)) "
            "once per rank process, or pass adapter="
        )
    return _bound


def _single_rank(parallel_config: Any) -> bool:
    return getattr(parallel_config, "data_parallel_size", None) == 1


def coordinate_batch_across_dp(
    num_tokens_unpadded: int,
    allow_microbatching: bool,
    parallel_config: Any,
    num_tokens_padded: int | None = None,
    uniform_decode: bool | None = None,
    cudagraph_mode: Any = CUDAGRAPH_NONE,
    *,
    adapter: VllmAdapter | None = None,
    **options: Any,
) -> VllmResult:
    """vLLM's `coordinate_batch_across_dp`, same signature, answered by the bound adapter (or
    `adapter`). dp=1 (by `parallel_config`) returns at once, as vLLM does, even unbound."""
    if adapter is None and _single_rank(parallel_config):
        return False, None, cudagraph_mode
    return (adapter or bound()).coordinate_batch_across_dp(
        num_tokens_unpadded,
        allow_microbatching,
        parallel_config,
        num_tokens_padded,
        uniform_decode,
        cudagraph_mode,
        **options,
    )


def start_dp_coordination_async(
    num_tokens_unpadded: int,
    allow_microbatching: bool,
    parallel_config: Any,
    num_tokens_padded: int | None = None,
    uniform_decode: bool | None = None,
    cudagraph_mode: Any = CUDAGRAPH_NONE,
    *,
    adapter: VllmAdapter | None = None,
    **options: Any,
) -> DPCoordinationHandle:
    """Start this step's round (`coordinate_batch_across_dp`'s arguments); returns a handle
    at once."""
    return (adapter or bound()).start_dp_coordination_async(
        num_tokens_unpadded,
        allow_microbatching,
        parallel_config,
        num_tokens_padded,
        uniform_decode,
        cudagraph_mode,
        **options,
    )


def finish_dp_coordination(
    handle: DPCoordinationHandle, timeout: float | None = None
) -> VllmResult:
    """The same tuple `coordinate_batch_across_dp` returns, for a started round."""
    return handle.finish(timeout)


__all__ = [
    "BETWEEN_STATE_SYNCS",
    "CUDAGRAPH_FULL",
    "CUDAGRAPH_NONE",
    "CUDAGRAPH_PIECEWISE",
    "VLLM_DP_UTILS",
    "AdapterNotBound",
    "DPCoordinationHandle",
    "DPGroupConfig",
    "DPState",
    "DraftBatch",
    "StepClient",
    "VllmAdapter",
    "bind",
    "bound",
    "build_report",
    "coordinate_batch_across_dp",
    "dp_state",
    "finish_dp_coordination",
    "last_ubatch_empty",
    "local_result",
    "should_skip_dp_coordination",
    "skip_dp_coordination",
    "start_dp_coordination_async",
    "state_report",
    "vllm_result",
    "wants_microbatching",
]
