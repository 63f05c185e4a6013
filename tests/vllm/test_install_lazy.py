"""The install imports none of the patched vLLM modules: a point whose module is not loaded yet
is patched when vLLM imports it, before anything can call through it; a point that fails its
check then is left to vLLM alone, with a warning naming it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (run tests/vllm in .ci/vllm-env)")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import vllm
import vllm.v1.engine.core as engine_core

from coordd.vllm import patches
from coordd.vllm.enable import PluginSettings

NOWHERE = PluginSettings("ipc:///nonexistent/coordd-vllm-test.sock", connect_timeout=0.5)
LINE = patches.release_line(vllm.__version__)

#: Run in a fresh process: what a vLLM process has when it loads plugins (vLLM and its config),
#: the install, then each point's module imported as vLLM imports them.
_FRESH = """
import json, sys
import vllm, vllm.config
from coordd.vllm import patches
from coordd.vllm.enable import PluginSettings

points = {"A": "vllm.v1.worker.dp_utils", "B": "vllm.v1.worker.gpu.dp_utils",
          "C-E": "vllm.config.parallel", "F": "vllm.v1.engine.core"}
out = {"loaded_before": sorted(p for p, n in points.items() if n in sys.modules)}
assert patches.install(PluginSettings("ipc:///nonexistent/coordd-vllm-test.sock"))
out["installed"] = patches.installed()
out["loaded_after_install"] = sorted(p for p, n in points.items() if n in sys.modules)
from vllm.v1.engine.core import DPEngineCoreProc
out["F"] = patches.wrapped(DPEngineCoreProc.__dict__["shutdown"])
from vllm.v1.worker.dp_utils import coordinate_batch_across_dp
import vllm.v1.worker.dp_utils as v1
out["A"] = isinstance(v1.__dict__["dist"], patches.DistShim)
import vllm.v1.worker.gpu.dp_utils as v2
from vllm.distributed.parallel_state import GroupCoordinator
if patches.release_line(vllm.__version__) == "0.33":
    out["B"] = patches.wrapped(GroupCoordinator.__dict__["cpu_all_reduce_"])
else:
    out["B"] = isinstance(v2.__dict__["dist"], patches.DistShim)
from vllm.config import ParallelConfig
out["C-E"] = patches.wrapped(ParallelConfig.__dict__["has_unfinished_dp"].__func__)
out["waiting"] = sum(type(f).__name__ == "_Hook" for f in sys.meta_path)
patches.uninstall()
out["restored"] = [not patches.wrapped(DPEngineCoreProc.__dict__["shutdown"]),
                   v1.__dict__["dist"] is __import__("torch").distributed]
print("RESULT", json.dumps(out))
"""

#: As above, but uninstalled before vLLM imports the engine core: nothing is patched then.
_CANCELLED = """
import sys
import vllm, vllm.config
from coordd.vllm import patches
from coordd.vllm.enable import PluginSettings

assert patches.install(PluginSettings("ipc:///nonexistent/coordd-vllm-test.sock"))
patches.uninstall()
from vllm.v1.engine.core import DPEngineCoreProc
print("RESULT", patches.wrapped(DPEngineCoreProc.__dict__["shutdown"]),
      sum(type(f).__name__ == "_Hook" for f in sys.meta_path))
"""


def _run(code: str, cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:]


@pytest.mark.timeout(400)  # a fresh vLLM import: a minute on a loaded host
def test_the_install_imports_no_patched_module_and_patches_each_when_vllm_does(
    tmp_path: Path,
) -> None:
    out = json.loads(_run(_FRESH, tmp_path))
    assert out["installed"] is True
    # the install imported none of them (the engine core's module cost most of its CPU)
    assert out["loaded_after_install"] == out["loaded_before"], out
    assert "F" not in out["loaded_after_install"] and "A" not in out["loaded_after_install"]
    # each patched by the time its import returned, whoever imported it
    assert (out["A"], out["B"], out["C-E"], out["F"]) == (True, True, True, True), out
    assert out["waiting"] == 0, out  # every wait fired, and took its hook off sys.meta_path
    assert out["restored"] == [True, True], out


@pytest.mark.timeout(400)
def test_a_point_imported_after_uninstall_is_left_to_vllm(tmp_path: Path) -> None:
    assert _run(_CANCELLED, tmp_path) == "False 0"


def test_a_point_that_fails_its_check_at_its_import_is_left_to_vllm_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A module imported after the install whose target moved: a warning names the point, the
    import goes on, the other points stay patched."""
    moved = types.ModuleType("vllm.v1.engine.core")  # no DPEngineCoreProc
    assert patches.install(NOWHERE)
    try:
        saved = len(patches._state.saved)
        with caplog.at_level(logging.WARNING, logger="vllm.coordd"):
            patches._point_loaded("F", LINE or "", moved)
        (record,) = caplog.records
        assert "patch point F NOT installed" in record.getMessage()
        assert "DPEngineCoreProc.shutdown" in record.getMessage()
        assert len(patches._state.saved) == saved and patches.installed()
        assert patches.wrapped(engine_core.DPEngineCoreProc.__dict__["shutdown"])
    finally:
        patches.uninstall()
