"""`ServerSettings`: everything `coordd serve` was told, in one frozen value that the CLI
builds and the server, its shell parts and the ops layer read."""

from __future__ import annotations

from dataclasses import dataclass

from coordd.core import _daemon_defaults as defaults
from coordd.proto.messages import MAX_DP_SIZE
from coordd.proto.snapshot import OnRankLoss


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """One coordd's settings. Groups share `dp_size`, `step_timeout` and `on_rank_loss`;
    `max_groups` bounds how many exist, `groups` (names and fnmatch patterns) which are
    admitted at all, and `expect_groups` how many must be formed for /readyz, or which
    (names: each always gets a slot, and only they count)."""

    address: str
    dp_size: int
    step_timeout: float = defaults.STEP_TIMEOUT
    on_rank_loss: OnRankLoss = OnRankLoss.FAIL
    max_groups: int = defaults.DEFAULT_MAX_GROUPS
    expect_groups: int | tuple[str, ...] = 0
    groups: tuple[str, ...] = defaults.DEFAULT_GROUPS
    heartbeat_interval: float = defaults.HEARTBEAT_INTERVAL
    heartbeat_timeout: float = defaults.HEARTBEAT_TIMEOUT
    max_connections: int = defaults.DEFAULT_MAX_CONNECTIONS
    ipc_mode: int = 0o600
    #: the memory budget (0: off, the default in-process: the host's memory is not coordd's)
    max_rss_mb: float = 0
    max_handshake_rate: float = 0
    handshake_ipv4_prefix: int = defaults.DEFAULT_HANDSHAKE_IPV4_PREFIX
    stranger_grace: float = defaults.STRANGER_GRACE
    #: `--relay-root`: whether relays (`coordd serve --relay-to`) may register here; without
    #: it the relay wire is undecodable input, as any stranger's junk.
    relay_root: bool = False

    def __post_init__(self) -> None:
        # lists from the command line become tuples: the value stays frozen
        object.__setattr__(self, "groups", tuple(self.groups))
        if not isinstance(self.expect_groups, int):
            object.__setattr__(self, "expect_groups", tuple(self.expect_groups))
        if not 1 <= self.dp_size <= MAX_DP_SIZE:
            raise ValueError(f"dp_size must be in 1..{MAX_DP_SIZE}, got {self.dp_size}")
        if self.max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {self.max_groups}")
        if isinstance(self.expect_groups, int) and not 0 <= self.expect_groups <= self.max_groups:
            raise ValueError(f"expect_groups must be in 0..max_groups ({self.max_groups})")

    @property
    def expected_names(self) -> tuple[str, ...]:
        """The groups /readyz waits for by name (empty: `expected_count` counts any)."""
        return () if isinstance(self.expect_groups, int) else self.expect_groups

    @property
    def expected_count(self) -> int:
        """How many groups /readyz waits for."""
        expect = self.expect_groups
        return expect if isinstance(expect, int) else len(expect)

    @property
    def gated(self) -> bool:
        """Whether new connections pass the handshake gate (memory budget or rate)."""
        return bool(self.max_rss_mb or self.max_handshake_rate)
