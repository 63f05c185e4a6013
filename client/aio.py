"""The asyncio client: `start()` returns an `asyncio.Future` for the round's decision.

Like the daemon, it watches the socket's file descriptor and drains every queued frame in one
callback; the only futures are the outcomes (one per pending round), never one per frame.
What each answer means is `RankSession`'s; this shell only decides how to wait (the loop).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import zmq

from coordd.client._config import ClientConfig
from coordd.client._edge import drain, send_and_look
from coordd.client._registration import Step, check_unsent
from coordd.client._session import (
    GroupFailed,
    Pong,
    Registered,
    RegistrationFailed,
    Resolved,
    RoundStillOpen,
)
from coordd.client._shell import ClientShell
from coordd.proto.errors import CoordError, CoordinatorUnavailable, ProtocolError, StepTimeout
from coordd.proto.messages import (
    MAX_WAITED_US,
    GatherReport,
    GatherResult,
    Goodbye,
    Heartbeat,
    StepDecision,
    StepKind,
    StepReport,
    Welcome,
    encode,
)

_GOODBYE = encode(Goodbye(text="rank closed"))

T = TypeVar("T")


class AsyncCoordClient(ClientShell):
    """One DP rank's connection to coordd, for engines that run an asyncio loop.

    Takes the same settings as `CoordClient`: keyword arguments, `config=`, or both."""

    def __init__(
        self,
        address: str | None = None,
        *,
        config: ClientConfig | None = None,
        context: zmq.Context | None = None,
        **options: Any,
    ) -> None:
        super().__init__(address, config=config, context=context, **options)
        #: The futures of unanswered rounds, by seq, with the registration each began in and
        #: whether it is a gather round (its future resolves to the rows).
        self._pending: dict[int, tuple[int, asyncio.Future[Any], bool]] = {}
        #: While connect() waits: woken by coordd's answer and by the monitor.
        self._wake: asyncio.Future[None] | None = None
        self._pongs: dict[int, asyncio.Future[None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        #: The last round sent: (seq, registration, its future).
        self._last_sent: tuple[int, int, asyncio.Future[Any] | None] = (-1, -1, None)
        #: The first wait() on each round's future: its waiter and the done-callback that
        #: would wake it (`_settle` wakes it directly and takes the callback off).
        self._waiting: dict[asyncio.Future[Any], tuple[asyncio.Future[None], Callable[..., None]]]
        self._waiting = {}
        #: Each blocked wait()'s waiter and its deadline (loop time); the one timer that
        #: wakes them (`_on_timer`), the loop time it fires at, and its loop.
        self._deadlines: dict[asyncio.Future[None], float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = math.inf
        self._timer_loop: asyncio.AbstractEventLoop | None = None

    async def connect(self, timeout: float = 5.0) -> Welcome:
        """Register (Hello -> Welcome) in a new epoch; raises `Rejected` or
        `CoordinatorUnavailable`. Rounds still pending from before get the latter."""
        loop = self._attach()
        registration = self.begin_registration(timeout, time.monotonic())
        self._settle_all()  # the old registration's rounds: superseded
        try:
            while True:
                step = registration.next_step(self.connection, time.monotonic())
                if step is Step.WAIT:
                    await self._wait_event(loop, registration.deadline)
                elif step is Step.SEND:
                    await self._send_before(registration.data, registration.deadline)
                elif step is Step.REOPEN:
                    loop = self._reopen(self.reopen_if_dropped)
                else:
                    assert registration.welcome is not None
                    return registration.welcome
        except CoordinatorUnavailable as error:
            self._dispatch(registration.abort(error))
            raise

    async def _wait_event(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """Until coordd answers the Hello, the monitor reports something, or `deadline`."""
        wake = self._wake = loop.create_future()
        try:
            await asyncio.wait_for(wake, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            pass
        finally:
            self._wake = None

    def _wake_registration(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def start(
        self, report: StepReport, kind: StepKind | str = StepKind.FORWARD
    ) -> asyncio.Future[StepDecision]:
        """Send the report now; the future resolves to the round's decision or its error."""
        # `_attach`, `_refuse_if_open`'s common case, `_waited_before` and `_send_report`
        # written out: this runs every round, and each call less is one less frame
        loop = self._loop
        if loop is None:
            loop = self._attach()
        sock = self.connection.socket
        if self._pending or self._closed:
            self._refuse_if_open()
        else:  # what came since: an answer for the round about to be reported is a misfit
            drain(sock, self._on_frame, expect=False)
        future: asyncio.Future[StepDecision] = loop.create_future()
        session = self.session
        registration = session.registration
        last, last_registration, waited = self._waited
        if last != session.next_seq - 1 or last_registration != registration:
            waited = -1
        try:
            stamped = session.report(
                report, kind if type(kind) is StepKind else StepKind(kind), waited
            )
        except CoordError as error:
            future.set_exception(error)
            return future
        seq = stamped.seq
        self._pending[seq] = (registration, future, False)
        self._last_sent = (seq, registration, future)
        if not send_and_look(sock, encode(stamped), self._on_frame):
            self._fail(
                CoordinatorUnavailable(f"cannot send to coordd at {self.address}: no connection")
            )
        return future

    def start_gather(self, site: str, values: Sequence[int]) -> asyncio.Future[list[list[int]]]:
        """Send this rank's values for the next round, a gather round labelled `site`; the
        future resolves to every rank's values in rank order ([] for a rank left out) or the
        round's error (`InvalidReport`, nothing sent, for what the wire cannot carry)."""
        loop = self._attach()
        self._refuse_if_open()
        future: asyncio.Future[list[list[int]]] = loop.create_future()
        try:
            stamped = self.session.gather(site, values, self._waited_before(self.session))
        except CoordError as error:
            future.set_exception(error)
            return future
        self._send_report(stamped, future, gather=True)
        return future

    async def gather(
        self, site: str, values: Sequence[int], timeout: float | None = None
    ) -> list[list[int]]:
        """start_gather() and await the rows, within `timeout` (default the client's)."""
        return await self.wait(self.start_gather(site, values), timeout)

    def _refuse_if_open(self) -> None:
        """Rounds are not pipelined (see `CoordClient.start`): `RoundStillOpen` while the
        previous round of this registration is unanswered. Reads what came first (an answer
        for the round about to be reported is then a misfit, not its answer)."""
        if self._closed:
            return
        if not self._pending:
            drain(self.connection.socket, self._on_frame, expect=False)
            return
        self._drain()
        registration = self.session.registration
        for seq, (began_in, future, _) in self._pending.items():
            if began_in == registration and not future.done():
                raise RoundStillOpen(self.dp_rank, seq)

    def _send_report(
        self, stamped: StepReport | GatherReport, future: asyncio.Future[Any], *, gather: bool
    ) -> None:
        self._pending[stamped.seq] = (self.session.registration, future, gather)
        self._last_sent = (stamped.seq, self.session.registration, future)
        if not send_and_look(self.connection.socket, encode(stamped), self._on_frame):
            self._fail(
                CoordinatorUnavailable(f"cannot send to coordd at {self.address}: no connection")
            )

    async def coordinate(
        self,
        report: StepReport,
        kind: StepKind | str = StepKind.FORWARD,
        timeout: float | None = None,
    ) -> StepDecision:
        """start() and await the decision, within `timeout` (default the client's)."""
        return await self.wait(self.start(report, kind), timeout)

    async def wait(self, future: asyncio.Future[T], timeout: float | None = None) -> T:
        """Await a `start()` future within `timeout` (default the client's); `StepTimeout`
        if no answer came by then (the round stays pending: waiting again may succeed).
        Awaiting an answered future again gives the same outcome at once."""
        if future.done():
            result = future.result()
            self._collected(future, 0)
            return result
        began = time.perf_counter_ns()
        if timeout is None:  # `wait_timeout`'s first case without the property's call
            timeout = self.config.wait_timeout
            if timeout is None:
                timeout = self.wait_timeout
        # wait_for(shield(future)) without its extra future and task hops: one waiter, woken
        # by the round's future or by the waits' timer; the round's future is never cancelled here
        # (a timeout, or this task's cancellation, leaves the round pending).
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()

        def wake(_: object = None) -> None:
            if not waiter.done():
                waiter.set_result(None)

        future.add_done_callback(wake)
        # `_settle` wakes the first wait on a round itself, as it resolves the round: the
        # done-callback's own hop through the loop (a Handle, one more turn) is then skipped
        waiting = self._waiting
        first = future not in waiting
        if first:
            waiting[future] = (waiter, wake)
        # one timer for every wait (`_on_timer`), armed anew only for a deadline before the
        # one it is armed for: a round's wait neither makes nor cancels a TimerHandle
        deadline = loop.time() + timeout
        deadlines = self._deadlines
        deadlines[waiter] = deadline
        if deadline < self._timer_when or self._timer_loop is not loop:
            self._arm(loop, deadline)
        try:
            await waiter
        finally:
            del deadlines[waiter]
            future.remove_done_callback(wake)
            if first:
                waiting.pop(future, None)
        if future.done():
            result = future.result()
            seq, registration, sent = self._last_sent  # `_collected`, written out
            if sent is future:
                waited = (time.perf_counter_ns() - began) // 1000
                self._waited = (
                    seq,
                    registration,
                    waited if waited < MAX_WAITED_US else MAX_WAITED_US,
                )
            return result
        raise StepTimeout((), timeout)

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        """(Re)arm the waits' one timer for loop time `when`."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer_when = when
        self._timer_loop = loop
        self._timer = loop.call_at(when, self._on_timer, loop)

    def _on_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake every wait whose deadline has come; rearm for the nearest one left."""
        self._timer = None
        self._timer_when = math.inf
        now = loop.time()
        nearest = math.inf
        for waiter, deadline in self._deadlines.items():
            if deadline <= now:
                if not waiter.done():
                    waiter.set_result(None)
            elif deadline < nearest:
                nearest = deadline
        if nearest != math.inf:
            self._arm(loop, nearest)

    def _collected(self, future: asyncio.Future[Any], waited_us: int) -> None:
        """A wait collected `future`'s answer after blocking `waited_us`: told to coordd with
        the next report, if it is the round this client sent last."""
        seq, registration, sent = self._last_sent
        if sent is future:
            self._waited = (seq, registration, min(waited_us, MAX_WAITED_US))

    async def ping(self, timeout: float = 5.0) -> float:
        """Round-trip time to coordd in seconds."""
        loop = self._attach()
        nonce = time.monotonic_ns()
        future: asyncio.Future[None] = loop.create_future()
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
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._timer_when = math.inf
        self._fail(CoordinatorUnavailable("client closed"))
        self.connection.close(_GOODBYE if self.session.epoch is not None else None)

    async def __aenter__(self) -> AsyncCoordClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- waiting ------------------------------------------------------------------------------

    def _attach(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            sock = self.connection.socket
            # `drain` itself, its arguments bound here (`_drain` is one frame more a wakeup);
            # a new connection is attached anew (`_reopen`)
            self._loop.add_reader(sock.fileno(), drain, sock, self._on_frame)
            self._loop.add_reader(self.connection.monitor.fileno(), self._check_monitor)
        return self._loop

    def _detach(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.connection.socket.fileno())
            self._loop.remove_reader(self.connection.monitor.fileno())

    def _reopen(self, reopen: Callable[[], object]) -> asyncio.AbstractEventLoop:
        """Watch the connection `reopen` opens in place of this one."""
        self._detach()
        reopen()
        self._loop = None
        loop = self._attach()
        # A new monitor's descriptor is not signalled for its first events until it is read:
        # unread, this connection's drop would go unnoticed (a round would wait out its timeout).
        self.connection.disconnected()
        return loop

    async def _send_before(self, data: bytes, deadline: float) -> None:
        """Queue `data` once the DEALER has a pipe (the monitor's reader keeps the
        connection's findings current meanwhile), or give up."""
        while not self.connection.writable():
            check_unsent(self.connection, self.address, deadline, time.monotonic())
            await asyncio.sleep(0.01)
        send_and_look(self.connection.socket, data, self._on_frame)

    def _check_monitor(self) -> None:
        connection = self.connection
        dropped = connection.disconnected()
        self._drain()  # what coordd sent before the close is still this rank's
        self._wake_registration()  # connect() looks at what the monitor said
        if dropped:
            self._dispatch(self.session.connection_lost())

    def _drain(self) -> None:
        drain(self.connection.socket, self._on_frame)

    def _on_frame(self, frame: bytes) -> None:
        event = self.session.receive_frame(frame)
        if type(event) is Resolved:  # a round's answer (`_dispatch`'s first case)
            self._settle(event.seq)
        else:
            self._dispatch(event)

    def _dispatch(self, event: object) -> None:
        if type(event) is Resolved:
            self._settle(event.seq)
        elif type(event) is GroupFailed:
            self._settle_all()
        elif type(event) is Registered or type(event) is RegistrationFailed:
            self._wake_registration()
        elif type(event) is Pong:
            pong = self._pongs.get(event.nonce)
            if pong is not None and not pong.done():
                pong.set_result(None)

    def _settle(self, seq: int) -> None:
        entry = self._pending.get(seq)
        if entry is None:
            return
        registration, future, gather = entry
        outcome = self.session.outcome(seq, registration)
        if outcome is None:
            return
        del self._pending[seq]
        if future.done():
            return
        woken = self._waiting.pop(future, None)
        if woken is not None:  # a wait() on this round: woken here, not by the done-callback
            waiter, wake = woken
            future.remove_done_callback(wake)
            if not waiter.done():
                waiter.set_result(None)
        if isinstance(outcome, CoordError):
            future.set_exception(outcome)
        elif gather and type(outcome) is GatherResult:
            future.set_result(outcome.rows)
        elif not gather and type(outcome) is StepDecision:
            future.set_result(outcome)
        else:
            expected = "gather" if gather else "step"
            future.set_exception(
                ProtocolError(
                    f"coordd answered the {expected} round seq={seq} "
                    f"with a {type(outcome).__name__}"
                )
            )

    def _settle_all(self) -> None:
        for seq in list(self._pending):
            self._settle(seq)

    def _fail(self, error: CoordError) -> None:
        self.session.fail(error)
        self._settle_all()
