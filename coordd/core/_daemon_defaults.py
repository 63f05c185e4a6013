"""Every default of the daemon, written once: the flags' defaults, `CoordServer`'s and the
limits'. The protocol's own (step timeout, heartbeats) live in `coordd.proto.defaults`, which
the client reads too."""

from coordd.proto.defaults import HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT, STEP_TIMEOUT

__all__ = [
    "BAN_SECONDS",
    "DEFAULT_GROUPS",
    "DEFAULT_HANDSHAKE_IPV4_PREFIX",
    "DEFAULT_HANDSHAKE_RATE",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_GROUPS",
    "DEFAULT_MAX_HTTP_CONNECTIONS",
    "DEFAULT_MAX_RSS_MB",
    "DEFAULT_METRICS_PORT",
    "HANDSHAKE_TIMEOUT",
    "HEARTBEAT_INTERVAL",
    "HEARTBEAT_TIMEOUT",
    "MAX_RSS_MB",
    "METRICS_RANK_SERIES",
    "METRICS_WAIT_SERIES",
    "MIN_RSS_MB",
    "SEND_QUEUE",
    "STATUS_RANK_ROWS",
    "STEP_TIMEOUT",
    "STRANGER_GRACE",
]

#: The groups a deployment expects (`--groups`: names or fnmatch patterns): vLLM's as the
#: plugin names them (coordd.vllm.groups: one per TP/PP/PCP position of the workers,
#: `dp-tp{t}-pp{p}[-pcp{n}][-engine]`, and the engine cores), and the plain client's default
#: (client.config.ClientConfig.group). An exact name always gets a group slot (`--max-groups`
#: bounds the groups admitted by a pattern); `dp-tp0-pp0` is named exactly for that.
DEFAULT_GROUPS = ("dp-tp0-pp0", "enginecore", "default", "dp-tp*-pp*")
#: Most groups one coordd serves (`--max-groups`).
DEFAULT_MAX_GROUPS = 64
#: Most ZeroMQ connections (ranks and anything else that connects) held at once.
DEFAULT_MAX_CONNECTIONS = 1024
#: Most HTTP connections (/metrics, /livez, ...) held at once.
DEFAULT_MAX_HTTP_CONNECTIONS = 64
#: A connection that has not finished its ZMTP (or CURVE) handshake within this is closed.
HANDSHAKE_TIMEOUT = 5.0
#: A connection that has not said Hello this long after it was accepted is shut down: a
#: routing id held by a silent peer is what can make libzmq abort coordd (see coordd.io._gate).
STRANGER_GRACE = 5.0
#: Per-peer outbound queue (messages). A registered rank reads its decision every round; one
#: that falls this far behind is broken, and a peer that never reads costs no more than this.
SEND_QUEUE = 128
#: How long a process cut off for flooding has its new ipc connections refused.
BAN_SECONDS = 10.0
#: Handshakes admitted a second, from all peers together (`--max-handshake-rate`).
DEFAULT_HANDSHAKE_RATE = 20.0
#: A tcp peer's IPv4 address is charged to its /N's group of the rate, which gets half of it
#: (`--handshake-ipv4-prefix`; see coordd.core._handshake.source_group).
DEFAULT_HANDSHAKE_IPV4_PREFIX = 24
#: The memory budget, MB (`--max-rss-mb`): above a quiet coordd's own, and low enough that
#: what a flood adds before the guard acts stays under a 100 MB target.
DEFAULT_MAX_RSS_MB = 64
#: Least and most budget `--max-rss-mb` takes (0 turns the guard off).
MIN_RSS_MB = 32
MAX_RSS_MB = 1 << 20
#: The port the deploy files serve metrics and health on, and `coordd status` asks by default.
DEFAULT_METRICS_PORT = 9180
#: Most rank rows in one /status answer over all groups (`/status?group=NAME` lists all of
#: one group's), and most per-rank series in one /metrics answer: a scrape's cost (and the
#: loop's time on it) stops growing with dp x groups.
STATUS_RANK_ROWS = 256
METRICS_RANK_SERIES = 2048
#: Most wait-histogram site series in one /metrics answer over all groups (each group keeps 32
#: apart): past it, a group's further sites are summed as site="other".
METRICS_WAIT_SERIES = 256
