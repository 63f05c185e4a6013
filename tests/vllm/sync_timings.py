"""How long one DP sync takes through coordd vs. vLLM's own gloo path, side by side.

  VLLM_TARGET_DEVICE=cpu python -m tests.vllm.sync_timings --dp 2,4,8 --rounds 300

For each dp: a real coordd process and dp real rank processes in vLLM's distributed
environment (CPU, gloo). Every rank times, round by round, the same int32 [7, dp] tensor
holding only its own column (Model Runner V2's sync) three ways:
  - vLLM's gloo path: `vllm.distributed.utils.cpu_all_reduce_` on the DP group's cpu_group
    (what MRV2 and sync_dp_state use);
  - torch.distributed.all_reduce on the same gloo group (the V1 runner's path);
  - through coordd: `get_dp_group().cpu_all_reduce_` with the plugin installed (patch point B:
    site label, column check, gather round, local reduce).
Ranks line up on a gloo barrier before each way; p50/p99 pool every rank's rounds.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

WAYS = (
    "vLLM cpu_all_reduce_ (gloo)",
    "torch all_reduce (gloo, V1)",
    "coordd gather (plugin)",
)


def _rank(idx: int, cfg: Any, address: str, rounds: int, warmup: int, queue: Any) -> None:
    try:
        import torch

        torch.set_num_threads(1)
        from vllm.config import set_current_vllm_config
        from vllm.distributed import parallel_state as ps
        from vllm.distributed.utils import cpu_all_reduce_

        from coordd.vllm import patches
        from coordd.vllm.enable import PluginSettings

        pc = cfg.parallel_config
        pc.data_parallel_rank = pc.data_parallel_rank_local = idx
        with set_current_vllm_config(cfg):
            ps.init_distributed_environment(
                world_size=1, rank=0, local_rank=idx, backend="gloo", distributed_init_method=None
            )
            ps.initialize_model_parallel(1, 1, backend="gloo")
            group = ps.get_dp_group()
            size = group.world_size

            def fresh() -> torch.Tensor:
                t = torch.zeros(7, size, dtype=torch.int32)
                t[:, idx] = torch.arange(7, dtype=torch.int32) + idx
                return t

            ways = {
                WAYS[0]: lambda t: cpu_all_reduce_(t, group.cpu_group),
                WAYS[1]: lambda t: torch.distributed.all_reduce(t, group=group.cpu_group),
                WAYS[2]: lambda t: group.cpu_all_reduce_(t),
            }
            out: dict[str, list[float]] = {}
            want = None
            for way, fn in ways.items():
                if way == WAYS[2]:
                    assert patches.install(PluginSettings(address))
                for _ in range(warmup):
                    fn(fresh())
                torch.distributed.barrier(group=group.cpu_group)
                times = []
                for _ in range(rounds):
                    t = fresh()
                    began = time.perf_counter()
                    fn(t)
                    times.append(time.perf_counter() - began)
                got = t.tolist()
                assert want is None or got == want, (way, got, want)  # all three agree
                want = got
                out[way] = times
                if way == WAYS[2]:
                    patches.uninstall()
                torch.distributed.barrier(group=group.cpu_group)
        queue.put((idx, out))
    except BaseException as exc:
        queue.put((idx, repr(exc)))


def measure(dp: int, rounds: int, warmup: int) -> dict[str, list[float]]:
    from vllm.config import ParallelConfig, VllmConfig

    from coordd.testing import CoorddProcess

    cfg = VllmConfig(
        parallel_config=ParallelConfig(data_parallel_size=dp, data_parallel_master_ip="127.0.0.1")
    )
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with (
        tempfile.TemporaryDirectory() as tmp,
        CoorddProcess(dp, f"ipc://{tmp}/coordd.sock") as coordd,
    ):
        procs = [
            ctx.Process(
                target=_rank, args=(i, cfg, coordd.address, rounds, warmup, queue), daemon=True
            )
            for i in range(dp)
        ]
        try:
            for p in procs:
                p.start()
            results = [queue.get(timeout=600) for _ in procs]
        finally:
            for p in procs:
                p.join(timeout=20)
                if p.is_alive():
                    p.kill()
    pooled: dict[str, list[float]] = {w: [] for w in WAYS}
    for idx, out in results:
        if isinstance(out, str):
            raise RuntimeError(f"rank {idx}: {out}")
        for way, times in out.items():
            pooled[way] += times
    return pooled


def _pct(times: list[float], q: float) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", default="2,4,8", help="comma-separated DP sizes (default 2,4,8)")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    args = ap.parse_args()
    sizes = [int(x) for x in args.dp.split(",")]
    print(
        f"int32 [7, dp] own-column sync, {args.rounds} rounds after {args.warmup} warm-up, "
        f"per-round times pooled over ranks; {os.cpu_count()} CPUs"
    )
    print(f"{'dp':>3}  {'path':30} {'p50 us':>9} {'p99 us':>9}")
    for dp in sizes:
        pooled = measure(dp, args.rounds, args.warmup)
        for way in WAYS:
            times = pooled[way]
            print(f"{dp:>3}  {way:30} {_pct(times, 0.5):9.0f} {_pct(times, 0.99):9.0f}")


if __name__ == "__main__":
    main()
