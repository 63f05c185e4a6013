"""tests/engine only: a vLLM general plugin that makes this rank skip one runner DP sync.

On the test's PYTHONPATH for one rank only (its dist-info beside it is what vLLM's plugin loader
finds), so vLLM is patched in that rank's processes and nowhere else. Once the file named by
COORDD_TEST_SKIP_FILE exists (`<file>.armed` says it was seen), the next all-reduce of the V1
runner's sync module (`vllm.v1.worker.dp_utils.dist`, stock torch.distributed or coordd's
stand-in) is not made, once: this rank goes on with its own column only, as if it had skipped
that sync; `<file>.skipped` records when. Until then nothing of this module is on the sync's
call path (a thread watches for the file), so every other sync is exactly vLLM's own.
"""

from __future__ import annotations

import os
import threading
import time
import types
from typing import Any


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
        with open(self._flag + ".skipped", "w") as f:
            f.write(f"{time.time()}\n")


def register() -> None:
    flag = os.environ.get("COORDD_TEST_SKIP_FILE", "")
    if not flag or getattr(register, "started", False):
        return
    register.started = True  # type: ignore[attr-defined]
    import vllm.v1.worker.dp_utils as dp_utils

    def watch() -> None:
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline:
            if os.path.exists(flag):
                dp_utils.dist = _SkipOnce(dp_utils, dp_utils.dist, flag)
                with open(flag + ".armed", "w") as f:  # the test releases the next round now
                    f.write(f"{time.time()}\n")
                return
            time.sleep(0.01)

    threading.Thread(target=watch, name="coordd-test-skip", daemon=True).start()
