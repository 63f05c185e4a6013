"""`coordd serve`'s option set refused before anything starts, one line naming the option
(exit code 1), and the connection caps fitted to the NOFILE limit."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from coordd.core._daemon_defaults import DEFAULT_MAX_CONNECTIONS
from coordd.core._options import (
    OptionError,
    count,
    dp_size,
    expected_groups,
    group_patterns,
    handshake_rate,
    heartbeats,
    rss_mb,
    seconds,
)
from coordd.proto.address import default_address

if TYPE_CHECKING:
    from coordd.io._limits import ConnectionCaps


def check_serve(args: argparse.Namespace) -> None:
    """Every range of `coordd serve`'s options (`OptionError` for the first one out)."""
    if args.dp is None:  # one line naming it, not argparse's usage block
        raise OptionError(
            "--dp is required: the data-parallel size, vLLM's --data-parallel-size "
            "(coordd serve --dp 8, or COORDD_DP=8)"
        )
    dp_size("--dp", args.dp)
    seconds("--step-timeout", args.step_timeout, low=0.001)
    heartbeats(args.heartbeat_interval, args.heartbeat_timeout)
    count("--max-groups", args.max_groups, low=1, high=1_000_000)
    group_patterns(args.groups)
    expected_groups(args.expect_groups, args.groups, args.max_groups)
    rss_mb(args.max_rss_mb)
    handshake_rate(args.max_handshake_rate)
    count("--handshake-ipv4-prefix", args.handshake_ipv4_prefix, low=8, high=32)
    if args.metrics_port is not None:
        count("--metrics-port", args.metrics_port, low=0, high=65535)
    if getattr(args, "relay_root", False) and getattr(args, "relay_to", None):
        raise OptionError(
            "--relay-root and --relay-to: a coordd is the root relays register with, or a "
            "relay, not both"
        )
    if not str(args.metrics_host).strip():
        raise OptionError("--metrics-host must name an address (127.0.0.1, or 0.0.0.0)")


def check_server_args(args: argparse.Namespace) -> bool:
    """Reject unsafe, incomplete or out-of-range option sets before anything starts, with one
    line naming the option (exit code 1); True if CURVE is on."""
    from coordd.io._curve import SecurityConfigError, check_security_options
    from coordd.io._listen import BindError, check_bind

    try:
        check_serve(args)
    except OptionError as exc:
        raise SystemExit(f"coordd: {exc}{_source(args, str(exc))}") from None
    bind = args.bind or default_address()
    try:
        check_bind(bind)
    except BindError as exc:
        raise SystemExit(f"coordd: {exc}") from None
    try:
        return check_security_options(
            bind,
            args.curve_secret_key,
            args.curve_client_keys,
            args.insecure,
        )
    except SecurityConfigError as exc:
        raise SystemExit(f"coordd: {exc}") from None


def _source(args: argparse.Namespace, refusal: str) -> str:
    """' (from COORDD_X)' if the option a refusal names took its value from the environment."""
    for flag, var in getattr(args, "from_env", {}).items():
        if refusal.startswith(flag + " ") or refusal.startswith(flag + ":"):
            return f" (from {var})"
    return ""


def fit_limits(args: argparse.Namespace, log: logging.Logger) -> ConnectionCaps:
    """Raise the soft NOFILE limit to the hard one and fit the connection caps under it."""
    from coordd.core._admission import STRANGER_ROOM
    from coordd.io._limits import ConnectionCaps, raise_nofile

    for option in ("max_connections", "max_http_connections"):
        least = 0 if option == "max_connections" else 1  # 0: sized from the deployment
        if getattr(args, option) < least:
            flag = "--" + option.replace("_", "-")
            raise SystemExit(f"coordd: {flag} must be >= {least}, got {getattr(args, option)}")
    needed = deployment_connections(args)
    wanted = args.max_connections or max(DEFAULT_MAX_CONNECTIONS, needed)
    soft, _hard = raise_nofile()
    caps = ConnectionCaps.fit(soft, wanted, args.max_http_connections)
    if (caps.zmq, caps.http) != (wanted, args.max_http_connections):
        log.warning(
            "NOFILE limit %d: connection caps lowered to %d ZeroMQ and %d HTTP (raise "
            "LimitNOFILE / ulimit -n to keep --max-connections %d)",
            soft,
            caps.zmq,
            caps.http,
            wanted,
        )
    if caps.zmq < needed:
        log.warning(
            "the connection cap %d leaves no room for every rank of every group: --dp %d x "
            "(--max-groups %d + %d named groups) + %d for newcomers = %d; members of groups "
            "only a pattern admits are closed first when ranks crowd it (raise "
            "--max-connections%s, or lower --max-groups)",
            caps.zmq,
            args.dp,
            args.max_groups,
            (needed - STRANGER_ROOM) // args.dp - args.max_groups,
            STRANGER_ROOM,
            needed,
            " and LimitNOFILE / ulimit -n" if caps.zmq < wanted else "",
        )
    return caps


def deployment_connections(args: argparse.Namespace) -> int:
    """The connections every rank of every group `coordd serve` may serve holds, plus room
    for newcomers (`coordd.core._admission.connections_needed`)."""
    from coordd.core._admission import connections_needed
    from coordd.core._group_names import GroupRules

    expected = args.expect_groups if not isinstance(args.expect_groups, int) else ()
    try:
        named = len(GroupRules(args.groups, always=expected).exact)
    except ValueError:  # refused later, naming the option
        named = len(args.groups)
    return connections_needed(args.dp, args.max_groups, named)
