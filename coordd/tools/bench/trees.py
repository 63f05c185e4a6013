"""Two source trees of coordd in one run: `coordd bench` alternately from each, side by side.

A change to the hot path is judged against the code before it on the same host at the same
time: the whole bench, run from each tree in turn (`PYTHONPATH=<tree>`, so every process of a
run, ranks and coordd alike, runs that tree's code), in pairs whose order alternates (ABBA), so
that drift in the host's load falls on both sides. Each run measures its own hub and floor,
so each tree's figures are also read as ratios to the hub in the same run. What this prints
per dp: each tree's median over its runs, and the after/before ratio of every pair with its
p10, p50 and p90 over the pairs.

    python -m coordd.tools.bench.trees --before /tmp/old --after . --pairs 4 -- \\
        --dp 2,8,16 --methods coordd-ipc,zmq-hub,floor --rounds 1000 --blocks 4 \\
        --overlap-rounds 0 --crosshost-dp none --engine-steps 0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordd.tools.bench.methods import (
    COORDD_IPC,
    DEVICE,
    DEVICE_NCCL,
    GLOO_BARE,
    HUB,
    NCCL_BARE,
    VLLM,
    VLLM_PLUGIN,
)

#: Longest one bench run may take before the comparison gives up on it.
RUN_TIMEOUT_S = 1800.0

Row = dict[str, Any]


@dataclass(frozen=True)
class Metric:
    """One figure read off a run's latency rows at one dp; None where the run lacks it."""

    name: str
    read: Callable[[Sequence[Row], int], float | None]


def _row(rows: Sequence[Row], dp: int, method: str) -> Row | None:
    for row in rows:
        if row.get("dp") == dp and row.get("method") == method:
            return row
    return None


def _field(method: str, key: str) -> Callable[[Sequence[Row], int], float | None]:
    def read(rows: Sequence[Row], dp: int) -> float | None:
        row = _row(rows, dp, method)
        return None if row is None else float(row[key])

    return read


def _thread(method: str, thread: str) -> Callable[[Sequence[Row], int], float | None]:
    """CPU of one thread kind per rank per round (the bench's own unit for its targets)."""

    def read(rows: Sequence[Row], dp: int) -> float | None:
        row = _row(rows, dp, method)
        if row is None or thread not in row.get("cpu_us_per_round_by_thread", {}):
            return None
        return float(row["cpu_us_per_round_by_thread"][thread]) / dp

    return read


def _over(
    a: Callable[[Sequence[Row], int], float | None],
    b: Callable[[Sequence[Row], int], float | None],
) -> Callable[[Sequence[Row], int], float | None]:
    def read(rows: Sequence[Row], dp: int) -> float | None:
        x, y = a(rows, dp), b(rows, dp)
        return None if x is None or not y else x / y

    return read


_IPC_P50, _IPC_P99 = _field(COORDD_IPC, "p50_us"), _field(COORDD_IPC, "p99_us")
_RANK, _HUB_RANK = _thread(COORDD_IPC, "ranks main"), _thread(HUB, "ranks main")
_SERVER, _HUB_SERVER = _thread(COORDD_IPC, "server main"), _thread(HUB, "server main")
METRICS = (
    Metric("coordd-ipc p50 us", _IPC_P50),
    Metric("coordd-ipc p99 us", _IPC_P99),
    Metric("coordd-ipc p99 / p50", _over(_IPC_P99, _IPC_P50)),
    Metric("coordd-ipc / hub p50", _over(_IPC_P50, _field(HUB, "p50_us"))),
    Metric("rank main CPU us", _RANK),
    Metric("rank main CPU / hub rank's", _over(_RANK, _HUB_RANK)),
    Metric("coordd main CPU us", _SERVER),
    Metric("coordd main CPU / hub's", _over(_SERVER, _HUB_SERVER)),
    Metric("vllm-plugin p50 us", _field(VLLM_PLUGIN, "p50_us")),
    Metric(
        "vllm-plugin / vLLM's own p50", _over(_field(VLLM_PLUGIN, "p50_us"), _field(VLLM, "p50_us"))
    ),
    Metric("device-gloo p50 us", _field(DEVICE, "p50_us")),
    Metric(
        "device-gloo / gloo-bare p50", _over(_field(DEVICE, "p50_us"), _field(GLOO_BARE, "p50_us"))
    ),
    Metric(
        "device-nccl / nccl-bare p50",
        _over(_field(DEVICE_NCCL, "p50_us"), _field(NCCL_BARE, "p50_us")),
    ),
)


def order(pairs: int) -> list[str]:
    """before, after, after, before, ...: each pair's first side alternates."""
    out: list[str] = []
    for i in range(pairs):
        out.extend(("before", "after") if i % 2 == 0 else ("after", "before"))
    return out


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (a handful of pairs: nearest rank would jump)."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def compare(runs: dict[str, list[Sequence[Row]]], dps: Sequence[int]) -> list[Row]:
    """Per dp and metric: each side's median over its runs, and the after/before ratios of
    the pairs (the i-th run of each side) with their p10/p50/p90."""
    out = []
    for dp in dps:
        for metric in METRICS:
            before = [metric.read(rows, dp) for rows in runs["before"]]
            after = [metric.read(rows, dp) for rows in runs["after"]]
            pairs = [a / b for b, a in zip(before, after, strict=False) if a is not None and b]
            have_b = [v for v in before if v is not None]
            have_a = [v for v in after if v is not None]
            if not have_b and not have_a:
                continue
            out.append(
                {
                    "dp": dp,
                    "metric": metric.name,
                    "before": statistics.median(have_b) if have_b else None,
                    "after": statistics.median(have_a) if have_a else None,
                    "before_runs": before,
                    "after_runs": after,
                    "ratio_p10": quantile(pairs, 0.1) if pairs else None,
                    "ratio_p50": quantile(pairs, 0.5) if pairs else None,
                    "ratio_p90": quantile(pairs, 0.9) if pairs else None,
                }
            )
    return out


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"


def render(table: Sequence[Row], meta: Row) -> str:
    lines = [
        f"before: {meta['before']} ({meta['before_rev']}); after: {meta['after']} "
        f"({meta['after_rev']}); {meta['pairs']} pairs, order {' '.join(meta['order'])}; "
        f"load {meta['load_start']:.1f} -> {meta['load_end']:.1f}; bench {' '.join(meta['bench'])}",
        "",
        "| dp | figure | before (median) | after (median) | after/before p10 | p50 | p90 | "
        "runs before | runs after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        runs_b = ", ".join(_fmt(v) for v in r["before_runs"])
        runs_a = ", ".join(_fmt(v) for v in r["after_runs"])
        lines.append(
            f"| {r['dp']} | {r['metric']} | {_fmt(r['before'])} | {_fmt(r['after'])} | "
            f"{_fmt(r['ratio_p10'])} | {_fmt(r['ratio_p50'])} | {_fmt(r['ratio_p90'])} | "
            f"{runs_b} | {runs_a} |"
        )
    return "\n".join(lines)


def _revision(tree: Path) -> str:
    try:
        got = subprocess.run(
            ["git", "-C", str(tree), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return got.stdout.strip() or "?"


def _tree(text: str) -> Path:
    path = Path(text).resolve()
    if not (path / "coordd" / "tools" / "bench" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(
            f"{text}: not a coordd source tree (no coordd/tools/bench)"
        )
    return path


def run_bench(tree: Path, bench: Sequence[str], out: Path, timeout: float) -> Sequence[Row]:
    """One `coordd bench --json` run with every process on `tree`'s code; its latency rows."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])),
    )
    argv = [sys.executable, "-m", "coordd", "bench", *bench, "--json", str(out)]
    with open(out.with_suffix(".txt"), "w") as log:
        done = subprocess.run(
            argv, env=env, cwd=tree, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
        )
    if done.returncode not in (0, 1) or not out.is_file():
        raise SystemExit(
            f"bench from {tree} exited {done.returncode}: see {out.with_suffix('.txt')}"
        )
    return json.loads(out.read_text())["latency"]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m coordd.tools.bench.trees",
        description="coordd bench from two source trees, alternated (ABBA), compared per pair",
    )
    p.add_argument("--before", type=_tree, required=True, help="the tree before the change")
    p.add_argument("--after", type=_tree, required=True, help="the tree after it")
    p.add_argument("--pairs", type=int, default=4, help="runs of each tree (4)")
    p.add_argument("--out", type=Path, default=None, help="keep each run's JSON and log here")
    p.add_argument("--json", metavar="FILE", help="write the comparison as JSON")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then `coordd bench`'s options")
    args = p.parse_args(argv)
    bench = [a for a in args.bench if a != "--"] if args.bench[:1] == ["--"] else args.bench
    if args.pairs < 1:
        raise SystemExit("--pairs must be >= 1")
    if "--json" in bench:
        raise SystemExit("give --json to this tool, not to the bench (each run keeps its own)")
    out = args.out or Path(f"/tmp/coordd-trees-{os.getpid()}")
    out.mkdir(parents=True, exist_ok=True)
    trees = {"before": args.before, "after": args.after}
    runs: dict[str, list[Sequence[Row]]] = {"before": [], "after": []}
    sides = order(args.pairs)
    load_start = os.getloadavg()[0]
    for i, side in enumerate(sides):
        began = time.monotonic()
        rows = run_bench(trees[side], bench, out / f"{i:02d}-{side}.json", RUN_TIMEOUT_S)
        runs[side].append(rows)
        print(f"run {i + 1}/{len(sides)}: {side} in {time.monotonic() - began:.0f} s, "
              f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)  # fmt: skip
    dps = sorted({r["dp"] for side in runs.values() for rows in side for r in rows})
    table = compare(runs, dps)
    meta = {
        "before": str(args.before),
        "after": str(args.after),
        "before_rev": _revision(args.before),
        "after_rev": _revision(args.after),
        "pairs": args.pairs,
        "order": sides,
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
        "bench": bench,
    }
    print(render(table, meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
