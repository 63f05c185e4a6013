"""A rank that speaks the wire format by hand: the real client refuses to misbehave, this one can.

It sends whatever `StepReport` or `Hello` it is given (a skipped or repeated seq, the wrong kind,
another rank's id, a foreign protocol version) over a DEALER set up like the real client's, and
reads coordd's answers through the real client's `RankSession`, so apart from the one fault it
injects it behaves, and judges what it hears, exactly as a real rank does.
"""

from __future__ import annotations

import time

import msgspec
import zmq

from coordd.client.session import (
    GroupFailed,
    Pong,
    RankSession,
    Registered,
    RegistrationFailed,
    Resolved,
)
from coordd.client.transport import close_dealer, drain_disconnects, open_dealer
from coordd.proto.errors import CoordError, CoordinatorUnavailable, ProtocolError, StepTimeout
from coordd.proto.messages import (
    Heartbeat,
    Hello,
    StepDecision,
    StepKind,
    StepReport,
    Welcome,
    encode,
)
from coordd.proto.messages import decode_from_coordinator as decode


class RawRank:
    """One rank on a raw DEALER: `send` any message, `wait` for what coordd makes of it."""

    def __init__(
        self,
        address: str,
        *,
        dp_rank: int,
        dp_size: int,
        config_fingerprint: str,
        heartbeat_interval: float,
        heartbeat_timeout: float,
        context: zmq.Context | None = None,
    ) -> None:
        self.address = address
        self.session = RankSession(
            dp_rank=dp_rank, dp_size=dp_size, config_fingerprint=config_fingerprint
        )
        self._context = context or zmq.Context.instance()
        self._sock, self._monitor = open_dealer(
            self._context,
            address,
            self.session.identity,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
        )
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._results: dict[int, list[StepDecision | CoordError]] = {}
        self._welcome: Welcome | None = None
        self._pongs: set[int] = set()

    @property
    def epoch(self) -> int | None:
        return self.session.epoch

    @property
    def next_seq(self) -> int:
        return self.session.next_seq

    def register(self, timeout: float, hello: Hello | None = None) -> Welcome:
        """Send `hello` (default: this rank's proper one); raises `Rejected` or unavailable."""
        self._results.clear()
        self._welcome = None
        drain_disconnects(self._monitor)
        deadline = time.monotonic() + timeout
        if not self._sock.poll(int(timeout * 1000), zmq.POLLOUT):
            raise CoordinatorUnavailable(f"cannot reach coordd at {self.address}")
        self._sock.send(encode(hello or self.session.hello_message), zmq.NOBLOCK)
        while self._welcome is None:
            if not self._pump(deadline, registering=True):
                raise CoordinatorUnavailable(f"no answer from coordd within {timeout:g}s")
        return self._welcome

    def stamp(
        self, report: StepReport, kind: StepKind, *, seq: int | None = None, dp_rank: int = -1
    ) -> StepReport:
        """`report` in this rank's envelope; `seq`/`dp_rank` override what a real rank would put."""
        if self.session.failed is not None:
            raise self.session.failed
        assert self.session.epoch is not None, "register first"
        return msgspec.structs.replace(
            report,
            dp_rank=self.session.dp_rank if dp_rank < 0 else dp_rank,
            epoch=self.session.epoch,
            seq=self.session.next_seq if seq is None else seq,
            kind=kind,
        )

    def send(self, message: StepReport) -> None:
        try:
            self._sock.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            raise self.session.fail(
                CoordinatorUnavailable(f"cannot send to coordd at {self.address}: no connection")
            ).error from None

    def advance(self) -> None:
        """This rank's round is reported: the next one gets the next seq."""
        self.session.next_seq += 1

    def wait(self, seq: int, timeout: float) -> StepDecision:
        """The next outcome for `seq`: its decision, or the error it (or the group) ended with."""
        deadline = time.monotonic() + timeout
        self._read_available()
        while True:
            queue = self._results.get(seq)
            if queue:
                outcome = queue.pop(0)
                if isinstance(outcome, CoordError):
                    raise outcome
                return outcome
            if self.session.failed is not None:
                raise self.session.failed
            if not self._pump(deadline):
                raise StepTimeout((), timeout)

    def ping(self, timeout: float) -> bool:
        """True if coordd echoes a heartbeat within `timeout`."""
        nonce = time.monotonic_ns()
        self._sock.send(encode(Heartbeat(nonce=nonce)), zmq.NOBLOCK)
        deadline = time.monotonic() + timeout
        while nonce not in self._pongs:
            if not self._pump(deadline):
                return False
        return True

    def close(self) -> None:
        close_dealer(self._sock, self._monitor)

    def _read_available(self) -> None:
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frame)
            except ProtocolError:
                continue
            event = self.session.receive(msg)
            if type(event) is Resolved:
                self._results.setdefault(event.seq, []).append(event.outcome)
            elif type(event) is Registered:
                self._welcome = event.welcome
            elif type(event) is RegistrationFailed:
                raise event.error
            elif type(event) is Pong:
                self._pongs.add(event.nonce)
            elif type(event) is GroupFailed:
                pass  # session.failed is set; wait() raises it

    def _pump(self, deadline: float, registering: bool = False) -> bool:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        events = dict(self._poller.poll(max(1, int(remaining * 1000))))
        if not events:
            return False
        if self._monitor in events and drain_disconnects(self._monitor) and not registering:
            self.session.fail(CoordinatorUnavailable("connection to coordd dropped"))
        if self._sock in events:
            self._read_available()
        return True
