"""`coordd chaos`: inject faults into a real coordd and real ranks, check every history, print
the table. `coordd chaos --seeds 20` is the full suite; point `--transport`, `--step-timeout` and
the heartbeat options at your own settings to see how coordd behaves there."""

from __future__ import annotations

import argparse
import json
import sys
import time

from coordd.testing.checker import ScenarioResult
from coordd.tools.chaos.spec import Fault, Settings
from coordd.tools.chaos.suite import run_suite
from coordd.tools.chaos.summary import as_json, failures, notable, summarize, table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=int, default=20, help="seeds per fault kind (default 20)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument(
        "--kinds",
        default="all",
        help="comma-separated fault kinds (default all): " + ", ".join(f.value for f in Fault),
    )
    p.add_argument(
        "--transport",
        choices=["ipc", "tcp"],
        default="ipc",
        help="network_cut always runs over tcp",
    )
    p.add_argument("--step-timeout", type=float, default=2.0, help="seconds (default 2)")
    p.add_argument("--heartbeat-interval", type=float, default=0.2, help="seconds (default 0.2)")
    p.add_argument("--heartbeat-timeout", type=float, default=1.0, help="seconds (default 1)")
    p.add_argument("--min-dp", type=int, default=2)
    p.add_argument("--max-dp", type=int, default=4)
    p.add_argument("--rounds", type=int, default=30, help="rounds per scenario (default 30)")
    p.add_argument(
        "--grace",
        type=float,
        default=1.0,
        help="scheduling slack on the detection bound, seconds (default 1)",
    )
    p.add_argument("--parallel", type=int, default=3, help="scenarios at a time (default 3)")
    p.add_argument("--keep", metavar="DIR", help="keep every scenario's logs under DIR")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")


def parse_kinds(text: str) -> list[Fault]:
    if text == "all":
        return list(Fault)
    try:
        return [Fault(k.strip()) for k in text.split(",") if k.strip()]
    except ValueError as exc:
        raise SystemExit(f"coordd chaos: {exc}; kinds are {[f.value for f in Fault]}") from None


def settings_from(args: argparse.Namespace) -> Settings:
    from coordd.core._options import OptionError, count, dp_size, heartbeats, seconds

    try:
        count("--seeds", args.seeds, low=1, high=100_000)
        count("--first-seed", args.first_seed, low=0)
        seconds("--step-timeout", args.step_timeout, low=0.001)
        heartbeats(args.heartbeat_interval, args.heartbeat_timeout)
        dp_size("--min-dp", args.min_dp, low=2)
        dp_size("--max-dp", args.max_dp, low=2)
        count("--rounds", args.rounds, low=1, high=1_000_000)
        seconds("--grace", args.grace, low=0.0, high=3600.0)
        count("--parallel", args.parallel, low=1, high=256)
    except OptionError as exc:
        raise SystemExit(f"coordd chaos: {exc}") from None
    if not 2 <= args.min_dp <= args.max_dp:
        raise SystemExit("coordd chaos: need 2 <= --min-dp <= --max-dp (a fault needs a group)")
    return Settings(
        transport=args.transport,
        step_timeout=args.step_timeout,
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_timeout=args.heartbeat_timeout,
        min_dp=args.min_dp,
        max_dp=args.max_dp,
        rounds=max(10, args.rounds),
        grace=args.grace,
    )


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    kinds = parse_kinds(args.kinds)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    began = time.monotonic()

    def progress(result: ScenarioResult) -> None:
        if args.quiet or args.json:
            return
        status = "skipped" if result.skipped else ("ok" if result.ok else "FAILED")
        ttd = "" if result.ttd is None else f" ttd {result.ttd * 1000:.0f} ms"
        print(
            f"  {result.fault:<22} seed {result.seed:<3} dp={result.dp} {status}{ttd}",
            file=sys.stderr,
            flush=True,
        )

    results = run_suite(
        kinds, seeds, settings, parallel=args.parallel, keep=args.keep, on_result=progress
    )
    seconds = time.monotonic() - began
    if args.json:
        print(json.dumps(as_json(results, settings, seconds), indent=2))
    else:
        print(
            f"coordd chaos: {len(kinds)} fault kinds x {args.seeds} seeds, transport "
            f"{settings.transport}, step timeout {settings.step_timeout:g}s, heartbeat "
            f"{settings.heartbeat_interval:g}/{settings.heartbeat_timeout:g}s, "
            f"{seconds:.0f}s"
        )
        print(table(summarize(results)))
        remarks = notable(results)
        if remarks:
            print(remarks)
        bad = failures(results)
        if bad:
            print(bad)
    return 0 if all(r.ok or r.skipped for r in results) else 1
