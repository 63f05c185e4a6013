"""tests/engine only: a vLLM general plugin that makes this rank skip one runner DP sync.

On the test's PYTHONPATH for one rank only (its dist-info beside it is what vLLM's plugin loader
finds), so vLLM is patched in that rank's processes and nowhere else. Once the file named by
COORDD_TEST_SKIP_FILE exists, the next V1 runner sync (`vllm.v1.worker.dp_utils._run_ar`) of
this process is made without its collective (this rank's own column stands for every rank's,
as under vLLM's skip_dp_coordination), once; `<file>.skipped` records when.
"""

from __future__ import annotations

import os
import time
import types
from typing import Any


class _NoCollective(types.ModuleType):
    """torch.distributed (or coordd's stand-in for it) with all_reduce doing nothing."""

    def __init__(self, real: Any) -> None:
        super().__init__("torch.distributed")
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def all_reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> None:
        return None


def register() -> None:
    flag = os.environ.get("COORDD_TEST_SKIP_FILE", "")
    if not flag:
        return
    import vllm.v1.worker.dp_utils as dp_utils

    original = dp_utils._run_ar
    if getattr(original, "coordd_test_skip", False):
        return
    done = False

    def _run_ar(*args: Any, **kwargs: Any) -> Any:
        nonlocal done
        if done or not os.path.exists(flag):
            return original(*args, **kwargs)
        done = True
        parallel_config = kwargs.get("parallel_config", args[4] if len(args) > 4 else None)
        rank = parallel_config.data_parallel_rank
        real = dp_utils.dist
        dp_utils.dist = _NoCollective(real)
        try:
            tensor = original(*args, **kwargs)
        finally:
            dp_utils.dist = real
        tensor[:] = tensor[:, rank, None].clone()
        with open(flag + ".skipped", "w") as f:
            f.write(f"{time.time()}\n")
        return tensor

    _run_ar.coordd_test_skip = True  # type: ignore[attr-defined]
    dp_utils._run_ar = _run_ar
