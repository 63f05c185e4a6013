"""Claimed automatic routing ids, found before libzmq's counter reaches them (issue 11).

libzmq names a peer that presents no routing id `\\x00` + a 32-bit counter, which moves by
one per such connection, and aborts coordd if a peer already holds the name it generates
(see `coordd.identity`). The counter starts at a secret value, but a peer holding many ids
spread over the 2**32 values and opening id-less connections fast hits one in minutes. coordd
cannot see a connection's routing id, but it can send to one: with ROUTER_MANDATORY a send to
an id nobody holds fails (EHOSTUNREACH). So after connections are accepted, coordd reads the
counter (an id-less peer of its own, over inproc) and probes the ids just ahead of it: an id
held there was chosen by a peer (libzmq generated only ids behind the counter). Found, every
connection that holds no rank is shut down.

This module is the decision, without sockets: when to read the counter, which ids to probe,
what a held id means. The daemon (`coordd.server`) does the socket work.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: Ids probed ahead of the counter at least (at most this many connections between two looks).
MARGIN = 256
#: A look at most this often (seconds); its window covers twice the connections of the last.
PERIOD = 0.5
#: Probes per loop turn (~2.4 us each, measured: about 0.6 ms a turn).
CHUNK = 256

_SPACE = 1 << 32


class ClaimWatch:
    """When to read libzmq's counter, which ids ahead of it to probe, and whether a held id
    is a claim. Idle (no connection accepted since the last look): nothing to do."""

    def __init__(
        self,
        margin: int = MARGIN,
        period: float = PERIOD,
        chunk: int = CHUNK,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.margin = margin
        self.period = period
        self.chunk = chunk
        self.clock = clock
        #: connections accepted since the counter was last read
        self.accepted_since_read = 0
        #: connections accepted in the look before this one's read (sets the window)
        self._last_period = 0
        self.counter: int | None = None
        self.reading = False
        self._next = 0  # next offset to probe ahead of `counter`
        self._window = 0
        self._next_look = 0.0
        #: claims found (ids held ahead of the counter), probes sent, looks taken
        self.claims = 0
        self.probes = 0
        self.looks = 0

    def accepted(self) -> None:
        """A connection was accepted: the counter may move by one when it attaches."""
        self.accepted_since_read += 1

    def want_read(self) -> bool:
        """Whether to read the counter now: connections were accepted, no reading is under
        way, and either the last window is probed and a period has passed, or the counter may
        have moved through half the window (a burst: read again at once, even mid-window)."""
        if self.accepted_since_read == 0 or self.reading:
            return False
        if 2 * self.accepted_since_read >= self._window:
            return True
        return self._next >= self._window and self.clock() >= self._next_look

    def start_read(self) -> None:
        self.reading = True
        self._next_look = self.clock() + self.period

    def read(self, counter: int) -> None:
        """The counter's value (the id libzmq gave coordd's own id-less peer): probe the ids
        after it, a window twice the connections accepted since the last read (or MARGIN)."""
        self.reading = False
        self.looks += 1
        self.counter = counter
        self._window = max(self.margin, 2 * max(self.accepted_since_read, self._last_period))
        self._last_period = self.accepted_since_read
        self.accepted_since_read = 0
        self._next = 0

    def read_failed(self) -> None:
        """The reading was lost: the next turn may read again."""
        self.reading = False
        self._next_look = self.clock()

    def probing(self) -> bool:
        return self._next < self._window and self.counter is not None

    def next_chunk(self) -> list[int]:
        """The next ids (counter values) to probe, at most `chunk`; never one libzmq may have
        generated since the read (one per connection accepted since): an honest id-less peer
        would get the probe's empty frame."""
        if self.counter is None:
            return []
        self._next = max(self._next, min(self._window, self.accepted_since_read))
        end = min(self._window, self._next + self.chunk)
        values = [(self.counter + 1 + k) % _SPACE for k in range(self._next, end)]
        self._next = end
        self.probes += len(values)
        return values

    def held(self, value: int) -> bool:
        """A probe found `value` held: a claim if it is ahead of every id libzmq can have
        generated since the read (one per connection accepted since then); True if so."""
        if self.counter is None:
            return False
        ahead = (value - self.counter) % _SPACE
        if ahead <= self.accepted_since_read:
            return False  # possibly an id-less connection's own, generated since the read
        self.claims += 1
        return True

    def found(self) -> None:
        """Claims were found and connections shut: stop this window, look again soon."""
        self._next = self._window
        self._next_look = self.clock()
