"""Start and stop a real `coordd` process: used by the demo, the benchmark and the tests."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

READY = "coordd ready on "

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Any:
    """libc's prctl, resolved once here: the child of a fork calls it and nothing else."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_prctl = _load_prctl()


def die_with_parent(*, any_thread: bool = False) -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child die (SIGKILL) when the process starting it dies,
    so a test run killed from outside (SIGKILL: no cleanup runs) leaves no coordd or rank
    behind. Linux only (None elsewhere: nothing to do).

    The kernel sends the signal when the *thread* that started the child ends, so by default
    only a child started from the main thread gets it (None from another thread: a worker
    thread that ends would take its child along); `any_thread=True` where the caller knows its
    thread outlives the child. The parent's pid is taken before the fork: a parent gone before
    the child's prctl ran (the child was already re-parented) ends the child at once."""
    if _prctl is None:
        return None
    if not any_thread and threading.current_thread() is not threading.main_thread():
        return None
    prctl = _prctl
    parent = os.getpid()
    sigkill = int(signal.SIGKILL)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sigkill)

    return preexec


class CoorddProcess:
    """A `coordd serve` child process; `address` is where it listens once started. It dies
    with the process that started it (`die_with_parent`). Its log (stderr) goes to the file
    `log` if given (appended), else to this process's stderr."""

    #: The thread that calls `start` outlives the child (see `die_with_parent`); else only a
    #: start from the main thread ties the child's life to this process.
    starter_outlives_child = False

    def __init__(
        self,
        dp: int | None,
        bind: str,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        log: str | os.PathLike[str] | None = None,
    ) -> None:
        self.log = log
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
        log = None if self.log is None else open(self.log, "ab")  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=subprocess.PIPE,
                stderr=log,
                env=self.env,
                start_new_session=True,
                preexec_fn=die_with_parent(any_thread=self.starter_outlives_child),
            )
        finally:
            if log is not None:
                log.close()  # the child holds its own copy
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
