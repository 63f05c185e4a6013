"""coordd.io._memory: the RSS budget's policy (fake clock, no sockets), the RSS reader, the trim,
and the watch's decisions with its I/O injected."""

from __future__ import annotations

import logging

import pytest

from coordd.io import _memory as memory
from coordd.io._memory import MB, MemoryWatch, RssBudget


def test_under_the_budget_nothing_happens_and_checks_are_slow_without_strangers() -> None:
    policy = RssBudget(80)
    assert policy.check(40 * MB, 0.0, strangers=0) == memory.Verdict()
    assert policy.interval(0) == memory.SLOW_INTERVAL
    assert policy.interval(2) == memory.FAST_INTERVAL  # a stranger could be a flood


def test_over_the_budget_strangers_are_closed_and_memory_trimmed_at_a_bounded_rate() -> None:
    policy = RssBudget(80)
    policy.check(40 * MB, 0.0, strangers=0)  # coordd's own level
    first = policy.check(90 * MB, 1.0, strangers=50)
    assert first.pressure and first.trim
    again = policy.check(95 * MB, 1.01, strangers=3)  # reconnects: closed again
    assert again.pressure and not again.trim  # the next trim waits TRIM_EVERY
    assert policy.check(95 * MB, 1.0 + memory.TRIM_EVERY, strangers=0).trim
    assert policy.interval(0) == memory.FAST_INTERVAL  # still over: keep watching closely
    # what was queued is dropped: under the budget, one last trim, then quiet
    assert policy.check(60 * MB, 2.0, strangers=0) == memory.Verdict(trim=True)
    assert policy.check(55 * MB, 3.0, strangers=0) == memory.Verdict()
    assert policy.interval(0) == memory.SLOW_INTERVAL
    assert policy.peak == 95 * MB


def test_coordd_s_own_memory_over_the_budget_does_not_lock_new_ranks_out() -> None:
    """Many groups can make coordd itself outgrow the budget: a rank connecting then (a
    stranger until its Hello) is not closed unless the RSS also rose STRANGER_SLACK_MB above
    what coordd held with no stranger; and coordd says so once."""
    policy = RssBudget(80)
    assert not policy.check(120 * MB, 0.0, strangers=0).pressure
    assert policy.warn() and not policy.warn()  # once per episode
    assert not policy.check(121 * MB, 5.0, strangers=1).pressure
    assert policy.threshold() == (120 + memory.STRANGER_SLACK_MB) * MB
    assert policy.check(140 * MB, 5.1, strangers=1).pressure  # a flood on top


def test_pressure_ends_only_well_under_where_it_started() -> None:
    """At the edge it flapped every few checks, and each release let the closed peers'
    reconnects burst in again."""
    policy = RssBudget(80)
    policy.check(40 * MB, 0.0, strangers=0)
    assert policy.check(81 * MB, 1.0, strangers=50).pressure
    assert policy.check(79 * MB, 1.02, strangers=0).pressure  # under the budget: not yet
    assert policy.check((80 - memory.HYSTERESIS_MB + 1) * MB, 1.04, strangers=0).pressure
    assert not policy.check((80 - memory.HYSTERESIS_MB - 1) * MB, 1.06, strangers=0).pressure
    assert not policy.check(79 * MB, 1.08, strangers=5).pressure  # starts over the budget only


def test_after_pressure_the_level_without_strangers_is_not_taken_as_coordd_s_own() -> None:
    """Right after strangers were closed their queued messages still count in the RSS; taken
    as coordd's own level, they would raise the threshold and let the next burst in. But an
    RSS that stays up with no stranger to close (nothing to trim back) becomes coordd's own
    level after SETTLE, so new ranks are not refused for good."""
    policy = RssBudget(80)
    policy.check(40 * MB, 0.0, strangers=0)
    assert policy.check(100 * MB, 1.0, strangers=10).pressure
    assert policy.check(100 * MB, 1.1, strangers=0).pressure  # still refusing newcomers
    assert policy.own == 40 * MB
    assert policy.check(90 * MB, 1.0 + memory.SETTLE / 2, strangers=0).pressure
    assert not policy.check(90 * MB, 1.0 + memory.SETTLE, strangers=0).pressure
    assert policy.own == 90 * MB
    assert policy.threshold() == (90 + memory.STRANGER_SLACK_MB) * MB


def test_the_rss_with_messages_queued_unread_is_not_taken_as_coordd_s_own() -> None:
    """A flood whose reconnects are shut as soon as seen (banned, refused) leaves no stranger
    open at any check, while what it sent sits queued in coordd. Taken as coordd's own level,
    that RSS ratcheted the threshold up with it (measured: 150-190 MB at a 64 MB budget);
    with the backlog seen, pressure starts at the budget, and the level is taken once the
    queue is empty."""
    policy = RssBudget(64)
    policy.check(36 * MB, 0.0, strangers=0)
    rss = 36
    for i in range(1, 20):
        rss += 2
        verdict = policy.check(rss * MB, i * 0.015, strangers=0, backlog=True)
        if rss > 64:
            assert verdict.pressure
    assert policy.own == 36 * MB and policy.threshold() == 64 * MB
    # the queue dropped and trimmed, pressure over: the level is coordd's own again
    assert not policy.check(40 * MB, 10.0, strangers=0, backlog=False).pressure
    assert policy.own == 40 * MB


def test_a_backlog_that_never_empties_does_not_hold_the_pressure_on() -> None:
    """Ranks' own traffic (or a drain slower than its input) can leave messages queued at
    every check. The RSS was then never taken as coordd's own, and an RSS that dropping the
    burst's backlog did not bring under threshold - HYSTERESIS kept refusing new ranks for as
    long as that lasted. Now the pressure ends SETTLE after the RSS stops moving."""
    policy = RssBudget(64)
    policy.check(36 * MB, 0.0, strangers=0)
    assert policy.check(70 * MB, 1.0, strangers=50, backlog=True).pressure
    now = 1.0
    # the burst's backlog dropped and trimmed, down to 58 MB (over 64 - HYSTERESIS_MB)
    for rss in (66, 62, 58):
        now += memory.TRIM_EVERY
        assert policy.check(rss * MB, now, strangers=0, backlog=True).pressure
    flat_from = now
    ended = None
    while now < 60.0:
        now += memory.FAST_INTERVAL
        if not policy.check(58 * MB, now, strangers=0, backlog=True).pressure:
            ended = now
            break
    assert ended is not None, "the pressure outlasted 60 s of a flat RSS"
    assert flat_from + memory.SETTLE <= ended <= flat_from + memory.SETTLE + 0.05
    assert policy.own == 58 * MB
    assert policy.threshold() == (58 + memory.STRANGER_SLACK_MB) * MB


def test_with_a_backlog_a_moving_rss_is_not_taken_as_coordd_s_own() -> None:
    """While the backlog is being dropped (the RSS falls at each trim) or a flood goes on
    through connections shut as soon as seen (it rises), the level is not coordd's own, however
    long that lasts."""
    policy = RssBudget(64)
    policy.check(36 * MB, 0.0, strangers=0)
    now, rss = 0.0, 40.0
    for _ in range(600):  # 30 s rising 1.5 MB/s: never flat for SETTLE
        now += 0.05
        rss += 0.075
        policy.check(int(rss * MB), now, strangers=0, backlog=True)
    assert policy.own == 36 * MB and policy.threshold() == 64 * MB
    assert policy.pressure  # 85 MB: over the budget
    for _ in range(12):  # dropped: 2.5 MB less at each trim, down to 55 MB
        now += memory.TRIM_EVERY
        rss -= 2.5
        assert policy.check(int(rss * MB), now, strangers=0, backlog=True).pressure
    assert policy.own == 36 * MB


def test_rss_reader_reads_this_process() -> None:
    reader = memory.RssReader()
    try:
        rss = reader()
    finally:
        reader.close()
    with open("/proc/self/status") as f:
        status = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    assert rss > 0 and abs(rss - status) < 16 * MB


def test_malloc_trim_is_there_on_glibc_and_gives_memory_back() -> None:
    trim = memory.malloc_trimmer()
    if trim is None:  # pragma: no cover - musl
        pytest.skip("no malloc_trim in this C library")
    trim()


class Fake:
    def __init__(self) -> None:
        self.now = 0.0
        self.rss = 40 * MB
        self.strangers = 0
        self.pressure: list[bool] = []
        self.trims = 0
        self.backlog = False

    def press(self, on: bool) -> int:
        self.pressure.append(on)
        if on:
            closed, self.strangers = self.strangers, 0
            return closed
        return 0

    def trim(self) -> None:
        self.trims += 1

    def watch(self, budget: float = 80) -> MemoryWatch:
        return MemoryWatch(
            budget,
            strangers=lambda: self.strangers,
            pressure=self.press,
            clock=lambda: self.now,
            rss=lambda: self.rss,
            trim=self.trim,
            backlog=lambda: self.backlog,
        )


def test_the_watch_closes_strangers_under_pressure_logs_once_and_lets_go(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = Fake()
    watch = fake.watch()
    watch.check()
    assert fake.pressure == [] and watch.stats.checks == 1
    caplog.set_level(logging.WARNING, logger="coordd")
    fake.rss, fake.strangers = 100 * MB, 50
    for _ in range(5):  # closed, reconnecting: closed again, one line
        fake.now += memory.FAST_INTERVAL
        watch.check()
        fake.strangers = 3
    assert fake.pressure == [True] * 5
    assert watch.stats.shed_connections == 50 + 4 * 3
    lines = [r for r in caplog.records if "memory budget" in r.getMessage()]
    assert len(lines) == 1
    fake.rss, fake.strangers = 50 * MB, 0
    fake.now += 1.0
    watch.check()
    assert fake.pressure[-1] is False  # new connections admitted again
    assert fake.trims >= 2
    assert watch.stats.peak_rss == 100 * MB


def test_the_watch_tells_the_gate_whether_memory_is_over_the_threshold_now() -> None:
    fake = Fake()
    watch = fake.watch(64)
    assert not watch.over()
    fake.rss = 65 * MB
    assert watch.over()


def test_a_new_connection_brings_the_next_check_forward() -> None:
    import asyncio

    fake = Fake()
    watch = fake.watch()

    async def run() -> float:
        loop = asyncio.get_running_loop()
        watch.start(loop)
        watch.check()  # no stranger: the next check in SLOW_INTERVAL
        assert watch._handle is not None
        slow = watch._handle.when() - loop.time()
        watch.poke()
        fast = watch._handle.when() - loop.time()
        watch.stop()
        assert slow > memory.FAST_INTERVAL * 2
        return fast

    assert asyncio.run(run()) <= memory.FAST_INTERVAL + 1e-3


def test_the_watch_asks_for_the_backlog_before_taking_coordd_s_own_level() -> None:
    fake = Fake()
    watch = fake.watch(64)
    fake.rss, fake.backlog = 60 * MB, True
    watch.check()
    assert watch.policy.own == 0  # queued messages: not coordd's own
    fake.backlog = False
    watch.check()
    assert watch.policy.own == 60 * MB
