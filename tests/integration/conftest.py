from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coordd.testing import CoorddProcess

TCP_ARGS: list[str] = ["--insecure"]  # tcp without CURVE keys needs it (coordd keys)


def bind_for(transport: str, tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/coordd.sock" if transport == "ipc" else "tcp://127.0.0.1:*"


@pytest.fixture
def start_coordd(tmp_path: Path) -> Iterator[Callable[..., CoorddProcess]]:
    """Start real coordd processes; every one is stopped at teardown."""
    started: list[CoorddProcess] = []

    def start(dp: int, transport: str = "ipc", *args: str, **env: str) -> CoorddProcess:
        extra = [*args, *(TCP_ARGS if transport == "tcp" else [])]
        proc = CoorddProcess(dp, bind_for(transport, tmp_path), ["--log-level", "warning", *extra],
                             env=env)
        started.append(proc)
        return proc.start()

    yield start
    for proc in started:
        proc.stop()
