"""The blocking client that engine ranks import: `start` sends now, `wait` reads later.

`start()` hands the report to ZeroMQ and returns at once; ZeroMQ's I/O thread takes the
decision in while the engine thread is busy (on the GPU, say), so `wait()` usually finds it
already queued and only decodes it. No Python thread of ours runs on this path. What each
answer means is `RankSession`'s; this shell only decides how to wait (a blocking recv,
as the minimal pyzmq hub's rank does, in slices that also look at `close()` and the monitor).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

from coordd.client._config import ClientConfig
from coordd.client._edge import drain, zmq_poll
from coordd.client._registration import Step, check_unsent
from coordd.client._session import Pong, RegistrationFailed, Resolved, RoundStillOpen
from coordd.client._shell import ClientShell
from coordd.proto.errors import CoordError, CoordinatorUnavailable, ProtocolError, StepTimeout
from coordd.proto.messages import (
    MAX_WAITED_US,
    GatherReport,
    GatherResult,
    Goodbye,
    Heartbeat,
    Hello,
    StepDecision,
    StepKind,
    StepReport,
    Welcome,
    encode,
)

_GOODBYE = encode(Goodbye(text="rank closed"))
#: Longest single blocking recv: a wait looks at `_closed` and at the monitor this often, so
#: close() from another thread, or a dropped connection, ends it within this (the rounds
#: themselves are answered far sooner).
_POLL_SLICE_MS = 50
_RCVTIMEO = int(zmq.RCVTIMEO)
_NOBLOCK = int(zmq.NOBLOCK)
_CLOSED = "client closed"
_WAIT, _SEND, _REOPEN = Step.WAIT, Step.SEND, Step.REOPEN
_get_ident = threading.get_ident
_now_ns = time.perf_counter_ns
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv
_Socket = zmq.Socket
_POLLIN = int(zmq.POLLIN)
#: The shortest wait whose first slice `_wait_outcome` takes itself: a whole slice and more
#: to spare, so that slice cannot end past the wait's deadline (`_pump` trims a last slice).
_FIRST_SLICE_MIN_S = 2 * _POLL_SLICE_MS / 1000


class _PendingRound:
    """A round this rank has sent its part of; the first outcome is kept, so a second `wait()`
    returns the same answer (or raises the same error) at once. A timeout is not an outcome:
    the round is still open and waiting again may succeed."""

    __slots__ = ("_client", "_outcome", "_registration", "seq")
    #: The answer this kind of round ends with, and its name in a wrong-answer error.
    _answer: type[StepDecision] | type[GatherResult]
    _round_name: str

    def __init__(self, client: CoordClient, seq: int, registration: int) -> None:
        self._client = client
        self._registration = registration
        self._outcome: StepDecision | GatherResult | CoordError | None = None
        self.seq = seq

    def _settle(self, timeout: float | None) -> StepDecision | GatherResult:
        outcome = self._outcome
        if outcome is None:
            try:
                got = self._client._wait_outcome(self.seq, self._registration, timeout)
                if type(got) is not self._answer:
                    raise _wrong_answer(self.seq, self._round_name, got)
                outcome = got
            except StepTimeout:
                raise
            except CoordError as error:
                outcome = error
            self._outcome = outcome
        if isinstance(outcome, CoordError):
            raise outcome
        return outcome

    def done(self) -> bool:
        """True if `wait()` would return or raise without blocking."""
        return self._outcome is not None or self._client._settled(self.seq, self._registration)


class PendingStep(_PendingRound):
    """A round this rank has reported for; `wait()` returns its decision or raises its error."""

    __slots__ = ("kind",)
    _answer = StepDecision
    _round_name = "step"

    def __init__(self, client: CoordClient, seq: int, kind: StepKind, registration: int) -> None:
        self._client = client  # the base's fields, set here: one call less per round
        self._registration = registration
        self._outcome = None
        self.seq = seq
        self.kind = kind

    def wait(self, timeout: float | None = None) -> StepDecision:
        """Block until the decision arrives (at most `timeout`, default the client's); a
        second call returns the same decision (or raises the same error) at once."""
        outcome = self._outcome
        if outcome is None:  # `_settle`, written out: every round comes here
            try:
                got = self._client._wait_outcome(self.seq, self._registration, timeout)
                if type(got) is not StepDecision:
                    raise _wrong_answer(self.seq, "step", got)
            except StepTimeout:
                raise
            except CoordError as error:
                self._outcome = error
                raise
            self._outcome = got
            return got
        if isinstance(outcome, CoordError):
            raise outcome
        assert type(outcome) is StepDecision
        return outcome


class PendingGather(_PendingRound):
    """A gather round this rank has sent its values to; `wait()` returns every rank's values
    (rows[r] is rank r's; [] for a rank left out) or raises the round's error."""

    __slots__ = ("site",)
    _answer = GatherResult
    _round_name = "gather"

    def __init__(self, client: CoordClient, seq: int, site: str, registration: int) -> None:
        super().__init__(client, seq, registration)
        self.site = site

    def wait(self, timeout: float | None = None) -> list[list[int]]:
        """Block until the rows arrive (at most `timeout`, default the client's)."""
        outcome = self._outcome
        if outcome is None:  # `result` and `_settle`, written out: every gather comes here
            try:
                got = self._client._wait_outcome(self.seq, self._registration, timeout)
                if type(got) is not GatherResult:
                    raise _wrong_answer(self.seq, "gather", got)
            except StepTimeout:
                raise
            except CoordError as error:
                self._outcome = error
                raise
            self._outcome = got
            return got.rows
        if isinstance(outcome, CoordError):
            raise outcome
        assert type(outcome) is GatherResult
        return outcome.rows

    def result(self, timeout: float | None = None) -> GatherResult:
        """As `wait()`, but the whole `GatherResult` (its `dead_ranks` too)."""
        result = self._settle(timeout)
        assert type(result) is GatherResult
        return result


_new_step = object.__new__


def _wrong_answer(seq: int, expected: str, outcome: object) -> ProtocolError:
    return ProtocolError(
        f"coordd answered the {expected} round seq={seq} with a {type(outcome).__name__}"
    )


class CoordClient(ClientShell):
    """One DP rank's connection to coordd.

    Give the settings as keyword arguments (`CoordClient(address, dp_rank=0, dp_size=8)`), as
    a `ClientConfig` (`config=`), or both (the keywords replace the config's fields)."""

    def __init__(
        self,
        address: str | None = None,
        *,
        config: ClientConfig | None = None,
        context: zmq.Context | None = None,
        **options: Any,
    ) -> None:
        super().__init__(address, config=config, context=context, **options)
        #: The DEALER's RCVTIMEO in ms (-1: libzmq's default, block): a wait's slice.
        self._rcvtimeo = -1
        self._pong: int | None = None
        #: The last round started and not yet answered: (seq, registration).
        self._open: tuple[int, int] | None = None
        #: The thread inside a call that uses the socket (close() from another leaves the
        #: socket to it), and whether the sockets are closed.
        self._busy: int | None = None
        self._sockets_closed = False
        self._goodbye = True

    # -- public API ---------------------------------------------------------------------------

    def connect(self, timeout: float = 5.0) -> Welcome:
        """Register (Hello -> Welcome) in a new epoch; raises `Rejected` or
        `CoordinatorUnavailable`. Rounds still pending from before get the latter."""
        return self._register(timeout)

    def start(self, report: StepReport, kind: StepKind | str = StepKind.FORWARD) -> PendingStep:
        """Send this rank's report for the next round; returns at once.

        Rounds are not pipelined: while this client's previous round is unanswered, start()
        raises `RoundStillOpen` (wait() for it first). coordd runs one round at a time per
        group, and a report for the next round before every rank reported this one would
        fail the group with `StepMismatch`."""
        if type(kind) is not StepKind:
            kind = StepKind(kind)
        session = self.session
        # `_enter`, `_read_available`, `_waited_before` and `_send_report` written out: this
        # runs every round, and each call less is one less cold frame after the rank slept
        self._busy = _get_ident()
        try:
            if self._closed:  # read after marking, as `_enter` does
                raise CoordinatorUnavailable(_CLOSED)
            open_round = self._open
            connection = self.connection
            sock = connection.socket
            if open_round is not None:
                self._check_open(open_round)
            else:  # what came since: an answer for the round about to be reported is a misfit
                try:
                    # ZMQ_EVENTS through zmq_poll (`edge.queued`), its item list made once
                    if not sock.closed and zmq_poll(connection.look_in, 0):
                        drain(sock, self._on_frame, expect=True)
                except zmq.ZMQError as exc:
                    raise self._socket_error(exc) from None
            last, last_registration, waited = self._waited
            registration = session.registration
            if last != session.next_seq - 1 or last_registration != registration:
                waited = -1
            stamped = session.report(report, kind, waited)
            try:
                # pyzmq's Socket.send without its Python layer, whose routing_id/group/Frame
                # checks a plain bytes send never needs (the socket is always a pyzmq Socket)
                _send(sock, encode(stamped), _NOBLOCK)
            except zmq.Again:
                raise session.fail(
                    CoordinatorUnavailable(
                        f"cannot send to coordd at {self.address}: no connection"
                    )
                ).error from None
        finally:
            self._busy = None
            if self._closed:  # close() came from another thread meanwhile: it left this to us
                self._close_sockets()
        seq = stamped.seq
        self._open = (seq, registration)
        # `PendingStep(self, seq, kind, registration)` without its __init__ frame: every round
        step = _new_step(PendingStep)
        step._client = self
        step._registration = registration
        step._outcome = None
        step.seq = seq
        step.kind = kind
        return step

    def start_gather(self, site: str, values: Sequence[int]) -> PendingGather:
        """Send this rank's values for the next round, a gather round labelled `site` (the
        call site; every rank must gather the same site in the same place); returns at once.
        Raises `InvalidReport` without sending for what the wire cannot carry (more than
        MAX_GATHER_VALUES values, a value outside int64)."""
        session = self.session
        # `_enter`, `_read_available`, `_waited_before` and `_send_report` written out, as in
        # `start` (the same checks in the same order): the vLLM plugin's every sync comes here
        self._busy = _get_ident()
        try:
            if self._closed:  # read after marking, as `_enter` does
                raise CoordinatorUnavailable(_CLOSED)
            open_round = self._open
            connection = self.connection
            sock = connection.socket
            if open_round is not None:
                self._check_open(open_round)
            else:  # what came since: an answer for the round about to be reported is a misfit
                try:
                    if not sock.closed and zmq_poll(connection.look_in, 0):
                        drain(sock, self._on_frame, expect=True)
                except zmq.ZMQError as exc:
                    raise self._socket_error(exc) from None
            last, last_registration, waited = self._waited
            registration = session.registration
            if last != session.next_seq - 1 or last_registration != registration:
                waited = -1
            stamped = session.gather(site, values, waited)
            try:
                _send(sock, encode(stamped), _NOBLOCK)  # as in `start`
            except zmq.Again:
                raise session.fail(
                    CoordinatorUnavailable(
                        f"cannot send to coordd at {self.address}: no connection"
                    )
                ).error from None
        finally:
            self._busy = None
            if self._closed:  # close() came from another thread meanwhile: it left this to us
                self._close_sockets()
        seq = stamped.seq
        self._open = (seq, registration)
        # `PendingGather(self, seq, site, registration)` without its __init__ frames
        pending = _new_step(PendingGather)
        pending._client = self
        pending._registration = registration
        pending._outcome = None
        pending.seq = seq
        pending.site = site
        return pending

    def gather(
        self, site: str, values: Sequence[int], timeout: float | None = None
    ) -> list[list[int]]:
        """start_gather() and wait() in one call: every rank's values, in rank order."""
        return self.start_gather(site, values).wait(timeout)

    def coordinate(
        self,
        report: StepReport,
        kind: StepKind | str = StepKind.FORWARD,
        timeout: float | None = None,
    ) -> StepDecision:
        """start() and wait() in one call."""
        return self.start(report, kind).wait(timeout)

    def ping(self, timeout: float = 5.0) -> float:
        """Round-trip time to coordd in seconds."""
        nonce = time.monotonic_ns()
        began = time.perf_counter()
        deadline = time.monotonic() + timeout
        self._enter()
        try:
            self._send_before(encode(Heartbeat(nonce=nonce)), deadline)
            while self._pong != nonce:
                if not self._pump(deadline):
                    raise CoordinatorUnavailable(f"no pong from coordd within {timeout:g}s")
        finally:
            self._leave()
        return time.perf_counter() - began

    def close(self, goodbye: bool = True) -> None:
        """Say goodbye (if registered), fail what is pending, close; idempotent. Safe from
        another thread: a wait() in progress there raises `CoordinatorUnavailable("client
        closed")` within 50 ms, and that thread closes the sockets as it leaves.
        `goodbye=False`: leave without one, so coordd counts this rank lost, not gone cleanly
        (a rank that knows it broke its group's order)."""
        if self._closed:
            return
        self._closed = True
        self._goodbye = goodbye
        self.session.fail(CoordinatorUnavailable(_CLOSED))
        busy = self._busy
        if busy is None or busy == threading.get_ident():
            self._close_sockets()

    def _close_sockets(self) -> None:
        if self._sockets_closed:
            return
        self._sockets_closed = True
        registered = self.session.epoch is not None
        self.connection.close(_GOODBYE if registered and self._goodbye else None)

    def __enter__(self) -> CoordClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- waiting ------------------------------------------------------------------------------

    # -- one thread at a time on the sockets ---------------------------------------------------

    def _enter(self) -> None:
        """Mark this thread as using the sockets; raises "client closed" after close()."""
        self._busy = _get_ident()
        if self._closed:  # read after marking: close() either sees the mark or we see this
            self._leave()  # (and if it saw the mark, it left the sockets to us)
            raise CoordinatorUnavailable(_CLOSED)

    def _leave(self) -> None:
        self._busy = None
        if self._closed:  # close() came from another thread meanwhile: it left this to us
            self._close_sockets()

    def _settled(self, seq: int, registration: int) -> bool:
        """Read what came, then: would round `seq`'s wait return or raise at once?"""
        try:
            self._enter()
        except CoordinatorUnavailable:
            return True  # closed: every wait raises "client closed"
        try:
            self._read_available()
        finally:
            self._leave()
        return self.session.settled(seq, registration)

    def _check_open(self, open_round: tuple[int, int]) -> None:
        """Refuse a start() while this client's previous round is unanswered."""
        seq, registration = open_round
        session = self.session
        if registration == session.registration:
            self._read_available()
            if not session.settled(seq, registration):
                raise RoundStillOpen(self.dp_rank, seq)
        self._open = None

    def _register(self, timeout: float, hello: Hello | None = None) -> Welcome:
        """Begin a registration and send `hello` (default: this rank's own) for it; again over
        a new connection if the connection drops before the answer (`Registration`)."""
        self._enter()
        try:
            return self._register_now(timeout, hello)
        finally:
            self._leave()

    def _register_now(self, timeout: float, hello: Hello | None) -> Welcome:
        """Step a `Registration` (its rules are there, shared with the asyncio client)."""
        self._open = None
        registration = self.begin_registration(timeout, time.monotonic(), hello)
        try:
            while True:
                step = registration.next_step(self.connection, time.monotonic())
                if step is _WAIT:
                    self._pump(registration.deadline)  # a frame, or a slice (the monitor read)
                elif step is _SEND:
                    self._send_before(registration.data, registration.deadline)
                elif step is _REOPEN:
                    self.reopen_if_dropped()
                    self._rcvtimeo = -1
                else:
                    assert registration.welcome is not None
                    return registration.welcome
        except CoordinatorUnavailable as error:
            registration.abort(error)
            raise

    def _send_before(self, data: bytes, deadline: float) -> None:
        """Queue `data` once the DEALER has a pipe (IMMEDIATE is off: queued until the
        connection is up), reading the monitor every slice of the wait, or give up."""
        connection = self.connection
        while not connection.socket.poll(_POLL_SLICE_MS, zmq.POLLOUT):
            if self._closed:
                raise CoordinatorUnavailable(_CLOSED)
            connection.disconnected()  # nothing to do about a drop: this frame is not out yet
            check_unsent(connection, self.address, deadline, time.monotonic())
        connection.send(data)

    def _send_report(self, stamped: StepReport | GatherReport) -> None:
        try:
            # pyzmq's Socket.send without its Python layer, whose routing_id/group/Frame checks
            # a plain bytes send never needs (the socket is always a pyzmq Socket).
            _send(self.connection.socket, encode(stamped), _NOBLOCK)
        except zmq.Again:
            raise self.session.fail(
                CoordinatorUnavailable(f"cannot send to coordd at {self.address}: no connection")
            ).error from None

    def _wait(self, seq: int, registration: int, timeout: float | None) -> StepDecision:
        """A policy round's decision (or its error)."""
        outcome = self._wait_outcome(seq, registration, timeout)
        if type(outcome) is not StepDecision:
            raise _wrong_answer(seq, "step", outcome)
        return outcome

    def _wait_outcome(
        self, seq: int, registration: int, timeout: float | None
    ) -> StepDecision | GatherResult:
        session = self.session
        began = _now_ns()
        self._busy = _get_ident()  # `_enter` and `_leave` written out, as in `start`
        try:
            if self._closed:
                raise CoordinatorUnavailable(_CLOSED)
            outcome = session.outcome(seq, registration)
            if outcome is None:
                if timeout is None:  # `wait_timeout`'s first case without the property's call
                    timeout = self.config.wait_timeout
                    if timeout is None:
                        timeout = self.wait_timeout
                deadline = time.monotonic() + timeout
                sock = self.connection.socket
                if (
                    self._rcvtimeo == _POLL_SLICE_MS
                    and timeout >= _FIRST_SLICE_MIN_S
                    and type(sock) is _Socket
                ):
                    # `_pump`'s first slice written out, the common case of every round: a
                    # whole slice to wait (RCVTIMEO already set to it), pyzmq's own socket
                    # (its recv called unbound: no `__getattr__` hook on the attribute read)
                    try:
                        frame = _recv(sock, 0)
                    except zmq.Again:
                        self._slice_ended()
                    except zmq.ZMQError as exc:
                        raise self._socket_error(exc) from None
                    else:
                        if self._closed:
                            raise CoordinatorUnavailable(_CLOSED)
                        event = session.take_frame(frame, seq)
                        kind = type(event)
                        if kind is StepDecision or kind is GatherResult:
                            outcome = event  # type: ignore[assignment]
                        elif kind is not Resolved:
                            self._on_event(event)
                    if outcome is None:
                        outcome = session.outcome(seq, registration)
                while outcome is None:
                    got = self._pump(deadline, seq)
                    if got is False:
                        raise StepTimeout((), timeout)
                    outcome = session.outcome(seq, registration) if got is True else got
            if self._open is not None and self._open[0] == seq:
                self._open = None
            if isinstance(outcome, CoordError):
                raise outcome
            waited = (_now_ns() - began) // 1000  # min(waited, MAX_WAITED_US), without a call
            self._waited = (seq, registration, waited if waited < MAX_WAITED_US else MAX_WAITED_US)
            return outcome
        finally:
            self._busy = None
            if self._closed:
                self._close_sockets()

    def _read_available(self, expect: bool = True) -> None:
        """Receive what is queued (`expect`: as `edge.drain` takes it)."""
        try:
            drain(self.connection.socket, self._on_frame, expect=expect)
        except zmq.ZMQError as exc:
            raise self._socket_error(exc) from None

    def _socket_error(self, exc: zmq.ZMQError) -> CoordinatorUnavailable:
        if self._closed:
            return CoordinatorUnavailable(_CLOSED)
        error = CoordinatorUnavailable(f"the socket to coordd at {self.address} failed: {exc}")
        self.session.fail(error)
        return error

    def _pump(self, deadline: float, seq: int = -1) -> bool | StepDecision | GatherResult:
        """Read one frame, waiting for it until `deadline`: round `seq`'s own answer if that
        is what came (`RankSession.take_frame`; the caller found `outcome` empty for it);
        else True if a frame came or a slice of the wait passed (the caller looks again),
        False once the deadline has passed with nothing queued.

        A blocking recv, as the pyzmq hub's rank does: no poller, no ZMQ_EVENTS. RCVTIMEO
        ends it every slice, so close() from another thread ends the wait ("client closed"),
        and then the monitor is read: a disconnect is noticed within a slice of the
        DEALER going quiet, after every frame coordd sent before it."""
        sock = self.connection.socket
        if self._closed:
            raise CoordinatorUnavailable(_CLOSED)
        remaining_ms = (deadline - time.monotonic()) * 1000
        if remaining_ms >= _POLL_SLICE_MS:
            flags, slice_ms = 0, _POLL_SLICE_MS
        elif remaining_ms > 0:
            flags, slice_ms = 0, max(1, int(remaining_ms))
        else:
            flags, slice_ms = _NOBLOCK, self._rcvtimeo
        try:
            if slice_ms != self._rcvtimeo:
                sock.setsockopt(_RCVTIMEO, slice_ms)
                self._rcvtimeo = slice_ms
            frame = sock.recv(flags)
        except zmq.Again:
            self._slice_ended()
            return not flags
        except zmq.ZMQError as exc:
            raise self._socket_error(exc) from None
        if self._closed:
            raise CoordinatorUnavailable(_CLOSED)
        event = self.session.take_frame(frame, seq)
        kind = type(event)
        if kind is StepDecision or kind is GatherResult:
            return event  # type: ignore[return-value]
        if kind is not Resolved:
            self._on_event(event)
        return True

    def _slice_ended(self) -> None:
        """A recv's slice passed with nothing queued: raise "client closed" after close(); else
        read the monitor, and on a disconnect read what coordd sent before it, then fail."""
        if self._closed:
            raise CoordinatorUnavailable(_CLOSED) from None
        if self.connection.disconnected():
            self._read_available()  # what coordd sent before the close is this rank's
            self.session.connection_lost()

    def _on_frame(self, frame: bytes) -> None:
        event = self.session.receive_frame(frame)
        if type(event) is not Resolved:  # a round's answer: the session keeps it
            self._on_event(event)

    def _on_event(self, event: object) -> None:
        if type(event) is RegistrationFailed:
            raise event.error
        elif type(event) is Pong:
            self._pong = event.nonce
