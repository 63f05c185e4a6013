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

ROOT = Path(__file__).parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "coordd-alerts.yaml"
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
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """Every series name coordd's /metrics can hold -> its labels, from the real exporter."""
    address = f"ipc://{tmp_path_factory.mktemp('mon')}/c.sock"
    server = CoordServer(ServerSettings(address, dp_size=2))
    try:
        real = server.counters
        # the families a memory guard, a handshake gate and CURVE add: all on
        server.counters = lambda: dataclasses.replace(  # type: ignore[method-assign]
            real(), memory_shed=0, memory_refused=0, rate_refused=0, curve_refused=0
        )
        collector = CoorddCollector(server, lambda: server_readiness(server))
        names: dict[str, set[str]] = {}
        for family in make_registry(collector).collect():
            labels = set(getattr(family, "_labelnames", ()))
            for sample in family.samples:
                labels |= set(sample.labels)
            for name in _series_names(family.name, family.type):
                names[name] = labels | ({"le"} if name.endswith("_bucket") else set())
        return names
    finally:
        server.close()


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


def test_a_query_naming_what_coordd_does_not_export_is_caught(
    exported: dict[str, set[str]],
) -> None:
    with pytest.raises(AssertionError, match="not a metric coordd exports"):
        _check("x", "rate(coordd_round_latency_seconds_sum[5m])", exported)
    with pytest.raises(AssertionError, match="no label"):
        _check("x", 'coordd_faults_total{rank="1"}', exported)
    with pytest.raises(AssertionError, match="groups by"):
        _check("x", "sum by (site) (rate(coordd_rounds_total[5m]))", exported)
