"""The handshake rate (`--max-handshake-rate`) and the arithmetic behind it, pure: the time
is passed in. `coordd.io._gate` says why coordd bounds handshakes and asks this in its ZAP
handler."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from coordd.core._bounds import BoundedMap, TokenBucket
from coordd.core._daemon_defaults import DEFAULT_HANDSHAKE_IPV4_PREFIX

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
#: Quiet is earned, not given: a source counts as quiet only once it registered a rank
#: (`earn`) or its first try is at least this long ago (a rank's process retrying after a
#: refusal: answered REFUSAL_DELAY = 1 s late, it tries again 0.1 s later). A fresh source is
#: not: a stream of freshly forked processes (~295 a second, 2 handshakes each) took the
#: reserve and was answered first, and an honest connect(timeout=10) failed 3 times of 3.
EARN_WAIT = 1.0
#: Sources remembered (least recently seen forgotten first: a forgotten one starts afresh,
#: which the shared budget still bounds); as many groups.
MAX_SOURCES = 4096
#: The automatic routing ids a ROUTER can give: the `2^32` of the arithmetic above.
ROUTING_ID_SPACE = 1 << 32
#: A tcp source's group (`source_group`) gets this share of the rate, and the whole burst (a
#: cluster's ranks may all sit in one /24 and connect together): an attacker with many
#: addresses of one group (127.0.0.0/8 on the host, an IPv6 /64) took one share per address,
#: and each fresh address counted as quiet, so it took the reserve too. A source is quiet only
#: if its group is, and a group's handshakes leave the other half of the rate to the others.
GROUP_SHARE = 1 / 2
#: An IPv4 address's group is its /IPV4_PREFIX (`--handshake-ipv4-prefix`), an IPv6 one's its
#: /IPV6_PREFIX (what one host is routed), every loopback address one group.
IPV4_PREFIX = DEFAULT_HANDSHAKE_IPV4_PREFIX
IPV6_PREFIX = 64
#: The group of every loopback address: 127.0.0.0/8, ::1 and their IPv4-mapped forms.
LOOPBACK = b"loopback"


def source_group(address: bytes, key: bytes = b"", ipv4_prefix: int = IPV4_PREFIX) -> bytes | None:
    """The group a handshake from ZAP address `address` is charged to besides its source:
    with a CURVE client key (`key`, z85, one coordd admitted) the key, whatever the address
    (a key cannot be made up; a leaked one from many addresses is one group); else, for an IP
    address, loopback, its IPv4 /`ipv4_prefix` or its IPv6 /64. None for anything else (an
    ipc peer's `localhost:uid:gid:pid`: its process is its source, alone)."""
    if key:
        return b"key:" + key
    if address.startswith(b"localhost:"):
        return None
    try:
        ip = ipaddress.ip_address(address.decode("ascii").split("%", 1)[0])
    except (UnicodeDecodeError, ValueError):
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return LOOPBACK
    prefix = ipv4_prefix if isinstance(ip, ipaddress.IPv4Address) else IPV6_PREFIX
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False)).encode()


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
    group_share: float = GROUP_SHARE
    ipv4_prefix: int = IPV4_PREFIX
    #: refused: the source over its share, its group over the group's, or all over the rate
    refused_source: int = 0
    refused_group: int = 0
    refused_total: int = 0
    #: refused as busy while only quiet sources are admitted (memory pressure)
    refused_busy: int = 0
    #: admitted from the reserve (a quiet source while busy ones had spent the rest)
    reserved: int = 0
    _all: TokenBucket = field(init=False)
    _floor: float = field(init=False)
    _source_burst: float = field(init=False)
    _sources: BoundedMap[bytes, TokenBucket] = field(init=False)
    #: each source's tries, admitted or not (whether it is quiet)
    _tries: BoundedMap[bytes, TokenBucket] = field(init=False)
    #: when each source first tried (quiet needs EARN_WAIT since), and the sources that
    #: registered a rank (quiet as soon as their tries allow)
    _first: BoundedMap[bytes, float] = field(init=False)
    _earned: BoundedMap[bytes, None] = field(init=False)
    _groups: BoundedMap[bytes, TokenBucket] = field(init=False)
    #: each address's group, once worked out (an address keeps coming back)
    _group_of: BoundedMap[tuple[bytes, bytes], bytes | None] = field(init=False)

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.burst < 1:
            raise ValueError(f"rate must be > 0 and burst >= 1, got {self.rate}, {self.burst}")
        if not 0 <= self.ipv4_prefix <= 32:
            raise ValueError(f"ipv4_prefix must be in 0..32, got {self.ipv4_prefix}")
        self._all = TokenBucket(self.rate, self.burst)
        self._source_burst = min(self.burst, max(MIN_SOURCE_BURST, self.burst * self.share))
        self._floor = min(self.burst - 1.0, max(1.0, self.burst * self.reserve))
        self._sources = BoundedMap(self.max_sources)
        self._tries = BoundedMap(self.max_sources)
        self._first = BoundedMap(self.max_sources)
        self._earned = BoundedMap(self.max_sources)
        self._groups = BoundedMap(self.max_sources)
        self._group_of = BoundedMap(self.max_sources)

    @staticmethod
    def _bucket(
        table: BoundedMap[bytes, TokenBucket], name: bytes, rate: float, burst: float, now: float
    ) -> TokenBucket:
        bucket = table.get(name)
        if bucket is None:
            bucket = TokenBucket(rate, burst, now)
            table.put(name, bucket)
        else:
            table.touch(name)
        return bucket

    def group_of(self, address: bytes, key: bytes = b"") -> bytes | None:
        """`source_group` with this rate's IPv4 prefix."""
        try:
            return self._group_of[address, key]
        except KeyError:
            group = source_group(address, key, self.ipv4_prefix)
            self._group_of.put((address, key), group)
            return group

    def earn(self, source: bytes) -> None:
        """`source` registered a rank: quiet from now on whenever its tries allow."""
        self._earned.put(source, None)

    def _earned_quiet(self, source: bytes, now: float) -> bool:
        """Whether `source` has earned being quiet: it registered a rank, or it first tried
        EARN_WAIT ago or more (a fresh one has not)."""
        if source in self._earned:
            return True
        first = self._first.get(source)
        return first is not None and now - first >= EARN_WAIT

    def quiet(self, source: bytes, now: float) -> bool:
        """Whether `source` has earned quiet (`_earned_quiet`) and tried no handshake for a
        while (its tries' bucket is full): the gate answers such sources first (a rank's
        process, not one that keeps trying, nor one never seen)."""
        if not self._earned_quiet(source, now):
            return False
        tries = self._tries.get(source)
        if tries is None:
            return True
        tries.ready(now)
        return tries.tokens >= self._source_burst - 1.0

    def admit(
        self, source: bytes, now: float, group: bytes | None = None, *, quiet_only: bool = False
    ) -> bool:
        """One handshake from `source` (of `group`: `source_group`) at `now`: admitted (and
        counted) or not. A source over its share, or of a group over the group's, spends
        nothing of the shared budget; a busy one (its own bucket or its group's not full)
        only what is above the reserve. `quiet_only` (coordd over its memory budget): only a
        quiet source is admitted, within the rate, and it takes its whole share (one
        handshake, then busy until its bucket is full again); a busy one is refused
        (`refused_busy`), spending nothing: the handshakes in flight that grew coordd keep no
        rank out."""
        bucket = self._bucket(
            self._sources, source, self.rate * self.share, self._source_burst, now
        )
        # every try counts for whether a source is quiet, admitted or not, so that sources
        # refused at the shared limit are not counted quiet and take the reserve
        tries = self._bucket(self._tries, source, self.rate * self.share, self._source_burst, now)
        tries.ready(now)
        if self._first.get(source) is None:
            self._first.put(source, now)
        else:
            self._first.touch(source)
        tried = self._earned_quiet(source, now) and tries.tokens >= self._source_burst - 1.0
        tries.tokens = max(0.0, tries.tokens - 1.0)
        if not bucket.ready(now):
            self.refused_source += 1
            return False
        quiet = tried and bucket.tokens >= self._source_burst - 1.0
        grouped = None
        if group is not None and group != source:
            grouped = self._bucket(
                self._groups, group, self.rate * self.group_share, self.burst, now
            )
            if not grouped.ready(now):
                self.refused_group += 1
                return False
            quiet = quiet and grouped.tokens >= self.burst - 1.0
        if quiet_only and not quiet:
            self.refused_busy += 1
            return False
        shared = self._all
        shared.ready(now)
        if shared.tokens - 1.0 < (0.0 if quiet else self._floor):
            self.refused_total += 1
            return False
        if shared.tokens - 1.0 < self._floor:
            self.reserved += 1
        shared.tokens -= 1.0
        # under pressure a source gets one handshake, then is busy until its share refills
        bucket.tokens = 0.0 if quiet_only else bucket.tokens - 1.0
        if grouped is not None:
            grouped.tokens -= 1.0
        return True

    @property
    def refused(self) -> int:
        return self.refused_source + self.refused_group + self.refused_total
