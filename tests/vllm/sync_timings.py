"""What one DP sync costs through the coordd plugin, beside vLLM's own and a bare gather round.

  VLLM_TARGET_DEVICE=cpu python -m tests.vllm.sync_timings --dp 2,4,8 --rounds 600

For each dp: a real coordd process and dp real rank processes in vLLM's distributed
environment (CPU, gloo). Every rank syncs Model Runner V2's int32 [7, dp] tensor, holding only
its own column, three ways, in blocks of `--block` rounds interleaved A B C A B C (every rank
runs the same block at the same time; a gloo barrier lines them up before each block):
  - plugin: `get_dp_group().cpu_all_reduce_` with the plugin installed (patch point B: site
    label, column check, gather round, local reduce, the tensor written in place);
  - vllm: vLLM's own `vllm.distributed.utils.cpu_all_reduce_` on the DP group's cpu_group
    (recursive doubling over gloo; what `GroupCoordinator.cpu_all_reduce_` runs unpatched);
  - gather: a bare `CoordClient.gather` of the same 7 values over the plugin's own client
    (the same connection and group: no tensor, no label).
p50/p99 pool every rank's rounds; CPU is each rank's own per sync: its main thread's
(`time.thread_time`) and its whole process's (ZeroMQ's I/O thread and gloo's threads too).
`--profile FILE` writes rank 0's cProfile of its plugin blocks.

Below each dp's table, what the plugin's install cost each rank (means over ranks): its wall
and CPU time, the threads and child processes it left running, and the CPU its child processes
burnt while the blocks were timed (on a host with fewer cores than ranks, that CPU is taken
from the timed rounds of all three ways alike).
"""

from __future__ import annotations

import argparse
import glob
import multiprocessing
import os
import resource
import tempfile
import threading
import time
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

WAYS = ("plugin", "vllm", "gather")
#: The bare round's site (any label: every rank sends the same one).
_SITE = "bench.gather"


def _children() -> list[int]:
    """This process's live descendants (Linux /proc)."""
    found: list[int] = []
    todo = [os.getpid()]
    while todo:
        pid = todo.pop()
        for path in glob.glob(f"/proc/{pid}/task/*/children"):
            try:
                with open(path) as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def _children_cpu() -> float:
    """CPU seconds of this process's descendants so far: those waited for, and those alive."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = usage.ru_utime + usage.ru_stime
    ticks = os.sysconf("SC_CLK_TCK")
    for pid in _children():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def _rank(
    idx: int,
    cfg: Any,
    address: str,
    rounds: int,
    block: int,
    warmup: int,
    profile: str,
    queue: Any,
) -> None:
    try:
        import torch

        torch.set_num_threads(1)
        from vllm.config import set_current_vllm_config
        from vllm.distributed import parallel_state as ps
        from vllm.distributed.utils import cpu_all_reduce_

        # Model Runner V2's sync module, B's only caller in vLLM: the plugin patches B when it
        # is imported, which a V2 worker has done by its first sync
        from vllm.v1.worker.gpu import dp_utils  # noqa: F401

        from coordd.vllm import patches
        from coordd.vllm.enable import PluginSettings
        from coordd.vllm.groups import worker_group

        pc = cfg.parallel_config
        pc.data_parallel_rank = pc.data_parallel_rank_local = idx
        with set_current_vllm_config(cfg):
            ps.init_distributed_environment(
                world_size=1, rank=0, local_rank=idx, backend="gloo", distributed_init_method=None
            )
            ps.initialize_model_parallel(1, 1, backend="gloo")
            group = ps.get_dp_group()
            size, cpu_group = group.world_size, group.cpu_group
            threads0, children0 = threading.active_count(), len(_children())
            w0, c0 = time.perf_counter(), time.process_time()
            assert patches.install(PluginSettings(address))
            install = {
                "wall_ms": (time.perf_counter() - w0) * 1e3,
                "cpu_ms": (time.process_time() - c0) * 1e3,
                "threads": threading.active_count() - threads0,
                "children": len(_children()) - children0,
            }
            exchange = patches.exchange()
            assert exchange is not None
            column = [v + idx for v in range(7)]

            def fresh() -> torch.Tensor:
                t = torch.zeros(7, size, dtype=torch.int32)
                t[:, idx] = torch.tensor(column, dtype=torch.int32)
                return t

            ways = {
                "plugin": group.cpu_all_reduce_,
                "vllm": lambda t: cpu_all_reduce_(t, cpu_group),
            }
            want = None
            for way, fn in ways.items():  # every way gives the same tensor
                for _ in range(warmup):
                    t = fresh()
                    fn(t)
                assert want is None or t.tolist() == want, (way, t.tolist(), want)
                want = t.tolist()
            rows_want = [[int(v) for v in want[i]] for i in range(7)]
            client = exchange.link(worker_group()).client  # joined in the warm-up
            assert client is not None
            for _ in range(warmup):
                rows = client.gather(_SITE, column)
            assert [[rows[r][i] for r in range(size)] for i in range(7)] == rows_want

            profiler = None
            if profile and idx == 0:
                import cProfile

                profiler = cProfile.Profile()
            times: dict[str, list[float]] = {w: [] for w in WAYS}
            cpu: dict[str, list[float]] = {w: [0.0, 0.0, 0] for w in WAYS}  # type: ignore[misc]
            #: Each block's p50, per way: the plugin's block against vLLM's block beside it.
            blocks: dict[str, list[float]] = {w: [] for w in WAYS}
            done = 0
            torch.distributed.barrier(group=cpu_group)
            span0, kids0 = time.perf_counter(), _children_cpu()
            while done < rounds:
                n = min(block, rounds - done)
                for way in WAYS:
                    tensors = [fresh() for _ in range(n)] if way != "gather" else []
                    torch.distributed.barrier(group=cpu_group)
                    out = times[way]
                    t0, p0 = time.thread_time(), time.process_time()
                    if way == "gather":
                        for _ in range(n):
                            began = time.perf_counter()
                            client.gather(_SITE, column)
                            out.append(time.perf_counter() - began)
                    else:
                        fn = ways[way]
                        if profiler is not None and way == "plugin":
                            profiler.enable()
                        for t in tensors:
                            began = time.perf_counter()
                            fn(t)
                            out.append(time.perf_counter() - began)
                        if profiler is not None and way == "plugin":
                            profiler.disable()
                        assert tensors[-1].tolist() == want, (way, tensors[-1].tolist())
                    blocks[way].append(sorted(out[-n:])[n // 2])
                    c = cpu[way]
                    c[0] += time.thread_time() - t0
                    c[1] += time.process_time() - p0
                    c[2] += n
                done += n
            install["children_ms"] = (_children_cpu() - kids0) * 1e3
            install["span_ms"] = (time.perf_counter() - span0) * 1e3
            if profiler is not None:
                profiler.dump_stats(profile)
            torch.distributed.barrier(group=cpu_group)
            patches.uninstall()
        queue.put((idx, (times, cpu, install, blocks)))
    except BaseException:
        import traceback

        queue.put((idx, traceback.format_exc()))


def measure(dp: int, rounds: int, block: int, warmup: int, profile: str = "") -> dict[str, Any]:
    """One dp: every way's per-round times (pooled over ranks) and CPU per sync (mean over
    ranks), as {way: {"times": [...], "thread_us": x, "process_us": y}}, and the install's
    cost per rank (mean over ranks) as {"install": {"wall_ms": ..., "cpu_ms": ..., "threads":
    ..., "children": ..., "children_ms": ..., "span_ms": ...}}."""
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
                target=_rank,
                args=(i, cfg, coordd.address, rounds, block, warmup, profile, queue),
                daemon=True,
            )
            for i in range(dp)
        ]
        try:
            for p in procs:
                p.start()
            results = [queue.get(timeout=900) for _ in procs]
        finally:
            for p in procs:
                p.join(timeout=20)
                if p.is_alive():
                    p.kill()
    out: dict[str, Any] = {w: {"times": [], "thread_us": 0.0, "process_us": 0.0} for w in WAYS}
    out["install"] = {}
    out["blocks"] = []
    for idx, got in results:
        if isinstance(got, str):
            raise RuntimeError(f"rank {idx}:\n{got}")
        times, cpu, install, blocks = got
        out["blocks"].extend(zip(blocks["plugin"], blocks["vllm"], strict=True))
        for key, value in install.items():
            out["install"][key] = out["install"].get(key, 0.0) + value / dp
        for way in WAYS:
            out[way]["times"] += times[way]
            thread_s, process_s, n = cpu[way]
            out[way]["thread_us"] += thread_s / n * 1e6 / dp
            out[way]["process_us"] += process_s / n * 1e6 / dp
    return out


def pick(ordered: list[float], q: float) -> float:
    """The value at quantile `q` of already sorted values (nearest rank)."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def pct(times: list[float], q: float) -> float:
    return pick(sorted(times), q) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", default="2,4,8", help="comma-separated DP sizes (default 2,4,8)")
    ap.add_argument("--rounds", type=int, default=600, help="timed rounds per way and rank")
    ap.add_argument("--block", type=int, default=50, help="rounds per interleaved block")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--profile", default="", help="write rank 0's plugin cProfile here")
    args = ap.parse_args()
    sizes = [int(x) for x in args.dp.split(",")]
    print(
        f"int32 [7, dp] own-column sync, {args.rounds} rounds per way and rank in blocks of "
        f"{args.block} (A B C interleaved) after {args.warmup} warm-up; p50/p99 pooled over "
        f"ranks; CPU per sync per rank; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'dp':>3}  {'way':8} {'p50 us':>8} {'p99 us':>8} {'main CPU us':>12} "
        f"{'proc CPU us':>12} {'p50 / vllm':>11} {'p50 / gather':>13}"
    )
    for dp in sizes:
        got = measure(dp, args.rounds, args.block, args.warmup, args.profile)
        p50 = {w: pct(got[w]["times"], 0.5) for w in WAYS}
        for way in WAYS:
            g = got[way]
            print(
                f"{dp:>3}  {way:8} {p50[way]:8.0f} {pct(g['times'], 0.99):8.0f} "
                f"{g['thread_us']:12.1f} {g['process_us']:12.1f} "
                f"{p50[way] / p50['vllm']:10.2f}x {p50[way] / p50['gather']:12.2f}x"
            )
        pairs = got["blocks"]
        ratios = sorted(p / v for p, v in pairs)
        own = sorted(v for _, v in pairs)
        p10, p50_, p90 = (pick(ratios, q) for q in (0.1, 0.5, 0.9))
        print(
            f"{dp:>3}  plugin / vllm per block ({len(pairs)} blocks over ranks): p10 "
            f"{p10:.2f}x, p50 {p50_:.2f}x, p90 {p90:.2f}x; "
            f"vLLM's own block p50s {own[0] * 1e6:.0f}..{own[-1] * 1e6:.0f} us"
        )
        i = got["install"]
        print(
            f"{dp:>3}  install: {i['wall_ms']:.0f} ms wall, {i['cpu_ms']:.0f} ms CPU; left "
            f"{i['threads']:.1f} threads, {i['children']:.1f} child processes running; children's "
            f"CPU while timed {i['children_ms']:.0f} ms in {i['span_ms']:.0f} ms (per rank)"
        )


if __name__ == "__main__":
    main()
