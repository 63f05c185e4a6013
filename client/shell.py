"""What the blocking and the asyncio client share: the settings, the session, the connection.

A shell adds only how it waits; everything it reads about the rank comes from here, so the two
clients cannot drift apart on what `address`, `epoch` or `dp_rank` mean.
"""

from __future__ import annotations

from typing import Any

import zmq

from coordd.client.config import ClientConfig
from coordd.client.session import RankSession, SessionView
from coordd.client.transport import RankConnection
from coordd.proto.errors import CoordinatorUnavailable

#: How many times one registration sends its Hello again over a new connection, when the
#: connection drops before coordd's answer (see `ClientShell.hello_lost`).
HELLO_RESENDS = 3


class ClientShell(SessionView):
    """The parts of a rank's client that do not wait: built once from one `ClientConfig`."""

    def __init__(
        self,
        address: str | None = None,
        *,
        config: ClientConfig | None = None,
        context: zmq.Context | None = None,
        **options: Any,
    ) -> None:
        given = ClientConfig.of(config, address=address, **options)
        self.config = given.resolved()
        self.session = RankSession(self.config)
        # from `given`: the connection's errors say where the address came from
        self._given = given
        self._context = context
        self.connection = RankConnection.open(given, self.session.identity, context)
        self._closed = False
        #: Resends left to the registration in progress (`HELLO_RESENDS` at its start).
        self.resends_left = 0

    def reopen_if_dropped(self) -> bool:
        """Before a registration: if the connection ever dropped, replace it with a new one
        under a fresh routing id; True if it did.

        libzmq reconnects a dropped DEALER under its old routing id. When only this side of
        the connection died (a path that failed one way), coordd still holds the old
        connection under that id and, with ROUTER_HANDOVER off (see coordd.io.identity), never
        reads the new one: every connect() would go unanswered. A fresh id is read at once;
        until coordd notices the old connection gone, the Hello is refused `rank_taken`."""
        if not self.connection.dropped:
            return False
        self.connection.close()
        self.connection = RankConnection.open(
            self._given, self.session.new_identity(), self._context
        )
        return True

    def hello_lost(self) -> bool:
        """While registering, after the monitor was read: True if the connection dropped after
        its handshake and this registration may still send its Hello again (the caller then
        does so over `reopen_for_hello()`'s connection).

        coordd shut the connection (a flood cut-off, the memory guard, the stranger grace) or
        the network dropped it: the Hello, or coordd's Welcome, was lost with it. libzmq
        reconnects, but sends nothing again, and connect() would wait out its whole timeout
        though a new Hello is answered at once."""
        return self.resends_left > 0 and self.connection.lost_after_handshake

    def reopen_for_hello(self) -> None:
        """The connection for sending the Hello again: a new one under a fresh routing id, as
        after any drop (`reopen_if_dropped`); takes one of the registration's resends."""
        self.resends_left -= 1
        self.reopen_if_dropped()

    def no_answer(self, timeout: float) -> CoordinatorUnavailable:
        """The error of a registration that got no answer within `timeout`."""
        resent = HELLO_RESENDS - self.resends_left
        dropped = (
            f" (its connection dropped before coordd answered: the Hello went {resent + 1} times)"
            if resent > 0
            else ""
        )
        return CoordinatorUnavailable(
            f"no answer from coordd within {timeout:g}s{dropped}"
            + self.connection.why_unreachable()
        )

    @property
    def address(self) -> str:
        return self.connection.address
