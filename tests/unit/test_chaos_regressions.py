"""Bugs the chaos suite found, each pinned by a test that failed before its fix."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordd.client import AsyncCoordClient, CoordClient
from coordd.proto import CoordinatorUnavailable, StepReport
from coordd.testing import CoorddProcess

REPORT = StepReport(num_tokens=4, num_tokens_padded=8, want_ubatch=True, has_unfinished=True)


@pytest.fixture
def coordd(tmp_path: Path) -> Iterator[CoorddProcess]:
    with CoorddProcess(2, f"ipc://{tmp_path}/c.sock", ["--log-level", "warning"]) as proc:
        yield proc


def test_a_rank_that_reads_late_still_gets_the_decision_and_goodbye_sent_before_shutdown(
    coordd: CoorddProcess,
) -> None:
    """coordd_restart (SIGTERM): a round completed, coordd sent the decision and its Goodbye and
    closed. The rank that was busy (on the GPU) while that happened lost both: the client's
    DEALER was IMMEDIATE, and libzmq drops what was received and not yet read when the
    connection closes, so the ranks split (decision / "connection dropped") on one round."""
    a = CoordClient(coordd.address, dp_rank=0, dp_size=2)
    b = CoordClient(coordd.address, dp_rank=1, dp_size=2)
    try:
        a.connect(timeout=10)
        b.connect(timeout=10)
        pending_a, pending_b = a.start(REPORT), b.start(REPORT)
        decided = pending_a.wait(timeout=10)
        coordd.signal(signal.SIGTERM)
        assert coordd.proc is not None and coordd.proc.wait(timeout=10) == 0
        assert pending_b.wait(timeout=10) == decided  # b reads only now
        with pytest.raises(CoordinatorUnavailable, match="goodbye"):
            b.start(REPORT).wait(timeout=10)
    finally:
        a.close()
        b.close()


def test_the_asyncio_client_keeps_what_came_before_the_close_too(coordd: CoorddProcess) -> None:
    async def main() -> None:
        a = AsyncCoordClient(coordd.address, dp_rank=0, dp_size=2)
        b = CoordClient(coordd.address, dp_rank=1, dp_size=2)
        try:
            await a.connect(timeout=10)
            b.connect(timeout=10)
            future_a = a.start(REPORT)
            decided = b.start(REPORT).wait(timeout=10)  # the round is complete
            # the engine's loop is busy (blocked) while coordd shuts down: nothing reads
            coordd.signal(signal.SIGTERM)
            assert coordd.proc is not None and coordd.proc.wait(timeout=10) == 0
            time.sleep(0.2)
            assert await asyncio.wait_for(future_a, 10) == decided
            with pytest.raises(CoordinatorUnavailable, match="goodbye"):
                await asyncio.wait_for(a.start(REPORT), 10)
        finally:
            await a.close()
            b.close()

    asyncio.run(main())
