"""The early start inside one process, against this vLLM's patch points: an early call can
never make a round of its own (every patch point it can reach refuses starting mode), and a
process whose sync can never start early stops trying at its first step, with a WARNING, a
field of the start-up line's data and a count (issue 36)."""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (run tests/vllm in .ci/vllm-env)")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import numpy as np
import torch
import vllm
import vllm.config.parallel as config_parallel
import vllm.v1.worker.dp_utils as v1
import vllm.v1.worker.gpu.dp_utils as v2
from vllm.config import ParallelConfig
from vllm.distributed import parallel_state as ps
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from coordd.vllm import early, patches, runner
from coordd.vllm.enable import PluginSettings
from coordd.vllm.exchange import Exchange
from coordd.vllm.reduce import ReduceOp

pytestmark = pytest.mark.timeout(120)

#: Nothing listens here: a round the plugin tried to make would fail to connect.
NOWHERE = PluginSettings(
    "ipc:///nonexistent/coordd-vllm-early-test.sock", connect_timeout=0.5, overlap=True
)
LINE = patches.release_line(vllm.__version__)


class ReachedARound(BaseException):
    """The early call reached a way into a round (a link, a round made)."""


@pytest.fixture
def rounds(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The plugin installed; every way into a round (a link to coordd, a round started or
    made) recorded instead of taken."""
    made: list[str] = []

    def record(what: str) -> Callable[..., Any]:
        def called(self: Any, *args: Any, **kwargs: Any) -> Any:
            made.append(what)
            raise ReachedARound(what)  # past `start_sync`'s `except Exception`

        return called

    monkeypatch.setattr(Exchange, "link", record("Exchange.link"))
    monkeypatch.setattr(Exchange, "_round", record("Exchange._round"))
    assert patches.install(NOWHERE)
    try:
        yield made
    finally:
        patches.uninstall()


def _tensor() -> torch.Tensor:
    return torch.zeros(4, 2, dtype=torch.int32)


def _points() -> dict[str, Callable[[], Any]]:
    """Every patch point an early call could reach, called as vLLM calls it (on objects that
    are not vLLM's groups: an early call must be refused before it looks at them)."""
    dp = types.SimpleNamespace(cpu_group=object(), device_group=object())
    points: dict[str, Callable[[], Any]] = {
        "A": lambda: v1.dist.all_reduce(_tensor(), group=dp.cpu_group),
        "D: ParallelConfig.has_unfinished_dp": lambda: ParallelConfig.has_unfinished_dp(
            dp.cpu_group, True
        ),
        "D: ParallelConfig.sync_kv_cache_memory_size": (
            lambda: ParallelConfig.sync_kv_cache_memory_size(dp.cpu_group, 5)
        ),
        "E: ParallelConfig.stateless_init_dp_group": (
            lambda: ParallelConfig.stateless_init_dp_group(ParallelConfig())
        ),
        "Exchange.sync_": lambda: patches.exchange().sync_(  # type: ignore[union-attr]
            _tensor(), ReduceOp.SUM, None, True
        ),
    }
    if LINE == "0.33":
        points["B: GroupCoordinator.cpu_all_reduce_"] = lambda: ps.GroupCoordinator.cpu_all_reduce_(
            ps._DP or dp, _tensor()
        )
        points["C: vllm.config.parallel.cpu_all_reduce_"] = lambda: config_parallel.cpu_all_reduce_(
            _tensor(), dp.cpu_group
        )
    else:
        points["B"] = lambda: v2.dist.all_reduce(_tensor(), group=dp.cpu_group)
        points["C: ParallelConfig.sync_dp_state"] = lambda: ParallelConfig.sync_dp_state(
            dp.cpu_group, True, False
        )
    return points


POINTS = sorted(_points())


class _Runner:
    """The V1 runner's shape for `runner.start_sync`: its sync function calls one patch point
    (as a vLLM that routed `_run_ar` elsewhere would)."""

    def __init__(self, point: Callable[[], Any]) -> None:
        self.point = point
        self.input_batch = types.SimpleNamespace(num_reqs=1)

    def _determine_batch_execution_and_padding(self, **kwargs: Any) -> Any:
        return self.point()

    def _allow_microbatching(self, num_reqs: int, num_scheduled_tokens_np: Any) -> bool:
        return False


@pytest.mark.parametrize("name", POINTS)
def test_an_early_call_is_refused_at_every_patch_point_and_makes_no_round(
    rounds: list[str], name: str
) -> None:
    """Issue 36: only `DistShim.all_reduce` honoured starting mode; the 0.33 `cpu_all_reduce_`
    patch and the engine-core patches called the exchange (a whole blocking round for the
    early call, a second one at the sync). Routed through each, the early start ends in
    `NotStarted` saying why it never can, before any link, round or collective."""
    point = _points()[name]
    scheduler_output = types.SimpleNamespace(
        total_num_scheduled_tokens=3, scheduled_encoder_inputs=[]
    )
    with pytest.raises(early.NotStarted) as refused:
        runner.start_sync(_Runner(point), scheduler_output, np.array([3], dtype=np.int32))
    assert refused.value.why, name
    assert rounds == []
    assert not early.starting()


def _bare_runner(config: ParallelConfig) -> Any:
    made = object.__new__(GPUModelRunner)
    made.__dict__.update(parallel_config=config)
    return made


def _steps(model_runner: Any, n: int) -> None:
    """`n` steps' `_prepare_inputs` (the plugin's wrapper; vLLM's own then fails on a bare
    runner, which is not what is tested)."""
    scheduler_output = types.SimpleNamespace(
        total_num_scheduled_tokens=3, scheduled_encoder_inputs=[]
    )
    for _ in range(n):
        with pytest.raises(AttributeError):
            GPUModelRunner._prepare_inputs(model_runner, scheduler_output, np.array([3]))


@pytest.fixture
def warnings_said() -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(patches.log.name)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


class Starts:
    """Each call of `runner.start_sync` (`calls`), answered by raising `answer`."""

    def __init__(self) -> None:
        self.calls = 0
        self.answer: BaseException = early.Started()

    def __call__(self, model_runner: Any, scheduler_output: Any, tokens: Any) -> None:
        self.calls += 1
        raise self.answer


@pytest.fixture
def starts(monkeypatch: pytest.MonkeyPatch) -> Iterator[Starts]:
    """The plugin installed with its early start on, `runner.start_sync` a `Starts`."""
    recorded = Starts()
    monkeypatch.setattr(runner, "start_sync", recorded)
    assert patches.install(NOWHERE)
    try:
        yield recorded
    finally:
        patches.uninstall()


def _config(nccl: bool) -> ParallelConfig:
    config = ParallelConfig(data_parallel_size=2)
    config.disable_nccl_for_dp_synchronization = not nccl
    return config


def test_on_the_nccl_path_the_early_start_is_never_tried(
    monkeypatch: pytest.MonkeyPatch, starts: Starts, warnings_said: list[logging.LogRecord]
) -> None:
    """Issue 36: with `disable_nccl_for_dp_synchronization` false on a GPU the early call did
    the graph dispatch, `_allow_microbatching`, a pinned tensor and a host-to-device copy, then
    was refused, every step. Now the first step sees the sync's path and no step tries."""
    monkeypatch.setattr(
        ps, "_DP", types.SimpleNamespace(device=torch.device("cuda", 0)), raising=False
    )
    assert patches.overlapping()
    _steps(_bare_runner(_config(nccl=True)), 3)
    assert starts.calls == 0
    assert not patches.overlapping()
    data = patches.startup()
    assert data["overlap"] is False and data["early_refused"] == 1
    assert "NCCL on cuda:0" in data["no_overlap"]
    [record] = warnings_said
    assert record.levelno == logging.WARNING and "NCCL on cuda:0" in record.getMessage()


def test_on_the_cpu_group_the_early_start_is_tried_every_step(
    monkeypatch: pytest.MonkeyPatch, starts: Starts, warnings_said: list[logging.LogRecord]
) -> None:
    """The NCCL flag alone does not stop it: vLLM's DP group on the CPU (the CPU engine) or
    the flag set (the gloo group) can start."""
    monkeypatch.setattr(ps, "_DP", types.SimpleNamespace(device=torch.device("cpu")), raising=False)
    _steps(_bare_runner(_config(nccl=True)), 2)
    assert starts.calls == 2 and patches.overlapping() and warnings_said == []


def test_an_early_start_refused_for_good_is_not_tried_again(
    starts: Starts, warnings_said: list[logging.LogRecord]
) -> None:
    """A refusal that says why (the shim saw a device tensor, a patch point that cannot
    start, a tensor that cannot be gathered) ends the early start in this process at once;
    the sync makes the round from then on."""
    starts.answer = early.NotStarted("the sync's tensor is on cuda:0")
    _steps(_bare_runner(_config(nccl=False)), 3)
    assert starts.calls == 1
    assert patches.startup()["early_refused"] == 1 and not patches.overlapping()
    [record] = warnings_said
    assert record.getMessage().endswith("the sync's tensor is on cuda:0")


def test_a_start_left_to_the_sync_this_time_is_tried_again_and_counted(
    starts: Starts, warnings_said: list[logging.LogRecord]
) -> None:
    """A refusal without a why (the group on vLLM's own path, coordd lost): the next step
    tries again; each is counted, and none is a WARNING."""
    starts.answer = early.NotStarted()
    _steps(_bare_runner(_config(nccl=False)), 3)
    assert starts.calls == 3
    data = patches.startup()
    assert (data["early_refused"], data["not_started"], data["overlap"]) == (0, 3, True)
    assert warnings_said == []


def test_a_window_refused_at_install_is_a_warning_and_in_the_start_up_data(
    monkeypatch: pytest.MonkeyPatch, warnings_said: list[logging.LogRecord]
) -> None:
    """Issue 36: a refused early start was an INFO line only, deferred until vLLM's logging
    was set up (gone under VLLM_LOGGING_LEVEL=WARNING), and no count said it."""
    monkeypatch.setattr(runner, "window_in", lambda runner_class: "execute_model moved")
    logger = logging.getLogger(patches.log.name)
    monkeypatch.setattr(logger, "level", logging.WARNING)
    assert patches.install(NOWHERE)
    try:
        data = patches.startup()
        line = patches._state.line or patches._line()
    finally:
        patches.uninstall()
    [record] = warnings_said
    assert record.levelno == logging.WARNING and "execute_model moved" in record.getMessage()
    assert (data["overlap"], data["no_overlap"], data["early_refused"]) == (
        False,
        "execute_model moved",
        1,
    )
    assert "the early start is refused: execute_model moved" in line
