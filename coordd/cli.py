"""The `coordd` command: `coordd --dp 8` serves; subcommands run the demo and other tools.

Every option of the server can also come from an environment variable `COORDD_<OPTION>`
(`--step-timeout` <- `COORDD_STEP_TIMEOUT`); a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from proto.address import default_address
from proto.coordinator import Coordinator, OnRankLoss

#: Subcommands besides `serve`: name -> (module, help). Each module has
#: `add_arguments(parser)` and `run(args) -> int`, and is imported only when chosen.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("coordd.demo", "coordd plus simulated engine ranks, with round latency"),
    "bench": ("coordd.bench", "latency, overlap and scale against torch.distributed gloo"),
}


def _env(option: str, default: Any, kind: Callable[[str], Any] = str) -> Any:
    raw = os.environ.get("COORDD_" + option.upper().replace("-", "_"))
    if raw is None:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise SystemExit(f"coordd: bad value {raw!r} for COORDD_{option.upper()}") from None


def add_server_options(p: argparse.ArgumentParser) -> None:
    dp = _env("dp", None, int)
    p.add_argument("--dp", type=int, default=dp, required=dp is None, help="data-parallel size")
    p.add_argument(
        "--bind",
        default=_env("bind", None),
        help="ipc://PATH or tcp://HOST:PORT (default: ipc in a private runtime dir)",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=_env("step_timeout", 30.0, float),
        help="seconds a round may stay open after its first report",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=_env("heartbeat_interval", 1.0, float),
        help="ZMTP heartbeat, seconds",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=_env("heartbeat_timeout", 5.0, float),
        help="a rank silent this long is lost, seconds",
    )
    p.add_argument(
        "--on-rank-loss",
        choices=[m.value for m in OnRankLoss],
        default=_env("on_rank_loss", OnRankLoss.FAIL.value),
        help="fail: end the group (default); neutralize: leave the rank out",
    )
    p.add_argument(
        "--log-level",
        default=_env("log_level", "info"),
        choices=["debug", "info", "warning", "error"],
    )


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def serve(args: argparse.Namespace) -> int:
    from coordd.server import CoordServer

    _setup_logging(args.log_level)
    if args.dp < 1:
        raise SystemExit(f"coordd: --dp must be >= 1, got {args.dp}")
    coordinator = Coordinator(
        args.dp,
        epoch=int(time.time() * 1000),
        step_timeout=args.step_timeout,
        on_rank_loss=OnRankLoss(args.on_rank_loss),
    )
    server = CoordServer(
        coordinator,
        args.bind or default_address(),
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_timeout=args.heartbeat_timeout,
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(f"coordd ready on {server.bound_address}", flush=True)
        await server.serve(stop)

    _run(main)
    logging.getLogger("coordd").info("coordd stopped: %s", dict(server.stats.rounds))
    return 0


def _run(main: Callable[[], Any]) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; Windows lacks it
        asyncio.run(main())
    else:
        uvloop.run(main())


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    known = ("serve", "-h", "--help", *SUBCOMMANDS)
    if not argv or argv[0] not in known:
        argv.insert(0, "serve")
    parser = argparse.ArgumentParser(prog="coordd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_server_options(sub.add_parser("serve", help="run the coordinator (the default)"))
    chosen = None
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text)
        if argv[0] == name:
            chosen = importlib.import_module(module_name)
            chosen.add_arguments(sub_parser)
    args = parser.parse_args(argv)
    if chosen is not None:
        return int(chosen.run(args))
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
