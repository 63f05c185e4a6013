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

The rules, each with the vLLM 0.33 source it mirrors (the policy itself lives in
proto/policy.py, so the coordd path and the device path apply the very same code):

- dp = 1 returns at once, `(False, None, cudagraph_mode)` with the mode exactly as passed (an
  enum stays that enum), and talks to no one (`coordinate_batch_across_dp`'s early exit).
- Under `skip_dp_coordination()` (vLLM's, vllm/v1/worker/dp_utils.py, entered by elastic EP
  while it re-warms kernels; or this module's own) the call answers locally with no round, as
  vLLM does: every rank's entry is this rank's padded count, the mode is returned as passed,
  and micro-batching is this rank's vote unless its own last micro-batch would be empty.
- A rank's micro-batching vote is off unless micro-batching is allowed for the call and enabled
  for the group (`use_ubatching`: `enable_dbo` or `ubatch_size > 1`); otherwise it is
  `num_tokens_unpadded >= dbo_decode_token_threshold` for a uniform decode batch and
  `>= dbo_prefill_token_threshold` for any other, always on the *unpadded* count
  (vllm/v1/worker/ubatch_utils.py, `check_ubatch_thresholds`; vllm/config/parallel.py for the
  settings and their defaults 32 and 512).
- The group micro-batches only if every rank voted yes and the last micro-batch of the padded
  split is not empty: `(max_padded // n) * (n - 1) >= min_unpadded` vetoes it
  (`_post_process_ubatch` in dp_utils.py; `is_last_ubatch_empty` in ubatch_utils.py), with
  `n = num_ubatches` (2 with `enable_dbo`, else `ubatch_size`: vllm/config/parallel.py).
- The CUDA-graph mode is the minimum over ranks (`_post_process_cudagraph_mode`), an int.
- Padding is on when the synced mode is not NONE or the group micro-batches; then every rank's
  entry is the maximum padded count, else each rank's own padded count
  (`_post_process_dp_padding`); the result is an int32 CPU tensor (a list without torch).
- A dead rank (coordd's elastic mode, `--on-rank-loss neutralize`; vLLM has no counterpart)
  counts as neutral: it never lowers a minimum, never vetoes, never raises the maximum.
- The drafter's own agreement (`SpecDecodeBaseProposer._determine_batch_execution_and_padding`
  in vllm/v1/spec_decode/llm_base_proposer.py, and the same method of
  `ExtractHiddenStatesProposer` in extract_hidden_states.py) never micro-batches and
  re-dispatches with the synced mode at its own entry of the agreed counts; here it is a round
  of kind "draft" (`coordinate_draft_batch_across_dp`, which returns that mode and that count),
  so a rank that skips it makes every rank raise `StepMismatch` at once instead of hanging.
- The DP engine loop's state sync (`ParallelConfig.sync_dp_state` in vllm/config/parallel.py)
  runs on step 1 and then every `dp_sync_interval` steps (default 16; `_has_global_unfinished_reqs`
  in vllm/v1/engine/core.py) and is a round of kind "state" here (`sync_dp_state` for one
  round, `has_global_unfinished_reqs` for the loop's interval rule). Every forward and draft
  decision carries `any_unfinished` and `should_pause` too (`handle.decision`), so an engine can
  drop the separate collective altogether.

The adapter takes any client with `start(report, kind) -> pending` and `pending.wait(timeout)`:
`coordd.client.sync.CoordClient`, or the device-path client, which has the same surface.
"""

# Whole though over 500 lines: it is vLLM's one call surface (the adapter, its pending
# round, the module-level calls), and no part of it means anything without the others.

from __future__ import annotations

import enum
import hashlib
import operator
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import Any, NamedTuple, Protocol

from coordd.proto.errors import InvalidReport
from coordd.proto.messages import StepDecision, StepKind, StepReport
from coordd.proto.policy import decision_misfit, last_ubatch_empty

CUDAGRAPH_NONE, CUDAGRAPH_PIECEWISE, CUDAGRAPH_FULL = 0, 1, 2

#: What `coordinate_batch_across_dp` returns: (should_ubatch, num_tokens_after_padding,
#: synced_cudagraph_mode); the middle one is an int32 CPU tensor, a list of ints, or None (dp=1);
#: the mode is an int after a round, and exactly what was passed at dp=1 or under skip.
VllmResult = tuple[bool, Any, Any]

#: vLLM's module that holds its `skip_dp_coordination` context variable.
VLLM_DP_UTILS = "vllm.v1.worker.dp_utils"

_skip_dp_coordination: ContextVar[bool] = ContextVar("coordd_skip_dp_coordination", default=False)


@contextmanager
def skip_dp_coordination() -> Iterator[None]:
    """Answer every DP agreement locally, with no round (vLLM's `skip_dp_coordination`, for
    engines that do not run vLLM's own; inside vLLM, vLLM's context manager is honoured too)."""
    token = _skip_dp_coordination.set(True)
    try:
        yield
    finally:
        _skip_dp_coordination.reset(token)


def should_skip_dp_coordination() -> bool:
    """True inside this module's `skip_dp_coordination()` or vLLM's.

    vLLM's flag is read through `vllm.v1.worker.dp_utils.should_skip_dp_coordination` only when
    that module is already imported: its context manager lives there, so it cannot be active
    otherwise, and importing vLLM just to ask would cost seconds.
    """
    if _skip_dp_coordination.get():
        return True
    dp_utils = sys.modules.get(VLLM_DP_UTILS)
    probe = getattr(dp_utils, "should_skip_dp_coordination", None)
    return bool(probe()) if callable(probe) else False


class PendingDecision(Protocol):
    def wait(self, timeout: float | None = None) -> StepDecision: ...


class StepClient(Protocol):
    """What the adapter needs of a client (CoordClient and the device-path client have it)."""

    def start(self, report: StepReport, kind: StepKind | str = ...) -> PendingDecision: ...


@dataclass(frozen=True)
class DPGroupConfig:
    """The group-wide settings the agreement depends on; ranks must share them at join.

    The fields are vLLM's `ParallelConfig` names (vllm/config/parallel.py), with its defaults.
    `extra_fingerprint` lets an engine bind more of its config (model, dtype...) to the group.
    """

    data_parallel_size: int
    enable_dbo: bool = False
    ubatch_size: int = 0
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512
    extra_fingerprint: str = ""
    #: The engine loop's state sync runs on step 1 and every this many steps (vLLM's default).
    dp_sync_interval: int = 16

    def __post_init__(self) -> None:
        for name, low in (
            ("data_parallel_size", 1),
            ("ubatch_size", 0),
            ("dbo_decode_token_threshold", 0),
            ("dbo_prefill_token_threshold", 0),
            ("dp_sync_interval", 1),
        ):
            value = getattr(self, name)
            if type(value) is not int or value < low:
                raise ValueError(f"DPGroupConfig.{name}: expected an int >= {low}, got {value!r}")

    @classmethod
    def from_parallel_config(
        cls, parallel_config: Any, extra_fingerprint: str = ""
    ) -> DPGroupConfig:
        """Read the settings off a vLLM `ParallelConfig` (or anything with those attributes)."""
        return cls(
            data_parallel_size=int(parallel_config.data_parallel_size),
            enable_dbo=bool(getattr(parallel_config, "enable_dbo", False)),
            ubatch_size=int(getattr(parallel_config, "ubatch_size", 0)),
            dbo_decode_token_threshold=int(
                getattr(parallel_config, "dbo_decode_token_threshold", 32)
            ),
            dbo_prefill_token_threshold=int(
                getattr(parallel_config, "dbo_prefill_token_threshold", 512)
            ),
            extra_fingerprint=extra_fingerprint,
            dp_sync_interval=int(getattr(parallel_config, "dp_sync_interval", 16)),
        )

    @property
    def use_ubatching(self) -> bool:
        """vllm/config/parallel.py: micro-batching is on with DBO or an ubatch_size above 1."""
        return self.enable_dbo or self.ubatch_size > 1

    @property
    def num_ubatches(self) -> int:
        """vllm/config/parallel.py: 2 with DBO, else ubatch_size (at least 1 on the wire)."""
        return 2 if self.enable_dbo else max(1, self.ubatch_size)

    def fingerprint(self) -> str:
        """A short digest of every field; coordd rejects a rank whose digest differs."""
        text = ";".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return "vllm-dp1-" + hashlib.sha256(text.encode()).hexdigest()[:24]

    def client_options(self) -> dict[str, Any]:
        """The keyword arguments a client needs to register with this group."""
        return {
            "dp_size": self.data_parallel_size,
            "config_fingerprint": self.fingerprint(),
            "num_ubatches": self.num_ubatches,
        }


def wants_microbatching(
    config: DPGroupConfig, num_tokens_unpadded: int, uniform_decode: bool
) -> bool:
    """One rank's vote (vllm/v1/worker/ubatch_utils.py, `check_ubatch_thresholds`)."""
    if not config.use_ubatching:
        return False
    if uniform_decode:
        return num_tokens_unpadded >= config.dbo_decode_token_threshold
    return num_tokens_unpadded >= config.dbo_prefill_token_threshold


def _count(rank: int, name: str, value: Any) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidReport(rank, name, value, "an int") from None


def _mode(rank: int, value: Any) -> int:
    """A runtime CUDA-graph mode: an int 0..2 or an enum whose value is one."""
    raw = getattr(value, "value", value)
    if type(raw) is bool or not isinstance(raw, int):
        raise InvalidReport(rank, "cudagraph_mode", value, "0 (NONE), 1 (PIECEWISE) or 2 (FULL)")
    return int(raw)


def build_report(
    config: DPGroupConfig,
    num_tokens_unpadded: int,
    allow_microbatching: bool,
    num_tokens_padded: int | None = None,
    uniform_decode: bool | None = None,
    cudagraph_mode: Any = CUDAGRAPH_NONE,
    *,
    dp_rank: int = -1,
    has_unfinished: bool | None = None,
    want_pause: bool = False,
) -> StepReport:
    """This rank's report for one round, from vLLM's arguments (dp_utils.py's column)."""
    tokens = _count(dp_rank, "num_tokens_unpadded", num_tokens_unpadded)
    padded = (
        tokens
        if num_tokens_padded is None
        else _count(dp_rank, "num_tokens_padded", num_tokens_padded)
    )
    want_ubatch = False
    if allow_microbatching:
        if uniform_decode is None:
            raise InvalidReport(
                dp_rank, "uniform_decode", None, "a bool when allow_microbatching is True"
            )
        want_ubatch = wants_microbatching(config, tokens, bool(uniform_decode))
    return StepReport(
        num_tokens=tokens,
        num_tokens_padded=padded,
        want_ubatch=want_ubatch,
        cudagraph_mode=_mode(dp_rank, cudagraph_mode),
        has_unfinished=tokens > 0 if has_unfinished is None else bool(has_unfinished),
        want_pause=bool(want_pause),
    )


def _load_torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def _counts(values: list[int], torch_module: Any) -> Any:
    if torch_module is None:
        return values
    return torch_module.tensor(values, dtype=torch_module.int32, device="cpu")


def vllm_result(decision: StepDecision, torch_module: Any = None) -> VllmResult:
    """The decision in vLLM's return shape (`_synchronize_dp_ranks` in dp_utils.py)."""
    across = _counts(list(decision.num_tokens_across_dp), torch_module)
    return decision.should_ubatch, across, decision.cudagraph_mode


def local_result(
    config: DPGroupConfig, report: StepReport, cudagraph_mode: Any, torch_module: Any = None
) -> VllmResult:
    """vLLM's answer under `skip_dp_coordination()` (dp_utils.py): this rank alone decides,
    every entry is its padded count, the mode comes back as passed."""
    # vLLM's `is_last_ubatch_empty` on this rank alone: the one rule, proto's, by keyword
    should_ubatch = report.want_ubatch and not last_ubatch_empty(
        max_padded=report.num_tokens_padded,
        min_tokens=report.num_tokens,
        num_ubatches=config.num_ubatches,
    )
    across = _counts([report.num_tokens_padded] * config.data_parallel_size, torch_module)
    return should_ubatch, across, cudagraph_mode


class DPState(NamedTuple):
    """`sync_dp_state`'s answer, as vLLM's (vllm/config/parallel.py) gives it."""

    #: Some rank has work, or some but not all ranks wait to pause (so none stops alone).
    has_unfinished: bool
    #: Every live rank wants to pause.
    pause_consensus: bool


#: What the engine loop assumes between two state syncs (vLLM's `_has_global_unfinished_reqs`
#: returns True on those steps): the group is busy, no pause agreed.
BETWEEN_STATE_SYNCS = DPState(has_unfinished=True, pause_consensus=False)


class DraftBatch(NamedTuple):
    """The drafter's agreed batch, in the order vLLM 0.33's
    `SpecDecodeBaseProposer._determine_batch_execution_and_padding` returns it."""

    #: The synced mode the drafter re-dispatches with (the caller's enum class if it passed an
    #: enum, else an int); at dp=1 the mode exactly as passed.
    cudagraph_mode: Any
    #: This rank's own entry of the agreed counts (not rank 0's: unpadded counts differ).
    num_tokens_padded: int
    #: The agreed counts (int32 CPU tensor, or a list without torch); None at dp=1.
    num_tokens_across_dp: Any


def state_report(has_unfinished: bool, pending_pause: bool) -> StepReport:
    """A state round's report: no batch (0 tokens), this rank's work and pause wish."""
    return StepReport(
        num_tokens=0,
        num_tokens_padded=0,
        has_unfinished=bool(has_unfinished),
        want_pause=bool(pending_pause),
    )


def dp_state(decision: StepDecision) -> DPState:
    """vLLM's rule: work anywhere, or a pause that not every rank wants yet, keeps all running.

    `any_unfinished` is "some rank has work"; `any_pause` "some rank waits to pause";
    `should_pause` "every rank waits to pause".
    """
    pause_pending_somewhere = decision.any_pause and not decision.should_pause
    return DPState(decision.any_unfinished or pause_pending_somewhere, decision.should_pause)


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
