"""`coordd bench`: coordd against a bare pyzmq hub, gloo, vLLM's `cpu_all_reduce_` and a
raw-socket floor, in one run.

Latency (p50/p90/p99) per method and dp with the same rank processes for every method; overlap
(exposed wait when the round runs under W of sleeping or spinning work); the engine loop (the
share of a vLLM-shaped step blocked in DP sync, per way to sync); across hosts (each method over
tcp between two network namespaces, and a model for 2 and 4 nodes); scale (dp 16..256
simulated asyncio ranks: latency, coordd's CPU per round and resident memory); coordd's
performance targets with their measured ratios. `--json` keeps every figure, `--plot` draws them.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any

from coordd.tools.bench.methods import ALL_METHODS


def _numbers(kind: type) -> Any:
    def parse(text: str) -> list[Any]:
        if text.strip().lower() in ("", "none", "0"):
            return []
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a comma list of numbers, got {text!r}"
            ) from None

    return parse


def _dps(text: str) -> list[int]:
    """`--dp`: a comma list of rank counts, each 1..MAX_DP_SIZE (0 or nothing is refused: it
    would measure nothing and exit 0)."""
    from coordd.proto.messages import MAX_DP_SIZE

    try:
        dps = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of rank counts, got {text!r}"
        ) from None
    if not dps or any(not 1 <= dp <= MAX_DP_SIZE for dp in dps):
        raise argparse.ArgumentTypeError(
            f"every dp must be 1..{MAX_DP_SIZE}, got {text!r} (--dp 0 would measure nothing)"
        )
    return dps


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in ALL_METHODS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown method {bad[0]!r}: choose from {', '.join(ALL_METHODS)}"
        )
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dp", type=_dps, default=[2, 4, 8], help="rank counts (2,4,8)")
    p.add_argument("--methods", type=_names, default=list(ALL_METHODS), help=", ".join(ALL_METHODS))
    p.add_argument("--rounds", type=int, default=2000, help="timed rounds per method and dp")
    p.add_argument("--blocks", type=int, default=10, help="interleaved blocks per phase")
    p.add_argument("--warmup", type=int, default=5, help="untimed rounds per method per block")
    p.add_argument(
        "--overlap-rounds", type=int, default=400, help="timed rounds per overlap case (0: skip)"
    )
    p.add_argument(
        "--work",
        type=_numbers(float),
        default=[1.0, 2.0, 5.0],
        help="overlap work W as multiples of coordd-ipc's round p50 (1,2,5)",
    )
    p.add_argument(
        "--variants",
        type=lambda s: [v for v in s.split(",") if v],
        default=["sleep", "spin"],
        help="overlap work: sleep and/or spin",
    )
    p.add_argument(
        "--scale-dp", type=_numbers(int), default=[16, 64, 256], help="simulated dp (none: skip)"
    )
    p.add_argument(
        "--scale-clients",
        type=lambda s: [v for v in s.split(",") if v],
        default=["lean", "aio"],
        help="simulated ranks: lean (least CPU per rank) and/or aio (AsyncCoordClient)",
    )
    p.add_argument(
        "--engine",
        action="store_true",
        help="only the engine loop (no latency, overlap, across-host or scale sections)",
    )
    p.add_argument(
        "--engine-steps", type=int, default=200, help="engine-loop steps per way to sync (0: skip)"
    )
    p.add_argument(
        "--engine-step-ms",
        type=float,
        default=8.0,
        help="simulated GPU time scale: a step runs 0.5x..2.9x this (8: 4..23 ms)",
    )
    p.add_argument(
        "--crosshost-dp",
        type=_numbers(int),
        default=[2, 4, 8],
        help="dp measured across two network namespaces (none: skip)",
    )
    p.add_argument("--crosshost-rounds", type=int, default=500)
    p.add_argument("--scale-procs", type=int, default=4, help="simulator processes")
    p.add_argument("--scale-rounds", type=int, default=300)
    p.add_argument("--seed", type=int, default=0, help="seed of the reports")
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw the figures (needs coordd[plot])")
    p.add_argument(
        "--from-json",
        metavar="FILE",
        help="measure nothing: the tables (and --plot, --json) of a run saved with --json, with "
        "the targets and the model derived again",
    )


def _versions() -> dict[str, str]:
    import msgspec
    import zmq

    out = {
        "python": platform.python_version(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "msgspec": msgspec.__version__,
    }
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        pass
    return out


def _replay(args: argparse.Namespace) -> int:
    import json

    from coordd.tools.bench import crosshost, report

    with open(args.from_json) as f:
        results = json.load(f)
    results["targets"] = report.targets(results)
    results["crosshost_model"] = crosshost.model(results)
    print(report.render(results))
    if args.json:
        report.write_json(results, args.json)
    if args.plot:
        from coordd.tools.bench.plot import plot

        plot(results, args.plot)
    return 0


def _crosshost_unavailable() -> str | None:
    from coordd.tools.chaos import netns

    return netns.unavailable()


def run(args: argparse.Namespace) -> int:
    from coordd.tools.bench import crosshost, report
    from coordd.tools.bench.runner import (
        BenchError,
        LatencyOptions,
        available_methods,
        run_crosshost,
        run_latency,
    )
    from coordd.tools.bench.scale import ScaleOptions, run_scale

    if args.from_json:
        return _replay(args)

    if args.rounds < 1 or args.blocks < 1 or args.warmup < 1:
        raise SystemExit("coordd bench: --rounds, --blocks and --warmup must be >= 1")
    if any(v not in ("sleep", "spin") for v in args.variants):
        raise SystemExit(f"coordd bench: --variants takes sleep and/or spin, got {args.variants}")
    if any(c not in ("lean", "aio") for c in args.scale_clients):
        raise SystemExit(
            f"coordd bench: --scale-clients takes lean and/or aio, got {args.scale_clients}"
        )
    if any(dp < 1 for dp in [*args.dp, *args.scale_dp, *args.crosshost_dp]):
        raise SystemExit("coordd bench: every dp must be >= 1")
    if args.engine:
        args.scale_dp, args.crosshost_dp = [], []
    methods, skipped = available_methods(args.methods)
    began = time.time()
    results: dict[str, Any] = {
        "meta": {
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(began)),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "kernel": platform.release(),
            "loadavg_start": list(os.getloadavg()),
            "argv": sys.argv[1:],
            "versions": _versions(),
        },
        "methods": methods,
        "skipped": skipped,
        "latency": [],
        "overlap": [],
        "engine": [],
        "crosshost": [],
        "crosshost_skipped": "",
        "scale": [],
    }

    def log(text: str) -> None:
        print(f"[{time.time() - began:6.1f}s] {text}", file=sys.stderr, flush=True)

    for name, why in skipped.items():
        log(f"skipping {name}: {why}")
    try:
        if args.dp and methods:
            opts = LatencyOptions(
                dps=args.dp,
                methods=methods,
                rounds=args.rounds,
                blocks=min(args.blocks, args.rounds),
                warmup=args.warmup,
                overlap=args.overlap_rounds > 0 and bool(args.work),
                overlap_rounds=args.overlap_rounds,
                work_multiples=args.work,
                variants=args.variants,
                seed=args.seed,
                latency=not args.engine,
                engine_steps=args.engine_steps,
                engine_step_ms=args.engine_step_ms,
            )
            results.update(run_latency(opts, log))
        if args.crosshost_dp and methods:
            no_ns = _crosshost_unavailable()
            if no_ns is not None:
                results["crosshost_skipped"] = no_ns
                log(f"skipping the across-namespace runs: {no_ns}")
            else:
                cross = LatencyOptions(
                    dps=args.crosshost_dp,
                    methods=methods,
                    rounds=args.crosshost_rounds,
                    blocks=min(args.blocks, args.crosshost_rounds),
                    warmup=args.warmup,
                    seed=args.seed,
                )
                for dp in args.crosshost_dp:
                    results["crosshost"].extend(run_crosshost(dp, cross, log))
        if args.scale_dp:
            results["scale"] = run_scale(
                ScaleOptions(
                    dps=args.scale_dp,
                    clients=args.scale_clients,
                    procs=args.scale_procs,
                    rounds=args.scale_rounds,
                    seed=args.seed,
                ),
                log,
            )
    except BenchError as error:
        print(f"coordd bench: {error}", file=sys.stderr)
        return 2
    results["crosshost_model"] = crosshost.model(results)
    results["meta"]["seconds"] = time.time() - began
    results["meta"]["loadavg_end"] = list(os.getloadavg())
    results["targets"] = report.targets(results)
    print(report.render(results))
    if args.json:
        report.write_json(results, args.json)
    if args.plot:
        from coordd.tools.bench.plot import plot

        plot(results, args.plot)
    rows = [*results["latency"], *results["overlap"], *results["crosshost"], *results["scale"]]
    incomplete = [r for r in rows if r["completed"] != r["rounds"]]
    wrong = [r for r in rows if r["mismatches"]]
    return 1 if incomplete or wrong else 0
