"""coordd is never the engine's single point of failure: a group's syncs go to vLLM's own
collective while coordd is away, and come back to coordd when it returns.

`GroupPath` is one group's path in this process (`Exchange` keeps one per link). The rules are
`coordd.client.switch`'s and the exchanges `coordd.client.own_path`'s, over the group's own gloo
group; this module only says when each happens:

- the group's first sync registers with coordd and votes: every rank welcomed, the group starts
  on coordd; else on vLLM's own collective (a coordd that is not there when vLLM starts);
- a sync whose round fails with `CoordinatorUnavailable` (coordd gone, its Goodbye, heartbeats
  lost, a restart) settles the group over its gloo group: a rank one round behind takes the
  answer it missed, and every rank runs the next rounds on vLLM's own collective (the caller
  calls vLLM's original function: `Exchange.sync_` returns False);
- on that path a `Rejoiner` registers with coordd again; every `VOTE_EVERY` rounds the group
  votes, and returns to coordd at the same round on every rank once all are welcomed again.

A rank's own fault (`RankLost`, `StepMismatch`, `StepTimeout`, ...) is never a switch: it stays
the typed error it is. `COORDD_VLLM_FALLBACK=0` keeps the fail-stop of before (no settlement,
no vote: every sync is a coordd round, and coordd's loss raises).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from coordd.client import CoordClient
from coordd.client.own_path import gather_rows, settle_over
from coordd.client.rejoin import Rejoiner
from coordd.client.switch import VOTE_EVERY, RejoinPacing, Settlement, returns, votes_now
from coordd.proto.errors import CoordError, CoordinatorUnavailable
from coordd.vllm.groups import ENGINE_GROUP, GroupIdentity

log = logging.getLogger("vllm.coordd")

#: Longest a group's first sync waits for coordd's Welcome before it starts on vLLM's own
#: collective (when coordd's ipc socket is not there at all, it does not wait).
JOIN_WAIT = 5.0


class GroupPath:
    """Which path one group's syncs take in this process, and what a switch needs.

    `completed` counts the group's rounds on either path (every rank counts the same), `last`
    is the last round completed on coordd (its site and result, for a rank behind), and
    `switched_at` the count at which the group last left coordd (the votes count from it)."""

    def __init__(
        self,
        identity: GroupIdentity,
        make_client: Callable[[], CoordClient],
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
        client: CoordClient | None = None,
    ) -> None:
        """`client`: one to register again at the join (a rebuilt group's), else a new one."""
        self.identity = identity
        self._client = client
        #: The engine cores sync every 32 steps (`--dp-sync-interval`): they vote at each
        #: round on vLLM's path, the workers every VOTE_EVERY.
        self.vote_every = 1 if identity.name == ENGINE_GROUP else VOTE_EVERY
        self._make_client = make_client
        self._timeout = timeout
        self._clock = clock
        self.joined = False
        self.on_coordd = False
        self.completed = 0
        self.switched_at = 0
        self.last: tuple[str, list[int]] | None = None
        self.pacing = RejoinPacing()
        self.rejoiner: Rejoiner | None = None
        self.away_since = 0.0
        #: Falls back and returns so far, and each switch as ("own" or "coordd", the round it
        #: came at): the same on every rank of the group (tests compare them).
        self.fallbacks = 0
        self.returns = 0
        self.switches: list[tuple[str, int]] = []

    # -- the first sync ------------------------------------------------------------------------

    def join(self, group: Any, wait: float) -> CoordClient | None:
        """Register (within `wait`; not at all when coordd's ipc socket is not there) and
        vote: the client if the group starts on coordd, None if on vLLM's own path."""
        client: CoordClient | None = self._client or self._make_client()
        self._client = None
        assert client is not None
        unreachable = client.connection.no_socket_file()
        why = f"coordd is not reachable{unreachable}" if unreachable else ""
        epoch = 0
        if unreachable is None:
            try:
                epoch = client.connect(timeout=wait).epoch
            except CoordError as error:  # Rejected too: the WARNING says so, the rejoiner retries
                why = f"{type(error).__name__}: {error}"
        if unreachable is not None or not epoch:
            client.close(goodbye=False)
            client = None
        self.joined = True
        if self._vote(group, epoch):
            self.on_coordd = True
            return client
        if client is not None:
            client.close()
        self._leave(0, why or "not every rank of the group reached coordd", first=True)
        return None

    # -- coordd lost ---------------------------------------------------------------------------

    def fall_back(
        self, group: Any, error: CoordinatorUnavailable, pending: tuple[str, int]
    ) -> list[int] | None:
        """Settle after `error` ended this rank's round at `pending` (site, result length):
        the result of that round if this rank was one behind (the round is then done), else
        None (the round runs on vLLM's own collective: the caller's next step). Counted here
        either way."""
        identity = self.identity
        settlement, answer = settle_over(
            group,
            identity.dp_rank,
            identity.dp_size,
            self.completed,
            pending,
            self.last,
            self._timeout,
        )
        self._leave(settlement.completed, str(error), settlement=settlement)
        self.completed += 1  # the round it lacked, taken now, or this one, on vLLM's path
        return answer

    def _leave(
        self, at: int, why: str, first: bool = False, settlement: Settlement | None = None
    ) -> None:
        self.on_coordd = False
        self.switched_at = at
        self.away_since = self._clock()
        self.fallbacks += not first
        self.switches.append(("own", at))
        self.pacing.fell_back(self.away_since)
        if self.rejoiner is None:
            self.rejoiner = Rejoiner(
                self._make_client,
                self.pacing,
                name=f"coordd-rejoin-{self.identity.name}",
                clock=self._clock,
                away_since=self.away_since,
            )
        identity = self.identity
        behind = (
            f"; rank(s) {list(settlement.behind)} took round {at - 1}'s answer from rank "
            f"{settlement.source}"
            if settlement is not None and settlement.behind
            else ""
        )
        log.warning(
            "coordd: group %s (rank %d) %s vLLM's own collective at round %d%s: %s",
            identity.name,
            identity.dp_rank,
            "starts on" if first else "falls back to",
            at,
            behind,
            why,
        )

    # -- on vLLM's own path --------------------------------------------------------------------

    def own_round(self, group: Any, connect_wait: float) -> CoordClient | None:
        """Before a round on vLLM's own path: the vote, if this round has one. The client to
        run this round on coordd with if the group returns now; else None (the round is
        vLLM's, counted here)."""
        if votes_now(self.completed, self.switched_at, self.vote_every):
            rejoiner = self.rejoiner
            assert rejoiner is not None
            mine = rejoiner.epoch
            epochs = [row[0] for row in self._gather(group, [mine], "vote")]
            if returns(epochs):
                return self._come_back(connect_wait)
            if mine and mine < max(epochs):
                rejoiner.drop_stale()
        self.completed += 1
        return None

    def _come_back(self, connect_wait: float) -> CoordClient:
        """Every rank is welcomed again: take the registration (if it dropped since the vote,
        register now; if that fails, the round's `CoordinatorUnavailable` settles again)."""
        assert self.rejoiner is not None
        client = self.rejoiner.take()
        self.rejoiner = None
        if client is None:
            client = self._make_client()
            # if this fails, its round raises CoordinatorUnavailable and the group settles again
            with contextlib.suppress(CoordError):
                client.connect(timeout=connect_wait)
        now = self._clock()
        self.pacing.came_back(now)
        self.on_coordd = True
        self.returns += 1
        self.switches.append(("coordd", self.completed))
        log.info(
            "coordd: group %s (rank %d) is back on coordd at round %d, after %.1f s on vLLM's "
            "own collective",
            self.identity.name,
            self.identity.dp_rank,
            self.completed,
            now - self.away_since,
        )
        return client

    def completed_on_coordd(self, site: str, result: list[int]) -> None:
        self.completed += 1
        self.last = (site, result)

    def _gather(self, group: Any, row: Sequence[int], what: str) -> list[list[int]]:
        identity = self.identity
        return gather_rows(group, row, identity.dp_rank, identity.dp_size, self._timeout, what)

    def _vote(self, group: Any, epoch: int) -> bool:
        return returns([row[0] for row in self._gather(group, [epoch], "vote")])

    def close(self) -> None:
        if self.rejoiner is not None:
            self.rejoiner.stop()
            self.rejoiner = None
