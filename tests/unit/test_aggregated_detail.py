"""coordd.core._logs.Aggregated: a summary line of warnings that carry their own `detail` (the
flood cut-off, the connection cap, the memory budget) is logged, not a TypeError in a timer
callback (it was: `event() got multiple values for keyword argument 'detail'`)."""

from __future__ import annotations

import logging

import pytest

from coordd.core._logs import Aggregated
from coordd.testing import FakeClock


def test_a_summary_keeps_the_caller_s_detail(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("coordd.test_aggregated")
    aggregated = Aggregated(log, "peer cut off", clock=FakeClock())
    caplog.set_level(logging.WARNING, logger="coordd.test_aggregated")
    for _ in range(3):
        aggregated(peer="p", detail="connection shut down")
    aggregated.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "suppressed=2" in lines[1]
    assert "2 more like this" in lines[1] and "connection shut down" in lines[1]
