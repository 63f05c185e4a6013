"""What a peer may cost coordd, each rule written once (pure: the time is passed in).

- `BoundedMap`: a table a peer can grow (one entry per routing id, key or address it shows),
  capped: the least recently put (or touched) entry goes first.
- `TokenBucket`: at most `rate` events a second, `burst` at once (answers to strangers, the
  handshake rate's shared and per-source budgets).
- `Throttle`: which log lines of one kind are written: at most one per key per interval (and
  at most `lines` per interval over all keys); the rest are counted into the next line.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedMap(OrderedDict[K, V], Generic[K, V]):
    """A dict of at most `limit` entries: `put` inserts (or refreshes) an entry as the newest
    and drops the oldest beyond the limit; `touch` makes an entry the newest (least recently
    used first out)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        super().__init__()
        self.limit = limit

    def put(self, key: K, value: V) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)

    def touch(self, key: K) -> None:
        if key in self:
            self.move_to_end(key)


class TokenBucket:
    """At most `rate` tokens a second and `burst` at once; full at the start. Time never runs
    backwards here (an earlier `now` refills nothing)."""

    __slots__ = ("at", "burst", "rate", "tokens")

    def __init__(self, rate: float, burst: float, now: float = float("-inf")) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.at = now

    def ready(self, now: float) -> bool:
        """Refill to `now`; whether a token is there (not taken)."""
        if now > self.at:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
        return self.tokens >= 1.0

    def take(self, now: float) -> bool:
        """Refill to `now` and take a token; False (nothing taken) if none is there."""
        if not self.ready(now):
            return False
        self.tokens -= 1.0
        return True


class Throttle:
    """Which of a kind of log lines get written: at most one per key per `interval` and, with
    `lines`, at most `lines` per interval over all keys (the window starts at its first line).
    `admit` says yes or counts a line held back; `held(key)` / `held_all()` give (and reset)
    how many were held back since the key's last line / since the last line of any key, for the
    next line's `suppressed=N`. At most `keys` keys are remembered (least recently seen first
    out: a forgotten key's next line is admitted, which `lines` still bounds)."""

    def __init__(self, interval: float, *, keys: int = 1024, lines: int | None = None) -> None:
        self.interval = interval
        self.lines = lines
        #: key -> [when its last line was admitted, lines held back since]
        self._keys: BoundedMap[Hashable, list[float]] = BoundedMap(keys)
        self._window = (float("-inf"), 0)
        self._held_all = 0

    def admit(self, key: Hashable, now: float) -> bool:
        entry = self._keys.get(key)
        if entry is not None and now - entry[0] < self.interval:
            entry[1] += 1
            self._keys.move_to_end(key)
            self._held_all += 1
            return False
        if self.lines is not None:
            start, count = self._window
            if now - start >= self.interval:
                start, count = now, 0
            if count >= self.lines:
                self._held_all += 1
                return False
            self._window = (start, count + 1)
        held = entry[1] if entry is not None else 0
        self._keys.put(key, [now, held])
        return True

    def held(self, key: Hashable) -> int:
        entry = self._keys.get(key)
        if entry is None:
            return 0
        count, entry[1] = int(entry[1]), 0
        return count

    def held_all(self) -> int:
        count, self._held_all = self._held_all, 0
        return count

    def __len__(self) -> int:
        """How many keys are remembered."""
        return len(self._keys)
