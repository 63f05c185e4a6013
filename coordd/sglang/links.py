"""This process's coordd clients, one per group, each made and registered on the group's first
sync, said Goodbye to when the process exits normally.

Keyed by process id too: a process forked after a sync gets its own clients (a ZeroMQ socket
must not cross a fork). Nothing here is SGLang's: it could serve any engine plugin.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import threading
import time
import weakref
from typing import Any

import zmq

from coordd.client import CoordClient
from coordd.vllm.groups import GroupIdentity

#: Seconds `Links.close` waits for its ZeroMQ context to end (the Goodbyes to go out).
TERM_WAIT = 2.0
#: Seconds between looks for coordd's socket while a first sync waits for it to appear.
SOCKET_POLL = 0.1


#: Every `Links` with clients, and the processes whose exit closes them.
_LIVE: weakref.WeakSet[Links] = weakref.WeakSet()
_HOOKED: set[int] = set()


def _close_live() -> None:
    for links in list(_LIVE):
        if links._pid == os.getpid():
            links.close()


class Links:
    """The clients of this process, by group name."""

    def __init__(self, address: str | None, connect_timeout: float, sync_timeout: float) -> None:
        self.address = address
        self.connect_timeout = connect_timeout
        self.sync_timeout = sync_timeout
        self._clients: dict[str, tuple[GroupIdentity, CoordClient]] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._context: zmq.Context | None = None
        #: Rounds completed, by group (tests compare them with the syncs made).
        self.rounds: dict[str, int] = {}

    def client(self, identity: GroupIdentity) -> CoordClient:
        """The registered client of `identity`'s group; raises the client's CoordError
        (Rejected, CoordinatorUnavailable) if it cannot register within the connect timeout."""
        known = self._clients.get(identity.name)
        if known is not None and known[0] == identity and self._pid == os.getpid():
            return known[1]
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's sockets are not ours
                self._clients, self._context, self._pid = {}, None, os.getpid()
            known = self._clients.get(identity.name)
            if known is not None:
                if known[0] == identity:
                    return known[1]
                known[1].close()  # the group was rebuilt at another size: a new registration
            if self._context is None:
                self._context = zmq.Context()
            self._hook_exit()
            client = CoordClient(self.address, context=self._context, **self._options(identity))
            try:
                self._connect(client)
            except BaseException:  # never a half-registered client left open
                client.close()
                raise
            self._clients[identity.name] = (identity, client)
            return client

    def _options(self, identity: GroupIdentity) -> dict[str, Any]:
        """The client's settings for `identity`'s group (`coordd.client.ClientConfig`'s)."""
        return {
            "dp_rank": identity.dp_rank,
            "dp_size": identity.dp_size,
            "group": identity.name,
            "config_fingerprint": identity.fingerprint,
            "wait_timeout": self.sync_timeout,
        }

    def _connect(self, client: CoordClient) -> None:
        """Register within the connect timeout; a sidecar may start after the engine, so first
        wait (within the same timeout) for its ipc socket file to appear."""
        deadline = time.monotonic() + self.connect_timeout
        while client.connection.no_socket_file() is not None and time.monotonic() < deadline:
            time.sleep(SOCKET_POLL)
        client.connect(timeout=max(0.05, deadline - time.monotonic()))

    def drop(self, name: str) -> None:
        """Close a group's client without Goodbye: this rank broke the group's order, so coordd
        counts it lost and its peers are told at once instead of at the step timeout."""
        with self._lock:
            known = self._clients.pop(name, None)
        if known is not None:
            known[1].close(goodbye=False)

    def _hook_exit(self) -> None:
        """Close (Goodbye) at a normal exit: atexit for a plain interpreter, multiprocessing's
        exit finalizers for its children, which skip atexit. Once per process."""
        _LIVE.add(self)
        if os.getpid() in _HOOKED:
            return
        _HOOKED.add(os.getpid())
        atexit.register(_close_live)
        multiprocessing.util.Finalize(None, _close_live, exitpriority=100)

    def close(self) -> None:
        """Close every client (a Goodbye each); idempotent. The context's term is bounded by
        TERM_WAIT, so an exit path never hangs on a socket another thread still holds."""
        with self._lock:
            for _, client in self._clients.values():
                client.close()
            self._clients = {}
            context, self._context = self._context, None
        if context is not None and self._pid == os.getpid():
            ending = threading.Thread(target=context.term, name="coordd-term", daemon=True)
            ending.start()
            ending.join(TERM_WAIT)
