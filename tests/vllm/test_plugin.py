"""The plugin inside one process: the entry point vLLM finds, install/uninstall, the checks
that refuse a vLLM of another shape, and syncs that vLLM answers locally making no round."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (run tests/vllm in .ci/vllm-env)")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch
import torch.distributed as torch_dist
import vllm
import vllm.config.parallel as config_parallel
import vllm.v1.engine.core as engine_core
import vllm.v1.worker.dp_utils as v1
import vllm.v1.worker.gpu.dp_utils as v2
from vllm.config import ParallelConfig
from vllm.distributed import parallel_state as ps
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

import coordd.vllm
from coordd.vllm import patches, runner
from coordd.vllm.enable import PluginSettings

#: Nothing listens here: any round the plugin tried to make would fail to connect.
NOWHERE = PluginSettings("ipc:///nonexistent/coordd-vllm-test.sock", connect_timeout=0.5)


@pytest.fixture
def plugin() -> Iterator[None]:
    assert patches.install(NOWHERE)
    try:
        yield
    finally:
        patches.uninstall()


#: The release line of the vLLM here (the plugin patches each line's own targets).
LINE = patches.release_line(vllm.__version__)


def _originals() -> dict[str, object]:
    """Every attribute the plugin replaces in this vLLM release line."""
    if LINE == "0.33":
        b_c = {
            "B": ps.GroupCoordinator.__dict__["cpu_all_reduce_"],
            "C": config_parallel.__dict__["cpu_all_reduce_"],
        }
    else:
        b_c = {"B": v2.__dict__["dist"], "C": ParallelConfig.__dict__["sync_dp_state"]}
    return {
        "A": v1.__dict__["dist"],
        **b_c,
        "D1": ParallelConfig.__dict__["has_unfinished_dp"],
        "D2": ParallelConfig.__dict__["sync_kv_cache_memory_size"],
        "E": ParallelConfig.__dict__["stateless_init_dp_group"],
        "F": engine_core.DPEngineCoreProc.__dict__["shutdown"],
        "G": GPUModelRunner.__dict__["_prepare_inputs"],
    }


def test_this_vllm_is_a_supported_release() -> None:
    assert LINE in patches.SUPPORTED, vllm.__version__


def test_vllm_loads_the_plugin_through_its_entry_point(tmp_path: Path) -> None:
    """vLLM's own load_general_plugins() (what its front-end, engine cores and workers call)
    finds `coordd` in `vllm.general_plugins` and the plugin installs when COORDD_ADDRESS is set.
    Run from an empty directory, as vLLM is (a stale coordd.egg-info in a checkout would
    otherwise shadow the installed entry points)."""
    code = (
        "import importlib.metadata as md\n"
        "eps = [e.value for e in md.entry_points(group='vllm.general_plugins')"
        " if e.name == 'coordd']\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from coordd.vllm import patches\n"
        "print(eps, patches.installed())\n"
    )
    env = {**os.environ, "COORDD_ADDRESS": NOWHERE.address or "", "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("VLLM_PLUGINS", None)
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "['coordd.vllm:register'] True"


def test_register_does_nothing_unless_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COORDD_ADDRESS", raising=False)
    monkeypatch.delenv("COORDD_VLLM", raising=False)
    before = _originals()
    coordd.vllm.register()
    assert not patches.installed() and _originals() == before


def test_install_is_idempotent_and_uninstall_restores_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = _originals()
    monkeypatch.setenv("COORDD_ADDRESS", NOWHERE.address or "")
    monkeypatch.setenv("COORDD_VLLM_OVERLAP", "1")  # G too (off by default)
    try:
        coordd.vllm.register()
        patched = _originals()
        assert all(patched[k] is not before[k] for k in before)
        coordd.vllm.register()  # vLLM may load plugins again in the same process
        assert patches.install(NOWHERE)
        assert _originals() == patched
        assert isinstance(ParallelConfig.__dict__["has_unfinished_dp"], staticmethod)
    finally:
        patches.uninstall()
    assert _originals() == before


def test_a_vllm_of_another_shape_is_left_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """If one target moved, nothing is patched (never half), and the warning names it."""
    monkeypatch.setattr(v1, "dist", object())  # as if _run_ar no longer used torch.distributed
    before = _originals()
    with caplog.at_level(logging.WARNING, logger="coordd.vllm"):
        assert not patches.install(NOWHERE)
    assert not patches.installed() and _originals() == before
    assert "NOT installed" in caplog.text and "vllm.v1.worker.dp_utils.dist" in caplog.text
    assert len(caplog.records) == 1


@pytest.mark.parametrize("version", ["0.34.0", "0.31.2", "1.0.0", "0.3.3"])
def test_an_unknown_release_is_left_alone_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, version: str
) -> None:
    monkeypatch.setattr(vllm, "__version__", version)
    before = _originals()
    with caplog.at_level(logging.WARNING, logger="coordd.vllm"):
        assert not patches.install(NOWHERE)
    assert not patches.installed() and _originals() == before
    (record,) = caplog.records
    assert "NOT installed" in record.getMessage() and f"vLLM {version} is not a supported" in (
        record.getMessage()
    )
    assert "0.32.x and 0.33.x" in record.getMessage()


def test_the_other_lines_targets_are_refused_here() -> None:
    """Each line's checks are its own: this vLLM's shape fails the other line's checks (so a
    release that moved its targets is refused, never half patched)."""
    other = next(line for line in patches.SUPPORTED if line != LINE)
    with pytest.raises(patches.PatchRefused, match=r"^[BC]: "):
        patches._targets(other)


def test_other_groups_and_ops_take_vllms_path(plugin: None) -> None:
    """No DP group here: an all_reduce through the stand-in reaches torch.distributed itself
    (which says it is not initialised), never coordd."""
    with pytest.raises(ValueError, match=r"not been initialized|Default process group"):
        v1.dist.all_reduce(torch.zeros(2, dtype=torch.int32))
    assert v1.dist.ReduceOp is torch_dist.ReduceOp  # every other name is torch's own


def test_skip_dp_coordination_answers_locally_with_no_round(plugin: None) -> None:
    """vLLM's elastic-EP skip: the sync returns this rank's own view and no round is made
    (the exchange would fail to connect if one were)."""
    pc = ParallelConfig(data_parallel_size=4)
    pc.data_parallel_rank = 2
    with v1.skip_dp_coordination():
        should_ubatch, across, mode = v1.coordinate_batch_across_dp(
            num_tokens_unpadded=5,
            parallel_config=pc,
            allow_microbatching=False,
            num_tokens_padded=8,
            cudagraph_mode=2,
        )
    assert (should_ubatch, across.tolist(), mode) == (False, [8, 8, 8, 8], 2)
    assert across.dtype == torch.int32
    exchange = patches.exchange()
    assert exchange is not None and exchange.rounds() == {}


def test_a_reused_dp_sync_state_makes_no_round(plugin: None) -> None:
    from vllm.v1.worker.gpu import dp_utils as v2

    from tests.vllm.ranks import StubGraphManager

    state = v2.DPSyncState(
        num_tokens_across_dp=torch.tensor([16, 16], dtype=torch.int32),
        uniform_token_count=None,
        eager=False,
        num_reqs=3,
    )
    desc, again = v2.dispatch_cg_and_sync_dp(
        StubGraphManager(), 3, 16, None, dp_size=2, dp_rank=1, dp_sync_state=state
    )
    assert again is state and desc.num_tokens == 16
    exchange = patches.exchange()
    assert exchange is not None and exchange.rounds() == {}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def plugin_log() -> Iterator[list[str]]:
    """What the plugin says in vLLM's log (its logger is a child of vLLM's `vllm`)."""
    handler = _Lines()
    logger = logging.getLogger(patches.log.name)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_the_v1_runners_window_is_read_from_this_vllm() -> None:
    """This vLLM's execute_model computes the sync's inputs, calls _prepare_inputs, then the
    sync with exactly the arguments the early start passes."""
    assert patches.log.name.startswith("vllm.")
    assert runner.window_in(GPUModelRunner) == ""


def test_the_runner_starts_early_when_asked_and_says_so(plugin_log: list[str]) -> None:
    before = GPUModelRunner.__dict__["_prepare_inputs"]
    assert patches.install(dataclasses.replace(NOWHERE, overlap=True))
    try:
        assert patches.overlapping()
        assert patches.wrapped(GPUModelRunner.__dict__["_prepare_inputs"])
    finally:
        patches.uninstall()
    assert GPUModelRunner.__dict__["_prepare_inputs"] is before
    [line] = [line for line in plugin_log if "installed" in line]
    assert f"vLLM {vllm.__version__}" in line and NOWHERE.address in line
    assert "starts before _prepare_inputs" in line and "COORDD_VLLM_OVERLAP=0" in line


def test_overlap_off_leaves_the_runner_as_vllm_has_it(
    monkeypatch: pytest.MonkeyPatch, plugin_log: list[str]
) -> None:
    monkeypatch.setenv("COORDD_ADDRESS", NOWHERE.address or "")
    monkeypatch.setenv("COORDD_VLLM_OVERLAP", "0")
    before = GPUModelRunner.__dict__["_prepare_inputs"]
    try:
        coordd.vllm.register()
        assert patches.installed() and not patches.overlapping()
        assert GPUModelRunner.__dict__["_prepare_inputs"] is before
    finally:
        patches.uninstall()
    [line] = [line for line in plugin_log if "installed" in line]
    assert "every round starts at vLLM's sync (COORDD_VLLM_OVERLAP=0" in line


def test_the_early_start_is_off_by_default_and_the_line_says_how_to_turn_it_on(
    monkeypatch: pytest.MonkeyPatch, plugin_log: list[str]
) -> None:
    """Issue 36: on by default only if it pays; on the CPU engine it did not (docs/vllm.md)."""
    monkeypatch.setenv("COORDD_ADDRESS", NOWHERE.address or "")
    monkeypatch.delenv("COORDD_VLLM_OVERLAP", raising=False)
    before = GPUModelRunner.__dict__["_prepare_inputs"]
    try:
        coordd.vllm.register()
        assert patches.installed() and not patches.overlapping()
        assert GPUModelRunner.__dict__["_prepare_inputs"] is before
        assert patches.startup()["early_refused"] == 0  # not asked for: nothing refused
    finally:
        patches.uninstall()
    [line] = [line for line in plugin_log if "installed" in line]
    assert "the default" in line and "COORDD_VLLM_OVERLAP=1 turns it on" in line


def test_stock_timings_wrap_the_runner_without_the_plugin(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """COORDD_VLLM_TIMINGS with the plugin off times stock vLLM's steps; nothing else."""
    monkeypatch.delenv("COORDD_ADDRESS", raising=False)
    monkeypatch.setenv("COORDD_VLLM", "0")
    monkeypatch.setenv("COORDD_VLLM_TIMINGS", str(tmp_path))
    before = _originals()
    step = GPUModelRunner.__dict__["execute_model"]
    try:
        coordd.vllm.register()
        assert not patches.installed() and _originals() == before
        assert patches.wrapped(GPUModelRunner.__dict__["execute_model"])
    finally:
        patches.uninstall()
    assert GPUModelRunner.__dict__["execute_model"] is step


#: Run in a fresh process (this module imports the V1 runner itself): install with the early
#: start asked for, look, then import the runner as a vLLM worker does when it builds it.
_LAZY = """
import glob, logging, os, sys, threading
from coordd.vllm import patches
from coordd.vllm.enable import PluginSettings

def children():
    found = glob.glob(f"/proc/{os.getpid()}/task/*/children")
    return sum(len(open(p).read().split()) for p in found)

lines = []
handler = logging.Handler(logging.INFO)
handler.emit = lambda record: lines.append(record.getMessage())
patches.log.addHandler(handler)
patches.log.setLevel(logging.INFO)
assert patches.install(PluginSettings("ipc:///nonexistent/coordd-vllm-test.sock", overlap=True))
print("installed", patches.RUNNER_MODULE in sys.modules, children(),
      sorted(t.name for t in threading.enumerate()), patches.overlapping())
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
print("loaded", patches.overlapping(), patches.wrapped(GPUModelRunner.__dict__["_prepare_inputs"]),
      patches.wrapped(GPUModelRunner.__dict__["execute_model"]))
print("said", lines)
"""


@pytest.mark.timeout(400)  # a fresh vLLM import, twice over: minutes on a loaded host
def test_installing_leaves_the_v1_runner_to_vllm_and_patches_it_when_vllm_imports_it(
    tmp_path: Path,
) -> None:
    """The plugin never imports vLLM's V1 runner module (seconds of CPU; in 0.33 two background
    build processes): a process that never runs that runner (front-end, engine core, Model
    Runner V2 worker) pays nothing for it. When vLLM imports it, G and the step timings are in
    place before vLLM can build a runner, and the log says what was decided."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "COORDD_VLLM_TIMINGS": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", _LAZY],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=360,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = {line.split()[0]: line for line in done.stdout.splitlines()}
    assert out["installed"] == "installed False 0 ['MainThread'] False", done.stdout
    assert out["loaded"] == "loaded True True True", done.stdout
    said = out["said"]
    assert "starts before _prepare_inputs once vLLM loads that runner" in said
    assert "vLLM's V1 runner loaded: the V1 runner's round starts before _prepare_inputs" in said
