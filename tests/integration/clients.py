"""Both clients behind the blocking client's surface, so one test body checks both.

`BlockingAsyncClient` drives an `AsyncCoordClient` from blocking test code: each call runs a
private event loop until its await ends, so the client reads only while a call runs, as an
engine's loop that is busy between steps would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from coordd.client import AsyncCoordClient, CoordClient
from coordd.proto.messages import StepDecision, StepKind, StepReport, Welcome

T = TypeVar("T")

#: The ids the client fixtures are parametrized with.
CLIENT_KINDS = ["sync", "aio"]


class AsyncPending:
    """What `BlockingAsyncClient.start` returns: `PendingStep`'s surface over a future."""

    def __init__(self, client: BlockingAsyncClient, future: asyncio.Future[StepDecision],
                 seq: int) -> None:
        self._client = client
        self._future = future
        self.seq = seq

    def wait(self, timeout: float | None = None) -> StepDecision:
        return self._client.run(self._client.inner.wait(self._future, timeout))

    def done(self) -> bool:
        self._client.run(asyncio.sleep(0))
        return self._future.done()


class BlockingAsyncClient:
    def __init__(self, loop: asyncio.AbstractEventLoop, address: str | None = None,
                 **options: Any) -> None:
        self.loop = loop
        self.inner = AsyncCoordClient(address, **options)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    @property
    def epoch(self) -> int | None:
        return self.inner.epoch

    def connect(self, timeout: float = 5.0) -> Welcome:
        return self.run(self.inner.connect(timeout))

    def start(self, report: StepReport, kind: StepKind | str = StepKind.FORWARD) -> AsyncPending:
        async def start() -> asyncio.Future[StepDecision]:
            return self.inner.start(report, kind)

        seq = self.inner.session.next_seq
        return AsyncPending(self, self.run(start()), seq)

    def coordinate(self, report: StepReport, kind: StepKind | str = StepKind.FORWARD,
                   timeout: float | None = None) -> StepDecision:
        return self.start(report, kind).wait(timeout)

    def ping(self, timeout: float = 5.0) -> float:
        return self.run(self.inner.ping(timeout))

    def close(self) -> None:
        self.run(self.inner.close())


AnyClient = CoordClient | BlockingAsyncClient


class ClientMaker:
    """Makes clients of one kind ("sync" or "aio"); the fixture closes what it made."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.made: list[AnyClient] = []
        self.loop = asyncio.new_event_loop() if kind == "aio" else None

    def __call__(self, address: str | None = None, **options: Any) -> AnyClient:
        client: AnyClient
        if self.loop is None:
            client = CoordClient(address, **options)
        else:
            client = BlockingAsyncClient(self.loop, address, **options)
        self.made.append(client)
        return client

    def close(self) -> None:
        for client in self.made:
            client.close()
        if self.loop is not None:
            self.loop.close()


def client_maker(kind: str) -> Iterator[ClientMaker]:
    """The body of a test module's `make_client` fixture, parametrized over `CLIENT_KINDS`."""
    maker = ClientMaker(kind)
    try:
        yield maker
    finally:
        maker.close()
