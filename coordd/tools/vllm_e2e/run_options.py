"""What one run of the check is asked for, and the device it runs on."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path

#: Exit codes: 0 all equal, 1 a mismatch (or a run failed), 2 cannot run on this machine.
OK, MISMATCH, UNAVAILABLE = 0, 1, 2


@dataclass(frozen=True)
class Options:
    dp: int = 2
    gpus: int = 1
    moe: bool = False
    max_tokens: int = 24
    eager: bool = False
    runner: str = "default"
    gpu_memory_utilization: float = 0.2
    kv_cache_bytes: int = 512 << 20
    timeout: float = 600.0
    keep: str | None = None
    json_path: str | None = None
    #: "auto" (a GPU if there is one, else CPU), "cuda" or "cpu"
    device: str = "auto"
    #: > 0: instead of the check, this many interleaved sets of stock / overlap off / on runs,
    #: and the table of the runner's sync per step (coordd.tools.vllm_steps)
    overlap_sets: int = 0


def has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None or Path("/dev/nvidia0").exists()


def resolve_device(options: Options) -> Options:
    """`options` with device "auto" made "cuda" or "cpu"; on CPU always eager."""
    device = options.device
    if device == "auto":
        device = "cuda" if has_gpu() else "cpu"
    return replace(options, device=device, eager=options.eager or device == "cpu")
