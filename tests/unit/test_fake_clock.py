"""coordd.testing.FakeClock: time moves only when the test moves it, and only forward."""

from __future__ import annotations

import pytest

from coordd.testing import FakeClock


def test_it_moves_only_forward_and_only_when_told() -> None:
    clock = FakeClock(5.0)
    assert clock() == clock() == 5.0
    assert clock.advance(1.5) == 6.5 == clock()
    with pytest.raises(ValueError, match="forward"):
        clock.advance(-1.0)
    assert clock() == 6.5

