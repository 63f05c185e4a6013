"""vLLM 0.33's per-step DP agreement rules, mirrored: the pure half of the adapter.

No client, no socket, no round here: the group's settings (`DPGroupConfig`), a rank's report from
vLLM's arguments, the local answer under skip, and the decision in vLLM's return shapes.
client/dp_coordination.py is the adapter that runs rounds with them (and re-exports them).

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
"""

from __future__ import annotations

import hashlib
import operator
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from coordd.proto.errors import InvalidReport
from coordd.proto.messages import StepDecision, StepReport
from coordd.proto.policy import last_ubatch_empty

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
