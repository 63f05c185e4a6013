"""A load as a child process of the measuring one (it must not share its interpreter lock)."""

from __future__ import annotations

import subprocess
import sys

from coordd.testing.process import die_with_parent

LOADS = (
    "garbage",
    "fast",
    "multipart",
    "unread",
    "connections",
    "http",
    "claims",
    "member",
    "storm",
    "handshakes",
)


def start_load(
    kind: str, address: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start load `kind` (one of LOADS) against `address` as a child process (with `env`, that
    environment instead of this process's: a leaked key's, say)."""
    if kind not in LOADS:
        raise ValueError(f"load kind must be one of {LOADS}, got {kind!r}")
    argv = [sys.executable, "-m", "coordd.tools.load", kind, address, *args]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, env=env, preexec_fn=die_with_parent())


def wait_load(load: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait for a load started by `start_load` to end; past `timeout` it is killed and
    TimeoutError names it (a load that hangs must not hang the test that started it)."""
    try:
        load.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        load.kill()
        load.wait()
        raise TimeoutError(f"load {load.args!r} did not end within {timeout}s") from None
