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
        self.connection = RankConnection.open(given, self.session.identity, context)
        self._closed = False

    @property
    def address(self) -> str:
        return self.connection.address
