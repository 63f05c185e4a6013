"""The benchmark's results as tables, coordd's performance targets with their measured ratios,
and JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from coordd.tools.bench.methods import COORDD_IPC, COORDD_TCP, FLOOR, GLOO

TARGET_DP = 8
SCALE_DP = 256


def _fmt(value: Any, digits: int = 1) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _row(rows: Sequence[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def ratios(latency: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per dp, coordd's p50 and p99 over gloo's and over the floor's (same run)."""
    out = []
    for dp in sorted({r["dp"] for r in latency}):
        entry: dict[str, Any] = {"dp": dp}
        for mine in (COORDD_IPC, COORDD_TCP):
            for other in (GLOO, FLOOR):
                a, b = _row(latency, dp=dp, method=mine), _row(latency, dp=dp, method=other)
                if a and b:
                    entry[f"{mine}/{other} p50"] = a["p50_us"] / b["p50_us"]
                    entry[f"{mine}/{other} p99"] = a["p99_us"] / b["p99_us"]
        out.append(entry)
    return out


def _target(name: str, value: float | None, limit: float, unit: str, where: str) -> dict[str, Any]:
    met = None if value is None else value <= limit
    return {
        "target": name,
        "value": value,
        "limit": limit,
        "unit": unit,
        "where": where,
        "met": met,
    }


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """coordd's performance targets, each with its measured figure (None: not measured)."""
    latency = results.get("latency", [])
    overlap = results.get("overlap", [])
    scale = results.get("scale", [])
    out = []
    ipc = _row(latency, dp=TARGET_DP, method=COORDD_IPC)
    floor = _row(latency, dp=TARGET_DP, method=FLOOR)
    where = f"dp={TARGET_DP}"
    out.append(
        _target(
            "coordd ipc round p50 / raw-socket floor p50",
            ipc["p50_us"] / floor["p50_us"] if ipc and floor else None,
            1.3,
            "x",
            where,
        )
    )
    out.append(
        _target(
            "coordd ipc round p99 / its p50",
            ipc["p99_us"] / ipc["p50_us"] if ipc else None,
            3.0,
            "x",
            where,
        )
    )
    hidden = [
        r
        for r in overlap
        if r["method"] == COORDD_IPC and r["variant"] == "sleep" and r["work_multiple"] >= 2
    ]
    for dp in sorted({r["dp"] for r in hidden}) or [TARGET_DP]:
        worst = max(
            (r for r in hidden if r["dp"] == dp),
            key=lambda r: r["exposed_over_sync"],
            default=None,
        )
        out.append(
            _target(
                "coordd ipc exposed wait p50 / sync round p50 (sleeping W >= 2x, worst W)",
                100 * worst["exposed_over_sync"] if worst else None,
                5.0,
                "%",
                f"dp={dp}, W={worst['work_multiple']:g}x" if worst else f"dp={dp}",
            )
        )
    big = _row(scale, dp=SCALE_DP, client="lean") or _row(scale, dp=SCALE_DP)
    where = f"dp={SCALE_DP}, {big['client']} ranks" if big else f"dp={SCALE_DP}"
    out.append(_target("round p50", big["p50_us"] / 1000 if big else None, 10.0, "ms", where))
    out.append(
        _target(
            "coordd CPU per rank per round",
            big["coordd_cpu_us_per_rank_round"] if big else None,
            20.0,
            "us",
            where,
        )
    )
    out.append(
        _target("coordd resident memory", big["coordd_rss_mb"] if big else None, 60.0, "MB", where)
    )
    return out


def render(results: dict[str, Any]) -> str:
    parts = []
    latency = results.get("latency", [])
    if latency:
        parts.append("Round latency (synchronous rounds; every rank's samples), microseconds")
        parts.append(
            table(
                [
                    "dp",
                    "method",
                    "p50",
                    "p90",
                    "p99",
                    "p99/p50",
                    "CPU/round",
                    "ctxsw/round",
                    "done",
                ],
                [
                    [
                        r["dp"],
                        r["method"],
                        r["p50_us"],
                        r["p90_us"],
                        r["p99_us"],
                        r["p99_us"] / r["p50_us"],
                        r["cpu_us_per_round"],
                        r["ctx_switches_per_round"],
                        f"{r['completed']}/{r['rounds']}",
                    ]
                    for r in latency
                ],
            )
        )
        ratio_rows = ratios(latency)
        keys = [k for k in ratio_rows[0] if k != "dp"] if ratio_rows else []
        if keys:
            parts.append("\nRatios (same run)")
            parts.append(
                table(["dp", *keys], [[r["dp"], *(r.get(k) for k in keys)] for r in ratio_rows])
            )
        kinds = sorted({k for r in latency for k in r.get("cpu_us_per_round_by_thread", {})})
        if kinds:
            parts.append("\nWhere a round's CPU goes (all rank processes and the server), us")
            parts.append(
                table(
                    ["dp", "method", *kinds, "total"],
                    [
                        [
                            r["dp"],
                            r["method"],
                            *(r["cpu_us_per_round_by_thread"].get(k, 0.0) for k in kinds),
                            r["cpu_us_per_round"],
                        ]
                        for r in latency
                    ],
                )
            )
    overlap = results.get("overlap", [])
    if overlap:
        parts.append(
            "\nOverlap: start, work W, wait; exposed wait against the method's sync p50 (us)"
        )
        parts.append(
            table(
                [
                    "dp",
                    "method",
                    "work",
                    "W",
                    "W us",
                    "exposed p50",
                    "p99",
                    "sync p50",
                    "exp/sync %",
                ],
                [
                    [
                        r["dp"],
                        r["method"],
                        r["variant"],
                        f"{r['work_multiple']:g}x",
                        r["work_us"],
                        r["exposed_p50_us"],
                        r["exposed_p99_us"],
                        r["sync_p50_us"],
                        100 * r["exposed_over_sync"],
                    ]
                    for r in overlap
                ],
            )
        )
    scale = results.get("scale", [])
    if scale:
        parts.append(
            "\nScale: simulated ranks on one coordd over ipc (coordd CPU from its /proc; "
            "us per rank per round)"
        )
        parts.append(
            table(
                [
                    "dp",
                    "ranks",
                    "procs",
                    "p50 ms",
                    "p99 ms",
                    "rounds/s",
                    "coordd us/round",
                    "per rank",
                    "main",
                    "zmq io",
                    "RSS MB",
                    "sim ranks' own",
                    "done",
                ],
                [
                    [
                        r["dp"],
                        r["client"],
                        r["procs"],
                        r["p50_us"] / 1000,
                        r["p99_us"] / 1000,
                        r["rounds_per_s"],
                        r["coordd_cpu_us_per_round"],
                        r["coordd_cpu_us_per_rank_round"],
                        r["coordd_cpu_us_per_round_by_thread"].get("main", 0.0) / r["dp"],
                        sum(
                            v
                            for k, v in r["coordd_cpu_us_per_round_by_thread"].items()
                            if k.startswith("ZMQbg/IO")
                        )
                        / r["dp"],
                        r["coordd_rss_mb"],
                        sum(r["ranks_cpu_us_per_rank_round_by_thread"].values()),
                        f"{r['completed']}/{r['rounds']}",
                    ]
                    for r in scale
                ],
            )
        )
    checks = [r for r in [*latency, *overlap, *scale] if r.get("mismatches")]
    for r in checks:
        parts.append(f"\nWRONG DECISIONS: {r['mismatches']} in {r}")
    tgts = results.get("targets") or targets(results)
    parts.append("\nTargets")
    parts.append(
        table(
            ["target", "where", "measured", "limit", "met"],
            [
                [
                    t["target"],
                    t["where"],
                    "-" if t["value"] is None else f"{t['value']:.2f} {t['unit']}",
                    f"<= {t['limit']:g} {t['unit']}",
                    {True: "yes", False: "NO", None: "not run"}[t["met"]],
                ]
                for t in tgts
            ],
        )
    )
    if results.get("skipped"):
        parts.append("\nSkipped: " + "; ".join(f"{k}: {v}" for k, v in results["skipped"].items()))
    return "\n".join(parts)


def _finite(value: Any) -> Any:
    """NaN (no samples) becomes null: JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def write_json(results: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(_finite(results), f, indent=1, allow_nan=False, default=str)
        f.write("\n")
