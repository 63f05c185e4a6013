"""The claim watch's decisions (coordd.idclaims), with a fake clock."""

from __future__ import annotations

from coordd.idclaims import ClaimWatch


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_idle_nothing_to_do() -> None:
    watch = ClaimWatch(clock=Clock())
    assert not watch.want_read()
    assert not watch.probing()
    assert watch.next_chunk() == []


def test_accepted_connections_start_a_read_then_a_window_ahead_of_the_counter() -> None:
    clock = Clock()
    watch = ClaimWatch(margin=4, period=1.0, chunk=3, clock=clock)
    watch.accepted()
    assert watch.want_read()
    watch.start_read()
    assert not watch.want_read()
    watch.read(2**32 - 2)
    assert watch.next_chunk() == [2**32 - 1, 0, 1]
    assert watch.next_chunk() == [2]
    assert not watch.probing() and watch.probes == 4


def test_the_window_is_twice_the_connections_of_the_last_period() -> None:
    clock = Clock()
    watch = ClaimWatch(margin=4, period=1.0, chunk=1000, clock=clock)
    for _ in range(10):
        watch.accepted()
    watch.start_read()
    watch.read(100)
    assert len(watch.next_chunk()) == 20
    watch.accepted()
    assert not watch.want_read()  # a period has not passed
    clock.now = 1.0
    assert watch.want_read()
    watch.start_read()
    watch.read(200)
    assert len(watch.next_chunk()) == 20  # the last period's 10 still count


def test_a_held_id_is_a_claim_only_ahead_of_what_libzmq_can_have_generated() -> None:
    clock = Clock()
    watch = ClaimWatch(margin=8, clock=clock)
    watch.accepted()
    watch.start_read()
    watch.read(50)
    watch.accepted()
    watch.accepted()  # two id-less connections may have taken 51 and 52
    assert not watch.held(52)
    assert watch.held(53)
    assert watch.claims == 1
    watch.found()
    assert not watch.probing()


def test_a_failed_read_can_be_retried() -> None:
    watch = ClaimWatch(clock=Clock())
    watch.accepted()
    watch.start_read()
    watch.read_failed()
    assert watch.want_read()


def test_a_burst_reads_again_before_the_period_ends() -> None:
    """The counter may pass half the window before the window is probed: read again at once."""
    clock = Clock()
    watch = ClaimWatch(margin=8, period=10.0, chunk=2, clock=clock)
    watch.accepted()
    watch.start_read()
    watch.read(0)
    for _ in range(3):
        watch.accepted()
    assert not watch.want_read()
    watch.accepted()  # 4 of a window of 8
    assert watch.want_read()
    watch.start_read()
    watch.read(4)
    assert len(watch.next_chunk()) == 2 and watch.probing()  # window 2 * 4 = 8


def test_ids_libzmq_may_have_generated_since_the_read_are_not_probed() -> None:
    clock = Clock()
    watch = ClaimWatch(margin=8, chunk=3, clock=clock)
    watch.accepted()
    watch.start_read()
    watch.read(10)
    watch.accepted()
    watch.accepted()
    assert watch.next_chunk() == [13, 14, 15]
