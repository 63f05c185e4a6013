"""The blocking client that engine ranks import: `start` sends now, `wait` reads later.

`start()` hands the report to ZeroMQ and returns at once; ZeroMQ's I/O thread takes the
decision in while the engine thread is busy (on the GPU, say), so `wait()` usually finds it
already queued and only decodes it. No Python thread of ours runs on this path.
"""

from __future__ import annotations

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


class PendingStep:
    """A round this rank has reported for; `wait()` returns its decision or raises its error."""

    __slots__ = ("_client", "kind", "seq")

    def __init__(self, client: CoordClient, seq: int, kind: StepKind) -> None:
        self._client = client
        self.seq = seq
        self.kind = kind

    def wait(self, timeout: float | None = None) -> StepDecision:
        """Block until the decision arrives (at most `timeout`, default the client's)."""
        return self._client._wait(self.seq, timeout)

    def done(self) -> bool:
        """True if `wait()` would return or raise without blocking."""
        return self._client._ready(self.seq)


class CoordClient:
    """One DP rank's connection to coordd."""

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
        self._context = context or zmq.Context.instance()
        self._sock, self._monitor = open_dealer(
            self._context,
            self.address,
            self.session.identity,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            curve=curve,
        )
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._results: dict[int, StepDecision | CoordError] = {}
        self._welcome: Welcome | None = None
        self._pong: int | None = None
        self._closed = False

    # -- public API ---------------------------------------------------------------------------

    @property
    def dp_rank(self) -> int:
        return self.session.dp_rank

    @property
    def epoch(self) -> int | None:
        return self.session.epoch

    def connect(self, timeout: float = 5.0) -> Welcome:
        """Register (Hello -> Welcome); raises `Rejected` or `CoordinatorUnavailable`."""
        self._results.clear()
        self._welcome = None
        drain_disconnects(self._monitor)
        deadline = time.monotonic() + timeout
        self._send_before(encode(self.session.hello_message), deadline)
        while self._welcome is None:
            if not self._pump(deadline, registering=True):
                raise CoordinatorUnavailable(
                    f"no answer from coordd at {self.address} within {timeout:g}s"
                    + _why(self._monitor)
                )
        return self._welcome

    def start(self, report: StepReport, kind: StepKind | str = StepKind.FORWARD) -> PendingStep:
        """Send this rank's report for the next round; returns at once."""
        if type(kind) is not StepKind:
            kind = StepKind(kind)
        stamped = self.session.report(report, kind)
        try:
            self._sock.send(encode(stamped), _NOBLOCK)
        except zmq.Again:
            raise self._fail(
                CoordinatorUnavailable(f"cannot send to coordd at {self.address}: no connection")
            ) from None
        return PendingStep(self, stamped.seq, kind)

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
        self._send_before(encode(Heartbeat(nonce=nonce)), deadline)
        while self._pong != nonce:
            if not self._pump(deadline):
                raise CoordinatorUnavailable(f"no pong from coordd within {timeout:g}s")
        return time.perf_counter() - began

    def close(self) -> None:
        """Say goodbye (if registered) and close the socket; idempotent."""
        if self._closed:
            return
        self._closed = True
        final = _GOODBYE if self.session.epoch is not None else None
        close_dealer(self._sock, self._monitor, final)

    def __enter__(self) -> CoordClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _send_before(self, data: bytes, deadline: float) -> None:
        """Send (queued until the connection is up, IMMEDIATE is off), or give up."""
        remaining_ms = max(0.0, deadline - time.monotonic()) * 1000
        if not self._sock.poll(int(remaining_ms), zmq.POLLOUT):
            raise CoordinatorUnavailable(
                f"cannot reach coordd at {self.address}" + _why(self._monitor)
            )
        self._sock.send(data, zmq.NOBLOCK)

    def _ready(self, seq: int) -> bool:
        self._read_available()
        return seq in self._results or self.session.failed is not None

    def _wait(self, seq: int, timeout: float | None) -> StepDecision:
        timeout = self.wait_timeout if timeout is None else timeout
        self._read_available()
        deadline = time.monotonic() + timeout
        while True:
            outcome = self._results.pop(seq, None)
            if outcome is not None:
                if isinstance(outcome, CoordError):
                    raise outcome
                return outcome
            if self.session.failed is not None:
                raise self.session.failed
            if not self._pump(deadline):
                raise StepTimeout((), timeout)

    def _read_available(self) -> None:
        # Try the first frame straight away: wait() mostly finds the decision queued, and a
        # cold getsockopt (a syscall plus pyzmq's enum lookup) costs more than the recv. After
        # it, EVENTS rather than recv-until-Again: raising zmq.Again costs several times that.
        sock = self._sock
        try:
            frame = sock.recv(_NOBLOCK)
        except zmq.Again:
            return
        self._on_frame(frame)
        while int(sock.getsockopt(_EVENTS)) & _POLLIN:
            self._on_frame(sock.recv(_NOBLOCK))

    def _pump(self, deadline: float, registering: bool = False) -> bool:
        """Wait for traffic until `deadline`; False if none came."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        events = dict(self._poller.poll(max(1, int(remaining * 1000))))
        if not events:
            return False
        if self._monitor in events and drain_disconnects(self._monitor) and not registering:
            self._read_available()  # what coordd sent before the close is still this rank's
            if self.session.failed is None:
                dropped = f"connection to coordd at {self.address} dropped"
                self._fail(CoordinatorUnavailable(dropped))
        if self._sock in events:
            self._read_available()
        return True

    def _on_frame(self, frame: bytes) -> None:
        try:
            msg = decode_from_coordinator(frame)
        except ProtocolError:
            return
        event = self.session.receive(msg)
        if type(event) is Resolved:
            self._results[event.seq] = event.outcome
        elif type(event) is Registered:
            self._welcome = event.welcome
        elif type(event) is RegistrationFailed:
            raise event.error
        elif type(event) is Pong:
            self._pong = event.nonce
        elif type(event) is GroupFailed:
            pass  # session.failed is set: every wait and start raises it

    def _fail(self, error: CoordError) -> CoordError:
        self.session.fail(error)
        return error


def _why(monitor: zmq.Socket) -> str:
    reason = handshake_failure(monitor)
    return f": {reason}" if reason else ""
