"""coordd's observer, metrics, status, endpoints and log lines, driven without sockets or clocks.

`Daemon` holds named groups (a real `Coordinator` and `Observer` each, as coordd/io/_server.py
builds them) and passes what each sends to its `Observer` the way the server does (every Send,
the Hello before it is handled, the failure check after), so the numbers here are the ones a
scrape of a real coordd shows; the integration tests (tests/integration/test_operability.py,
test_groups.py) check the same against a real process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordd.cli._logging import JsonFormatter, setup_logging
from coordd.cli.status import probe_line, render
from coordd.core._admission import Admission
from coordd.core._daemon_defaults import STATUS_RANK_ROWS
from coordd.core._group_names import group_name_problem
from coordd.core._logs import event, fault_fields
from coordd.core._peers import Takeovers, peer_label
from coordd.core._settings import ServerSettings
from coordd.io._group import Group
from coordd.io._stats import ServerStats, shell_counters
from coordd.ops.endpoints import HttpEndpoints, coordd_routes
from coordd.ops.observer import DURATION_BUCKETS, Observer, ServerEvents
from coordd.ops.status_doc import group_readiness, readiness, status_document
from coordd.proto.coordinator import Coordinator, OnRankLoss
from coordd.proto.messages import Goodbye, Hello, StepKind, StepReport
from coordd.proto.snapshot import GroupSnapshot

EPOCH = 9


def peer(rank: int, group: str = "default") -> bytes:
    return f"{rank}:inc{rank}:{group}".encode()


class Daemon:
    """Named groups wired as CoordServer wires them, with a settable clock, and the attributes
    the endpoints read from a server. `group` names the group a call goes to ("default")."""

    def __init__(self, dp: int, expect_groups: int = 0, **kw: Any) -> None:
        self.now = 100.0
        self.dp_size = dp
        self.kw = kw
        self.groups: dict[str, Group] = {}
        self.stats = ServerStats()
        self.events = ServerEvents()
        self.takeovers = Takeovers()
        self.bound_address = "ipc:///run/coordd/coordd.sock"
        self.settings = ServerSettings(
            self.bound_address, dp_size=dp, max_groups=64, expect_groups=expect_groups
        )
        self.admission = Admission(1024, lambda: ())
        self.started_wall = self.wall()
        self.sent: list[Any] = []

    def clock(self) -> float:
        return self.now

    #: what the server gives metrics and /status, from this fake's stats and guard
    def counters(self) -> Any:
        return shell_counters(self.stats, self.admission, None, None, None)

    def takeovers_refused(self) -> Any:
        return self.takeovers.refused

    def relayed_groups(self) -> dict[str, Any]:
        return {}

    def wall(self) -> float:
        return 1_700_000_000.0 + self.now

    def group(self, name: str = "default") -> Group:
        found = self.groups.get(name)
        if found is None:
            c = Coordinator(self.dp_size, epoch=EPOCH, step_timeout=10.0, **self.kw)
            found = self.groups[name] = Group(
                name, c, Observer(c.snapshot, name=name, wall=self.wall)
            )
        return found

    @property
    def coordinator(self) -> Coordinator:
        return self.group().coordinator

    @property
    def observer(self) -> Observer:
        return self.group().observer

    def snapshot(self, group: str = "default") -> GroupSnapshot:
        return self.group(group).coordinator.snapshot()

    def _after(self, sends: Any, g: Group) -> None:
        for s in sends:
            self.sent.append(s.message)
            g.observer.sent(s.peers, s.message)
        if g.coordinator.failures != g.observer.failures_seen:
            g.observer.group_failed(g.coordinator.snapshot())

    def hello(self, rank: int, at: float, group: str = "default", **kw: Any) -> None:
        self.now = at
        g = self.group(group)
        kw.setdefault("config_fingerprint", "fp")
        message = Hello(
            dp_size=self.dp_size, dp_rank=rank, incarnation=f"inc{rank}", group=group, **kw
        )
        g.observer.registering(peer(rank, group), message, f"10.0.0.{rank}")
        self._after(g.coordinator.receive(peer(rank, group), message, at), g)

    def report(
        self,
        rank: int,
        seq: int,
        at: float,
        kind: StepKind = StepKind.FORWARD,
        epoch: int = EPOCH,
        group: str = "default",
    ) -> None:
        self.now = at
        g = self.group(group)
        message = StepReport(
            num_tokens=rank, num_tokens_padded=rank, dp_rank=rank, epoch=epoch, seq=seq, kind=kind
        )
        self._after(g.coordinator.receive(peer(rank, group), message, at), g)

    def lose(self, rank: int, at: float, group: str = "default") -> None:
        self.now = at
        g = self.group(group)
        c = g.coordinator
        who = c.snapshot().rank_of(peer(rank, group))
        for s in c.peer_lost(peer(rank, group), at, "connection closed"):
            self.sent.append(s.message)
            g.observer.sent(s.peers, s.message)
        g.observer.lost(who, peer(rank, group), "connection closed")
        self._after((), g)

    def metrics(self) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        routes = coordd_routes(self)  # type: ignore[arg-type]
        status, ctype, body = routes["/metrics"]()
        assert status == 200 and ctype.startswith("text/plain")
        out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
        return out


def registered(dp: int, groups: tuple[str, ...] = ("default",), **kw: Any) -> Daemon:
    d = Daemon(dp, **kw)
    for group in groups:
        for r in range(dp):
            d.hello(r, 100.0, group)
    return d


def value(m: dict[str, Any], name: str, **labels: str) -> float:
    return m[name][tuple(sorted(labels.items()))]


def default(m: dict[str, Any], name: str, **labels: str) -> float:
    """A per-group series of the group "default"."""
    return value(m, name, group="default", **labels)


def test_rounds_durations_and_stragglers_are_counted_once_per_round() -> None:
    d = registered(3)
    # round 0: rank 2 last, 3 ms; round 1 (draft): rank 0 last, 40 ms; round 2: rank 2 last
    d.report(0, 0, 101.000)
    d.report(1, 0, 101.001)
    d.report(2, 0, 101.003)
    d.report(1, 1, 102.000, StepKind.DRAFT)
    d.report(2, 1, 102.010, StepKind.DRAFT)
    d.report(0, 1, 102.040, StepKind.DRAFT)
    d.report(2, 1, 102.5, StepKind.DRAFT)  # rank 2 repeats its last report: decision re-sent
    d.report(0, 2, 103.0)
    d.report(1, 2, 103.0)
    d.report(2, 2, 103.2)
    o = d.observer
    assert o.rounds_completed == 3
    assert dict(o.decided) == {"forward": 2, "draft": 1}
    assert o.stragglers == [1, 0, 2]
    assert [o.rounds_of(r) for r in range(3)] == [3, 3, 3]
    lateness = o.mean_lateness()
    assert lateness[0] == pytest.approx((0 + 0.040 + 0) / 3)
    assert lateness[2] == pytest.approx((0.003 + 0.010 + 0.2) / 3)

    m = d.metrics()
    assert default(m, "coordd_rounds_total", kind="forward", outcome="decided") == 2
    assert default(m, "coordd_rounds_total", kind="draft", outcome="decided") == 1
    assert default(m, "coordd_round_duration_seconds_count", kind="forward") == 2
    assert default(m, "coordd_round_duration_seconds_sum", kind="forward") == pytest.approx(0.203)
    # cumulative buckets: 3 ms is in le=0.005 and above; 200 ms only from le=0.25
    assert default(m, "coordd_round_duration_seconds_bucket", kind="forward", le="0.0025") == 0
    assert default(m, "coordd_round_duration_seconds_bucket", kind="forward", le="0.005") == 1
    assert default(m, "coordd_round_duration_seconds_bucket", kind="forward", le="0.1") == 1
    assert default(m, "coordd_round_duration_seconds_bucket", kind="forward", le="0.25") == 2
    assert default(m, "coordd_round_duration_seconds_bucket", kind="forward", le="+Inf") == 2
    assert default(m, "coordd_round_duration_seconds_bucket", kind="draft", le="0.05") == 1
    assert default(m, "coordd_straggler_rounds_total", rank="2") == 2
    assert default(m, "coordd_straggler_rounds_total", rank="0") == 1
    assert ("rank", "1") not in {pair for k in m["coordd_straggler_rounds_total"] for pair in k}
    assert default(m, "coordd_registered_ranks") == 3
    assert default(m, "coordd_round_seq") == 3
    assert value(m, "coordd_ready") == 1
    assert default(m, "coordd_group_state", state="idle") == 1
    assert default(m, "coordd_group_state", state="failed") == 0
    assert default(m, "coordd_registrations_total") == 3
    assert m["coordd_build_info"]
    assert len(DURATION_BUCKETS) + 1 == len(m["coordd_round_duration_seconds_bucket"]) // 2


def test_a_group_failure_is_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    d = registered(2)
    caplog.set_level(logging.WARNING, "coordd")
    d.report(0, 0, 101.0)
    d.report(1, 3, 101.1)  # rank 1 skipped ahead: the round fails for both
    d.report(0, 1, 101.2)  # later reports get the same failure again
    d.report(1, 1, 101.3)
    o = d.observer
    assert dict(o.faults) == {"mismatch": 1}
    assert dict(o.failed) == {"forward": 1}
    (line,) = [r for r in caplog.records if getattr(r, "event", "") == "group failed"]
    assert line.fields == {  # type: ignore[attr-defined]
        "group": "default",
        "epoch": EPOCH,
        "seq": 0,
        "kind": "forward",
        "ranks": [1],
        "reason": "mismatch",
        "detail": line.fields["detail"],  # type: ignore[attr-defined]
    }
    m = d.metrics()
    assert default(m, "coordd_faults_total", reason="mismatch") == 1
    assert default(m, "coordd_rounds_total", kind="forward", outcome="failed") == 1
    assert default(m, "coordd_group_failed") == 1
    assert default(m, "coordd_group_state", state="failed") == 1
    assert value(m, "coordd_ready") == 0
    (recent,) = o.recent_failures
    assert recent["ranks"] == [1] and recent["reason"] == "mismatch"


def test_each_failure_of_a_re_formed_group_is_counted() -> None:
    """A failure is new when the snapshot's failure counter moved, whatever it looks like."""
    d = registered(2)
    for epoch in (EPOCH, EPOCH + 1):
        d.report(0, 0 if epoch == EPOCH else 1, 101.0, epoch=epoch)
        d.report(1, 5, 101.1, epoch=epoch)  # skipped ahead: the group fails
        assert d.coordinator.snapshot().state.value == "failed"
        d.hello(0, 102.0)
        d.hello(1, 102.0)
    assert dict(d.observer.failed) == {"forward": 2}
    assert dict(d.observer.faults) == {"mismatch": 2}


def test_a_loss_between_rounds_is_a_fault_though_nobody_is_sent_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    d = registered(2)
    d.report(0, 0, 101.0)
    d.report(1, 0, 101.0)
    caplog.set_level(logging.WARNING, "coordd")
    d.lose(1, 105.0)
    assert d.sent[-1].__class__.__name__ == "StepDecision", "nothing was sent for the loss"
    assert dict(d.observer.faults) == {"lost": 1}
    events = [getattr(r, "event", "") for r in caplog.records]
    assert events == ["rank lost", "group failed"]
    lost = caplog.records[0].fields  # type: ignore[attr-defined]
    assert (lost["group"], lost["epoch"], lost["seq"], lost["ranks"]) == ("default", EPOCH, 1, [1])
    assert lost["peer"] == "10.0.0.1"


def test_a_report_from_a_stranger_is_a_fault_but_not_a_failed_round() -> None:
    d = registered(2)
    d.report(0, 0, 101.0, epoch=EPOCH - 1)  # a report from an old epoch: refused alone
    assert dict(d.observer.faults) == {"unavailable": 1}
    assert not d.observer.failed
    assert d.coordinator.snapshot().failure is None


def test_a_refused_registration_is_counted_and_names_the_rank(
    caplog: pytest.LogCaptureFixture,
) -> None:
    d = registered(2)
    caplog.set_level(logging.WARNING, "coordd")
    d.hello(1, 101.0, config_fingerprint="other")
    assert dict(d.observer.rejected) == {"fingerprint": 1}
    (record,) = caplog.records
    assert record.event == "registration rejected"  # type: ignore[attr-defined]
    assert record.fields["ranks"] == [1]  # type: ignore[attr-defined]
    assert record.fields["kind"] == "register"  # type: ignore[attr-defined]
    m = d.metrics()
    assert default(m, "coordd_registrations_rejected_total", reason="fingerprint") == 1


def test_group_readiness() -> None:
    d = Daemon(3)
    assert group_readiness(d.snapshot()) == (False, "0/3 ranks registered")
    d.hello(0, 100.0)
    d.hello(1, 100.0)
    assert group_readiness(d.snapshot()) == (False, "2/3 ranks registered")
    d.hello(2, 100.0)
    assert group_readiness(d.snapshot()) == (True, "3/3 ranks registered")
    d.lose(2, 101.0)
    ready, why = group_readiness(d.snapshot())
    assert not ready and why.startswith("failed at seq 0")

    elastic = registered(3, on_rank_loss=OnRankLoss.NEUTRALIZE)
    elastic.lose(2, 101.0)
    assert group_readiness(elastic.snapshot()) == (True, "2/3 ranks registered, left out: [2]")


def test_readiness_over_groups() -> None:
    """Ready: no group failed, and at least one group formed (or `expect_groups` of them)."""
    d = Daemon(2)

    def ready(expect: int = 0) -> tuple[bool, str]:
        return readiness({name: g.coordinator.snapshot() for name, g in d.groups.items()}, expect)

    assert ready() == (False, "no group has registered yet")
    d.hello(0, 100.0, "dp-tp0-pp0")
    assert ready() == (False, "0/1 groups formed: group dp-tp0-pp0 has 1/2 ranks registered")
    d.hello(1, 100.0, "dp-tp0-pp0")
    assert ready() == (True, "1/1 groups formed (dp-tp0-pp0: 2/2 ranks registered)")
    assert ready(expect=3) == (False, "1/3 groups formed: 2 more to register")
    d.hello(0, 100.0, "dp-tp1-pp0")  # a second group still forming holds nothing back
    assert ready() == (True, "1/2 groups formed")
    assert ready(expect=2) == (
        False,
        "1/2 groups formed: group dp-tp1-pp0 has 1/2 ranks registered",
    )
    d.hello(1, 100.0, "dp-tp1-pp0")
    assert ready(expect=2) == (True, "2/2 groups formed")
    d.report(0, 0, 101.0, group="dp-tp1-pp0")
    d.report(1, 4, 101.0, group="dp-tp1-pp0")  # rank 1 skipped ahead: that group fails
    ok, why = ready()
    assert not ok and why.startswith("group dp-tp1-pp0 failed at seq 0: rank 1 reported seq=4")
    assert group_readiness(d.snapshot("dp-tp0-pp0"))[0], "the other group is untouched"


def test_a_group_that_failed_and_was_left_or_never_formed_does_not_hold_readiness() -> None:
    """Issue 21: a peer's group of its own (one rank of dp) that fails with a wrong seq and
    leaves cannot hold /readyz at 503 while the real group serves; a formed group that fails
    with ranks still connected does."""
    d = Daemon(2)

    def ready(expect: int = 0) -> tuple[bool, str]:
        return readiness({name: g.coordinator.snapshot() for name, g in d.groups.items()}, expect)

    d.hello(0, 100.0, "dp-tp0-pp0")
    d.hello(1, 100.0, "dp-tp0-pp0")
    d.hello(0, 100.0, "dp-tp9-pp9")  # one rank of two: never formed
    d.report(0, 5, 100.5, group="dp-tp9-pp9")  # a wrong seq: it fails
    assert d.snapshot("dp-tp9-pp9").failure is not None
    assert ready() == (True, "1/2 groups formed"), "never formed: only not formed"
    d.lose(0, 101.0, group="dp-tp9-pp9")  # and it leaves
    assert ready() == (True, "1/2 groups formed")
    assert ready(expect=2)[0] is False, "the expected count still holds it"
    d.report(0, 0, 102.0, group="dp-tp0-pp0")
    d.report(1, 3, 102.0, group="dp-tp0-pp0")  # the formed group fails, its ranks connected
    ok, why = ready()
    assert not ok and why.startswith("group dp-tp0-pp0 failed at seq 0")
    d.lose(0, 103.0, group="dp-tp0-pp0")
    d.lose(1, 103.0, group="dp-tp0-pp0")  # every rank of it left: it serves nobody
    assert ready() == (False, "0/1 groups formed: group dp-tp0-pp0 has failed at seq 0: rank 1 "
                              "reported seq=3 kind=forward, the round expects seq=0 kind=forward")


def test_readiness_by_expected_names_ignores_other_groups() -> None:
    """Issue 21: with `--expect-groups` names, a peer's pattern-admitted junk groups neither
    make coordd ready (formed) nor keep it out of service (failed, ranks connected)."""
    d = Daemon(2)
    names = ("dp-tp0-pp0", "enginecore")

    def ready() -> tuple[bool, str]:
        return readiness({name: g.coordinator.snapshot() for name, g in d.groups.items()}, names)

    for junk in ("dp-tp7-pp0", "dp-tp8-pp0"):  # two formed junk groups
        d.hello(0, 100.0, junk)
        d.hello(1, 100.0, junk)
    assert readiness({n: g.coordinator.snapshot() for n, g in d.groups.items()}, 2)[0], (
        "a count is met by any groups (the weaker setting)"
    )
    assert ready() == (
        False, "0/2 expected groups formed: group dp-tp0-pp0 has not registered"
    )
    d.hello(0, 100.0, "dp-tp0-pp0")
    assert ready() == (
        False, "0/2 expected groups formed: group dp-tp0-pp0 has 1/2 ranks registered"
    )
    d.hello(1, 100.0, "dp-tp0-pp0")
    d.hello(0, 100.0, "enginecore")
    d.hello(1, 100.0, "enginecore")
    assert ready() == (True, "2/2 expected groups formed; 2 other group(s) not counted")
    d.report(0, 0, 101.0, group="dp-tp7-pp0")
    d.report(1, 4, 101.0, group="dp-tp7-pp0")  # a junk group fails, its ranks connected
    assert d.snapshot("dp-tp7-pp0").failure is not None
    assert ready()[0], "a failed group not expected holds nothing back"
    d.report(0, 0, 102.0, group="enginecore")
    d.report(1, 3, 102.0, group="enginecore")  # an expected group fails: not ready
    ok, why = ready()
    assert not ok and why.startswith("group enginecore failed at seq 0")


def test_every_series_of_a_group_carries_its_label() -> None:
    d = registered(2, groups=("enginecore", "dp-tp0-pp0"))
    for seq in range(3):
        for rank in range(2):
            d.report(rank, seq, 101.0 + seq, group="dp-tp0-pp0")
    d.report(0, 0, 105.0, StepKind.STATE, group="enginecore")
    d.report(1, 0, 105.2, StepKind.STATE, group="enginecore")
    d.report(0, 1, 106.0, StepKind.STATE, group="enginecore")
    d.report(1, 1, 106.1, StepKind.DRAFT, group="enginecore")  # a kind mismatch: it fails
    d.events.rejected["group_limit"] += 1  # a refusal before any group took the Hello
    m = d.metrics()
    assert value(m, "coordd_groups") == 2
    assert value(m, "coordd_ready") == 0, "a failed group makes coordd not ready"
    rounds = m["coordd_rounds_total"]
    assert rounds == {
        (("group", "dp-tp0-pp0"), ("kind", "forward"), ("outcome", "decided")): 3,
        (("group", "enginecore"), ("kind", "state"), ("outcome", "decided")): 1,
        (("group", "enginecore"), ("kind", "state"), ("outcome", "failed")): 1,
    }
    for name, want in (("dp-tp0-pp0", (3, 0, 1)), ("enginecore", (1, 1, 0))):
        seq, failed, ready = want
        assert value(m, "coordd_round_seq", group=name) == seq
        assert value(m, "coordd_group_failed", group=name) == failed
        assert value(m, "coordd_group_ready", group=name) == ready
        assert value(m, "coordd_registrations_total", group=name) == 2
        assert value(m, "coordd_epoch", group=name) == EPOCH
    assert value(m, "coordd_faults_total", group="enginecore", reason="mismatch") == 1
    assert value(m, "coordd_registrations_rejected_total", group="", reason="group_limit") == 1
    labelled = {
        name for name, series in m.items() if any(("group", "dp-tp0-pp0") in key for key in series)
    }
    assert {
        "coordd_round_duration_seconds_bucket",
        "coordd_straggler_rounds_total",
        "coordd_group_state",
        "coordd_registered_ranks",
        "coordd_dead_ranks",
    } <= labelled


def test_status_document_and_table() -> None:
    d = registered(2)
    d.report(0, 0, 101.0)
    d.report(1, 0, 101.5)
    d.report(1, 1, 102.0)  # round 1 open: rank 1 reported
    d.hello(0, 102.5, "enginecore")
    d.now = 103.0
    doc = json.loads(json.dumps(status_document(d)))  # type: ignore[arg-type]
    assert doc["ready"] is True and doc["coordd"]["dp_size"] == 2
    assert doc["ready_detail"] == "1/2 groups formed"
    default, engine = doc["groups"]
    assert (engine["name"], engine["members"], engine["ready"]) == ("enginecore", 1, False)
    assert default["name"] == "default"
    assert default["dp_size"] == 2 and default["epoch"] == EPOCH and default["seq"] == 1
    assert default["state"] == "round_open"
    assert default["ready"] is True
    assert default["round"] == {"open": True, "kind": "forward", "reported": 1, "age_s": 1.0}
    r0, r1 = default["ranks"]
    assert r0["state"] == "registered" and r0["address"] == "10.0.0.0"
    # the routing id itself is never shown: a label of the connection instead
    assert r0["incarnation"] == "inc0" and r0["peer"] == peer_label(b"0:inc0:default")
    assert "0:inc0:default" not in json.dumps(doc)
    assert r0["last_seen_s"] == 2.0 and r1["last_seen_s"] == 1.0
    assert r0["reported_open_round"] is False and r1["reported_open_round"] is True
    assert r0["rounds"] == r1["rounds"] == 1
    assert r1["mean_lateness_s"] == 0.5 and r1["straggler_rounds"] == 1
    table = render(doc)
    assert "ready: yes (1/2 groups formed)" in table
    assert "group default  dp 2  state round_open  epoch 9" in table
    assert "group enginecore  dp 2  state idle  epoch 9" in table
    assert "  round 1: open, forward, 1/2 reported" in table
    assert "  ready: NO (1/2 ranks registered)" in table
    blocks = table.split("\ngroup ")[1:]
    assert [block.split()[0] for block in blocks] == ["default", "enginecore"]
    rows = [line.split() for line in blocks[0].splitlines() if line.strip()[:1].isdigit()]
    assert [row[:3] for row in rows] == [
        ["0", "registered", "10.0.0.0"],
        ["1", "registered", "10.0.0.1"],
    ]


def test_status_table_and_probe_escape_a_peers_strings() -> None:
    """Before: an incarnation or gather site with ESC, BEL or CR was printed raw: it could
    retitle the terminal, clear it, or forge "ready: yes" (issue 21, item 11)."""
    evil = "x\x1b]0;owned\x07\x1b[2J\rready: yes\nfake"
    d = registered(2)
    d.report(0, 0, 101.0)
    doc = json.loads(json.dumps(status_document(d)))  # type: ignore[arg-type]
    doc["groups"][0]["ranks"][0]["incarnation"] = evil
    doc["groups"][0]["round"] = {"open": True, "kind": evil, "reported": 1, "age_s": 1.0}
    doc["ready_detail"] = evil
    table = render(doc)
    assert not set("\x1b\x07\r") & set(table)
    assert "\\x1b]0;owned\\x07" in table and "\\rready: yes\\nfake" in table
    lines = table.splitlines()
    assert len([line for line in lines if line.startswith("ready:")]) == 1  # none forged
    assert not [line for line in lines if line.startswith("fake")]
    line = probe_line("readyz", 503, evil.encode())
    assert "\n" not in line and "\x1b" not in line and line.startswith("readyz: 503 x\\x1b")


def test_endpoints_answer_get_head_and_refuse_the_rest() -> None:
    d = registered(2)
    routes = coordd_routes(d)  # type: ignore[arg-type]
    endpoints = HttpEndpoints(routes)
    assert endpoints.respond("GET", "/livez") == (200, "text/plain; charset=utf-8", b"ok\n")
    assert endpoints.respond("GET", "/readyz?verbose=1")[0] == 200
    assert endpoints.respond("POST", "/livez")[0] == 405
    status, _, body = endpoints.respond("GET", "/nope")
    assert status == 404 and b"/metrics" in body

    async def exchange(request: bytes) -> bytes:
        url = await endpoints.start("127.0.0.1", 0)
        port = int(url.rsplit(":", 1)[1])
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            await writer.drain()
            data = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            return data
        finally:
            await endpoints.close()

    got = asyncio.run(exchange(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n"))
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"application/json" in head
    assert json.loads(body)["groups"][0]["dp_size"] == 2
    got = asyncio.run(exchange(b"HEAD /metrics HTTP/1.1\r\n\r\n"))
    assert got.startswith(b"HTTP/1.1 200 OK") and got.endswith(b"\r\n\r\n")
    assert asyncio.run(exchange(b"garbage\r\n\r\n")).startswith(b"HTTP/1.1 400")
    d.lose(1, 101.0)
    got = asyncio.run(exchange(b"GET /readyz HTTP/1.1\r\n\r\n"))
    assert got.startswith(b"HTTP/1.1 503") and b"group default failed at seq 0" in got


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("dp-tp0-pp0", None),
        ("enginecore", None),
        ("x" * 64, None),
        ("", "it has 0 characters"),
        ("x" * 65, "it has 65 characters"),
        ("two words", "it holds ' '"),
        ("tab\there", "it holds '\\t'"),
        ("bell\x07", "it holds '\\x07'"),
        ("nbsp\u00a0", "it holds '\\xa0'"),
    ],
)
def test_group_names(name: str, problem: str | None) -> None:
    assert group_name_problem(name) == problem


def test_log_lines_carry_their_fields_in_both_formats(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("coordd.test")
    caplog.set_level(logging.WARNING, "coordd.test")
    fields = fault_fields(group="g", epoch=3, seq=41, kind="draft", ranks=(2, 5))
    event(log, logging.WARNING, "group failed", **fields, reason="timeout", detail="late rank")
    (record,) = caplog.records
    assert record.getMessage() == (
        "group failed group=g epoch=3 seq=41 kind=draft ranks=[2,5] reason=timeout "
        'detail="late rank"'
    )
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "group failed" and line["level"] == "warning"
    assert {k: line[k] for k in ("group", "epoch", "seq", "kind", "ranks", "reason")} == {
        "group": "g",
        "epoch": 3,
        "seq": 41,
        "kind": "draft",
        "ranks": [2, 5],
        "reason": "timeout",
    }
    with pytest.raises(ValueError, match="log format"):
        setup_logging("info", "xml")


def test_a_strangers_report_logs_the_rank_it_claims_not_as_the_culprit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A peer of no group that reports as rank 3 is not rank 3: the log line names no culprit
    rank, and says which rank was claimed, beside the sender's connection label."""
    from coordd.proto.errors import ProtocolError
    from coordd.proto.messages import failure_message

    events = ServerEvents()
    caplog.set_level(logging.WARNING, "coordd")
    error = ProtocolError("report from a peer that has not registered", rank=3)
    failure = failure_message(error, epoch=1, seq=5, kind=StepKind.FORWARD)
    events.refused_report(b"stranger", failure)
    (record,) = caplog.records
    assert record.event == "report refused"  # type: ignore[attr-defined]
    assert record.fields["ranks"] == []  # type: ignore[attr-defined]
    assert record.fields["claimed"] == [3]  # type: ignore[attr-defined]
    assert record.fields["peer"] == peer_label(b"stranger")  # type: ignore[attr-defined]
    assert events.faults == {"protocol": 1}


def test_status_is_bounded_over_groups_and_lists_one_group_whole() -> None:
    """At dp x groups past the cap, /status lists STATUS_RANK_ROWS rank rows in all (every
    group keeps its counts), and ?group=NAME lists that group's every rank."""
    groups = tuple(f"g{i}" for i in range(6))
    d = registered(64, groups)
    routes = coordd_routes(d)  # type: ignore[arg-type]
    status, _, body = routes["/status"]()
    doc = json.loads(body)
    assert status == 200 and len(doc["groups"]) == 6
    assert sum(len(g["ranks"]) for g in doc["groups"]) == STATUS_RANK_ROWS == 256
    assert [len(g["ranks"]) for g in doc["groups"]] == [64, 64, 64, 64, 0, 0]
    assert all(g["ranks_summary"]["registered"] == 64 for g in doc["groups"])
    table = render(doc)
    assert "(64 more ranks not shown: 64 registered, 0 missing, 0 left out in all; " in table
    assert "coordd status --group g5)" in table

    endpoints = HttpEndpoints(routes)
    status, _, body = endpoints.respond("GET", "/status?group=g5")
    one = json.loads(body)
    assert status == 200 and [g["name"] for g in one["groups"]] == ["g5"]
    assert len(one["groups"][0]["ranks"]) == 64
    status, _, body = endpoints.respond("GET", "/status?group=nope")
    assert status == 404 and b"no group 'nope'" in body


def test_straggler_series_stop_growing_past_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-rank straggler series up to METRICS_RANK_SERIES in all; the rest of a group's ranks
    are summed as rank="other", so the totals still add up."""
    from coordd.ops import collector

    monkeypatch.setattr(collector, "METRICS_RANK_SERIES", 3)
    d = registered(2, ("a", "b"))
    for group in ("a", "b"):
        d.group(group).observer.stragglers[:] = [5, 7]
    m = d.metrics()
    series = m["coordd_straggler_rounds_total"]
    assert series == {
        (("group", "a"), ("rank", "0")): 5,
        (("group", "a"), ("rank", "1")): 7,
        (("group", "b"), ("rank", "0")): 5,
        (("group", "b"), ("rank", "other")): 7,
    }


def test_a_scraper_that_does_not_read_is_aborted_not_left_buffered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An answer a client never reads is dropped when the write deadline passes: the
    connection is aborted (close() would keep the buffer outside --max-http-connections)."""
    from coordd.ops import endpoints as http

    monkeypatch.setattr(http, "_IO_TIMEOUT", 0.5)
    big = b"x" * (16 << 20)
    served = HttpEndpoints({"/big": lambda params=None: (200, "text/plain", big)})
    writers: list[asyncio.StreamWriter] = []
    answer = served._answer

    async def recording(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await answer(reader, writer)

    monkeypatch.setattr(served, "_answer", recording)

    async def scrape() -> tuple[int, int, int]:
        url = await served.start("127.0.0.1", 0)
        port = int(url.rsplit(":", 1)[1])
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        writer.write(b"GET /big HTTP/1.1\r\n\r\n")
        await writer.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not served.open and loop.time() < deadline:
            await asyncio.sleep(0.01)
        during = served.open
        while served.open and loop.time() < deadline:
            await asyncio.sleep(0.05)
        held = writers[0].transport.get_write_buffer_size()
        writer.transport.abort()
        await served.close()
        return during, served.open, held

    during, after, held = asyncio.run(scrape())
    assert during == 1 and after == 0
    assert held == 0, f"{held} bytes still buffered for a client that does not read"


def test_a_stopped_groups_readiness_does_not_read_no_under_coordds_yes() -> None:
    """Issue 30: `coordd status` printed "ready: yes (1/1 groups stopped ...)" and, under it,
    the group's "ready: NO (stopped ...)": a stopped group counts toward readiness."""
    from coordd.proto.messages import Goodbye

    d = registered(2)
    d.report(0, 0, 101.0)
    d.report(1, 0, 101.5)
    g = d.group()
    for rank in (0, 1):
        d._after(g.coordinator.receive(peer(rank), Goodbye(text="rank closed"), 102.0), g)
    doc = json.loads(json.dumps(status_document(d)))  # type: ignore[arg-type]
    assert doc["ready"] is True and doc["groups"][0]["left_cleanly"] is True
    table = render(doc)
    assert "ready: yes (1/1 groups stopped" in table
    assert "ready: NO" not in table
    assert "  ready: stopped, not a failure (stopped at seq 1" in table


def test_ranks_waits_are_a_histogram_by_group_and_site() -> None:
    """Issue 30: nothing in /metrics said how long a rank's step waited for coordd's answer.
    Each report says how long its rank's wait for the previous round blocked; coordd counts it
    under that round's site, once per rank, only for the round just decided."""
    from coordd.ops.observer import MAX_WAIT_SITES

    d = registered(2)
    d.report(0, 0, 101.0)
    d.report(1, 0, 101.5)  # round 0 (forward) decided
    o = d.observer
    o.waited(0, 1, 500)  # rank 0 waited 500 us for round 0
    o.waited(0, 1, 500)  # a resent report: counted once
    o.waited(1, 1, 20)
    o.waited(1, 5, 20)  # not the round just decided: dropped
    o.waited(7, 1, 20)  # no such rank: dropped
    m = d.metrics()
    w = {"group": "default", "site": "forward"}
    assert value(m, "coordd_rank_wait_seconds_count", **w) == 2
    assert value(m, "coordd_rank_wait_seconds_sum", **w) == pytest.approx(520e-6)
    assert value(m, "coordd_rank_wait_seconds_bucket", **w, le="2.5e-05") == 1
    assert value(m, "coordd_rank_wait_seconds_bucket", **w, le="0.0005") == 2
    # a gather round counts under its site; past MAX_WAIT_SITES sites, as "other"
    g = d.group()
    from coordd.proto.messages import GatherReport

    for seq in range(1, MAX_WAIT_SITES + 3):
        for rank in (0, 1):
            report = GatherReport(site=f"site{seq}", values=[rank], dp_rank=rank, epoch=EPOCH,
                                  seq=seq)
            d._after(g.coordinator.receive(peer(rank), report, 102.0 + seq), g)
        o.waited(0, seq + 1, 1)
    m = d.metrics()
    assert value(m, "coordd_rank_wait_seconds_count", group="default", site="site1") == 1
    sites = {dict(k)["site"] for k in m["coordd_rank_wait_seconds_count"]}
    assert len(sites) == MAX_WAIT_SITES + 1 and "other" in sites
    # "forward" and site1..site31 are kept apart; site32..site34 are "other"
    assert value(m, "coordd_rank_wait_seconds_count", group="default", site="other") == 3


def test_wait_site_series_are_capped_across_groups_and_still_add_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 36 (6): each group keeps MAX_WAIT_SITES sites apart, but 63 groups of 34 junk
    sites wrote 45,760 bucket lines. Past METRICS_WAIT_SERIES site series in all, a group's
    further sites are summed as site="other" (with the group's own "other")."""
    from coordd.ops.observer import MAX_WAIT_SITES, WAIT_BUCKETS, DurationHistogram

    names = tuple(f"g{i:02}" for i in range(63))
    d = registered(1, names)
    for name in names:
        waits = d.group(name).observer.waits
        for site in (*(f"s{k:02}" for k in range(MAX_WAIT_SITES)), "other"):
            waits[site] = DurationHistogram(WAIT_BUCKETS)
            waits[site].observe(0.001)
            waits[site].observe(0.002)
    counts = d.metrics()["coordd_rank_wait_seconds_count"]
    assert len(counts) <= 256 + len(names)  # the cap docs/operations.md states, + each "other"
    assert sum(counts.values()) == 2 * len(names) * (MAX_WAIT_SITES + 1)
    # the first group keeps all its sites apart; the last sums all of its sites as "other"
    assert counts[(("group", "g00"), ("site", "s05"))] == 2
    assert counts[(("group", "g62"), ("site", "other"))] == 2 * (MAX_WAIT_SITES + 1)
    assert not any(dict(k)["group"] == "g62" and dict(k)["site"] != "other" for k in counts)

    from coordd.ops import collector

    monkeypatch.setattr(collector, "METRICS_WAIT_SERIES", 3, raising=False)
    m = d.metrics()
    a = {"group": "g00"}
    assert value(m, "coordd_rank_wait_seconds_count", **a, site="s02") == 2
    assert value(m, "coordd_rank_wait_seconds_count", **a, site="other") == 2 * (
        MAX_WAIT_SITES - 2
    )
    assert value(m, "coordd_rank_wait_seconds_sum", **a, site="other") == pytest.approx(
        0.003 * (MAX_WAIT_SITES - 2)
    )
    assert value(m, "coordd_rank_wait_seconds_bucket", **a, site="other", le="0.001") == (
        MAX_WAIT_SITES - 2
    )
    assert len(m["coordd_rank_wait_seconds_count"]) == 3 + len(names)


@pytest.mark.parametrize("expect", [0, ("default",)])
def test_a_crash_stays_in_readyz_and_status_after_a_strangers_hello_and_goodbye(
    expect: Any,
) -> None:
    """Issue 28, defect 6: after rank 1 crashed, a stranger's Hello (for the free rank) and
    Goodbye made the group `stopped`: /readyz 200 "every rank left cleanly", /status failure
    None. The crash now stands, culprit and all, until every rank is back."""
    d = registered(2)
    d.settings = dataclasses.replace(d.settings, expect_groups=expect)
    d.report(0, 0, 101.0)
    d.report(1, 0, 101.0)
    d.lose(1, 102.0)

    def ready() -> tuple[bool, str]:
        return readiness({n: g.coordinator.snapshot() for n, g in d.groups.items()}, expect)

    ok, why = ready()
    assert not ok and "failed at seq 1: rank(s) [1] lost" in why
    stranger = Hello(dp_size=2, dp_rank=1, incarnation="x", config_fingerprint="fp")
    g = d.group()
    d._after(g.coordinator.receive(b"stranger", stranger, 103.0), g)
    d._after(g.coordinator.receive(b"stranger", Goodbye(), 103.5), g)
    ok, why = ready()
    assert not ok and "failed at seq 1: rank(s) [1] lost" in why, why
    doc = json.loads(json.dumps(status_document(d)))  # type: ignore[arg-type]
    (group,) = doc["groups"]
    assert group["left_cleanly"] is False and group["stops"] == 0
    assert group["failure"]["ranks"] == [1] and group["failure"]["reason"] == "lost"
    assert "STOPPED" not in render(doc) and "rank(s) [1] lost" in render(doc)


def test_group_created_and_dropped_lines_are_bounded_over_cycled_names(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 28, defect 5: two INFO lines per group name a peer cycles (400 names a second
    made 28,737 log lines in 12 s with the takeover lines); now at most GROUP_LINES per 10 s,
    the next line saying how many were held back."""
    from coordd.ops.observer import GROUP_LINES

    caplog.set_level(logging.INFO, logger="coordd")
    events = ServerEvents()
    for n in range(4800):
        now = 100.0 + n / 400
        events.group_created(f"dp-tp{n}-pp0", n, 4, 4, now=now)
        events.group_dropped(f"dp-tp{n}-pp0", n, now=now)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("group ")]
    assert len(lines) == 2 * GROUP_LINES, len(lines)  # 12 s: two windows of 10 s
    assert events.dropped_groups == 4800
    assert "suppressed=" in lines[GROUP_LINES]


def test_a_failed_group_whose_ranks_are_held_holds_readiness_back() -> None:
    """Issue 28, defect 6: after a stranger's Hello re-formed a crashed group and its Goodbye
    left the new epoch empty, the failed epoch's rank still connected is a held rank, not a
    member: readiness counts it, so the failed group still holds /readyz at 503 beside a
    formed one (it did with the rank a member before the Hello)."""
    d = registered(2, groups=("default", "enginecore"))
    d.report(0, 0, 101.0)
    d.report(1, 0, 101.0)
    d.lose(1, 102.0)

    def ready() -> tuple[bool, str]:
        return readiness({n: g.coordinator.snapshot() for n, g in d.groups.items()}, 0)

    assert ready()[0] is False
    stranger = Hello(dp_size=2, dp_rank=1, incarnation="x", config_fingerprint="fp")
    g = d.group()
    d._after(g.coordinator.receive(b"stranger", stranger, 103.0), g)
    d._after(g.coordinator.receive(b"stranger", Goodbye(), 103.5), g)
    snap = d.snapshot()
    assert not snap.members and snap.held == 1
    ok, why = ready()
    assert not ok and why.startswith("group default failed at seq 1"), why


def test_group_failed_reads_1_while_the_failure_stands_through_a_re_forming_epoch() -> None:
    """`coordd_group_failed` read 0 once a stranger's Hello re-formed a crashed group, while
    /readyz, /status and `coordd status` still named the failure."""
    d = registered(2)
    d.report(0, 0, 101.0)
    d.report(1, 0, 101.0)
    d.lose(1, 102.0)
    assert value(d.metrics(), "coordd_group_failed", group="default") == 1
    stranger = Hello(dp_size=2, dp_rank=1, incarnation="x", config_fingerprint="fp")
    g = d.group()
    d._after(g.coordinator.receive(b"stranger", stranger, 103.0), g)
    assert d.snapshot().failure is not None
    assert value(d.metrics(), "coordd_group_failed", group="default") == 1
