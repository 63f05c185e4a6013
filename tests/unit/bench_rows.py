"""A latency row as `coordd bench` writes one, for the tests of its targets and report."""

from __future__ import annotations

from typing import Any


def latency_row(method: str, p50: float, dp: int = 2) -> dict[str, Any]:
    """`method`'s row at `dp` with p50 `p50` us (p90 the same, p99 twice it; one round)."""
    return {
        "dp": dp,
        "method": method,
        "p50_us": p50,
        "p90_us": p50,
        "p99_us": 2 * p50,
        "cpu_us_per_round": 1.0,
        "ctx_switches_per_round": 1.0,
        "completed": 1,
        "rounds": 1,
        "cpu_us_per_round_by_thread": {},
    }
