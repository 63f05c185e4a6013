"""Start a sync's round before vLLM reaches its sync, and collect it at the sync.

vLLM's V1 runner knows every input of its DP sync right after `_update_states`, then spends
`_prepare_inputs` on host work before `_determine_batch_execution_and_padding` makes the sync.
The plugin runs vLLM's own `_determine_batch_execution_and_padding` at the start of that window
with the same arguments, in *starting* mode: the sync's all-reduce reaches the plugin's
stand-in, which sends this rank's values to coordd (`Exchange.start_`) and unwinds the call with
`Started`, before anything past the all-reduce runs (nothing before it has side effects: the
graph dispatch is a lookup, the tensor is local). When vLLM then makes the sync itself, the
stand-in takes that round's answer instead of starting another (`Exchange.sync_`), after
checking that vLLM's own values and site label are the ones that were sent.

The faults this adds, each a typed error naming the rank (and its link closed without Goodbye,
so coordd counts the rank lost and every peer learns of it at once):
- `EarlyStartMismatch`: vLLM's sync sent other values (or was another sync) than the round
  started for it; never a second round for one sync, never a tensor reduced from other values.
- `SkippedSync`: a round was started for a sync that vLLM never made: the group's next start
  finds it still uncollected, or its next sync is not made by the step that started it (the
  runner's `execute_model` call, `in_step`), a `_dummy_run`'s sync with the same label and
  values included.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from coordd.proto.errors import CoordError

#: The rows of the V1 runner's [4, dp] sync tensor (vLLM's `_run_ar`), by the sync's name.
ROW_NAMES = {
    "coordinate_batch_across_dp": (
        "num_tokens_unpadded",
        "num_tokens_padded",
        "should_ubatch",
        "cudagraph_mode",
    ),
}


class EarlyStartMismatch(CoordError):
    """Rank `rank`'s sync in group `group` differs from the round the plugin started early for
    it: `field` is "site" (another sync came first) or one of the sync's values, `started` what
    went to coordd, `at_sync` what vLLM computed at its sync.

    At fault: the plugin's early start on that rank (vLLM changed an input of the sync between
    `_prepare_inputs` and the sync). Run with COORDD_VLLM_OVERLAP=0 and report it.
    """

    reason = "early_mismatch"
    hint = "run with COORDD_VLLM_OVERLAP=0 (syncs start at vLLM's sync) and report this"

    def __init__(
        self, rank: int, group: str, site: str, field: str, started: object, at_sync: object
    ) -> None:
        self.rank = rank
        self.group = group
        self.site = site
        self.field = field
        self.started = started
        self.at_sync = at_sync
        super().__init__(
            f"rank {rank} of group {group}: its sync's {field} is {at_sync!r}, the round started "
            f"early for it sent {started!r} (site {site})"
        )

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.rank,)


class SkippedSync(CoordError):
    """Rank `rank` of group `group` started round `seq` early for sync `site` and never made
    that sync; `then` is the sync it made next.

    At fault: that rank's engine loop, which left a step between its inputs and its DP sync
    (an exception caught and the loop gone on, or a patched-out sync). Every rank must make the
    same syncs in the same order.
    """

    reason = "skipped"
    hint = "make every rank run the same syncs in the same order, then restart the engine"

    def __init__(self, rank: int, group: str, seq: int, site: str, then: str) -> None:
        self.rank = rank
        self.group = group
        self.seq = seq
        self.site = site
        self.then = then
        super().__init__(
            f"rank {rank} of group {group} started round seq={seq} for sync {site} and never "
            f"made it; its next sync: {then}"
        )

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.rank,)


class Started(BaseException):
    """Unwinds vLLM's sync function once its round is started (a BaseException, so no
    `except Exception` of vLLM's on the way can take it for an error)."""


class NotStarted(BaseException):
    """Unwinds vLLM's sync function when its round cannot start early (it then runs at the
    sync, as without overlap). `why`, when given, says why it never can in this process (the
    sync goes over NCCL, reaches a patch point that cannot start a round, or its tensor cannot
    be gathered): the plugin then stops calling the early start."""

    def __init__(self, why: str = "") -> None:
        super().__init__(why)
        self.why = why


def refuse_starting(point: str) -> None:
    """Raise `NotStarted` if this thread is starting a round early: at a patch point that cannot
    start one (`point`), the early call must neither run vLLM's collective nor make a round."""
    if getattr(_local, "starting", False):
        raise NotStarted(f"the sync reaches {point}, which cannot start a round early")


_local = threading.local()


def starting() -> bool:
    """True while this thread runs a sync function to start its round early."""
    return getattr(_local, "starting", False)


class StartingMode:
    """`with StartingMode():` the sync functions called in it start their rounds, not run
    them."""

    def __enter__(self) -> None:
        _local.starting = True

    def __exit__(self, *exc: object) -> None:
        _local.starting = False


class InStep:
    """`with InStep(frame):` a round started in it belongs to the step running in `frame` (the
    runner's `execute_model`): only a sync made under that frame collects it."""

    def __init__(self, frame: Any) -> None:
        self.frame = frame

    def __enter__(self) -> None:
        _local.step = self.frame

    def __exit__(self, *exc: object) -> None:
        _local.step = None


def step() -> Any:
    """The frame of the step a round started now belongs to (`InStep`), or None."""
    return getattr(_local, "step", None)


def _under(frame: Any) -> bool:
    """Whether `frame` is on this thread's stack now."""
    at: Any = sys._getframe(1)
    while at is not None:
        if at is frame:
            return True
        at = at.f_back
    return False


@dataclass(slots=True)
class EarlyRound:
    """A round started for a sync vLLM has not made yet; `step`: the frame of the step that
    must make it (None: any sync may collect it)."""

    site: str
    own: list[int]
    pending: Any  # coordd.client.PendingGather
    began: float
    step: Any = None

    def check(self, rank: int, group: str, site: str, own: Sequence[int]) -> None:
        """Raise `SkippedSync` if the sync at hand is not made by the step that started the
        round (that step left before its sync), else `EarlyStartMismatch` unless it sends
        what was started."""
        if self.step is not None and not _under(self.step):
            raise SkippedSync(rank, group, self.pending.seq, self.site, site)
        if site != self.site:
            raise EarlyStartMismatch(rank, group, self.site, "site", self.site, site)
        if own != self.own:
            names = ROW_NAMES.get(site.partition("@")[0], ())
            for i, (sent, now) in enumerate(zip(self.own, own, strict=False)):
                if sent != now:
                    field = names[i] if i < len(names) else f"values[{i}]"
                    raise EarlyStartMismatch(rank, group, site, field, sent, now)
            raise EarlyStartMismatch(rank, group, site, "len(values)", len(self.own), len(own))


def now() -> float:
    return time.perf_counter()
