"""A rank on the device path registers with coordd again, in a thread of its own.

While its group runs on its own collective, each rank's `Rejoiner` tries coordd at
`RejoinPacing`'s pace and, once welcomed, keeps the registration alive with a ping every
`PING_EVERY` (a dead or restarted coordd is noticed and registered with again). The group reads
`epoch` for its vote (`coordd.client.switch.returns`) and, when every rank has the same one,
each rank `take()`s its client and runs its next round on coordd. Engine threads never wait on
coordd here, only for `take()`, which is a ping at most.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import msgspec

from coordd.client.switch import RejoinPacing
from coordd.client.sync import CoordClient
from coordd.proto.errors import CoordError

#: Seconds between two tries while coordd does not answer, and between two pings once it does.
RETRY_EVERY = 0.5
PING_EVERY = 0.5
#: Longest single try: a registration, or a ping.
TRY_TIMEOUT = 2.0


class Rejoiner:
    """Registers a fresh client from `make_client` with coordd and holds it until `take()`.

    `pacing` says when the first try may come (the flap back-off); later tries follow every
    RETRY_EVERY. `epoch` is 0 while no registration is held."""

    def __init__(
        self,
        make_client: Callable[[], CoordClient],
        pacing: RejoinPacing,
        name: str = "coordd-rejoin",
        clock: Callable[[], float] = time.monotonic,
        away_since: float | None = None,
    ) -> None:
        self._make_client = make_client
        #: When the group left coordd (`clock`'s time): each Hello says how long ago (`away_ms`),
        #: which coordd shows in /metrics and `coordd status`.
        self.away_since = away_since
        self._pacing = pacing
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._client: CoordClient | None = None
        self.epoch = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(RETRY_EVERY if self._client is None else PING_EVERY):
            if not self._pacing.may_try(self._clock()):
                continue
            with self._lock:
                if self._stop.is_set():
                    break
                if self._client is None:
                    self._register()
                else:
                    self._check()
        with self._lock:  # stopped (not taken) during a try: what it registered goes too
            self._close_held()

    def _register(self) -> None:
        client = self._make_client()
        if self.away_since is not None:
            session = client.session
            away_ms = max(1, int((self._clock() - self.away_since) * 1000))
            session.hello_message = msgspec.structs.replace(session.hello_message, away_ms=away_ms)
        try:
            welcome = client.connect(timeout=TRY_TIMEOUT)
        except CoordError:
            client.close(goodbye=False)
            return
        self._client, self.epoch = client, welcome.epoch

    def _check(self) -> None:
        assert self._client is not None
        try:
            self._client.ping(timeout=TRY_TIMEOUT)
        except CoordError:
            self._drop()

    def _drop(self) -> None:
        client, self._client, self.epoch = self._client, None, 0
        if client is not None:
            client.close(goodbye=False)

    def drop_stale(self) -> None:
        """The vote showed a newer registration than ours: register again."""
        with self._lock:
            self._drop()

    def take(self) -> CoordClient | None:
        """Stop trying and hand over the registered client (None if there is none now); waits
        for a try in progress (at most TRY_TIMEOUT)."""
        self._stop.set()
        with self._lock:
            client, self._client, self.epoch = self._client, None, 0
        return client

    def stop(self) -> None:
        """Stop trying and close what is held (Goodbye), never waiting for a try in progress:
        the thread closes what that try registers (a process on its way out must not wait)."""
        self._stop.set()
        if self._lock.acquire(blocking=False):
            try:
                self._close_held()
            finally:
                self._lock.release()

    def _close_held(self) -> None:
        client, self._client, self.epoch = self._client, None, 0
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
