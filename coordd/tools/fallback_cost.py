"""What the fallback costs a sync while coordd is healthy: the plugin's Exchange with the
fallback on and off, side by side in the same rank processes, blocks interleaved.

    python -m coordd.tools.fallback_cost [--dp 2] [--rounds 4000] [--block 200]

Starts a `coordd serve` on an ipc socket in a temporary directory and `--dp` rank processes
joined by a gloo group (127.0.0.1); each rank holds two Exchanges, one per coordd group (`on`:
the default, with a gloo group to fall back on; `off`: COORDD_VLLM_FALLBACK=0), and times each
sync of a [4, dp] int32 worker tensor through `Exchange.sync_`, alternating blocks of `--block`
syncs between the two (each way first in every other pair). Prints p10/p50/p90 of each way and
of the on/off ratio of each pair of blocks (rank 0's).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import statistics
import tempfile
import time
from typing import Any

from coordd.testing import CoorddProcess


def _rank(rank: int, dp: int, address: str, store: str, rounds: int, block: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from coordd.vllm.enable import PluginSettings
    from coordd.vllm.exchange import Exchange, ReduceOp
    from coordd.vllm.groups import GroupIdentity

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=dp)
    group = dist.new_group(list(range(dp)), backend="gloo")
    ways = {
        # two of the names coordd admits by default (vLLM's worker groups)
        "on": (Exchange(PluginSettings(address)), GroupIdentity("dp-tp0-pp0", rank, dp, "fp")),
        "off": (
            Exchange(PluginSettings(address, fallback=False)),
            GroupIdentity("dp-tp1-pp0", rank, dp, "fp"),
        ),
    }
    times: dict[str, list[float]] = {way: [] for way in ways}
    blocks: list[float] = []
    done = -2 * block  # the first two blocks warm up, uncounted
    while done < rounds:
        medians = {}
        order = list(ways) if (done // block) % 2 else list(reversed(ways))  # each way first half
        for way in order:
            exchange, identity = ways[way]
            took = []
            for _ in range(block):
                t = torch.zeros(4, dp, dtype=torch.int32)
                t[:, rank] = rank + 1
                began = time.perf_counter()
                synced = exchange.sync_(t, ReduceOp.SUM, identity, True, group=group)
                took.append(time.perf_counter() - began)
                assert synced and t[0].tolist() == list(range(1, dp + 1)), (way, t)
            if done >= 0:
                times[way].extend(took)
            medians[way] = statistics.median(took)
        if done >= 0:
            blocks.append(medians["on"] / medians["off"])
        done += block
    for exchange, _ in ways.values():
        exchange.close()
    if rank == 0:
        out.put((times, blocks))


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    cuts = statistics.quantiles(values, n=10)
    return cuts[0], statistics.median(values), cuts[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coordd.tools.fallback_cost")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4000)
    parser.add_argument("--block", type=int, default=200)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="coordd-cost-") as tmp:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        with CoorddProcess(args.dp, f"ipc://{tmp}/c.sock", ["--log-level", "error"]) as coordd:
            procs = [
                ctx.Process(
                    target=_rank,
                    args=(r, args.dp, coordd.address, f"{tmp}/store", args.rounds, args.block, out),
                )
                for r in range(args.dp)
            ]
            for p in procs:
                p.start()
            deadline = time.monotonic() + 600
            while True:
                try:
                    times, blocks = out.get(timeout=1.0)
                    break
                except queue.Empty:
                    failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                    if failed or time.monotonic() > deadline:
                        for p in procs:
                            p.kill()
                        why = f"a rank failed (exit codes {failed}) or timed out"
                        raise SystemExit(why) from None
            for p in procs:
                p.join(60)
    print(f"dp={args.dp}, {args.rounds} syncs each way, blocks of {args.block}, interleaved")
    print(f"{'':24} {'p10':>8} {'p50':>8} {'p90':>8}")
    for way in ("off", "on"):
        p10, p50, p90 = (v * 1e6 for v in _quantiles(times[way]))
        print(f"{'fallback ' + way + ', us':24} {p10:>8.1f} {p50:>8.1f} {p90:>8.1f}")
    p10, p50, p90 = _quantiles(blocks)
    print(f"{'on/off, per block':24} {p10:>8.3f} {p50:>8.3f} {p90:>8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
