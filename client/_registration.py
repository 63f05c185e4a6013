"""One `connect()`, sans-IO: the Hello, its resends over new connections, the deadline, the verdict.

Both clients (blocking and asyncio) step the same `Registration`, so the rules of a
registration are written once and a fix reaches both. No sockets and no clocks here: the shell
passes in its connection's state (what its monitor told it) and the time, and does what each
step names:

- `REOPEN`: replace the connection with a new one under a fresh routing id
  (`ClientShell.reopen_if_dropped`), and watch the new one;
- `SEND`: send `data` (the Hello) over the connection, before `deadline`, or fail unreachable;
- `WAIT`: wait until something comes (a frame, a monitor event) or `deadline` passes;
- `DONE`: registered; `welcome` is coordd's answer.

A registration that cannot succeed raises from `next_step`; the shell passes that error, and
any `CoordinatorUnavailable` of its own (a failed send, a broken socket), to `abort`, which
fails the session with it.

The rules:
- A connection that ever dropped is replaced before the Hello: libzmq would reconnect it under
  its old routing id, which coordd may still hold for the old connection.
- The Hello is sent once. If the connection drops after its handshake and before coordd's
  answer, the Hello (or coordd's Welcome) was lost with it: libzmq reconnects but sends nothing
  again, so the same Hello goes again over a new connection, in the same registration and
  deadline, at most `HELLO_RESENDS` times. (A drop before the handshake needs nothing: the
  queued Hello survives it.)
- coordd's `Welcome` ends it (DONE); a `Reject` raises its `Rejected`; a handshake that will fail
  the same way every retry (a wrong key) raises `CoordinatorUnavailable` at once; no answer by
  the deadline raises `CoordinatorUnavailable` saying how many times the Hello went.
"""

from __future__ import annotations

import enum
from typing import Protocol

from coordd.client._session import GroupFailed, RankSession
from coordd.proto.errors import CoordError, CoordinatorUnavailable
from coordd.proto.messages import Hello, Welcome, encode

#: How many times one registration sends its Hello again over a new connection, when the
#: connection drops before coordd's answer.
HELLO_RESENDS = 3


class Step(enum.Enum):
    """What the shell does next for a registration (see the module's list)."""

    REOPEN = "reopen"
    SEND = "send"
    WAIT = "wait"
    DONE = "done"


class ConnectionState(Protocol):
    """What a registration reads of the shell's connection (`RankConnection`): its monitor's
    findings, as of the shell's last read of the monitor."""

    @property
    def dropped(self) -> bool: ...

    @property
    def lost_after_handshake(self) -> bool: ...

    @property
    def handshake_refused(self) -> bool: ...

    @property
    def handshake_failure(self) -> str | None: ...

    @property
    def handshake_hint(self) -> str: ...

    def where(self) -> str: ...

    def why_unreachable(self) -> str: ...


class Registration:
    """One registration's state: begun at construction (`RankSession.hello`), then stepped."""

    def __init__(
        self,
        session: RankSession,
        timeout: float,
        now: float,
        hello: Hello | None = None,
        resends: int = HELLO_RESENDS,
    ) -> None:
        own = session.hello()
        self.session = session
        self.timeout = timeout
        self.deadline = now + timeout
        #: The Hello's bytes (this rank's own, or `hello`: a test peer's forgery).
        self.data = encode(own if hello is None else hello)
        self.resends = resends
        #: Resends left to this registration.
        self.resends_left = resends
        self.welcome: Welcome | None = None
        self._queued: list[Step] | None = None

    def next_step(self, connection: ConnectionState, now: float) -> Step:
        """What to do next, given the connection's state and the time; raises the error that
        ends the registration (pass it to `abort`)."""
        queued = self._queued
        if queued is None:  # the first step
            if connection.handshake_refused:  # seen before connect(): no new connection helps
                raise _refused(connection)
            self._queued = queued = [Step.REOPEN, Step.SEND] if connection.dropped else [Step.SEND]
        if queued:
            return queued.pop(0)
        session = self.session
        if not session.registering:  # answered
            if session.failed is not None:
                raise session.failed  # the Reject's `Rejected` (the session holds it)
            self.welcome = session.welcome
            return Step.DONE
        if connection.handshake_refused:  # it fails the same way every retry: say so now
            raise _refused(connection)
        if now >= self.deadline:
            raise self.no_answer(connection)
        if connection.lost_after_handshake and self.resends_left > 0:
            self.resends_left -= 1
            queued.append(Step.SEND)
            return Step.REOPEN
        return Step.WAIT

    def no_answer(self, connection: ConnectionState) -> CoordinatorUnavailable:
        """The error of a registration that got no answer within its timeout."""
        resent = self.resends - self.resends_left
        dropped = (
            f" (its connection dropped before coordd answered: the Hello went {resent + 1} times)"
            if resent > 0
            else ""
        )
        return CoordinatorUnavailable(
            f"no answer from coordd within {self.timeout:g}s{dropped}"
            + connection.why_unreachable()
        )

    def abort(self, error: CoordError) -> GroupFailed | None:
        """The registration ended in `error`: a `CoordinatorUnavailable` fails the session with
        it (a `Rejected` already did, as the session received it). Returns the session's event
        (a `GroupFailed`), or None."""
        if isinstance(error, CoordinatorUnavailable):
            return self.session.registration_failed(error)
        return None


def check_unsent(connection: ConnectionState, address: str, deadline: float, now: float) -> None:
    """While a frame waits for a pipe to coordd (the shell read the monitor first): raise if
    none will come in time. libzmq ends a connection's pipe at a protocol error (no CURVE at a
    CURVE coordd), so a refused handshake is said at once, not at the deadline."""
    if connection.handshake_refused:
        raise _refused(connection)
    if now >= deadline:
        raise CoordinatorUnavailable(
            f"cannot reach coordd at {address}" + connection.why_unreachable()
        )


def _refused(connection: ConnectionState) -> CoordinatorUnavailable:
    """A handshake refusal that every retry would repeat, with what to do about it."""
    return CoordinatorUnavailable(
        f"coordd refused the connection ({connection.where()}): {connection.handshake_failure}",
        hint=connection.handshake_hint,
    )
