"""coordd.core._bounds: the one token bucket, bounded map and log throttle (the time passed in)."""

from __future__ import annotations

import pytest

from coordd.core._bounds import BoundedMap, Throttle, TokenBucket


def test_the_token_bucket_refills_up_to_its_burst_and_never_backwards() -> None:
    bucket = TokenBucket(10.0, 5.0, now=0.0)
    assert sum(bucket.take(0.0) for _ in range(100)) == 5
    assert sum(bucket.take(1.0) for _ in range(100)) == 5  # refilled up to the burst only
    assert not bucket.take(0.5)  # an earlier time refills nothing
    assert bucket.ready(1.1) and bucket.tokens == pytest.approx(1.0)
    assert bucket.ready(1.1) and bucket.take(1.1) and not bucket.ready(1.1)  # ready takes none
    assert TokenBucket(1.0, 3.0).take(-1e9)  # full from the start


def test_the_bounded_map_drops_the_least_recently_put_or_touched() -> None:
    table: BoundedMap[str, int] = BoundedMap(3)
    for n, key in enumerate("abcd"):
        table.put(key, n)
    assert list(table) == ["b", "c", "d"]
    table.touch("b")
    table.put("e", 9)
    assert list(table) == ["d", "b", "e"]
    table.put("d", 7)  # refreshed: the newest
    assert list(table.items()) == [("b", 1), ("e", 9), ("d", 7)]
    with pytest.raises(ValueError):
        BoundedMap(0)


def test_the_throttle_admits_a_key_once_an_interval_and_counts_the_rest() -> None:
    throttle = Throttle(10.0)
    assert throttle.admit("k", 0.0)
    assert not throttle.admit("k", 5.0) and not throttle.admit("k", 9.9)
    assert throttle.admit("other", 5.0)
    assert throttle.admit("k", 10.0)
    assert throttle.held("k") == 2 and throttle.held("k") == 0
    assert throttle.held_all() == 2 and throttle.held("never") == 0


def test_the_throttle_bounds_lines_over_all_keys_and_the_keys_it_remembers() -> None:
    throttle = Throttle(60.0, keys=8, lines=3)
    admitted = [throttle.admit(n, 1.0) for n in range(1000)]
    assert sum(admitted) == 3 and len(throttle) == 3
    assert throttle.held_all() == 997
    assert sum(throttle.admit(n, 61.0) for n in range(1000, 2000)) == 3  # a new window
    assert len(throttle) <= 8
