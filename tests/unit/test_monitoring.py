"""The Grafana dashboard and the Prometheus alert rules in deploy/ ask only for what coordd
exports (issue 30): every metric name a query names, and every label it selects or groups by,
is checked against the real exporter (`coordd.ops.collector` behind a real `CoordServer`, with
every optional family switched on), not against a list kept by hand."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordd.core._settings import ServerSettings
from coordd.io._server import CoordServer
from coordd.ops.collector import CoorddCollector, make_registry
from coordd.ops.status_doc import server_readiness
from coordd.ops.view import RelayedGroup, RelayRow
from coordd.proto.coordinator import Coordinator
from coordd.proto.messages import FailReason

ROOT = Path(__file__).parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "coordd-alerts.yaml"
OPERATIONS = ROOT / "docs" / "operations.md"
DASHBOARD = ROOT / "deploy" / "grafana" / "coordd-dashboard.json"
#: Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"instance", "job"}
#: Prometheus's own series a rule may use: `up` of coordd's scrape job.
PROMETHEUS_OWN = {"up": set()}
PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "topk", "bottomk", "by", "without", "on", "ignoring",
    "group_left", "group_right", "and", "or", "unless", "bool", "offset", "rate", "irate",
    "increase", "delta", "histogram_quantile", "scalar", "vector", "absent", "label_values",
    "abs", "clamp_min", "clamp_max", "quantile", "stddev",
}


@pytest.fixture(scope="module")
def collected(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """The real exporter's families: "on", with every optional family switched on (a memory
    guard, a handshake gate, CURVE) and a group served through relays; "default", as a
    `CoordServer` with none of them exports."""
    address = f"ipc://{tmp_path_factory.mktemp('mon')}/c.sock"
    server = CoordServer(ServerSettings(address, dp_size=2))
    try:
        collector = CoorddCollector(server, lambda: server_readiness(server))
        default = list(make_registry(collector).collect())
        real = server.counters
        server.counters = lambda: dataclasses.replace(  # type: ignore[method-assign]
            real(), memory_shed=0, memory_refused=0, rate_refused=0, curve_refused=0
        )
        relayed = RelayedGroup(Coordinator(2, epoch=1).snapshot(), (RelayRow("node0", (0, 1), ""),))
        server.relayed_groups = lambda: {"r": relayed}  # type: ignore[method-assign]
        return {"on": list(make_registry(collector).collect()), "default": default}
    finally:
        server.close()


@pytest.fixture(scope="module")
def exported(collected: dict[str, list[Any]]) -> dict[str, set[str]]:
    """Every series name coordd's /metrics can hold -> its labels, from the real exporter."""
    names: dict[str, set[str]] = {}
    for family in collected["on"]:
        labels = set(getattr(family, "_labelnames", ()))
        for sample in family.samples:
            labels |= set(sample.labels)
        for name in _series_names(family.name, family.type):
            names[name] = labels | ({"le"} if name.endswith("_bucket") else set())
    return names


def _series_names(name: str, kind: str) -> list[str]:
    if kind == "counter":
        return [f"{name}_total"]
    if kind == "histogram":
        return [f"{name}_bucket", f"{name}_sum", f"{name}_count"]
    if kind == "info":
        return [f"{name}_info"]
    return [name]


def _uses(expr: str) -> Iterator[tuple[str, set[str]]]:
    """(metric name, label names it selects) for every series `expr` names, then ("", the
    labels of every by/without/on/ignoring list)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings: no names in them
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\$\{?\w+\}?", "", text)  # Grafana's variables
    grouped: set[str] = set()
    for label in re.findall(r"label_values\((?:[^,()]|\([^()]*\))*,\s*(\w+)\s*\)", text):
        grouped.add(label)  # Grafana's label_values(SERIES, LABEL)
    text = re.sub(r"(label_values\((?:[^,()]|\([^()]*\))*),\s*\w+\s*\)", r"\1)", text)
    for words in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", text):
        grouped |= {w.strip() for w in words.split(",") if w.strip()}
    text = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", "", text)
    for name, selector in re.findall(r"([A-Za-z_:][\w:]*)\s*(\{[^}]*\})?", text):
        if name in PROMQL_WORDS or re.fullmatch(r"[\d.e]+", name):
            continue
        keys = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector or ""))
        yield name, keys
    yield "", grouped


def _check(where: str, expr: str, exported: dict[str, set[str]]) -> None:
    assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), where
    named = 0
    labels_here = set(TARGET_LABELS)
    for name, keys in _uses(expr):
        if not name:
            assert keys <= labels_here, f"{where}: groups by {sorted(keys - labels_here)}"
            continue
        known = {**PROMETHEUS_OWN, **exported}
        assert name in known, f"{where}: {name} is not a metric coordd exports"
        allowed = known[name] | TARGET_LABELS
        assert keys <= allowed, f"{where}: {name} has no label(s) {sorted(keys - allowed)}"
        labels_here |= allowed
        named += 1
    assert named, f"{where}: names no metric"


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_the_exporter_is_read_not_a_hand_list(exported: dict[str, set[str]]) -> None:
    assert {"coordd_group_failed", "coordd_faults_total", "coordd_rank_wait_seconds_bucket",
            "coordd_memory_handshakes_refused_total", "process_resident_memory_bytes"} <= set(
        exported)
    assert exported["coordd_faults_total"] >= {"group", "reason"}
    assert exported["coordd_rank_wait_seconds_bucket"] >= {"group", "site", "le"}


def test_every_alert_rule_asks_for_what_coordd_exports(exported: dict[str, set[str]]) -> None:
    rules = _rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        _check(rule["alert"], rule["expr"], exported)
    # what issue 30 asked the rules to cover
    exprs = " ".join(rule["expr"] for rule in rules)
    for needed in ("coordd_group_failed", 'reason="lost"', 'reason="timeout"',
                   "coordd_round_duration_seconds_bucket", "coordd_connections_closed_total",
                   "coordd_curve_refused_total", "coordd_memory_handshakes_refused_total",
                   "coordd_rank_wait_seconds_sum"):
        assert needed in exprs, needed


def test_every_dashboard_query_asks_for_what_coordd_exports(
    exported: dict[str, set[str]],
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    queries = [(p["title"], t["expr"]) for p in panels for t in p["targets"]]
    queries += [(v["name"], v["query"]["query"]) for v in dashboard["templating"]["list"]
                if v["type"] == "query"]
    for where, expr in queries:
        _check(where, expr, exported)
    titles = " ".join(p["title"] for p in panels)
    assert "What a sync costs" in titles and "Round latency" in titles


def test_the_dashboard_declares_no_input_it_does_not_use() -> None:
    """Issue 39, item 8: an `__inputs` data source (DS_PROMETHEUS) that no panel used, which
    Grafana's import dialog asked for anyway. The panels take their data source from the
    dashboard's own `datasource` variable; every `${DS_...}` used must be declared, and the
    other way round."""
    text = DASHBOARD.read_text()
    dashboard = json.loads(text)
    declared = {one["name"] for one in dashboard.get("__inputs", [])}
    used = set(re.findall(r"\$\{(DS_\w+)\}", text))
    assert declared == used
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    sources = [p.get("datasource") for p in dashboard["panels"]]
    sources += [t.get("datasource") for p in dashboard["panels"] for t in p["targets"]]
    assert {json.dumps(s) for s in sources if s} == {
        json.dumps({"type": "prometheus", "uid": "${datasource}"})
    }


def test_a_query_naming_what_coordd_does_not_export_is_caught(
    exported: dict[str, set[str]],
) -> None:
    with pytest.raises(AssertionError, match="not a metric coordd exports"):
        _check("x", "rate(coordd_round_latency_seconds_sum[5m])", exported)
    with pytest.raises(AssertionError, match="no label"):
        _check("x", 'coordd_faults_total{rank="1"}', exported)
    with pytest.raises(AssertionError, match="groups by"):
        _check("x", "sum by (site) (rate(coordd_rounds_total[5m]))", exported)


# -- issue 39, item 4: docs/operations.md's metrics reference is the exporter's list ------------


def _reference() -> list[tuple[list[str], str, set[str], str]]:
    """The reference's rows: (metric names, type cell, label words, what)."""
    text = OPERATIONS.read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        names = re.findall(r"`(coordd_\w+)`", cells[0])
        rows.append((names, cells[1], set(re.findall(r"[a-z_]+", cells[2])), cells[3]))
    return rows


def _documented_name(family: Any) -> str:
    """A family as the reference names it: a counter with _total, an info with _info."""
    return {"counter": f"{family.name}_total", "info": f"{family.name}_info"}.get(
        family.type, family.name
    )


def test_the_metrics_reference_lists_what_the_exporter_exports(
    collected: dict[str, list[Any]],
) -> None:
    """Before: coordd_group_stopped, coordd_departures_total and coordd_group_stops_total were
    exported but not listed, and `violation` was missing from the closed connections' reasons."""
    families = {_documented_name(f): f for f in collected["on"] if f.name.startswith("coordd_")}
    rows = _reference()
    listed = [name for names, *_ in rows for name in names]
    assert len(listed) == len(set(listed)), "a metric listed twice"
    assert set(listed) == set(families)
    for names, kinds, labels, _ in rows:
        row = [families[name] for name in names]
        assert set(kinds.split(", ")) == {f.type for f in row}, names
        exported = {
            label
            for f in row
            for label in (*getattr(f, "_labelnames", ()), *(k for s in f.samples for k in s.labels))
        }
        assert labels == exported - {"le"}, names
    (closed,) = [what for names, _, _, what in rows if "coordd_connections_closed_total" in names]
    reasons = {s.labels["reason"] for s in families["coordd_connections_closed_total"].samples}
    assert set(re.findall(r"`([a-z_]+)`", closed)) == reasons
    (faults,) = [what for names, _, _, what in rows if names == ["coordd_faults_total"]]
    assert {r.value for r in FailReason} <= set(re.findall(r"\w+", faults))


def test_the_metrics_reference_says_which_families_only_some_coordds_export(
    collected: dict[str, list[Any]],
) -> None:
    """Before: nothing said coordd_curve_refused_total exists only with CURVE. A row of a
    family a plain coordd does not export says "only" and when."""
    plain = {_documented_name(f) for f in collected["default"]}
    optional = {_documented_name(f) for f in collected["on"]} - plain
    assert "coordd_curve_refused_total" in optional
    for names, _, _, what in _reference():
        assert ("only" in what) == bool(set(names) & optional), names
