"""Percentiles and summaries of latency samples (nanoseconds in, microseconds out)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(sorted_ns: Sequence[int], q: float) -> float:
    """Nearest-rank percentile of already sorted samples, in microseconds."""
    if not sorted_ns:
        return float("nan")
    k = min(len(sorted_ns) - 1, max(0, math.ceil(q * len(sorted_ns)) - 1))
    return sorted_ns[k] / 1000.0


def summary(samples_ns: Sequence[int]) -> dict[str, float]:
    """p50 / p90 / p99 / max / mean in microseconds."""
    xs = sorted(samples_ns)
    mean = sum(xs) / len(xs) / 1000.0 if xs else float("nan")
    return {
        "p50_us": percentile(xs, 0.50),
        "p90_us": percentile(xs, 0.90),
        "p99_us": percentile(xs, 0.99),
        "max_us": xs[-1] / 1000.0 if xs else float("nan"),
        "mean_us": mean,
    }
