"""A bench hub run as a child process: started, read until its ready line, stopped."""

from __future__ import annotations

import selectors
import subprocess
import sys

from coordd.testing.process import die_with_parent, stop_process


class HubChild:
    """`python -m MODULE --dp N --FLAG WHERE --timeout T`, ready once it prints `ready` + where.

    `address` is where it listens once started (the child may resolve a wildcard port)."""

    #: Set by each hub: its module, the option naming where it listens, its ready line, a name.
    module: str
    where_flag: str
    ready: str
    what: str

    def __init__(self, dp: int, where: str, timeout: float = 120.0) -> None:
        self.argv = [sys.executable, "-m", self.module, "--dp", str(dp), self.where_flag, where,
                     "--timeout", str(timeout)]  # fmt: skip
        self.address = where
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 15.0) -> HubChild:
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        self.address = read_ready_line(self.proc, self.ready, timeout, self.what)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout)


def read_ready_line(proc: subprocess.Popen[str], ready: str, timeout: float, what: str) -> str:
    """The address a child hub printed after `ready`; stops it and raises if it did not."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            stop_process(proc, 5.0)
            raise TimeoutError(f"{what} not ready within {timeout}s")
        line = proc.stdout.readline()
    if not line.startswith(ready):
        stop_process(proc, 5.0)
        raise RuntimeError(f"{what} failed to start: {line!r}")
    return line[len(ready) :].strip()
