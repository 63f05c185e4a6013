"""coordd.core.handshake's rate and the arithmetic behind it (pure: the time is passed in)."""

from __future__ import annotations

import pytest

from coordd.core import defaults
from coordd.core.defaults import DEFAULT_HANDSHAKE_RATE
from coordd.core.handshake import (
    SOURCE_SHARE,
    HandshakeRate,
    hits_per_second,
    mean_seconds_to_abort,
)

IPC = b"localhost:1000:1000:4242"
OTHER = b"localhost:1000:1000:4343"


def test_a_burst_is_admitted_then_one_source_gets_its_share() -> None:
    rate = HandshakeRate(rate=80, burst=128)  # one source: 64 at once
    assert all(rate.admit(IPC, 0.0) for _ in range(64))
    assert not rate.admit(IPC, 0.0)
    # a share of 80/8 = 10 a second: one more after 0.1 s, not before
    assert not rate.admit(IPC, 0.09)
    assert rate.admit(IPC, 0.1)
    assert not rate.admit(IPC, 0.11)
    assert rate.refused_source == 3 and rate.refused_total == 0


def test_a_source_over_its_share_does_not_spend_the_others_budget() -> None:
    rate = HandshakeRate(rate=80, burst=128)
    for _ in range(64):
        rate.admit(IPC, 0.0)
    for step in range(1, 100):  # one source retrying as fast as it can for 1 s
        rate.admit(IPC, step / 100)
    # the shared budget refilled at 80 a second, less the ~10 the busy source got
    admitted = sum(rate.admit(OTHER, 1.0) for _ in range(100))
    assert admitted == 64  # its own full burst: the busy source's refusals spent nothing
    assert rate.refused_total == 0


def test_all_sources_together_get_the_rate() -> None:
    rate = HandshakeRate(rate=10, burst=4)
    sources = [f"10.0.0.{n}".encode() for n in range(100)]  # each within its own share
    admitted = sum(rate.admit(source, t / 10) for t in range(100) for source in sources)
    assert 10 * 10 - 1 <= admitted <= 4 + 10 * 10  # the rate x 10 s, plus the burst


def test_one_source_gets_its_share_of_the_burst() -> None:
    rate = HandshakeRate(rate=20, burst=1024)  # the defaults: 128 from one source at once
    assert sum(rate.admit(IPC, 0.0) for _ in range(1024)) == 128
    assert sum(rate.admit(OTHER, 0.0) for _ in range(1024)) == 128
    small = HandshakeRate(rate=20, burst=40)  # never more than the shared burst, and a busy
    assert sum(small.admit(IPC, 0.0) for _ in range(100)) == 35  # one leaves the reserve (5)
    assert small.admit(OTHER, 0.0) and small.reserved == 1  # which a quiet source takes


def test_many_busy_sources_cannot_keep_a_quiet_one_out() -> None:
    """Issue 21, 5: 16 processes (each its own source) keeping handshakes in flight took every
    token of the shared rate; a rank's connect() failed in 2-3 of 3 tries. Busy sources now
    leave the reserve to quiet ones: a fresh process's handshake gets in at any moment."""
    rate = HandshakeRate(rate=20, burst=1024)  # the defaults
    attackers = [f"localhost:1000:1000:{pid}".encode() for pid in range(100, 116)]
    admitted_quiet = 0
    for step in range(1, 1001):  # 10 s, every attacker retrying every 10 ms
        now = step / 100
        for source in attackers:
            rate.admit(source, now)
        if step % 97 == 0:  # now and then a rank's process connects (a new pid each time)
            admitted_quiet += rate.admit(f"localhost:1000:1000:{9000 + step}".encode(), now)
    assert admitted_quiet == 1000 // 97
    assert rate.refused_total > 0  # the attackers were held to what is above the reserve


def test_sources_are_bounded() -> None:
    rate = HandshakeRate(rate=10, burst=4, max_sources=8)
    for n in range(100):
        rate.admit(str(n).encode(), 0.0)
    assert len(rate._sources) == 8


@pytest.mark.parametrize(("rate", "burst"), [(0, 1), (-1, 1), (1, 0)])
def test_a_rate_needs_room(rate: float, burst: float) -> None:
    with pytest.raises(ValueError):
        HandshakeRate(rate=rate, burst=burst)


def test_the_arithmetic_before_and_at_the_defaults() -> None:
    # before: ~1,000 held names (the connection cap) and 6,300 id-less connections a second
    # from one process, with nothing closing silent names
    before = mean_seconds_to_abort(6300, grace=1e12, cap=1024)
    assert 9 * 60 < before < 13 * 60
    grace = defaults.STRANGER_GRACE
    every_source = mean_seconds_to_abort(DEFAULT_HANDSHAKE_RATE, grace, cap=1024)
    one_source = mean_seconds_to_abort(DEFAULT_HANDSHAKE_RATE * SOURCE_SHARE, grace, cap=1024)
    assert every_source > 90 * 86400
    assert one_source > 10 * 365 * 86400
    # the attacker's best split is half the rate on names, half on id-less connections
    best = hits_per_second(50, 10)
    for names_share in (0.1, 0.3, 0.7, 0.9):
        held = 50 * names_share * 10
        assert held * 50 * (1 - names_share) <= best + 1e-9
