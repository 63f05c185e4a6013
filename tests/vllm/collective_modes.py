"""vLLM's own DP collective, block by block: does it run in one mode or several?

  VLLM_TARGET_DEVICE=cpu python -m tests.vllm.collective_modes --dp 2 --blocks 8 --calls 100

dp real rank processes in vLLM's distributed environment (CPU, gloo, the DP group made as
`init_distributed_environment` makes it), each calling vLLM 0.33's `cpu_all_reduce_` on the DP
group's cpu_group with MRV2's int32 [7, dp] tensor, in blocks of `--calls` after a gloo
barrier; prints each block's p50 per rank. On the 2-core box the blocks' p50s were either
about 0.2 ms or 1.5-4 ms, switching between blocks (docs/plugin-cost.md), so a ratio against
vLLM's own taken from pooled samples depends on which mode held longer.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def _rank(idx: int, cfg: Any, blocks: int, calls: int, queue: Any) -> None:
    try:
        import torch

        torch.set_num_threads(1)
        from vllm.config import set_current_vllm_config
        from vllm.distributed import parallel_state as ps
        from vllm.distributed.utils import cpu_all_reduce_

        pc = cfg.parallel_config
        pc.data_parallel_rank = pc.data_parallel_rank_local = idx
        with set_current_vllm_config(cfg):
            ps.init_distributed_environment(
                world_size=1, rank=0, local_rank=idx, backend="gloo", distributed_init_method=None
            )
            ps.initialize_model_parallel(1, 1, backend="gloo")
            group = ps.get_dp_group()
            size, cpu_group = group.world_size, group.cpu_group
            p50s = []
            for _ in range(blocks):
                tensors = [torch.zeros(7, size, dtype=torch.int32) for _ in range(calls)]
                torch.distributed.barrier(group=cpu_group)
                times = []
                for t in tensors:
                    began = time.perf_counter_ns()
                    cpu_all_reduce_(t, cpu_group)
                    times.append(time.perf_counter_ns() - began)
                p50s.append(sorted(times)[calls // 2] / 1000)
        queue.put((idx, p50s))
    except BaseException:
        import traceback

        queue.put((idx, traceback.format_exc()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--calls", type=int, default=100, help="calls per block")
    args = ap.parse_args()
    from vllm.config import ParallelConfig, VllmConfig

    cfg = VllmConfig(
        parallel_config=ParallelConfig(
            data_parallel_size=args.dp, data_parallel_master_ip="127.0.0.1"
        )
    )
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(i, cfg, args.blocks, args.calls, queue), daemon=True)
        for i in range(args.dp)
    ]
    try:
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=600) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    print(f"cpu_all_reduce_, dp={args.dp}, {args.calls} calls a block, load "
          f"{os.getloadavg()[0]:.2f}; each block's p50 in us")  # fmt: skip
    for idx, got in results:
        if isinstance(got, str):
            raise RuntimeError(f"rank {idx}:\n{got}")
        print(f"rank {idx}: " + ", ".join(f"{v:.0f}" for v in got))


if __name__ == "__main__":
    main()
