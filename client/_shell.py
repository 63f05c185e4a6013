"""What the blocking and the asyncio client share: the settings, the session, the connection.

A shell adds only how it waits; everything it reads about the rank comes from here, so the two
clients cannot drift apart on what `address`, `epoch` or `dp_rank` mean.
"""

from __future__ import annotations

from typing import Any

import zmq

from coordd.client._config import ClientConfig
from coordd.client._registration import Registration
from coordd.client._session import RankSession, SessionView
from coordd.client._transport import RankConnection
from coordd.proto.errors import CoordinatorUnavailable
from coordd.proto.messages import Hello


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
        #: The last round whose answer a wait collected: (seq, registration, microseconds the
        #: wait blocked), told to coordd with the next report (`StepReport.waited_us`).
        self._waited: tuple[int, int, int] = (-2, -1, -1)

    def _waited_before(self, session: RankSession) -> int:
        """How long the wait for this rank's previous round (the seq before the next, this
        registration) blocked, in microseconds; -1 if no wait collected it."""
        seq, registration, waited = self._waited
        if seq == session.next_seq - 1 and registration == session.registration:
            return waited
        return -1

    def reopen_if_dropped(self) -> bool:
        """Before a registration: if the connection ever dropped, replace it with a new one
        under a fresh routing id; True if it did.

        libzmq reconnects a dropped DEALER under its old routing id. When only this side of
        the connection died (a path that failed one way), coordd still holds the old
        connection under that id and, with ROUTER_HANDOVER off (see coordd.io._identity), never
        reads the new one: every connect() would go unanswered. A fresh id is read at once;
        until coordd notices the old connection gone, the Hello is refused `rank_taken`."""
        if not self.connection.dropped:
            return False
        self.connection.close()
        self.connection = RankConnection.open(
            self._given, self.session.new_identity(), self._context
        )
        return True

    def begin_registration(
        self, timeout: float, now: float, hello: Hello | None = None
    ) -> Registration:
        """Read the monitor (the registration's first step looks at whether the connection
        ever dropped), then begin a registration (`Registration`) for the shell to step.

        A first registration to an ipc path with no socket file (nor coordd's lock file or
        set-aside socket beside it) fails at once: no coordd is there to answer. A later one
        (coordd restarting) waits for the socket until its deadline, as a tcp address does."""
        if self.session.welcome is None:
            missing = self.connection.no_socket_file()
            if missing is not None:
                raise CoordinatorUnavailable(f"cannot reach coordd at {self.address}{missing}")
        self.connection.disconnected()
        return Registration(self.session, timeout, now, hello)

    @property
    def address(self) -> str:
        return self.connection.address
