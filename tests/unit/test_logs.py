"""Log lines a peer can influence: escaped values, aggregated floods, a bounded CURVE limiter
(issue 11, part B)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import zmq

from coordd.cli import _logging as log_setup
from coordd.core import _logs as logs
from coordd.io import _curve as keys
from coordd.testing import FakeClock


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger whose records go through coordd's text format into a buffer."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(log_setup.TextFormatter(log_setup.TEXT_FORMAT))
    logger = logging.getLogger("coordd.test_logs")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield logger, out
    logger.handlers[:] = []


FORGED = 'ok\n2099-01-01 00:00:00,000 ERROR coordd: group failed group="prod" ranks=[0]'


@pytest.mark.parametrize("field", ["group", "got", "fingerprint"])
def test_a_newline_in_a_peer_value_cannot_forge_a_line(captured, field: str) -> None:
    logger, out = captured
    logs.event(logger, logging.WARNING, "registration rejected", **{field: FORGED})
    text = out.getvalue()
    assert text.count("\n") == 1, text  # one record, one line
    assert "\\n2099" in text


def test_control_characters_in_a_plain_message_are_escaped(captured) -> None:
    logger, out = captured
    logger.warning("peer %s", "x\r\x1b[2Jy\nz")
    assert out.getvalue().count("\n") == 1
    assert "\\r\\x1b[2Jy\\nz" in out.getvalue()


def test_plain_values_stay_as_they_are() -> None:
    assert logs._value("dp-tp0-pp0") == "dp-tp0-pp0"
    assert logs._value("two words") == '"two words"'
    assert logs._value("") == '""'
    assert logs._value("tab\there") == '"tab\\there"'
    assert logs._value([1, 2]) == "[1,2]"


def test_json_lines_carry_peer_values_escaped() -> None:
    record = logging.LogRecord("coordd", logging.WARNING, __file__, 1, "x", None, None)
    record.event = "registration rejected"
    record.fields = {"group": FORGED}
    line = log_setup.JsonFormatter().format(record)
    assert "\n" not in line
    assert json.loads(line)["group"] == FORGED


def test_a_flood_of_one_warning_is_aggregated(captured) -> None:
    logger, out = captured
    clock = FakeClock()
    scheduled: list[tuple[float, object]] = []
    agg = logs.Aggregated(
        logger,
        "bad frame dropped",
        interval=10.0,
        clock=clock,
        schedule=lambda delay, fn: scheduled.append((delay, fn)),
    )
    for i in range(20_000):
        clock.now = i * 1e-4  # 2 s of flood
        agg(peer=b"rogue", why="garbage")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "bad frame dropped" in lines[0]
    assert len(scheduled) == 1 and scheduled[0][0] == pytest.approx(10.0, abs=1e-3)
    clock.now = 10.0
    scheduled[0][1]()  # the loop's timer: the summary
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "suppressed=19999" in lines[1]
    assert agg.total == 20_000
    clock.now = 30.0
    agg(peer=b"rogue", why="later")  # a new window: logged at once
    assert len(out.getvalue().splitlines()) == 3


def test_the_aggregate_without_a_timer_waits_for_the_next_one(captured) -> None:
    logger, out = captured
    clock = FakeClock()
    agg = logs.Aggregated(logger, "report refused", interval=1.0, clock=clock)
    agg(n=1)
    agg(n=2)
    agg(n=3)
    clock.now = 5.0
    agg(n=4)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert "suppressed=2" in lines[1] and "n=3" in lines[1]
    assert "n=4" in lines[2]


def test_the_curve_refusal_limiter_is_bounded(captured, monkeypatch) -> None:
    logger, out = captured
    monkeypatch.setattr(keys, "log", logger)
    public, secret = zmq.curve_keypair()
    gate = keys.CurveGate(public, secret, {b"A" * 40: "rank.key"})
    fresh = (f"{i:040d}".encode() for i in range(200_000))
    for key in fresh:
        assert gate.callback("coordd", key) is False
    assert gate.refused == 200_000
    assert len(gate._throttle) <= keys.REFUSAL_KEYS_KEPT
    assert len(out.getvalue().splitlines()) == keys.REFUSAL_LINES
    assert gate.callback("coordd", b"A" * 40) is True


def test_the_curve_refusal_limiter_logs_a_key_again_after_the_interval(
    captured, monkeypatch
) -> None:
    logger, out = captured
    monkeypatch.setattr(keys, "log", logger)
    clock = FakeClock()
    monkeypatch.setattr(keys.time, "monotonic", clock)
    public, secret = zmq.curve_keypair()
    gate = keys.CurveGate(public, secret, {})
    for _ in range(5):
        gate.callback("coordd", b"K" * 40)
    assert len(out.getvalue().splitlines()) == 1
    clock.now = keys.REFUSAL_LOG_INTERVAL + 1
    gate.callback("coordd", b"K" * 40)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "suppressed=4" in lines[1]
