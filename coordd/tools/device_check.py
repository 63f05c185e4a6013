"""Check and time the device path: `python -m coordd.tools.device_check` (one command, < 3 minutes).

Sections (each in freshly spawned rank processes, skipped with a reason where they cannot run):
- `nccl`: NCCL over CUDA tensors, world size 1 (2 where there are 2 GPUs), once with each
  wait strategy (`poll`: event queries, the default; `work`: Work.wait(timeout)), plus the
  time a rank is blocked when the round overlaps ~1 ms of GPU work on the compute stream;
- `gloo-cuda`: gloo over CUDA tensors, 2 processes on one GPU;
- `cpu`: gloo over CPU tensors beside a real coordd, N = 2 and 4, the two paths (and, for
  reference, a bare all_reduce of the same matrix) interleaved round by round in one run.
In every section the device path's rounds alternate with its floor, the bare collective on the
same [N, fields] int64 matrix made once: on CUDA the row copied in from pinned memory, the
all_reduce and the copy back into pinned memory (on the CPU the all_reduce alone); the table
ends with each device path's p50 over its floor's (the goal: <= 1.5x). `--profile N` profiles
N more device-path rounds on rank 0 of each section (cProfile, the top entries by own time).
Every round's decision is checked against `coordd.proto.policy.decide` of all ranks' reports (every
rank draws every rank's report from the shared seed). Prints a table and one JSON line; exits
1 on any wrong decision or error.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time

import msgspec

from coordd.proto.messages import StepDecision, StepKind, StepReport
from coordd.proto.policy import decide

WARMUP = 50
KINDS = [StepKind.FORWARD, StepKind.FORWARD, StepKind.DRAFT, StepKind.STATE]


class Section(msgspec.Struct, frozen=True):
    name: str
    backend: str
    world: int
    device: str
    rounds: int
    store: str
    coordd: str = ""
    cuda_waits: list[str] = msgspec.field(default_factory=lambda: ["poll"])
    overlap: bool = False
    profile: int = 0


class Timing(msgspec.Struct):
    path: str
    latencies: list[float]
    exposed: list[float] = []


class RankResult(msgspec.Struct):
    rank: int
    timings: list[Timing] = []
    wrong: list[str] = []
    error: str = ""
    profile: str = ""


def draw(seq: int, world: int) -> tuple[list[StepReport], StepKind]:
    """Round `seq`'s reports of every rank and its kind, the same on every rank."""
    rng = random.Random(seq * 1_000_003 + world)
    reports = []
    for _ in range(world):
        tokens = rng.choice([0, rng.randint(1, 64), rng.randint(1, 512), rng.randint(512, 8192)])
        reports.append(
            StepReport(
                num_tokens=tokens,
                num_tokens_padded=tokens + rng.choice([0, rng.randint(0, 64)]),
                want_ubatch=rng.random() < 0.7,
                cudagraph_mode=rng.choice([0, 1, 2]),
                has_unfinished=rng.random() < 0.8,
                want_pause=rng.random() < 0.05,
            )
        )
    return reports, rng.choice(KINDS)


def one_round(client, rank: int, world: int, seq: int, timing: Timing, wrong: list[str]) -> int:  # type: ignore[no-untyped-def]
    """One synchronous round (start + wait) for `seq`, timed and checked; returns seq + 1."""
    reports, kind = draw(seq, world)
    want = decide(reports, 2, epoch=0, seq=seq, kind=kind)
    t0 = time.perf_counter()
    got: StepDecision = client.coordinate(reports[rank], kind, timeout=30)
    timing.latencies.append(time.perf_counter() - t0)
    if msgspec.structs.replace(got, epoch=0) != want and len(wrong) < 5:
        wrong.append(f"{timing.path} seq {seq}: {got} != {want}")
    return seq + 1


def gpu_work(device: str):  # type: ignore[no-untyped-def]
    """A function that queues ~1 ms of matmuls on the current (compute) stream."""
    import torch

    a = torch.randn(1024, 1024, device=device)

    def one() -> None:
        torch.tanh(a @ a, out=a)

    for _ in range(20):
        one()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        one()
    torch.cuda.synchronize()
    reps = max(1, round(1e-3 / ((time.perf_counter() - t0) / 50)))

    def work() -> None:
        for _ in range(reps):
            one()

    return work


def overlapped(client, rank: int, s: Section, seq: int, timing: Timing, wrong: list[str]) -> int:  # type: ignore[no-untyped-def]
    """start; ~1 ms of matmuls queued on the compute stream; wait: how long is the rank blocked?"""
    import torch

    work = gpu_work(s.device)
    for _ in range(min(300, s.rounds)):
        reports, kind = draw(seq, s.world)
        want = decide(reports, 2, epoch=0, seq=seq, kind=kind)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pending = client.start(reports[rank], kind)
        work()
        t1 = time.perf_counter()
        got = pending.wait(timeout=30)
        t2 = time.perf_counter()
        timing.latencies.append(t2 - t0)
        timing.exposed.append(t2 - t1)
        if got != want and len(wrong) < 5:
            wrong.append(f"{timing.path} seq {seq}: {got} != {want}")
        seq += 1
    torch.cuda.synchronize()
    return seq


#: The floor's name in the table, by device type.
BARE = {"cpu": "bare all_reduce", "cuda": "bare all_reduce + host copies"}


def bare_round(world: int, device: str):  # type: ignore[no-untyped-def]
    """The device path's floor: one round of the same collective on the same matrix, made
    once (on CUDA: the row in from pinned memory, the all_reduce, the sum back into pinned
    memory, as the device path moves it; on the CPU: the all_reduce)."""
    import torch
    import torch.distributed as dist

    from coordd.client.device import NUM_FIELDS

    cuda = device.startswith("cuda")
    matrix = torch.zeros((world, NUM_FIELDS), dtype=torch.int64, device=device)
    if not cuda:
        return lambda: dist.all_reduce(matrix, async_op=True).wait()
    staged = torch.zeros((world, NUM_FIELDS), dtype=torch.int64, pin_memory=True)
    out = torch.zeros((world, NUM_FIELDS), dtype=torch.int64, pin_memory=True)

    def one() -> None:
        matrix.copy_(staged, non_blocking=True)
        dist.all_reduce(matrix, async_op=True).wait()
        out.copy_(matrix)

    return one


def profiled(client, rank: int, s: Section, seq: int, wrong: list[str]) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    """`s.profile` more rounds under cProfile: the top entries by own time, as text."""
    import cProfile
    import io
    import pstats

    timing = Timing("profile", [])
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(s.profile):
        seq = one_round(client, rank, s.world, seq, timing, wrong)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
    return seq, text.getvalue()


def rank_main(rank: int, data: bytes, out: mp.Queue) -> None:
    s = msgspec.msgpack.decode(data, type=Section)
    s = msgspec.structs.replace(s, device=s.device or f"cuda:{rank}")  # "": one GPU per rank
    result = RankResult(rank)
    try:
        import datetime

        import torch
        import torch.distributed as dist

        from coordd.client.device import DeviceCoordClient
        from coordd.client.sync import CoordClient

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        if s.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(s.device))
        dist.init_process_group(
            s.backend,
            init_method=f"file://{s.store}",
            rank=rank,
            world_size=s.world,
            timeout=datetime.timedelta(seconds=60),
        )
        coordd, cseq = None, 0
        if s.coordd:
            coordd = CoordClient(s.coordd, dp_rank=rank, dp_size=s.world, config_fingerprint="c")
            cseq = coordd.connect(timeout=30).next_seq
            warm = Timing("warmup", [])
            for _ in range(WARMUP):
                cseq = one_round(coordd, rank, s.world, cseq, warm, result.wrong)
        for wait in s.cuda_waits:
            with DeviceCoordClient(
                config_fingerprint="c", device=s.device, cuda_wait=wait, wait_timeout=30
            ) as device:
                seq = device.connect(timeout=60).next_seq
                warm = Timing("warmup", [])
                for _ in range(WARMUP):
                    seq = one_round(device, rank, s.world, seq, warm, result.wrong)
                path = f"device {s.backend} {s.device.split(':')[0]}"
                path += f" wait={wait}" if s.backend == "nccl" else ""
                timing = Timing(path, [])
                result.timings.append(timing)
                ctiming = Timing("coordd", [])
                rtiming = Timing(f"{BARE[s.device.split(':')[0]]} ({s.backend})", [])
                bare = bare_round(s.world, s.device)
                turns = 3 if coordd is not None else 2
                for i in range(s.rounds):
                    # the paths interleaved, in turns, so none always follows the same one
                    for turn in range(turns):
                        which = (i + turn) % turns
                        if which == 0:
                            seq = one_round(device, rank, s.world, seq, timing, result.wrong)
                        elif which == 1:
                            t0 = time.perf_counter()
                            bare()
                            rtiming.latencies.append(time.perf_counter() - t0)
                        else:
                            cseq = one_round(coordd, rank, s.world, cseq, ctiming, result.wrong)
                result.timings.append(rtiming)
                if coordd is not None:
                    result.timings.append(ctiming)
                if s.profile and wait == s.cuda_waits[0]:  # every rank: the rounds are collective
                    seq, text = profiled(device, rank, s, seq, result.wrong)
                    result.profile = f"{s.name}, {path}, {s.profile} rounds, rank {rank}:\n{text}"
                if s.overlap:
                    otiming = Timing(path + " + 1ms GPU work", [])
                    result.timings.append(otiming)
                    seq = overlapped(device, rank, s, seq, otiming, result.wrong)
        if coordd is not None:
            coordd.close()
        dist.destroy_process_group()
    except BaseException as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    out.put(msgspec.msgpack.encode(result))


def run_section(s: Section, timeout: float = 120.0) -> list[RankResult]:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    data = msgspec.msgpack.encode(s)
    procs = [
        ctx.Process(target=rank_main, args=(r, data, out), daemon=True) for r in range(s.world)
    ]
    for p in procs:
        p.start()
    results: list[RankResult] = []
    try:
        deadline = time.monotonic() + timeout
        for _ in procs:
            raw = out.get(timeout=max(0.1, deadline - time.monotonic()))
            results.append(msgspec.msgpack.decode(raw, type=RankResult))
    except Exception as exc:  # queue.Empty: a rank hung or died
        results.append(RankResult(-1, error=f"{s.name}: no result in {timeout:g}s ({exc!r})"))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return sorted(results, key=lambda r: r.rank)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e6 if xs else float("nan")


def floor_ratios(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """Each device path's p50 over its section's floor's (the bare collective's)."""
    out: list[dict[str, object]] = []
    for row in rows:
        path = str(row["path"])
        if not path.startswith("device ") or "GPU work" in path:
            continue
        floor = next(
            (
                r
                for r in rows
                if r["section"] == row["section"] and str(r["path"]).startswith("bare ")
            ),
            None,
        )
        if floor is None:
            continue
        p50, floor_p50 = float(row["p50_us"]), float(floor["p50_us"])  # type: ignore[arg-type]
        out.append(
            {
                "section": row["section"],
                "path": path,
                "floor": floor["path"],
                "p50_us": p50,
                "floor_p50_us": floor_p50,
                "ratio": round(p50 / floor_p50, 3),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2000, help="timed rounds per path and section")
    ap.add_argument("--sections", default="nccl,gloo-cuda,cpu", help="comma-separated")
    ap.add_argument("--cpu-worlds", default="2,4", help="N for the cpu section")
    ap.add_argument(
        "--profile", type=int, default=0, help="profile this many more device-path rounds (0: no)"
    )
    args = ap.parse_args(argv)
    wanted = set(args.sections.split(","))

    import torch
    import torch.distributed as dist

    from coordd.testing.process import CoorddProcess

    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    rows: list[dict[str, object]] = []
    failures: list[str] = []
    profiles: list[str] = []
    print(f"torch {torch.__version__}, CUDA devices: {gpus}, python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory(prefix="coordd-device-check-") as tmp:
        sections: list[tuple[Section, CoorddProcess | None]] = []
        if "nccl" in wanted:
            if not (cuda and dist.is_nccl_available()):
                print("nccl: skipped (no CUDA device or no NCCL in this torch)")
            else:
                world = min(2, gpus)
                sections.append(
                    (
                        Section(
                            "nccl",
                            "nccl",
                            world,
                            "cuda:0" if world == 1 else "",
                            args.rounds,
                            f"{tmp}/nccl",
                            cuda_waits=["poll", "work"],
                            overlap=True,
                            profile=args.profile,
                        ),
                        None,
                    )
                )
        if "gloo-cuda" in wanted:
            if not cuda:
                print("gloo-cuda: skipped (no CUDA device)")
            else:
                sections.append(
                    (
                        Section(
                            "gloo-cuda",
                            "gloo",
                            2,
                            "cuda:0",
                            args.rounds,
                            f"{tmp}/gloo-cuda",
                            profile=args.profile,
                        ),
                        None,
                    )
                )
        if "cpu" in wanted:
            for n in (int(x) for x in args.cpu_worlds.split(",")):
                proc = CoorddProcess(n, f"ipc://{tmp}/coordd-{n}.sock", ["--log-level", "warning"])
                sections.append(
                    (
                        Section(
                            f"cpu N={n}",
                            "gloo",
                            n,
                            "cpu",
                            args.rounds,
                            f"{tmp}/cpu-{n}",
                            profile=args.profile,
                        ),
                        proc,
                    )
                )
        for s, coordd in sections:
            started = time.monotonic()
            try:
                if coordd is not None:
                    s = msgspec.structs.replace(s, coordd=coordd.start().address)
                results = run_section(s)
            finally:
                if coordd is not None:
                    coordd.stop()
            profiles.extend(r.profile for r in results if r.profile and r.rank == 0)
            for r in results:
                if r.error:
                    failures.append(f"{s.name} rank {r.rank}: {r.error}")
                failures.extend(f"{s.name} rank {r.rank}: {w}" for w in r.wrong)
            by_path: dict[str, Timing] = {}
            for r in results:
                for t in r.timings:
                    pooled = by_path.setdefault(t.path, Timing(t.path, []))
                    pooled.latencies.extend(t.latencies)
                    pooled.exposed.extend(t.exposed)
            for t in by_path.values():
                row: dict[str, object] = {
                    "section": s.name,
                    "path": t.path,
                    "n": s.world,
                    "rounds": len(t.latencies),
                    "p50_us": round(pct(t.latencies, 0.5), 1),
                    "p99_us": round(pct(t.latencies, 0.99), 1),
                }
                if t.exposed:
                    row["blocked_p50_us"] = round(pct(t.exposed, 0.5), 1)
                    row["blocked_p99_us"] = round(pct(t.exposed, 0.99), 1)
                rows.append(row)
            print(f"{s.name}: done in {time.monotonic() - started:.1f}s")
    print(
        f"\n{'section':<10} {'path':<34} {'N':>2} {'rounds':>7} {'p50 us':>9} {'p99 us':>9}"
        "  blocked p50/p99 us"
    )
    for row in rows:
        blocked = (
            f"  {row['blocked_p50_us']}/{row['blocked_p99_us']}" if "blocked_p50_us" in row else ""
        )
        print(
            f"{row['section']:<10} {row['path']:<34} {row['n']:>2} {row['rounds']:>7} "
            f"{row['p50_us']:>9} {row['p99_us']:>9}{blocked}"
        )
    ratios = floor_ratios(rows)
    if ratios:
        print("\ndevice path p50 / its floor's p50 (same run; the goal: <= 1.5x)")
    for ratio in ratios:
        print(
            f"{ratio['section']:<10} {ratio['path']:<34} {ratio['ratio']:.2f}x "
            f"({ratio['p50_us']} / {ratio['floor_p50_us']} us, {ratio['floor']})"
        )
    for text in profiles:
        print(f"\nprofile: {text}")
    print(json.dumps({"rows": rows, "ratios": ratios, "failures": failures}))
    for f in failures:
        print("FAIL", f)
    print("OK: every decision equal to the policy" if not failures else "FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
