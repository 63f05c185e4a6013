"""The handshake rate (`--max-handshake-rate`) and the arithmetic behind it, pure: the time
is passed in. `coordd.io.gate` says why coordd bounds handshakes and asks this in its ZAP
handler."""

from __future__ import annotations

from dataclasses import dataclass, field

from coordd.core.bounds import BoundedMap, TokenBucket

#: One source's share of that rate, and of the burst (at least MIN_SOURCE_BURST): one fresh
#: source took the whole shared burst in its first second, leaving the others the refill.
SOURCE_SHARE = 1 / 8
MIN_SOURCE_BURST = 64
#: A reserve of the shared burst (at least one handshake) that only a quiet source may take:
#: one whose own bucket is full (it has not connected lately: a rank's process connecting,
#: an engine starting). Busy sources take the shared budget only above it, so however many of
#: them keep handshakes in flight (16 same-uid processes took every token of the shared rate,
#: and an honest connect() failed in 2-3 of 3 tries), a rank's first handshake finds a token.
RESERVE_SHARE = 1 / 8
#: Sources remembered (least recently seen forgotten first: a forgotten one starts afresh,
#: which the shared budget still bounds).
MAX_SOURCES = 4096
#: The automatic routing ids a ROUTER can give: the `2^32` of the arithmetic above.
ROUTING_ID_SPACE = 1 << 32


def hits_per_second(rate: float, grace: float, cap: int | None = None) -> float:
    """The most `held names x id-less connections a second` an attacker gets out of `rate`
    admitted handshakes a second, when each name is held at most `grace` seconds a handshake
    and at most `cap` connections at once: it spends x a second on id-less connections and
    the rest on names, holding (rate - x) * grace of them; x = rate / 2 is best."""
    held = rate * grace / 2
    if cap is not None and held > cap:
        held = cap
    return held * (rate - held / grace)


def mean_seconds_to_abort(rate: float, grace: float, cap: int | None = None) -> float:
    """Mean time for such an attacker to make libzmq give an id-less connection a name it
    holds (the counter's start is secret, so each new name hits with probability held/2^32)."""
    return ROUTING_ID_SPACE / max(hits_per_second(rate, grace, cap), 1e-12)


@dataclass
class HandshakeRate:
    """At most `rate` handshakes a second from all sources and `rate * share` from one;
    `burst` at once from all (a whole engine's ranks connect together at start), `burst *
    share` from one (at least MIN_SOURCE_BURST: a host's ranks). The last `burst * reserve`
    tokens of the shared budget (at least one) go only to quiet sources (RESERVE_SHARE).
    Pure: the time is passed in."""

    rate: float
    burst: float
    share: float = SOURCE_SHARE
    reserve: float = RESERVE_SHARE
    max_sources: int = MAX_SOURCES
    #: refused: the source over its share, or all sources over the rate
    refused_source: int = 0
    refused_total: int = 0
    #: admitted from the reserve (a quiet source while busy ones had spent the rest)
    reserved: int = 0
    _all: TokenBucket = field(init=False)
    _floor: float = field(init=False)
    _source_burst: float = field(init=False)
    _sources: BoundedMap[bytes, TokenBucket] = field(init=False)

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.burst < 1:
            raise ValueError(f"rate must be > 0 and burst >= 1, got {self.rate}, {self.burst}")
        self._all = TokenBucket(self.rate, self.burst)
        self._source_burst = min(self.burst, max(MIN_SOURCE_BURST, self.burst * self.share))
        self._floor = min(self.burst - 1.0, max(1.0, self.burst * self.reserve))
        self._sources = BoundedMap(self.max_sources)

    def admit(self, source: bytes, now: float) -> bool:
        """One handshake from `source` at `now`: admitted (and counted) or not. A source over
        its share spends nothing of the shared budget; a busy one (its own bucket not full)
        only what is above the reserve."""
        bucket = self._sources.get(source)
        if bucket is None:
            bucket = TokenBucket(self.rate * self.share, self._source_burst, now)
            self._sources.put(source, bucket)
        else:
            self._sources.touch(source)
        if not bucket.ready(now):
            self.refused_source += 1
            return False
        quiet = bucket.tokens >= self._source_burst - 1.0
        shared = self._all
        shared.ready(now)
        if shared.tokens - 1.0 < (0.0 if quiet else self._floor):
            self.refused_total += 1
            return False
        if shared.tokens - 1.0 < self._floor:
            self.reserved += 1
        shared.tokens -= 1.0
        bucket.tokens -= 1.0
        return True

    @property
    def refused(self) -> int:
        return self.refused_source + self.refused_total
