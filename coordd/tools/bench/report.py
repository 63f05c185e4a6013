"""The benchmark's results as tables (a summary, the targets with their measured ratios, the
engine loop, across hosts; then the details), and JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from coordd.tools.bench import crosshost
from coordd.tools.bench.engine import STATE_EVERY
from coordd.tools.bench.methods import COORDD_IPC, FLOOR, GLOO, HUB, VLLM
from coordd.tools.bench.targets import find_row, ratios, targets


def _fmt(value: Any, digits: int = 1) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def _is_number(text: str) -> bool:
    try:
        float(text.rstrip("%x").split(" ")[0])
    except ValueError:
        return text == "-"
    return True


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns of numbers right-aligned, columns of words left-aligned."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    left = [not all(_is_number(r[i]) for r in cells[1:]) for i in range(len(headers))]
    lines = [
        "  ".join(
            (c.ljust(w) if lf else c.rjust(w)).rstrip()
            if i == len(r) - 1
            else (c.ljust(w) if lf else c.rjust(w))
            for i, (c, w, lf) in enumerate(zip(r, widths, left, strict=True))
        )
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def _summary(latency: Sequence[dict[str, Any]]) -> str:
    methods = list(dict.fromkeys(r["method"] for r in latency))
    dps = sorted({r["dp"] for r in latency})
    rows = []
    for dp in dps:
        cells: list[Any] = [dp]
        for m in methods:
            r = find_row(latency, dp=dp, method=m)
            cells.append(f"{r['p50_us']:.0f} / {r['p99_us']:.0f}" if r else "-")
        rows.append(cells)
    return table(["dp", *methods], rows)


def _unmeasured(t: dict[str, Any]) -> str:
    """A target without a figure: "not asked" where the run was not asked for what it needs
    (a dp, a method, a phase), "not run" where it was and the figure is missing all the same."""
    if t["value"] is not None or t["limit"] is None:
        return "-"
    return "not run" if t.get("asked", True) else "not asked"


def _targets_table(tgts: Sequence[dict[str, Any]]) -> str:
    def limit(t: dict[str, Any]) -> str:
        if t["limit"] is None:
            return "(reported)"
        return f"{'<' if t.get('strict') else '<='} {t['limit']:g} {t['unit']}"

    return table(
        ["target", "where", "measured", "limit", "result"],
        [
            [
                t["target"],
                t["where"],
                "-" if t["value"] is None else f"{t['value']:.2f} {t['unit']}",
                limit(t),
                {True: "PASS", False: "MISS", None: _unmeasured(t)}[t["met"]],
            ]
            for t in tgts
        ],
    )


def _engine_table(rows: Sequence[dict[str, Any]]) -> str:
    return table(
        [
            "dp",
            "sync",
            "step ms",
            "GPU ms",
            "blocked ms",
            "blocked %",
            "step vs gloo",
            "vs coordd sync",
        ],
        [
            [
                r["dp"],
                r["mode"],
                r["mean_step_ms"],
                r["gpu_ms_per_step"],
                r["blocked_ms_per_step"],
                100 * r["blocked_share"],
                _pct(r["step_vs_gloo"]),
                _pct(r.get("step_vs_coordd_sync")),
            ]
            for r in rows
        ],
    )


def _model_table(rows: Sequence[dict[str, Any]]) -> str:
    headers = ["method", "dp", "local p50", "measured on"]
    keys = []
    for nodes in crosshost.NODES:
        headers.append(f"{nodes}n trips")
        keys.append(f"trips_{nodes}n")
        for rtt in crosshost.RTTS_US:
            headers.append(f"{nodes}n @{rtt:g}")
            keys.append(f"p50_{nodes}n_{rtt:g}us")
    return table(
        headers,
        [
            [
                r["method"],
                r["dp"],
                r["base_p50_us"],
                r["base_from"],
                *(r.get(k, "-") for k in keys),
            ]
            for r in rows
        ],
    )


def render(results: dict[str, Any]) -> str:
    parts = []
    meta = results.get("meta", {})
    latency = results.get("latency", [])
    load = meta.get("loadavg_start")
    end = meta.get("loadavg_end")
    parts.append(
        f"coordd bench, {meta.get('started', '')}: {meta.get('cpus', '?')} CPUs, "
        f"load average {load[0]:.2f} at the start"
        + (f", {end[0]:.2f} at the end" if end else "")
        + ". On a shared machine every figure is noisy: compare methods within one run, and "
        "runs by their ranges."
        if load
        else "coordd bench"
    )
    if latency:
        parts.append(
            "\nSUMMARY: round latency p50 / p99, microseconds (synchronous rounds, every "
            "rank's samples; measured)"
        )
        parts.append(_summary(latency))
    if latency or results.get("scale"):  # (not for `--engine` alone: nothing to judge)
        tgts = results.get("targets") or targets(results)
        parts.append("\nTargets")
        parts.append(_targets_table(tgts))
    engine_rows = results.get("engine", [])
    if engine_rows:
        first = engine_rows[0]
        parts.append(
            f"\nEngine loop (measured): a vLLM-shaped step, GPU time simulated "
            f"(0.5x..2.9x of {first['step_ms']:g} ms), forward + drafter rounds each step, a "
            f"state round every {STATE_EVERY}; {first['steps']} steps per way to sync. blocked: "
            "time in DP sync calls (overlap: the wait left after the GPU work)"
        )
        parts.append(_engine_table(engine_rows))
    cross = results.get("crosshost", [])
    if cross:
        parts.append(
            "\nAcross namespaces (measured): each method over tcp, half the ranks in a second "
            "network namespace joined by veth, no added delay; p50 / p99 us"
        )
        parts.append(_summary(cross))
    elif results.get("crosshost_skipped"):
        parts.append(f"\nAcross namespaces: not measured ({results['crosshost_skipped']})")
    model_rows = results.get("crosshost_model") or crosshost.model(results)
    if model_rows:
        parts.append(
            "\nAcross hosts, MODELLED (not measured): p50 = measured local p50 (the lower of "
            "across namespaces and one host) + one-way "
            "network trips on the critical path x RTT/2, in us, for 2 and 4 nodes (ranks in "
            "contiguous blocks per node, coordd and the hubs on node 0) at RTT 50 and 200 us. "
            "Trips: star (coordd, pyzmq hub, floor) = report in + decision out = 2; gloo ring = "
            "the longest chain of its 2(dp-1) dependent steps, one trip per node boundary "
            "crossed; vLLM recursive doubling = its log2(dp) exchanges that span nodes"
        )
        parts.append(_model_table(model_rows))
    parts.append("\n-- details --")
    if latency:
        parts.append("\nRound latency (synchronous rounds; every rank's samples), microseconds")
        parts.append(
            table(
                ["dp", "method", "p50", "p90", "p99", "p99/p50", "CPU/round", "ctxsw", "done"],
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
        keys = list(dict.fromkeys(k for r in ratio_rows for k in r if k != "dp"))
        if keys:
            parts.append("\nRatios of p50 (same run)")
            parts.append(
                table(["dp", *keys], [[r["dp"], *(r.get(k) for k in keys)] for r in ratio_rows])
            )
        kinds = sorted({k for r in latency for k in r.get("cpu_us_per_round_by_thread", {})})
        if kinds:
            parts.append(
                "\nWhere a round's CPU goes (all rank processes and the server), us per round"
            )
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
                ["dp", "method", "work", "W", "W us", "exposed p50", "p99", "sync p50", "exp %"],
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
            "\nScale: simulated ranks on one coordd over ipc, flat or through relays (one "
            "process each; coordd: the root's CPU from its /proc; per rank, main and zmq io: "
            "us per rank per round; relay: mean/max over the relays)"
        )
        parts.append(
            table(
                [
                    "dp",
                    "ranks",
                    "layout",
                    "procs",
                    "p50 ms",
                    "p99 ms",
                    "rounds/s",
                    "coordd us/round",
                    "per rank",
                    "main",
                    "zmq io",
                    "RSS MB",
                    "relay us/round",
                    "relay RSS MB",
                    "sim ranks' own",
                    "done",
                ],
                [
                    [
                        r["dp"],
                        r["client"],
                        r.get("layout", "flat"),
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
                        _mean_max(r.get("relay_cpu_us_per_round", [])),
                        _mean_max(r.get("relay_rss_mb", [])),
                        sum(r["ranks_cpu_us_per_rank_round_by_thread"].values()),
                        f"{r['completed']}/{r['rounds']}",
                    ]
                    for r in scale
                ],
            )
        )
    if cross:
        parts.append("\nAcross namespaces, every figure (us)")
        parts.append(
            table(
                ["dp", "method", "p50", "p90", "p99", "CPU/round", "done"],
                [
                    [
                        r["dp"],
                        r["method"],
                        r["p50_us"],
                        r["p90_us"],
                        r["p99_us"],
                        r["cpu_us_per_round"],
                        f"{r['completed']}/{r['rounds']}",
                    ]
                    for r in cross
                ],
            )
        )
    checks = [r for r in [*latency, *overlap, *cross, *scale] if r.get("mismatches")]
    for r in checks:
        parts.append(f"\nWRONG DECISIONS: {r['mismatches']} in {r}")
    if results.get("skipped"):
        parts.append("\nSkipped: " + "; ".join(f"{k}: {v}" for k, v in results["skipped"].items()))
    parts.append("\n" + verdict(results))
    return "\n".join(parts)


#: What the verdict compares coordd's ipc round with, most telling first.
VERDICT_METHODS = {
    VLLM: "vLLM's cpu_all_reduce_",
    GLOO: "gloo all_reduce",
    HUB: "the bare pyzmq hub",
    FLOOR: "the raw-socket floor",
}
#: How to measure against vLLM where it does not import.
WITH_VLLM = (
    "PYTHONPATH=<this checkout> VLLM_TARGET_DEVICE=cpu <vLLM's venv>/bin/python -m coordd bench "
    "--quick"
)


def verdict(results: dict[str, Any]) -> str:
    """The run's last line: at the largest dp measured, coordd's ipc round p50 against each
    method measured beside it (which is faster, by how much), and, where vLLM's own
    all-reduce was not measured, what it takes to measure it."""
    latency = results.get("latency", [])
    rows = [r for r in latency if r["method"] == COORDD_IPC]
    if not rows:
        return "verdict: no coordd round latency measured in this run (nothing to compare)"
    dp = max(r["dp"] for r in rows)
    mine = find_row(latency, dp=dp, method=COORDD_IPC)
    assert mine is not None
    said = []
    for method, name in VERDICT_METHODS.items():
        other = find_row(latency, dp=dp, method=method)
        if other is None:
            continue
        ratio = mine["p50_us"] / other["p50_us"]
        if ratio <= 1:
            said.append(f"{1 / ratio:.2f}x faster than {name} ({other['p50_us']:.0f} us)")
        else:
            said.append(f"{ratio:.2f}x slower than {name} ({other['p50_us']:.0f} us)")
    line = (
        f"verdict: dp={dp}, round p50 (synchronous, same ranks, same run): coordd ipc "
        f"{mine['p50_us']:.0f} us is " + ("; ".join(said) or "compared with nothing else")
    )
    if find_row(latency, dp=dp, method=VLLM) is None:
        why = results.get("skipped", {}).get(VLLM, "not asked (--methods)").split(" (")[0]
        line += f"; against vLLM: not measured ({why}); to measure it: {WITH_VLLM}"
    return line


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


def _mean_max(values: list[float]) -> str:
    """ "mean/max" of the relays' figures; "-" for a flat run."""
    if not values:
        return "-"
    return f"{sum(values) / len(values):.0f}/{max(values):.0f}"
