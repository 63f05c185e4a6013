"""coordd.core._handshake's rate and the arithmetic behind it (pure: the time is passed in)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from coordd.core import _daemon_defaults as defaults
from coordd.core._daemon_defaults import DEFAULT_HANDSHAKE_RATE
from coordd.core._handshake import (
    EARN_WAIT,
    SOURCE_SHARE,
    HandshakeRate,
    hits_per_second,
    mean_seconds_to_abort,
    source_group,
)

IPC = b"localhost:1000:1000:4242"
OTHER = b"localhost:1000:1000:4343"


class Ranks:
    """Ranks' processes connecting as the client does: a refused handshake is tried again
    RETRY seconds later (the gate answers a refusal 1 s late; the client reconnects 0.1 s
    after). Quiet is earned (issue 28): a fresh process is not, so its first try may be
    refused; its second, having waited, is quiet."""

    RETRY = 1.1

    def __init__(self, rate: HandshakeRate, *, grouped: bool = False,
                 quiet_only: bool = False) -> None:
        self.rate = rate
        self.grouped = grouped
        self.quiet_only = quiet_only
        self.due: dict[bytes, float] = {}
        self.tries: dict[bytes, int] = {}
        self.admitted: list[bytes] = []

    def start(self, source: bytes, now: float) -> None:
        self._try(source, now)

    def tick(self, now: float) -> None:
        for source, due in list(self.due.items()):
            if due <= now:
                self._try(source, now)

    def _try(self, source: bytes, now: float) -> None:
        self.tries[source] = self.tries.get(source, 0) + 1
        group = self.rate.group_of(source) if self.grouped else None
        if self.rate.admit(source, now, group, quiet_only=self.quiet_only):
            self.admitted.append(source)
            self.due.pop(source, None)
        else:
            self.due[source] = now + self.RETRY

    def most_tries(self) -> int:
        return max(self.tries[s] for s in self.admitted)


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
    assert not small.admit(OTHER, 0.0)  # a fresh source is not quiet: no reserve for it
    small.earn(OTHER)  # it registered a rank: quiet is earned
    assert small.admit(OTHER, 0.0) and small.reserved == 1  # the reserve is for it


def test_many_busy_sources_cannot_keep_a_quiet_one_out() -> None:
    """Issue 21, 5: 16 processes (each its own source) keeping handshakes in flight took every
    token of the shared rate; a rank's connect() failed in 2-3 of 3 tries. Busy sources now
    leave the reserve to quiet ones: a rank's process gets in at its first retry at most."""
    rate = HandshakeRate(rate=20, burst=1024)  # the defaults
    attackers = [f"localhost:1000:1000:{pid}".encode() for pid in range(100, 116)]
    ranks = Ranks(rate)
    for step in range(1, 1121):  # 10 s, every attacker retrying every 10 ms (and 1.2 s more)
        now = step / 100
        for source in attackers:
            rate.admit(source, now)
        ranks.tick(now)
        if step % 97 == 0 and step <= 1000:  # now and then a rank's process connects
            ranks.start(f"localhost:1000:1000:{9000 + step}".encode(), now)
    assert len(ranks.admitted) == 1000 // 97 and ranks.most_tries() <= 2
    assert rate.refused_total > 0  # the attackers were held to what is above the reserve


def test_attackers_refused_at_the_shared_limit_are_busy_not_quiet() -> None:
    """64 attacking processes: the burst serves 8 of them, the other 56 are refused at the
    shared limit with their own share untouched. Counted by admissions they were quiet and
    took the reserve from a rank's process (a connect() failed 1 in 10); every try counts."""
    rate = HandshakeRate(rate=20, burst=1024)
    attackers = [f"localhost:1000:1000:{pid}".encode() for pid in range(100, 164)]
    ranks = Ranks(rate)
    for step in range(1, 1121):
        now = step / 100
        for source in attackers:
            rate.admit(source, now)
        ranks.tick(now)
        if step % 97 == 0 and step <= 1000:
            ranks.start(f"localhost:1000:1000:{9000 + step}".encode(), now)
    assert len(ranks.admitted) == 1000 // 97 and ranks.most_tries() <= 2


def test_under_memory_pressure_only_a_quiet_source_gets_in() -> None:
    """Issue 21, 5: the 16-process attack's handshakes in flight took coordd over its memory
    budget (65 MB, no stranger to close), which refused every handshake: a rank's connect()
    failed in 5 of 10 tries. Under pressure a quiet source is still let in, within the rate;
    a busy one spends nothing."""
    rate = HandshakeRate(rate=20, burst=1024)
    attackers = [f"localhost:1000:1000:{pid}".encode() for pid in range(100, 116)]
    for source in attackers:  # each keeps handshakes in flight: busy
        for _ in range(64):
            rate.admit(source, 0.0)
    admitted_busy = dict.fromkeys(attackers, 0)
    ranks = Ranks(rate, quiet_only=True)
    for step in range(1, 1121):  # 10 s under pressure (and 1.2 s more for the last retry)
        now = step / 100
        for source in attackers:
            admitted_busy[source] += rate.admit(source, now, quiet_only=True)
        ranks.tick(now)
        if step % 97 == 0 and step <= 1000:
            ranks.start(f"localhost:1000:1000:{9000 + step}".encode(), now)
    # the attackers the burst left quiet (it ran out) get one each, then are busy
    assert max(admitted_busy.values()) <= 1 and sum(admitted_busy.values()) <= 2
    assert rate.refused_busy > 10_000
    # a rank's process is fresh at its first try (refused: not quiet), quiet at its retry
    assert len(ranks.admitted) == 1000 // 97 and set(ranks.tries.values()) == {2}
    again = b"localhost:1000:1000:9097"  # a source let in under pressure is busy after it
    assert not rate.admit(again, 10.81, quiet_only=True)
    assert rate.admit(again, 10.81 + 128 / 2.5)
    # issue 28, defect 4: fresh processes got in under pressure (the gate let each one's
    # handshake through as quiet, and admission spared it); now none does
    flood = HandshakeRate(rate=20, burst=1024)
    got = sum(flood.admit(f"localhost:0:0:{pid}".encode(), pid / 1000, quiet_only=True)
              for pid in range(10_000))  # 10 s of a new process every ms
    assert got == 0


def test_a_source_is_quiet_until_it_keeps_trying() -> None:
    """What the ZAP thread answers first: a source that has earned it (issue 28: it registered
    a rank, or first tried EARN_WAIT ago: a rank's process retrying) and has tried at most once
    lately, not one that keeps trying, admitted or refused, nor one never seen."""
    rate = HandshakeRate(rate=20, burst=1024)  # a source's share: 2.5 a second, 128 at once
    assert not rate.quiet(IPC, 0.0)  # never seen: a fresh process is not quiet
    rate.admit(IPC, 0.0)
    assert not rate.quiet(IPC, 0.0) and not rate.quiet(IPC, 0.99)  # fresh still
    assert rate.quiet(IPC, EARN_WAIT)  # one try, EARN_WAIT ago: a rank's retry
    rate.admit(IPC, EARN_WAIT)
    rate.admit(IPC, EARN_WAIT)
    assert not rate.quiet(IPC, EARN_WAIT) and not rate.quiet(OTHER, EARN_WAIT)
    assert not rate.quiet(IPC, 1.3) and rate.quiet(IPC, 1.4)  # its share refilled one try
    for _ in range(500):  # refused over its share: the tries count all the same
        rate.admit(IPC, 2.0)
    assert not rate.quiet(IPC, 2.0 + 126 / 2.5) and rate.quiet(IPC, 2.0 + 127 / 2.5)
    rate.earn(OTHER)  # it registered a rank: quiet at once
    assert rate.quiet(OTHER, 0.0)


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


# -- tcp sources grouped (issue 21, 5 over tcp) ------------------------------------------------


@pytest.mark.parametrize(
    ("address", "group"),
    [
        (b"127.0.0.1", b"loopback"),
        (b"127.203.4.5", b"loopback"),
        (b"::1", b"loopback"),
        (b"::ffff:127.9.9.9", b"loopback"),
        (b"10.0.0.7", b"10.0.0.0/24"),
        (b"::ffff:10.0.0.7", b"10.0.0.0/24"),
        (b"2001:db8:1:2:aaaa:bbbb:cccc:dddd", b"2001:db8:1:2::/64"),
        (b"fe80::1%eth0", b"fe80::/64"),
        (b"localhost:1000:1000:4242", None),  # ipc: the process alone
        (b"", None),
    ],
)
def test_a_tcp_source_is_grouped_by_its_prefix(address: bytes, group: bytes | None) -> None:
    assert source_group(address) == group


def test_a_known_key_groups_by_the_key_and_the_prefix_is_configurable() -> None:
    assert source_group(b"127.0.0.1", key=b"K" * 40) == b"key:" + b"K" * 40
    assert source_group(b"10.1.2.3", ipv4_prefix=16) == b"10.1.0.0/16"
    assert source_group(b"10.1.2.3", ipv4_prefix=32) == b"10.1.2.3/32"
    assert HandshakeRate(rate=20, burst=64, ipv4_prefix=8).group_of(b"10.1.2.3") == b"10.0.0.0/8"
    with pytest.raises(ValueError):
        HandshakeRate(rate=20, burst=64, ipv4_prefix=33)


def _attack(rate: HandshakeRate, attackers: list[bytes], honest: Callable[[int], bytes]) -> int:
    """Every attacker address retries every 10 ms for 10 s, and one more fresh attacker
    address joins every 10 ms (each is quiet when it first comes); now and then an honest
    handshake from `honest(step)`, retried as the client does: how many of those were admitted
    (of 10) within two tries (the first, fresh, may be refused)."""
    ranks = Ranks(rate, grouped=True)
    for step in range(1, 1121):
        now = step / 100
        fresh = f"127.{step // 250 + 100}.{step % 250}.1".encode()
        for source in [*attackers, fresh]:
            rate.admit(source, now, rate.group_of(source))
        ranks.tick(now)
        if step % 97 == 0 and step <= 1000:
            ranks.start(honest(step), now)
    return sum(1 for source in ranks.admitted if ranks.tries[source] <= 2)


def test_many_loopback_addresses_cannot_keep_a_rank_out() -> None:
    """An attacker on the host handshakes from many 127.0.0.0/8 addresses, each its own
    source: together they took the whole shared rate, and each fresh one was quiet and took
    the reserve too: an honest connect from another host got 0 of 10 in. Now 127.0.0.0/8 is
    one group, held to half the rate, and none of its sources is quiet once it is busy. (A
    rank on the same host, from 127.0.0.1 and without a key, is in the attacker's group: with
    CURVE its key is its group, `test_a_leaked_key_from_many_addresses_is_one_group`.)"""
    attackers = [f"127.0.{n}.1".encode() for n in range(64)]
    rate = HandshakeRate(rate=20, burst=1024)
    # ranks of other hosts (a new address of 10.0.0.0/24 each time): the reserve is theirs
    assert _attack(rate, attackers, lambda s: b"10.0.0.%d" % s) == 1000 // 97
    assert rate.refused_total > 0


def test_many_ipv6_addresses_of_one_host_are_one_group() -> None:
    rate = HandshakeRate(rate=20, burst=64)
    base = "2001:db8:0:7:"
    admitted = sum(
        rate.admit(a, t / 100, rate.group_of(a))
        for t in range(300)
        for a in [f"{base}{t:x}:{n:x}::1".encode() for n in range(32)]
    )
    # the burst, then half of 20 a second for 3 s (before: each address its own source, and
    # together the shared rate: 123)
    assert admitted <= 64 + 30 + 1
    other = b"2001:db8:0:8::1"  # another /64: quiet, the reserve is there
    assert rate.admit(other, 3.0, rate.group_of(other))


def test_a_whole_cluster_in_one_slash_24_connects_at_once() -> None:
    """256 ranks in one /24, 3 connections each, all at once at start: grouping must not
    starve them (the group may take the whole burst but the reserve, which is for quiet
    sources of quiet groups: 896 of 1024)."""
    rate = HandshakeRate(rate=20, burst=1024)
    ranks = [f"10.0.0.{n}".encode() for n in range(256)]
    assert sum(rate.admit(a, 0.0, rate.group_of(a)) for a in ranks for _ in range(3)) == 768
    # and another /24's ranks beside them
    assert all(rate.admit(b"10.0.1.%d" % n, 0.0, rate.group_of(b"10.0.1.%d" % n)) for n in range(8))


def test_a_leaked_key_from_many_addresses_is_one_group() -> None:
    rate = HandshakeRate(rate=20, burst=64)
    key = b"L" * 40
    got = sum(
        rate.admit(b"127.0.%d.%d" % (t, n), t / 100, rate.group_of(b"127.0.0.1", key))
        for t in range(300)
        for n in range(16)
    )
    assert got <= 64 + 30 + 1  # before: 123, the shared rate
    honest = b"R" * 40  # another key from the same host: its own, quiet group
    assert rate.admit(b"127.0.0.1", 3.0, rate.group_of(b"127.0.0.1", honest))


def test_groups_worked_out_are_bounded() -> None:
    rate = HandshakeRate(rate=10, burst=4, max_sources=8)
    for n in range(100):
        assert rate.group_of(b"10.0.%d.1" % n) == b"10.0.%d.0/24" % n
    assert len(rate._group_of) == 8 and len(rate._groups) == 0


def test_the_gate_under_memory_pressure_with_a_rate_admits_only_quiet_sources() -> None:
    """Issue 28, planted bug: the ZAP gate skipping the memory-pressure rule when a handshake
    rate is set (`quiet_only=pressed` -> False) passed every test: the rate's rule was tested
    (above), the gate's wiring of it never. Over the budget, a busy source (one that keeps
    handshakes in flight, well within its own share) is refused with REFUSAL and counted; a
    quiet one gets in."""
    import zmq

    from coordd.io._gate import REFUSAL, ZAP_VERSION, HandshakeGate

    context = zmq.Context()
    now = [0.0]
    gate = HandshakeGate(context, clock=lambda: now[0])
    try:
        gate.rate = HandshakeRate(rate=20, burst=1024)

        def ask(source: bytes) -> tuple[bytes, bytes]:
            reply = gate.decide([ZAP_VERSION, b"1", b"", source, b"rid", b"NULL"])
            return reply[2], reply[3]

        for _ in range(16):  # busy: 16 handshakes at once, within its share of 128
            assert ask(IPC)[0] == b"200"
        gate.refusing = True  # over --max-rss-mb
        assert ask(IPC) == (b"300", REFUSAL) and gate.refused == 1
        assert ask(OTHER)[0] == b"300", "a fresh source is not quiet (issue 28)"
        now[0] = 1.1  # its retry, having waited: quiet
        assert ask(OTHER)[0] == b"200", "a quiet source (a rank's process) still gets in"
        third = b"localhost:1000:1000:4444"
        gate.earned.append(third)  # the server says: its process registered a rank
        assert ask(third)[0] == b"200", "quiet earned by registering"
        gate.refusing = False
        gate.over = lambda: True  # the memory watch says so at the handshake: the same
        assert ask(IPC) == (b"300", REFUSAL) and gate.refused == 3
    finally:
        gate.stop()
        context.term()


def test_fork_churn_cannot_keep_a_rank_out() -> None:
    """Issue 28, defect 3: a stream of freshly forked processes (~295 a second, 2 handshakes
    each) counted as quiet: each took the reserve and was answered first, and an honest
    connect(timeout=10) failed 3 times of 3 (~20,700 handshakes refused). Quiet is earned now:
    the churn gets only what is above the reserve, and a rank's process (its own retries, or
    an earlier registration) gets in."""
    rate = HandshakeRate(rate=20, burst=1024)  # the defaults
    ranks = Ranks(rate)
    pid = 20_000
    for step in range(1, 1121):  # 11.2 s in 10 ms steps: ~3 forks a step, 2 handshakes each
        now = step / 100
        for _ in range(3):
            pid += 1
            fork = f"localhost:1000:1000:{pid}".encode()
            rate.admit(fork, now)
            rate.admit(fork, now)
        ranks.tick(now)
        if step % 97 == 0 and step <= 1000:
            ranks.start(f"localhost:1000:1000:{9000 + step}".encode(), now)
    assert len(ranks.admitted) == 1000 // 97 and ranks.most_tries() <= 2
    assert rate.refused_total > 5000  # the churn, held to what is above the reserve
