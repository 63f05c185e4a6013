"""The two runs side by side: the same tokens on every rank, and the per-step times."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

# -- the comparison -----------------------------------------------------------------------------


@dataclass
class RankResult:
    """What one rank process reports (one JSON file per rank and run)."""

    rank: int
    tokens: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""

    @classmethod
    def load(cls, path: Path) -> RankResult:
        return cls(**json.loads(path.read_text()))


def compare(plain: Sequence[RankResult], plugin: Sequence[RankResult]) -> list[str]:
    """Every difference between the two runs' generated tokens (empty: identical)."""
    problems = []
    for results, name in ((plain, "without coordd"), (plugin, "with coordd")):
        for r in results:
            if r.error:
                problems.append(f"rank {r.rank} {name} failed: {r.error}")
    if problems:
        return problems
    by_rank = {r.rank: r for r in plugin}
    for base in plain:
        other = by_rank.get(base.rank)
        if other is None:
            problems.append(f"rank {base.rank}: no result with coordd")
            continue
        if len(base.tokens) != len(other.tokens):
            problems.append(
                f"rank {base.rank}: {len(base.tokens)} outputs without coordd, "
                f"{len(other.tokens)} with"
            )
        for i, (a, b) in enumerate(zip(base.tokens, other.tokens, strict=False)):
            if a != b:
                at = next(
                    (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                    min(len(a), len(b)),
                )
                problems.append(
                    f"rank {base.rank} prompt {i}: tokens differ from position {at} "
                    f"({a[at : at + 4]} without coordd, {b[at : at + 4]} with)"
                )
    return problems


def step_summary(results: Sequence[RankResult]) -> dict[str, float]:
    steps = sorted(s for r in results for s in r.step_seconds)
    if not steps:
        return {"steps": 0}

    def pct(q: float) -> float:
        return steps[min(len(steps) - 1, int(q * len(steps)))] * 1e3

    return {
        "steps": len(steps),
        "mean_ms": statistics.fmean(steps) * 1e3,
        "p50_ms": pct(0.5),
        "p90_ms": pct(0.9),
        "p99_ms": pct(0.99),
        "run_s": max((r.seconds for r in results), default=0.0),
    }


def side_by_side(plain: Sequence[RankResult], plugin: Sequence[RankResult]) -> str:
    a, b = step_summary(plain), step_summary(plugin)
    rows = [
        ("engine steps", "steps", "{:.0f}"),
        ("step mean (ms)", "mean_ms", "{:.2f}"),
        ("step p50 (ms)", "p50_ms", "{:.2f}"),
        ("step p90 (ms)", "p90_ms", "{:.2f}"),
        ("step p99 (ms)", "p99_ms", "{:.2f}"),
        ("generate wall (s)", "run_s", "{:.2f}"),
    ]
    lines = [f"{'':20} {'vLLM (gloo)':>14} {'vLLM + coordd':>14}"]
    for label, key, fmt in rows:
        left = fmt.format(a[key]) if key in a else "-"
        right = fmt.format(b[key]) if key in b else "-"
        lines.append(f"{label:20} {left:>14} {right:>14}")
    lines.append(STEP_NOTE)
    return "\n".join(lines)


#: What the step table's figures include, printed under it.
STEP_NOTE = (
    "(engine.step() wall time in each rank's front-end process, both ranks pooled: the "
    "scheduler, the engine core's step and its DP syncs, the worker's forward and the "
    "outputs; with coordd the sidecar shares the machine's cores with the ranks. The V1 "
    "runner's sync alone is the table below.)"
)
