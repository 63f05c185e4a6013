"""`coordd serve`: the server, its HTTP endpoints and status socket, until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

from coordd.cli._checks import check_server_args, fit_limits
from coordd.proto.address import default_address
from coordd.proto.snapshot import OnRankLoss


def serve(args: argparse.Namespace) -> int:
    import zmq

    from coordd.cli._logging import setup_logging
    from coordd.core._settings import ServerSettings
    from coordd.io._curve import CurveGate, SecurityConfigError
    from coordd.io._gate import SWITCH_INTERVAL
    from coordd.io._listen import IPC_MODES, BindError
    from coordd.io._server import CoordServer
    from coordd.proto.keyfile import KeyFileError

    setup_logging(args.log_level, args.log_format)
    log = logging.getLogger("coordd")
    curve = check_server_args(args)
    bind = args.bind or default_address()
    caps = fit_limits(args, log)
    if args.insecure and bind.startswith("tcp://"):
        log.warning("tcp without CURVE (--insecure): any host that reaches %s can join", bind)
    sys.setswitchinterval(SWITCH_INTERVAL)  # the ZAP thread's turn comes sooner
    context = zmq.Context()
    gate = None
    try:
        if curve:
            try:
                gate = CurveGate.start(context, args.curve_secret_key, args.curve_client_keys)
            except (KeyFileError, SecurityConfigError) as exc:
                raise SystemExit(f"coordd: {exc}") from None
        settings = ServerSettings(
            address=bind,
            dp_size=args.dp,
            step_timeout=args.step_timeout,
            on_rank_loss=OnRankLoss(args.on_rank_loss),
            max_groups=args.max_groups,
            expect_groups=args.expect_groups,
            groups=tuple(args.groups),
            heartbeat_interval=args.heartbeat_interval,
            heartbeat_timeout=args.heartbeat_timeout,
            max_connections=caps.zmq,
            ipc_mode=IPC_MODES[args.ipc_mode],
            max_rss_mb=args.max_rss_mb,
            max_handshake_rate=args.max_handshake_rate,
            handshake_ipv4_prefix=args.handshake_ipv4_prefix,
            relay_root=args.relay_root,
        )
        try:
            server = CoordServer(settings, context=context, curve=gate)
        except BindError as exc:
            raise SystemExit(f"coordd: {exc}") from None
        relay = _relay(args, server, context)

        async def main() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            from coordd.ops.endpoints import HttpEndpoints, coordd_routes, status_socket

            # One server for the HTTP port (if asked) and the status socket beside an ipc bind
            # (always: `coordd status` with no options finds it), under one connection cap.
            endpoints = HttpEndpoints(coordd_routes(server), max_connections=caps.http)
            if args.metrics_port is not None:
                try:
                    await endpoints.start(args.metrics_host, args.metrics_port)
                except OSError as exc:
                    server.close()
                    raise SystemExit(f"coordd: {_http_refusal(args, exc)}") from None
            unix_path = status_socket(server.bound_address)
            if unix_path is not None:
                try:
                    await endpoints.start_unix(unix_path)
                except OSError as exc:
                    log.warning(
                        "no status socket at %s (%s): coordd status needs --address",
                        unix_path,
                        exc.strerror or exc,
                    )
            # the ready line comes first: launchers (CoorddProcess) wait for it as line one
            print(f"coordd ready on {server.bound_address}", flush=True)
            if endpoints.url:
                print(f"coordd metrics on {endpoints.url}", flush=True)
            if relay is not None:
                relay.start(loop)
            try:
                await server.serve(stop)
            finally:
                if relay is not None:
                    relay.close()
                await endpoints.close()

        _run(main)
    finally:
        if gate is not None:
            gate.stop()
    stopped(log, {name: group.observer.decided for name, group in server.groups.items()})
    return 0


def _relay(args: argparse.Namespace, server: Any, context: Any) -> Any:
    """With --relay-to: the connection to the root (`coordd.io._relay.Relay`), else None."""
    if not args.relay_to:
        return None
    from coordd.io._relay import Relay
    from coordd.proto.relay import parse_ranks

    if not args.relay_ranks:
        raise SystemExit("coordd: --relay-to needs --relay-ranks: the DP ranks this node serves")
    try:
        ranks = parse_ranks(args.relay_ranks)
    except ValueError as exc:
        raise SystemExit(f"coordd: --relay-ranks {args.relay_ranks}: {exc}") from None
    if max(ranks) >= args.dp:
        raise SystemExit(f"coordd: --relay-ranks {args.relay_ranks}: ranks are 0..{args.dp - 1}")
    configure = None
    if args.relay_curve_server_key:
        from coordd.io._curve import SecurityConfigError, relay_curve_client

        try:
            configure = relay_curve_client(args.relay_curve_server_key, args.relay_curve_key)
        except SecurityConfigError as exc:
            raise SystemExit(f"coordd: {exc}") from None
    elif args.relay_to.startswith("tcp://") and not args.insecure:
        raise SystemExit(
            "coordd: --relay-to over tcp needs --relay-curve-server-key and --relay-curve-key "
            "(or --insecure)"
        )
    return Relay(
        server,
        args.relay_to,
        ranks,
        context=context,
        name=args.relay_name,
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_timeout=args.heartbeat_timeout,
        configure_socket=configure,
    )


def stopped(log: logging.Logger, decided: dict[str, dict[str, int]]) -> None:
    """The last lines: rounds decided in all, then per group their count and by kind, as
    key=value fields (`rounds decided group=default rounds=3 forward=2 state=1`; a group that
    decided none: `rounds=0`, not a bare line)."""
    from coordd.core._logs import event

    total = sum(sum(kinds.values()) for kinds in decided.values())
    event(log, logging.INFO, "coordd stopped", rounds=total, groups=len(decided))
    for group, kinds in decided.items():
        by_kind = {kind: n for kind, n in sorted(kinds.items()) if n}
        event(
            log,
            logging.INFO,
            "rounds decided",
            group=group,
            rounds=sum(by_kind.values()),
            **by_kind,
        )


def _http_refusal(args: argparse.Namespace, exc: OSError) -> str:
    """One line for HTTP endpoints that cannot start, naming the option to change."""
    where = f"{args.metrics_host}:{args.metrics_port}"
    if exc.errno == errno.EADDRINUSE:
        return (
            f"--metrics-port {args.metrics_port}: {where} is in use (another coordd, or "
            "another service): give another port, or 0 for any free one"
        )
    if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or isinstance(exc, socket.gaierror):
        return f"--metrics-host {args.metrics_host}: cannot serve HTTP on {where}: {exc.strerror}"
    why = exc.strerror or exc
    return f"--metrics-port {args.metrics_port}: cannot serve HTTP on {where}: {why}"


def _run(main: Callable[[], Any]) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; Windows lacks it
        asyncio.run(main())
    else:
        uvloop.run(main())
