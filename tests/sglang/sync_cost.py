"""The cost of one SGLang DP attention sync through the plugin against SGLang's own (gloo), in
the same rank processes, interleaved: `MLPSyncBatchInfo.all_gather` on SGLang's TP group (its
CPU group, the overlap scheduler's), timed on every rank, the two paths taking turns (which goes
first alternates), against a real coordd.

    "$(.ci/sglang-env)" tests/sglang/sync_cost.py [--rounds 400] [--sizes 2,4]

Prints p10/p50/p90 per path and the plugin's over SGLang's at each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from coordd.testing import CoorddProcess
from tests.sglang.ranks import Spec, check_crashes, free_port, run_ranks, tiny_model


def quantiles(values: list[float]) -> tuple[float, float, float]:
    cuts = statistics.quantiles(values, n=10)
    return cuts[0], statistics.median(values), cuts[8]


def measure(world: int, rounds: int, work: Path, model: str) -> dict[str, list[float]]:
    coordd = CoorddProcess(world, f"ipc://{work}/coordd-{world}.sock")
    address = coordd.start().address
    try:
        spec = Spec(world, world, free_port(), model, 0, 1, address, bench=rounds)
        outcomes, blocked = run_ranks(lambda _: spec, world, wait=60.0 + rounds)
    finally:
        coordd.stop()
    check_crashes(outcomes)
    assert not blocked and all(o.error is None for o in outcomes), [o.error for o in outcomes]
    return {name: [t for o in outcomes for t in o.times[name]] for name in ("stock", "coordd")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--sizes", default="2,4")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = tiny_model(work / "tiny")
        print(f"{'dp':>3} {'path':<22} {'syncs':>6} {'p10 us':>8} {'p50 us':>8} {'p90 us':>8}")
        for world in (int(s) for s in options.sizes.split(",")):
            times = measure(world, options.rounds, work, model)
            q = {name: quantiles(values) for name, values in times.items()}
            for name, label in (("stock", "SGLang (gloo)"), ("coordd", "through coordd")):
                p10, p50, p90 = (v * 1e6 for v in q[name])
                print(
                    f"{world:>3} {label:<22} {len(times[name]):>6} {p10:8.0f} {p50:8.0f} {p90:8.0f}"
                )
            ratio = "/".join(f"{a / b:.2f}" for a, b in zip(q["coordd"], q["stock"], strict=True))
            print(f"{world:>3} coordd / gloo (p10/p50/p90): {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
