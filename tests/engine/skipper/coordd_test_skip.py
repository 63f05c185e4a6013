"""tests/engine only: a vLLM general plugin that makes this rank skip one runner DP sync, or
raise once inside `_prepare_inputs` (after the coordd plugin started the step's round early).

On the test's PYTHONPATH for one rank only (its dist-info beside it is what vLLM's plugin loader
finds), so vLLM is patched in that rank's processes and nowhere else. Once the file named by
COORDD_TEST_SKIP_FILE exists (`<file>.armed` says it was seen), the next step's runner sync is
not made, once: when that step's `_prepare_inputs` returns (after coordd's early start, if on),
the V1 runner's sync module's `dist` (stock torch.distributed or coordd's stand-in) is replaced
for one all-reduce, which it drops; this rank goes on with its own column only, as if it had
skipped that sync, and `<file>.skipped` records when. No frame of this module is ever between
vLLM's sync function and the collective, so every sync it lets through keeps its site label.
COORDD_TEST_PAUSE=SECONDS (every rank) slows each forward step by that much, and nothing else.
With COORDD_TEST_RAISE=1 the armed fault is instead an error raised once in `_prepare_inputs`
(from the block table's commit, its first call), between the early start and the sync.
Until armed nothing of this module is on the sync's call path (a thread watches for the file),
so every other sync is exactly vLLM's own.
"""

from __future__ import annotations

import os
import threading
import time
import types
from typing import Any


def _record(flag: str) -> None:
    with open(flag + ".skipped", "w") as f:
        f.write(f"{time.time()}\n")


class _SkipOnce(types.ModuleType):
    """Stands in for the module's `dist` for one all_reduce, which it drops, then puts the
    real one back."""

    def __init__(self, module: Any, real: Any, flag: str) -> None:
        super().__init__("torch.distributed")
        self._module, self._real, self._flag = module, real, flag

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def all_reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> None:
        self._module.dist = self._real
        _record(self._flag)


def _skip_after_prepare(dp_utils: Any, flag: str) -> None:
    """Once: after the next `_prepare_inputs` returns, the step's sync is dropped."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    current = GPUModelRunner.__dict__["_prepare_inputs"]  # coordd's wrapper, or vLLM's own

    def _prepare_inputs(self: Any, *args: Any, **kwargs: Any) -> Any:
        GPUModelRunner._prepare_inputs = current  # type: ignore[method-assign]
        out = current(self, *args, **kwargs)
        dp_utils.dist = _SkipOnce(dp_utils, dp_utils.dist, flag)
        return out

    GPUModelRunner._prepare_inputs = _prepare_inputs  # type: ignore[method-assign]


class InjectedFault(RuntimeError):
    """The error this plugin raises inside `_prepare_inputs`."""


def _raise_once(flag: str) -> None:
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    original = MultiGroupBlockTable.commit_block_table

    def commit_block_table(self: Any, num_reqs: int) -> None:
        MultiGroupBlockTable.commit_block_table = original  # type: ignore[method-assign]
        _record(flag)
        raise InjectedFault("coordd_test_skip: injected error in _prepare_inputs")

    MultiGroupBlockTable.commit_block_table = commit_block_table  # type: ignore[method-assign]


def _pace(seconds: float) -> None:
    """Every forward step of this rank's runner sleeps `seconds` first: a run long enough for
    coordd to be killed and restarted, or stopped and resumed, under it (COORDD_TEST_PAUSE)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.execute_model

    def execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return original(self, *args, **kwargs)

    GPUModelRunner.execute_model = execute_model  # type: ignore[method-assign]


def register() -> None:
    pause = float(os.environ.get("COORDD_TEST_PAUSE", "0") or 0)
    if pause > 0 and not getattr(register, "paced", False):
        register.paced = True  # type: ignore[attr-defined]
        _pace(pause)
    flag = os.environ.get("COORDD_TEST_SKIP_FILE", "")
    if not flag or getattr(register, "started", False):
        return
    register.started = True  # type: ignore[attr-defined]
    raising = os.environ.get("COORDD_TEST_RAISE") == "1"
    import vllm.v1.worker.dp_utils as dp_utils

    def watch() -> None:
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline:
            if os.path.exists(flag):
                if raising:
                    _raise_once(flag)
                else:
                    _skip_after_prepare(dp_utils, flag)
                with open(flag + ".armed", "w") as f:  # the test releases the next round now
                    f.write(f"{time.time()}\n")
                return
            time.sleep(0.01)

    threading.Thread(target=watch, name="coordd-test-skip", daemon=True).start()
