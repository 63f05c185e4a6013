"""The asyncio client's waits share one timer (issue 37): each still ends at its own deadline.

A wait no longer makes and cancels a TimerHandle of its own; one timer, armed for the nearest
deadline, wakes the waits whose deadline has come and rearms for the next. Against a fake
coordd that never answers: a wait with a short timeout under a timer armed for a long one
ends at its own (the timer is armed anew, earlier); a wait with a long timeout outlives the
timer's firing for a shorter one (it is rearmed, later); and an answer still ends a wait at
once, without the timer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from coordd.client.aio import AsyncCoordClient
from coordd.proto.errors import StepTimeout
from coordd.proto.messages import GatherReport, StepReport
from tests.integration.test_answer_checks import DP, REPORT, FakeCoordd, proper

pytestmark = pytest.mark.timeout(60)


def silent(report: StepReport | GatherReport) -> list:
    return []


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeCoordd]:
    context = zmq.Context()
    served = FakeCoordd(context, f"ipc://{tmp_path}/fake.sock")
    yield served
    served.stop()
    context.term()


async def _client(fake: FakeCoordd) -> AsyncCoordClient:
    client = AsyncCoordClient(fake.address, dp_rank=0, dp_size=DP, config_fingerprint="fp")
    await client.connect(timeout=10)
    return client


async def _timed_out(client: AsyncCoordClient, future: asyncio.Future, timeout: float) -> float:
    began = time.monotonic()
    with pytest.raises(StepTimeout):
        await client.wait(future, timeout)
    return time.monotonic() - began


def test_a_short_wait_under_a_long_ones_timer_ends_at_its_own_deadline(
    fake: FakeCoordd,
) -> None:
    async def run() -> None:
        client = await _client(fake)
        fake.answer = silent
        future = client.start(REPORT)
        long_wait = asyncio.ensure_future(client.wait(future, 30.0))
        await asyncio.sleep(0.05)  # the long wait armed the timer for 30 s
        took = await _timed_out(client, future, 0.3)
        assert 0.25 <= took < 5.0, f"the 0.3 s wait took {took:.2f} s"
        assert not long_wait.done(), "the long wait ended with the short one"
        long_wait.cancel()
        await asyncio.gather(long_wait, return_exceptions=True)
        assert not future.done(), "a timeout leaves the round pending"
        await client.close()

    asyncio.run(run())


def test_a_long_wait_outlives_the_timer_firing_for_a_shorter_one(fake: FakeCoordd) -> None:
    async def run() -> None:
        client = await _client(fake)
        fake.answer = silent
        future = client.start(REPORT)
        short = asyncio.ensure_future(_timed_out(client, future, 0.2))
        took = await _timed_out(client, future, 0.8)
        assert 0.75 <= took < 5.0, f"the 0.8 s wait took {took:.2f} s"
        assert 0.15 <= await short < 0.75
        await client.close()

    asyncio.run(run())


def test_an_answer_ends_the_wait_and_later_rounds_time_out_alike(fake: FakeCoordd) -> None:
    async def run() -> None:
        client = await _client(fake)
        for seq in range(3):  # answered: none waits for the timer
            began = time.monotonic()
            assert (await client.wait(client.start(REPORT), 30.0)).seq == seq
            assert time.monotonic() - began < 5.0
        fake.answer = silent
        future = client.start(REPORT)
        assert 0.15 <= await _timed_out(client, future, 0.2) < 5.0
        assert 0.15 <= await _timed_out(client, future, 0.2) < 5.0, "waiting again times out"
        fake.answer = proper
        await client.close()

    asyncio.run(run())
