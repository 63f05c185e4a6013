"""Start and stop a real `coordd` process: used by the demo, the benchmark and the tests."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

READY = "coordd ready on "


class CoorddProcess:
    """A `coordd serve` child process; `address` is where it listens once started."""

    def __init__(
        self,
        dp: int | None,
        bind: str,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.argv = [
            sys.executable,
            "-m",
            "coordd",
            "serve",
            *([] if dp is None else ["--dp", str(dp)]),
            "--bind",
            bind,
            *extra_args,
        ]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = bind

    def start(self, timeout: float = 15.0) -> CoorddProcess:
        """Start coordd and wait for its ready line (read unbuffered: no line is missed)."""
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=None, env=self.env, start_new_session=True
        )
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        seen = b""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                for line in seen.decode(errors="replace").splitlines(keepends=True):
                    if line.startswith(READY) and line.endswith("\n"):
                        self.address = line[len(READY) :].strip()
                        return self
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sel.select(remaining):
                    self.stop()
                    raise TimeoutError(f"coordd not ready within {timeout}s: {self.argv}")
                chunk = os.read(fd, 4096)
                if not chunk:
                    code = self.proc.wait(timeout=5)
                    raise RuntimeError(f"coordd exited with {code} before it was ready")
                seen += chunk

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
        return None if self.proc is None else stop_process(self.proc, timeout)

    def __enter__(self) -> CoorddProcess:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def stop_process(proc: subprocess.Popen[Any], timeout: float = 5.0) -> int:
    """End a child: SIGTERM, then SIGKILL after `timeout`; close its stdout; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode
