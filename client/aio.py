"""The asyncio client: `start()` returns an `asyncio.Future` for the round's decision.

Like the daemon, it watches the socket's file descriptor and drains every queued frame in one
callback; the only futures are the outcomes (one per pending round), never one per frame.
"""

from __future__ import annotations

import asyncio
import time

import zmq

from coordd.client.session import (
    GroupFailed,
    Pong,
    RankSession,
    Registered,
    RegistrationFailed,
    Resolved,
)
from coordd.client.transport import (
    CurveKeys,
    close_dealer,
    drain_disconnects,
    handshake_failure,
    open_dealer,
)
from coordd.proto.address import default_address
from coordd.proto.errors import CoordError, CoordinatorUnavailable, ProtocolError, StepTimeout
from coordd.proto.messages import (
    Goodbye,
    Heartbeat,
    StepDecision,
    StepKind,
    StepReport,
    Welcome,
    decode_from_coordinator,
    encode,
)

_GOODBYE = encode(Goodbye(text="rank closed"))
# Plain ints: pyzmq's constants are enum.Flag members, slow to combine in Python.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)


class AsyncCoordClient:
    """One DP rank's connection to coordd, for engines that run an asyncio loop."""

    def __init__(
        self,
        address: str | None = None,
        *,
        dp_rank: int,
        dp_size: int,
        config_fingerprint: str = "",
        group: str = "default",
        num_ubatches: int = 2,
        incarnation: str | None = None,
        wait_timeout: float = 60.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        curve: CurveKeys | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.address = address or default_address()
        self.session = RankSession(
            dp_rank=dp_rank,
            dp_size=dp_size,
            config_fingerprint=config_fingerprint,
            group=group,
            num_ubatches=num_ubatches,
            incarnation=incarnation,
        )
        self.wait_timeout = wait_timeout
        self._sock, self._monitor = open_dealer(
            context or zmq.Context.instance(),
            self.address,
            self.session.identity,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            curve=curve,
        )
        self._pending: dict[int, asyncio.Future[StepDecision]] = {}
        self._welcome: asyncio.Future[Welcome] | None = None
        self._pongs: dict[int, asyncio.Future[None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def dp_rank(self) -> int:
        return self.session.dp_rank

    async def connect(self, timeout: float = 5.0) -> Welcome:
        """Register (Hello -> Welcome); raises `Rejected` or `CoordinatorUnavailable`."""
        self._attach()
        assert self._loop is not None
        drain_disconnects(self._monitor)
        self._welcome = self._loop.create_future()
        deadline = time.monotonic() + timeout
        await self._send_before(encode(self.session.hello_message), deadline)
        try:
            return await asyncio.wait_for(self._welcome, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise CoordinatorUnavailable(
                f"no answer from coordd at {self.address} within {timeout:g}s" + _why(self._monitor)
            ) from None
        finally:
            self._welcome = None

    def start(
        self, report: StepReport, kind: StepKind | str = StepKind.FORWARD
    ) -> asyncio.Future[StepDecision]:
        """Send the report now; the future resolves to the round's decision or its error."""
        assert self._loop is not None, "connect() first"
        future: asyncio.Future[StepDecision] = self._loop.create_future()
        try:
            stamped = self.session.report(
                report, kind if type(kind) is StepKind else StepKind(kind)
            )
            self._sock.send(encode(stamped), _NOBLOCK)
        except CoordError as error:
            future.set_exception(error)
            return future
        except zmq.Again:
            future.set_exception(
                self._fail(
                    CoordinatorUnavailable(
                        f"cannot send to coordd at {self.address}: no connection"
                    )
                )
            )
            return future
        self._pending[stamped.seq] = future
        self._drain()
        return future

    async def coordinate(
        self,
        report: StepReport,
        kind: StepKind | str = StepKind.FORWARD,
        timeout: float | None = None,
    ) -> StepDecision:
        """start() and await the decision, within `timeout` (default the client's)."""
        timeout = self.wait_timeout if timeout is None else timeout
        future = self.start(report, kind)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            raise StepTimeout((), timeout) from None

    async def ping(self, timeout: float = 5.0) -> float:
        """Round-trip time to coordd in seconds."""
        assert self._loop is not None, "connect() first"
        nonce = time.monotonic_ns()
        future: asyncio.Future[None] = self._loop.create_future()
        self._pongs[nonce] = future
        began = time.perf_counter()
        try:
            await self._send_before(encode(Heartbeat(nonce=nonce)), time.monotonic() + timeout)
            await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise CoordinatorUnavailable(f"no pong from coordd within {timeout:g}s") from None
        finally:
            self._pongs.pop(nonce, None)
        return time.perf_counter() - began

    async def close(self) -> None:
        """Say goodbye (if registered), fail what is pending, close; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._detach()
        self._fail(CoordinatorUnavailable("client closed"))
        close_dealer(
            self._sock, self._monitor, _GOODBYE if self.session.epoch is not None else None
        )

    async def __aenter__(self) -> AsyncCoordClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- internals ----------------------------------------------------------------------------

    def _attach(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._sock.fileno(), self._drain)
            self._loop.add_reader(self._monitor.fileno(), self._check_monitor)

    def _detach(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._loop.remove_reader(self._monitor.fileno())

    async def _send_before(self, data: bytes, deadline: float) -> None:
        while not int(self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLOUT:
            if time.monotonic() >= deadline:
                raise CoordinatorUnavailable(
                    f"cannot reach coordd at {self.address}" + _why(self._monitor)
                )
            await asyncio.sleep(0.01)
        self._sock.send(data, zmq.NOBLOCK)
        self._drain()

    def _check_monitor(self) -> None:
        dropped = drain_disconnects(self._monitor)
        self._drain()  # what coordd sent before the close is still this rank's
        if dropped and self._welcome is None and self._pending and self.session.failed is None:
            self._fail(CoordinatorUnavailable(f"connection to coordd at {self.address} dropped"))

    def _drain(self) -> None:
        sock = self._sock
        while int(sock.getsockopt(_EVENTS)) & _POLLIN:
            frame = sock.recv(_NOBLOCK)
            try:
                msg = decode_from_coordinator(frame)
            except ProtocolError:
                continue
            self._dispatch(self.session.receive(msg))

    def _dispatch(self, event: object) -> None:
        if type(event) is Resolved:
            future = self._pending.pop(event.seq, None)
            if future is not None and not future.done():
                if isinstance(event.outcome, CoordError):
                    future.set_exception(event.outcome)
                else:
                    future.set_result(event.outcome)
        elif type(event) is GroupFailed:
            self._fail_pending(event.error)
        elif type(event) is Registered:
            if self._welcome is not None and not self._welcome.done():
                self._welcome.set_result(event.welcome)
        elif type(event) is RegistrationFailed:
            if self._welcome is not None and not self._welcome.done():
                self._welcome.set_exception(event.error)
        elif type(event) is Pong:
            pong = self._pongs.get(event.nonce)
            if pong is not None and not pong.done():
                pong.set_result(None)

    def _fail(self, error: CoordError) -> CoordError:
        self.session.fail(error)
        self._fail_pending(error)
        return error

    def _fail_pending(self, error: CoordError) -> None:
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)


def _why(monitor: zmq.Socket) -> str:
    reason = handshake_failure(monitor)
    return f": {reason}" if reason else ""
