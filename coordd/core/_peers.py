"""What coordd shows of a peer (a keyed hash of its routing id, never the id), and the
record of attempts to speak for a rank over a connection that did not register it."""

from __future__ import annotations

import hashlib
import secrets
from collections import Counter

from coordd.core._bounds import Throttle
from coordd.core._logs import WARNING, LogEvent

_LABEL_KEY = secrets.token_bytes(16)
#: A refused takeover is logged at most once per this many seconds per group and kind (the
#: rest are counted, and the count is in the next line).
LOG_INTERVAL = 10.0
#: ... and at most this many lines per LOG_INTERVAL over all groups: a peer that cycles group
#: names makes a new key per name, which the per-key limit alone does not bound.
LOG_LINES = 16


def peer_label(peer: bytes) -> str:
    """What logs, metrics and /status show of a routing id: a keyed hash, never the id."""
    digest = hashlib.blake2b(peer, digest_size=5, key=_LABEL_KEY).hexdigest()
    return f"conn-{digest}"


class Takeovers:
    """Attempts to speak for a rank over a connection that did not register it: refused,
    counted by group and kind (`coordd_rank_takeovers_refused_total`), with a line for the
    shell to log with the peer's address (rate-limited). What is kept under a group's name
    goes with the group (`forget`): a peer cycling names through a pattern cannot grow the
    record or its /metrics series."""

    #: kind values
    RANK_HELD = "rank_held"  # a Hello for a rank another live connection holds
    OTHER_CONNECTION = "other_connection"  # a message over another connection than the Hello's
    KEY_BOUND = "key_bound"  # a Hello for a rank its CURVE key is not bound to

    def __init__(self) -> None:
        self.refused: Counter[tuple[str, str]] = Counter()
        self._throttle = Throttle(LOG_INTERVAL, keys=4096, lines=LOG_LINES)

    def refuse(
        self,
        group: str,
        kind: str,
        *,
        rank: int | None,
        address: str,
        peer: bytes,
        detail: str,
        now: float,
    ) -> LogEvent | None:
        """Count one refused takeover; the line to log, unless the rate limit holds it back."""
        key = (group, kind)
        self.refused[key] += 1
        if not self._throttle.admit(key, now):
            return None
        more = self._throttle.held_all()  # held back since the last takeover line
        fields = {
            "group": group,
            "kind": kind,
            "rank": -1 if rank is None else rank,
            "peer": peer_label(peer),
            "address": address or "-",
            "detail": detail,
        }
        if more:
            fields["suppressed"] = more
        return LogEvent(WARNING, "rank takeover refused", fields)

    def forget(self, group: str) -> None:
        """Group `group` was dropped: its counts go with it (their series end)."""
        for key in [k for k in self.refused if k[0] == group]:
            del self.refused[key]
