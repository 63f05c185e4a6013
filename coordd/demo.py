"""`coordd demo --dp N`: a real coordd and N simulated engine ranks, printing round latency.

Each rank draws a batch (decode-heavy with occasional prefills), starts the round, "runs"
the step (sleeps), waits for the decision and checks that every rank saw the same one.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import tempfile
import time

from client.sync import CoordClient
from coordd.procs import CoorddProcess
from proto.messages import StepReport
from proto.policy import decide


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dp", type=int, default=4, help="simulated ranks")
    p.add_argument("--rounds", type=int, default=500)
    p.add_argument("--step-ms", type=float, default=0.5, help="simulated GPU time per step")
    p.add_argument("--bind", default=None, help="default: ipc in a temporary directory")


def _draw(rng: random.Random) -> StepReport:
    tokens = rng.choice([0, rng.randint(1, 64), rng.randint(1, 256), rng.randint(512, 4096)])
    bucket = next((b for b in (8, 16, 32, 64, 128, 256, 512) if b >= tokens), tokens)
    return StepReport(
        num_tokens=tokens,
        num_tokens_padded=bucket,
        want_ubatch=tokens >= 32,
        cudagraph_mode=rng.choice([0, 1, 2, 2]) if tokens <= 512 else 0,
        has_unfinished=tokens > 0,
    )


def _rank(address: str, rank: int, dp: int, rounds: int, step_s: float, out: mp.Queue) -> None:
    rng = random.Random(rank)
    reports, decisions, latencies, exposed = [], [], [], []
    with CoordClient(address, dp_rank=rank, dp_size=dp, config_fingerprint="demo") as client:
        client.connect(timeout=10)
        for _ in range(rounds):
            report = _draw(rng)
            t0 = time.perf_counter()
            pending = client.start(report)
            time.sleep(step_s)
            t1 = time.perf_counter()
            decisions.append(pending.wait(timeout=30))
            t2 = time.perf_counter()
            reports.append(report)
            latencies.append(t2 - t0)
            exposed.append(t2 - t1)
        # a synchronous pass for the plain round latency
        sync = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            client.coordinate(_draw(rng), timeout=30)
            sync.append(time.perf_counter() - t0)
    out.put((rank, reports, decisions, exposed, sync))


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e6


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="coordd-demo-") as tmp:
        bind = args.bind or f"ipc://{tmp}/coordd.sock"
        with CoorddProcess(args.dp, bind, ["--log-level", "warning"]) as coordd:
            ctx = mp.get_context("spawn")
            out: mp.Queue = ctx.Queue()
            procs = [
                ctx.Process(
                    target=_rank,
                    args=(coordd.address, r, args.dp, args.rounds, args.step_ms / 1000, out),
                )
                for r in range(args.dp)
            ]
            for p in procs:
                p.start()
            results = sorted(out.get(timeout=120) for _ in procs)
            for p in procs:
                p.join(timeout=10)
    agree = all(
        len({repr(res[2][i]) for res in results}) == 1
        and results[0][2][i]
        == decide([res[1][i] for res in results], seq=i, epoch=results[0][2][i].epoch)
        for i in range(args.rounds)
    )
    sync = [x for res in results for x in res[4]]
    exposed = [x for res in results for x in res[3]]
    print(
        f"coordd demo: dp={args.dp}, {args.rounds} overlapped + {args.rounds} sync rounds on {bind}"
    )
    print(f"  every rank got the same decision, equal to the policy: {'yes' if agree else 'NO'}")
    print(f"  sync round latency   p50 {_pct(sync, 0.5):7.1f} us   p99 {_pct(sync, 0.99):7.1f} us")
    print(
        f"  exposed wait after a {args.step_ms} ms step: p50 {_pct(exposed, 0.5):7.1f} us   "
        f"p99 {_pct(exposed, 0.99):7.1f} us"
    )
    print(f"  mean sync latency {statistics.mean(sync) * 1e6:.1f} us")
    return 0 if agree else 1
