"""The `coordd` command line: the subcommands, `coordd serve`'s options (each also from its
environment variable, `apply_env`) and `parse`."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, Protocol, cast

from coordd.core._daemon_defaults import (
    DEFAULT_GROUPS,
    DEFAULT_HANDSHAKE_IPV4_PREFIX,
    DEFAULT_HANDSHAKE_RATE,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_GROUPS,
    DEFAULT_MAX_HTTP_CONNECTIONS,
    DEFAULT_MAX_RSS_MB,
    DEFAULT_METRICS_PORT,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    STEP_TIMEOUT,
    STRANGER_GRACE,
)
from coordd.proto.messages import MAX_DP_SIZE
from coordd.proto.snapshot import OnRankLoss

#: `coordd --help`'s description.
DESCRIPTION = (
    "The `coordd` command: `coordd --dp 8` serves; subcommands run the demo and other tools.\n"
    "\n"
    "Every option of the server can also come from an environment variable `COORDD_<OPTION>`\n"
    "(`--step-timeout` <- `COORDD_STEP_TIMEOUT`); a flag on the command line wins.\n"
)


class Subcommand(Protocol):
    """A subcommand's module: imported by name only when chosen, so the daemon loads no tool."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


#: Subcommands besides `serve`: name -> (module, help). The tools live in coordd.tools and
#: need what the daemon does not (the demo's live view: the `demo` extra; bench's gloo: torch).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("coordd.tools.demo", "coordd plus simulated engine ranks, with round latency"),
    "bench": ("coordd.tools.bench", "latency, overlap and scale against torch.distributed gloo"),
    "status": (
        "coordd.cli.status",
        "a running coordd's status table (or --probe livez|readyz)",
    ),
    "keygen": ("coordd.cli.keygen", "write CURVE key pairs (NAME.key, NAME.key_secret) for tcp"),
    "chaos": (
        "coordd.tools.chaos.cli",
        "inject faults into real coordd and ranks, check every history",
    ),
}


class _Default:
    """An option's default, which its environment variable overrides: read once parsing is
    done (`apply_env`), so a bad variable breaks only the command that uses it (`coordd
    status` is not `serve`), and is refused as the flag would be, naming the variable."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def _env(option: str, default: Any) -> _Default:
    return _Default(default)


def env_var(dest: str) -> str:
    """The environment variable of option `dest` (`step_timeout` -> COORDD_STEP_TIMEOUT)."""
    return "COORDD_" + dest.upper()


def _takes(action: argparse.Action) -> str:
    """What an option takes, as its refusal says it."""
    if action.choices is not None:
        return "one of " + ", ".join(str(c) for c in action.choices)
    if isinstance(action, argparse._StoreTrueAction):
        return "1/0, true/false, yes/no or on/off"
    kind = action.type
    if kind is int:
        return "a whole number"
    if kind is float:
        return "a number"
    if kind is _paths:
        return "a comma list"
    if kind is _count_or_names:
        return "a whole number or a comma list of group names"
    return "a string"


def apply_env(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Give every option not on the command line its environment variable's value (checked as
    its flag is, one line on a bad one: the variable, what it got, what it takes), else its
    default. `args.from_env` maps each flag that took its variable's value to the variable."""
    from_env: dict[str, str] = {}
    for action in parser._actions:
        current = getattr(args, action.dest, None)
        if not isinstance(current, _Default):
            continue
        var = env_var(action.dest)
        raw = os.environ.get(var)
        if raw is None:
            setattr(args, action.dest, current.value)
            continue
        flag = action.option_strings[-1]
        try:
            if isinstance(action, argparse._StoreTrueAction):
                value: Any = _flag(raw)
            else:
                value = action.type(raw) if callable(action.type) else raw
            if action.choices is not None and value not in action.choices:
                raise ValueError(raw)
        except (ValueError, TypeError):
            raise SystemExit(f"coordd: {var}={raw!r}: {flag} takes {_takes(action)}") from None
        setattr(args, action.dest, value)
        from_env[flag] = var
    args.from_env = from_env


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def _paths(raw: str) -> list[str]:
    return [p for p in (part.strip() for part in raw.split(",")) if p]


def _count_or_names(raw: str) -> int | list[str]:
    """`--expect-groups`: a count (`2`), or the groups' names (`dp-tp0-pp0,enginecore`)."""
    text = raw.strip()
    if text.isdigit():
        return int(text)
    return _paths(text)


def add_server_options(p: argparse.ArgumentParser) -> None:
    """`coordd serve`'s options; each also comes from COORDD_<OPTION> (`apply_env`)."""
    p.add_argument(
        "--dp",
        type=int,
        default=_env("dp", None),
        help=f"data-parallel size: the ranks of every group (1..{MAX_DP_SIZE}; required, "
        "here or as COORDD_DP)",
    )
    p.add_argument(
        "--bind",
        default=_env("bind", None),
        help="ipc://PATH or tcp://HOST:PORT, IPv6 as tcp://[::1]:PORT (default: "
        "ipc://$XDG_RUNTIME_DIR/coordd/coordd.sock, else /tmp/coordd-$UID/coordd.sock)",
    )
    p.add_argument(
        "--relay-root",
        action="store_true",
        default=_env("relay_root", False),
        help="take relays: relays (--relay-to) may register this coordd's groups for the "
        "ranks they serve (default: off; a relay's message is then refused as junk)",
    )
    p.add_argument(
        "--relay-to",
        default=_env("relay_to", None),
        help="run as a relay: serve this node's ranks at --bind and speak for all of them to "
        "the root coordd at this address (tcp://ROOT:PORT), one message per round (default: "
        "none, this coordd decides)",
    )
    p.add_argument(
        "--relay-ranks",
        default=_env("relay_ranks", None),
        help="with --relay-to: the DP ranks this node serves, like 0-7 or 0,2,4, or SIZE@INDEX "
        "(8@2: ranks 16-23, from a pod's index) (required with --relay-to)",
    )
    p.add_argument(
        "--relay-name",
        default=_env("relay_name", ""),
        help="with --relay-to: the relay's name in the root's errors and logs (default: the "
        "host name)",
    )
    p.add_argument(
        "--relay-curve-server-key",
        default=_env("relay_curve_server_key", None),
        help="with --relay-to over tcp: the root's public key file, and this relay's own key "
        "pair from --relay-curve-key (default: none; then tcp needs --insecure)",
    )
    p.add_argument(
        "--relay-curve-key",
        default=_env("relay_curve_key", None),
        help="with --relay-curve-server-key: this relay's secret key file (coordd keygen), "
        "which the root binds to the ranks it may speak for (default: none)",
    )
    p.add_argument(
        "--ipc-mode",
        choices=["600", "660"],
        default=_env("ipc_mode", "600"),
        help="the ipc socket's permissions, whatever the umask: 600 (coordd's user only) or "
        "660 (also the group of the socket's directory: ranks of another uid in that group, "
        "e.g. a pod's fsGroup) (default 600)",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=_env("step_timeout", STEP_TIMEOUT),
        help="seconds a round may stay open after its first report; then the ranks not "
        f"reported are named in StepTimeout (default {STEP_TIMEOUT:g})",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=_env("heartbeat_interval", HEARTBEAT_INTERVAL),
        help=f"ZMTP heartbeat interval, seconds (default {HEARTBEAT_INTERVAL:g})",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=_env("heartbeat_timeout", HEARTBEAT_TIMEOUT),
        help="a connection silent this long is closed and its rank lost, seconds; at least "
        f"the interval (default {HEARTBEAT_TIMEOUT:g})",
    )
    p.add_argument(
        "--on-rank-loss",
        choices=[m.value for m in OnRankLoss],
        default=_env("on_rank_loss", OnRankLoss.FAIL.value),
        help="fail: a lost rank ends the group's rounds; neutralize: leave the rank out "
        "(default fail)",
    )
    p.add_argument(
        "--max-groups",
        type=int,
        default=_env("max_groups", DEFAULT_MAX_GROUPS),
        help="most named groups served at once (each its own rounds; vLLM: one per TP/PP "
        f"position plus the engine cores); a Hello for one more is refused "
        f"(default {DEFAULT_MAX_GROUPS})",
    )
    p.add_argument(
        "--groups",
        type=_paths,
        default=_env("groups", list(DEFAULT_GROUPS)),
        help="comma list of the group names (or fnmatch patterns) this deployment expects; a "
        "Hello for another group is refused (group_unexpected), and an exact name always gets "
        f"a slot under --max-groups (default {','.join(DEFAULT_GROUPS)}: vLLM's worker groups, "
        "its engine cores and the plain client's default; '*' admits any name)",
    )
    p.add_argument(
        "--expect-groups",
        type=_count_or_names,
        default=_env("expect_groups", 0),
        metavar="N|NAMES",
        help="/readyz turns ready once this many groups are formed, or once each group of a "
        "comma list of names is (names: only they count, a failed other group does not hold "
        "readiness back, and each always gets a slot under --max-groups; the strict setting, "
        "as no peer can make coordd ready by forming groups of its own) (default 0: once any "
        "one is; a failed group makes it not ready)",
    )
    p.add_argument(
        "--log-level",
        default=_env("log_level", "info"),
        choices=["debug", "info", "warning", "error"],
        help="the least severe log lines written (default info)",
    )
    p.add_argument(
        "--log-format",
        default=_env("log_format", "text"),
        choices=["text", "json"],
        help="text, or one JSON object per line (fault lines carry group, epoch, seq, kind, "
        "ranks) (default text)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=_env("metrics_port", None),
        help="serve /metrics, /livez, /readyz and /status over HTTP on this port "
        f"(0: any free port; default: off; the deploy files use {DEFAULT_METRICS_PORT})",
    )
    p.add_argument(
        "--metrics-host",
        default=_env("metrics_host", "127.0.0.1"),
        help="address for the HTTP endpoints (default 127.0.0.1; 0.0.0.0 only if you ask)",
    )
    p.add_argument(
        "--curve-secret-key",
        default=_env("curve_secret_key", None),
        help="coordd's CURVE key pair file (NAME.key_secret from `coordd keygen`) (default: "
        "none; a tcp bind then needs --insecure)",
    )
    p.add_argument(
        "--curve-client-keys",
        type=_paths,
        default=_env("curve_client_keys", []),
        help="comma list of client public key files (NAME.key) or directories of them: "
        "coordd admits only these; a file named rank<N>.key, or an entry N=PATH, admits its "
        "key(s) for dp_rank N only, A-B=PATH for dp_ranks A..B (a relay's node), an entry "
        "@GROUP=PATH (GROUP: a name or pattern) for that group only, N@GROUP=PATH or "
        "A-B@GROUP=PATH for those ranks of it (default: none)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        default=_env("insecure", False),
        help="allow a tcp bind without CURVE (any host that reaches the port can join) "
        "(default off)",
    )
    add_limit_options(p)


def add_limit_options(p: argparse.ArgumentParser) -> None:
    """Caps on what peers can hold (coordd.io._limits): fitted to the NOFILE limit at start."""
    from coordd.io._gate import SOURCE_SHARE

    p.add_argument(
        "--max-connections",
        type=int,
        default=_env("max_connections", 0),
        help="most ZeroMQ connections held at once; over it the oldest that registered no rank "
        "is closed (default 0: room for every rank of every group, --dp x (--max-groups + the "
        f"names --groups and --expect-groups name), and 64 more, at least "
        f"{DEFAULT_MAX_CONNECTIONS}; lowered to fit the NOFILE limit)",
    )
    p.add_argument(
        "--max-http-connections",
        type=int,
        default=_env("max_http_connections", DEFAULT_MAX_HTTP_CONNECTIONS),
        help="most HTTP connections held at once; at the cap, the one that has waited longest "
        f"for its request is closed (default {DEFAULT_MAX_HTTP_CONNECTIONS})",
    )
    p.add_argument(
        "--max-rss-mb",
        type=int,
        default=_env("max_rss_mb", DEFAULT_MAX_RSS_MB),
        help="memory budget: while coordd's resident memory is over this many MB, connections "
        "that registered no rank are closed, new connections are refused in their handshake "
        "(they retry), and freed memory is given back to the OS; registered ranks are never "
        f"touched (default {DEFAULT_MAX_RSS_MB}; 0: off)",
    )
    p.add_argument(
        "--max-handshake-rate",
        type=float,
        default=_env("max_handshake_rate", DEFAULT_HANDSHAKE_RATE),
        help="most new connections admitted a second, from all peers together (one peer "
        f"address or process: 1/{round(1 / SOURCE_SHARE)} of it), after a burst of "
        "--max-connections (one source: the same share of it, at least 64); more wait and "
        "retry. With the close of a connection that says "
        f"no Hello within {STRANGER_GRACE:g}s, it keeps a peer from making libzmq abort "
        f"coordd (see coordd/io/_gate.py) (default {DEFAULT_HANDSHAKE_RATE:g}; 0: off)",
    )
    p.add_argument(
        "--handshake-ipv4-prefix",
        type=int,
        default=_env("handshake_ipv4_prefix", DEFAULT_HANDSHAKE_IPV4_PREFIX),
        help="tcp peers' handshakes are also counted by group, and one group gets at most "
        "half of --max-handshake-rate: an IPv4 address's group is its /N (8..32), an IPv6 "
        "address's its /64, every loopback address one, and with CURVE a client key's its "
        "key, so many addresses of one host count as one "
        f"(default {DEFAULT_HANDSHAKE_IPV4_PREFIX})",
    )


class Parser(argparse.ArgumentParser):
    """An argument parser whose every refusal is one line naming the option, exit code 1, as
    coordd's own checks are (`coordd: --dp takes a whole number, got 'two'`), not argparse's
    usage block and exit code 2. Its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        name = "coordd" if self.prog == "coordd serve" else self.prog
        print(f"{name}: {self._one_line(message)}", file=sys.stderr)
        raise SystemExit(1)

    def _one_line(self, message: str) -> str:
        bad = re.fullmatch(r"argument ([^:]+): invalid (?:\w+ value|choice): '(.*?)'.*", message)
        if bad is not None:
            flag = bad.group(1).split("/")[-1]
            action = self._option_string_actions.get(flag)
            if action is not None:
                return f"{flag} takes {_takes(action)}, got {bad.group(2)!r}"
        if message.startswith("argument ") and "expected" not in message:
            return message.removeprefix("argument ")  # a type's own refusal says what it takes
        return f"{message.removeprefix('argument ')} (`{self.prog} --help` lists the options)"


def version_line() -> str:
    """What `coordd --version` prints: the release and the wire protocol it speaks."""
    from coordd.ops.observer import version
    from coordd.proto.messages import PROTOCOL_VERSION

    return f"coordd {version()} (protocol {PROTOCOL_VERSION})"


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, Subcommand | None]:
    """Parse a coordd command line: (args, the chosen subcommand's module or None for serve).

    The tests parse every command the deploy files run with this same function."""
    argv = list(argv)
    known = ("serve", "-h", "--help", "--version", *SUBCOMMANDS)
    if not argv or argv[0] not in known:
        argv.insert(0, "serve")
    parser = Parser(prog="coordd", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser(
        "serve",
        help="run the coordinator (the default)",
        description="Run the coordinator. Every option also comes from COORDD_<OPTION> "
        "(--step-timeout: COORDD_STEP_TIMEOUT); a flag on the command line wins.",
    )
    add_server_options(serve_parser)
    chosen: Subcommand | None = None
    parsers = {"serve": serve_parser}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        parsers[name] = sub_parser = sub.add_parser(name, help=help_text)
        if argv[0] == name:
            chosen = cast(Subcommand, importlib.import_module(module_name))
            chosen.add_arguments(sub_parser)
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the command they were given to, whose --help lists its options
        parsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "serve":
        apply_env(serve_parser, args)
    return args, chosen
