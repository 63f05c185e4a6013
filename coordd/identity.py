"""A rank is the connection that registered it: how coordd tells connections apart, what it shows
of them, and what it does with a message that claims a rank over another connection.

The binding, over ipc and tcp (+CURVE) alike:

- **One live connection per routing id.** The ROUTER runs with `ROUTER_HANDOVER` off: while a
  connection holds routing id X, libzmq itself drops a second connection that presents X (its
  frames never reach coordd). With handover on (coordd before this), the newcomer took X over
  and received the rank's decisions; the rank's own connection was orphaned.
- **The registering connection, by descriptor.** A Hello records the file descriptor its frame
  came in on (the message's `SRCFD`); every later message from that routing id must come in on
  the same descriptor while coordd knows the connection open (the socket monitor reports its
  close). A message over another descriptor is refused (answered as a stranger's), counted and
  logged: it cannot count as the rank's report, heartbeat or Goodbye.
- **Unguessable routing ids, never shown.** A client picks a fresh random routing id (128 bits)
  for each connection (`RankSession.identity`); it is not derived from the rank or the
  incarnation, and coordd never echoes it: Rejects name no holder, logs and /status show
  `peer_label(peer)` (a keyed hash, stable for the process's life, that cannot be turned back
  into the id) and the connection's address.

What is left: after rank r's connection closes, and before coordd has read the monitor's
report of it (one loop turn), a new connection that presents r's routing id *and* got the same
descriptor number would pass; it would have to know a 128-bit id that only the rank and coordd
hold. (libzmq's own routing ids are no alternative: they are a counter from a fixed start, and a
peer that picks `\\x00` + the next value makes libzmq abort when an id-less peer connects.)
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable

import zmq

from coordd import logs

log = logging.getLogger("coordd")

_LABEL_KEY = secrets.token_bytes(16)
#: A refused takeover is logged at most once per this many seconds per group and kind (the
#: rest are counted, and the count is in the next line).
LOG_INTERVAL = 10.0


def peer_label(peer: bytes) -> str:
    """What logs, metrics and /status show of a routing id: a keyed hash, never the id."""
    digest = hashlib.blake2b(peer, digest_size=5, key=_LABEL_KEY).hexdigest()
    return f"conn-{digest}"


class Takeovers:
    """Attempts to speak for a rank over a connection that did not register it: refused,
    counted by group and kind (`coordd_rank_takeovers_refused_total`), logged with the peer's
    address (rate-limited)."""

    #: kind values
    RANK_HELD = "rank_held"  # a Hello for a rank another live connection holds
    OTHER_CONNECTION = "other_connection"  # a message over another connection than the Hello's
    KEY_BOUND = "key_bound"  # a Hello for a rank its CURVE key is not bound to

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.refused: Counter[tuple[str, str]] = Counter()
        self.clock = clock
        self._logged_at: dict[tuple[str, str], float] = {}
        self._unlogged: Counter[tuple[str, str]] = Counter()

    def refuse(
        self, group: str, kind: str, *, rank: int | None, address: str, peer: bytes, detail: str
    ) -> None:
        key = (group, kind)
        self.refused[key] += 1
        now = self.clock()
        last = self._logged_at.get(key)
        if last is not None and now - last < LOG_INTERVAL:
            self._unlogged[key] += 1
            return
        self._logged_at[key] = now
        more = self._unlogged.pop(key, 0)
        logs.event(
            log,
            logging.WARNING,
            "rank takeover refused",
            group=group,
            kind=kind,
            rank=-1 if rank is None else rank,
            peer=peer_label(peer),
            address=address or "-",
            detail=detail,
            **({"suppressed": more} if more else {}),
        )


def frame_address(frame: object) -> str:
    """The connection's address as libzmq gives it (tcp: the IP; ipc: the peer's credentials),
    or "" if it has none."""
    try:
        return str(frame.get("Peer-Address"))  # type: ignore[attr-defined]
    except (zmq.ZMQError, KeyError, TypeError, ValueError):  # the transport set none
        return ""
