"""A rank's client that outlives coordd: coordd while it is there, the device path while not.

`FallbackClient` has the blocking client's methods (`connect`, `start`/`wait`, `coordinate`,
`start_gather`/`gather`, `close`) and runs each round on one of two paths, the same for every
rank of the group at every round (`coordd.client.switch` holds the rules, pure):

- `connect()` registers with coordd and votes over the rank's process group: the group starts
  on coordd if every rank was welcomed, else on the device path (`DeviceCoordClient` over the
  same process group), where it stays until a vote brings it back.
- A round that ends in `CoordinatorUnavailable` (coordd gone, its Goodbye, heartbeats lost, a
  new epoch) settles the group over the process group (`own_path.settle_over`): a rank one
  round behind (coordd answered the others and died before its answer left) takes the answer
  from a rank ahead, so no decision is lost, doubled or changed; the round the group lacks runs
  on the device path. A round started before the loss (and still in flight) is the same case.
- On the device path a `Rejoiner` registers with coordd again; every `VOTE_EVERY` rounds the
  group votes, and returns to coordd at the same round once every rank has one epoch.

Only the loss of coordd switches: a rank's own fault (`RankLost`, `StepMismatch`, ...) and this
client's own `close()` stay the errors they are. The answer a rank behind takes travels as
ints in a fixed layout (`answer_ints`), not as its msgpack bytes: the settlement checks the
length of that answer on the ranks that lack it before it travels, so the length must follow
from what every rank knows (the round's site, dp, a gather's value count), and msgpack's
integers vary in width. `seq` on a pending round is the group's round index, the same on both
paths; a decision keeps the seq and epoch of the path that made it (the device path's: 0).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import torch

from coordd.client._config import ClientConfig
from coordd.client.device import DEVICE_EPOCH, DeviceCoordClient
from coordd.client.own_path import gather_rows, settle_over
from coordd.client.rejoin import Rejoiner
from coordd.client.switch import RejoinPacing, returns, site_code, votes_now
from coordd.client.sync import CoordClient
from coordd.proto.errors import (
    CoordError,
    CoordinatorUnavailable,
    InvalidReport,
    ProtocolError,
    Rejected,
    StepMismatch,
    StepTimeout,
)
from coordd.proto.messages import GatherResult, StepDecision, StepKind, StepReport, Welcome
from coordd.proto.rounds import majority

#: The details of a `CoordinatorUnavailable` that this client caused itself: never a switch.
_OWN = frozenset({"client closed", "superseded by connect()"})
_FLAGS = ("should_ubatch", "should_pad", "any_unfinished", "all_idle", "should_pause", "any_pause")
COORDD, DEVICE = "coordd", "device"
#: A policy round's site in the settlement (a gather round's is its own).
_SITES = {kind: f"step:{kind.value}" for kind in StepKind}
#: A rank's vote at `connect()` when coordd refused its Hello.
_REFUSED = -1

Answer = StepDecision | GatherResult


def answer_len(dp: int, values: int | None) -> int:
    """The length of `answer_ints` for a policy round (`values` None) or a gather of `values`."""
    return 3 + len(_FLAGS) + 2 * dp if values is None else 2 + dp * (values + 1)


def answer_ints(answer: Answer, dp: int) -> list[int]:
    """An answer in the fixed layout a rank behind decodes (`answer_from`)."""
    if type(answer) is StepDecision:
        dead = set(answer.dead_ranks)
        flags = [int(getattr(answer, name)) for name in _FLAGS]
        mask = [int(rank in dead) for rank in range(dp)]
        head = [answer.epoch, answer.seq, answer.cudagraph_mode]
        return head + flags + list(answer.num_tokens_across_dp) + mask
    assert type(answer) is GatherResult
    dead = set(answer.dead_ranks)
    width = max(map(len, answer.rows), default=0)
    ints = [answer.epoch, answer.seq]
    for rank, row in enumerate(answer.rows):
        ints += [0] * (width + 1) if rank in dead else [1, *row]
    return ints


def answer_from(ints: Sequence[int], dp: int, kind: StepKind, site: str) -> Answer:
    """The answer `answer_ints` encoded, for a round of `kind` (a gather's: at `site`)."""
    epoch, seq = ints[0], ints[1]
    if kind is not StepKind.GATHER:
        flags = {name: bool(v) for name, v in zip(_FLAGS, ints[3 : 3 + len(_FLAGS)], strict=True)}
        rest = ints[3 + len(_FLAGS) :]
        dead = [rank for rank in range(dp) if rest[dp + rank]]
        return StepDecision(
            epoch=epoch, seq=seq, kind=kind, num_tokens_across_dp=list(rest[:dp]),
            cudagraph_mode=ints[2], dead_ranks=dead, **flags,
        )  # fmt: skip
    width = (len(ints) - 2) // dp
    rows = [list(ints[2 + r * width : 2 + (r + 1) * width]) for r in range(dp)]
    dead = [rank for rank, row in enumerate(rows) if not row[0]]
    rows = [row[1:] if row[0] else [] for row in rows]
    return GatherResult(epoch=epoch, seq=seq, site=site, rows=rows, dead_ranks=dead)


class FallbackPending:
    """A round this rank has started; `wait()` returns its answer on whichever path ran it.

    `seq` is the group's round index; `path` the path the round runs on now."""

    __slots__ = ("_client", "_inner", "_outcome", "kind", "path", "report", "seq", "site")

    def __init__(
        self, client: FallbackClient, seq: int, kind: StepKind, site: str, report: Any
    ) -> None:
        self._client = client
        self._inner: Any = None
        self._outcome: Answer | CoordError | None = None
        self.seq, self.kind, self.site, self.report = seq, kind, site, report
        self.path = client.path

    def wait(self, timeout: float | None = None) -> Any:
        """The decision (a gather round's: its rows), or the round's error."""
        answer = self.result(timeout)
        return answer.rows if type(answer) is GatherResult else answer

    def result(self, timeout: float | None = None) -> Answer:
        """As `wait()`, a gather round's whole `GatherResult`."""
        if self._outcome is None:
            self._client._settle(self, timeout)
        outcome = self._outcome
        if isinstance(outcome, CoordError):
            raise outcome
        assert outcome is not None
        return outcome

    def done(self) -> bool:
        return self._outcome is not None or self._inner.done()


class FallbackClient:
    """One DP rank's rounds over coordd at `address`, and over `process_group` (None: torch's
    default group; gloo on CPU, NCCL on GPU) while coordd is lost. Settings as for
    `CoordClient` (keywords, `config=`, or both). `switch_timeout`: the longest a switch's
    exchanges over the process group wait for every rank (default: the client's wait)."""

    def __init__(
        self,
        address: str | None = None,
        *,
        config: ClientConfig | None = None,
        process_group: Any = None,
        device: Any = None,
        context: Any = None,
        switch_timeout: float | None = None,
        **options: Any,
    ) -> None:
        self.config = ClientConfig.of(config, address=address, **options)
        self._context = context
        self.device = DeviceCoordClient(
            config=self.config, process_group=process_group, device=device
        )
        self._group = process_group
        self.dp_rank, self.dp_size = self.config.dp_rank, self.config.dp_size
        self.coordd: CoordClient | None = None
        self.path = COORDD
        self._switch_timeout = switch_timeout
        #: Rounds started, and answered to this rank (on either path); the last answered on
        #: coordd (its site and answer, for a rank behind) and the round last left at.
        self.started = self.completed = 0
        self._last: tuple[str, Answer] | None = None
        self._open: FallbackPending | None = None
        self.switched_at = 0
        self.pacing = RejoinPacing()
        self.rejoiner: Rejoiner | None = None
        #: Each switch: (round index, path taken, why, time.monotonic()).
        self.switches: list[tuple[int, str, str, float]] = []
        #: Why no round can run (until `connect()`): not registered, refused, or a switch that
        #: found no group; every round raises it.
        self.failed: CoordError | None = self._not_registered()
        self._closed = False

    # -- public API ---------------------------------------------------------------------------

    def connect(self, timeout: float = 5.0) -> Welcome:
        """Register with coordd (within `timeout`) and vote with every rank of the group: all
        welcomed, the group runs on coordd, else on the device path (a collective: every rank
        calls it). Raises `Rejected` as either client does."""
        if self.rejoiner is not None:
            self.rejoiner.stop()
            self.rejoiner = None
        self.failed = self._not_registered()
        client, self.coordd = self.coordd or self._new_client(), None
        welcome: Welcome | None = None
        why = ""
        try:
            welcome = client.connect(timeout)
        except CoordinatorUnavailable as error:
            why = str(error)
        except Rejected as refused:
            self.failed = refused
            self._gather([_REFUSED], "vote")  # the others learn it now, not at a timeout
            client.close(goodbye=False)
            raise
        epochs = [row[0] for row in self._gather([welcome.epoch if welcome else 0], "vote")]
        if _REFUSED in epochs:
            client.close()
            self.failed = CoordinatorUnavailable(f"coordd refused rank {epochs.index(_REFUSED)}")
            raise self.failed
        if returns(epochs):
            self.coordd, self.path, self.failed = client, COORDD, None
            assert welcome is not None
            return welcome
        client.close(goodbye=welcome is not None)
        return self._leave(self.started, why or "not every rank of the group reached coordd")

    def start(self, report: StepReport, kind: StepKind | str = StepKind.FORWARD) -> FallbackPending:
        """Start this rank's next round (see `CoordClient.start`); returns at once."""
        if type(kind) is not StepKind:
            kind = StepKind(kind)
        return self._start(FallbackPending(self, self.started, kind, _SITES[kind], report))

    def start_gather(self, site: str, values: Sequence[int]) -> FallbackPending:
        """Start a gather round at `site` (see `CoordClient.start_gather`)."""
        return self._start(FallbackPending(self, self.started, StepKind.GATHER, site, values))

    def coordinate(
        self, report: StepReport, kind: StepKind | str = "forward", timeout: float | None = None
    ) -> StepDecision:
        decision: StepDecision = self.start(report, kind).wait(timeout)
        return decision

    def gather(
        self, site: str, values: Sequence[int], timeout: float | None = None
    ) -> list[list[int]]:
        rows: list[list[int]] = self.start_gather(site, values).wait(timeout)
        return rows

    def close(self) -> None:
        """Say goodbye to coordd (if on it), stop rejoining, close; idempotent."""
        self._closed = True
        if self.rejoiner is not None:
            self.rejoiner.stop()
            self.rejoiner = None
        if self.coordd is not None:
            self.coordd.close()
        self.device.close()

    def __enter__(self) -> FallbackClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- rounds -------------------------------------------------------------------------------

    def _start(self, pending: FallbackPending) -> FallbackPending:
        if self.failed is not None:
            raise self.failed
        last = self._open
        if self.path == COORDD and last is not None and last._outcome is None and last.done():
            self._settle(last, None)  # answered, not yet collected: it counts before this one
        if self.path == DEVICE and votes_now(self.started, self.switched_at):
            self._vote()
        self.started += 1
        pending.path = self.path
        if self.path == DEVICE:
            self._post_device(pending)
            return pending
        try:
            self._post_coordd(pending)
        except CoordinatorUnavailable as error:
            if error.detail in _OWN or self._closed:
                raise
            self._fall_back(pending, error)
        self._open = pending
        return pending

    def _post_coordd(self, pending: FallbackPending) -> None:
        assert self.coordd is not None
        if pending.kind is StepKind.GATHER:
            pending._inner = self.coordd.start_gather(pending.site, pending.report)
        else:
            pending._inner = self.coordd.start(pending.report, pending.kind)

    def _post_device(self, pending: FallbackPending) -> None:
        pending.path = DEVICE
        if pending.kind is StepKind.GATHER:
            pending._inner = _DeviceGather(self, pending)
        else:
            pending._inner = self.device.start(pending.report, pending.kind)

    def _settle(self, pending: FallbackPending, timeout: float | None) -> None:
        """Wait for `pending`'s outcome on its path; coordd's loss settles the group first."""
        try:
            if pending.path == COORDD and pending.kind is StepKind.GATHER:
                answer: Answer = pending._inner.result(timeout)
            else:
                answer = pending._inner.wait(timeout)
        except CoordinatorUnavailable as error:
            if pending.path != COORDD or error.detail in _OWN or self._closed:
                raise
            self._fall_back(pending, error)
            if pending._outcome is None:
                self._settle(pending, timeout)  # the round runs on the device path now
            return
        except StepTimeout:
            raise  # not an outcome: waiting again may succeed
        except CoordError as error:
            pending._outcome = error
            raise
        pending._outcome = answer
        self.completed += 1
        if pending.path == COORDD:
            self._last = (pending.site, answer)

    # -- switching ----------------------------------------------------------------------------

    def _fall_back(self, pending: FallbackPending, error: CoordinatorUnavailable) -> None:
        """coordd was lost with `pending` unanswered here: settle, and take its answer from a
        rank ahead, or run it on the device path (the group's next rounds run there)."""
        client, self.coordd = self.coordd, None
        if client is not None:
            client.close(goodbye=False)
        values = len(pending.report) if pending.kind is StepKind.GATHER else None
        last = self._last
        try:
            settlement, answer = settle_over(
                self._group,
                self.dp_rank,
                self.dp_size,
                self.completed,
                (pending.site, answer_len(self.dp_size, values)),
                None if last is None else (last[0], answer_ints(last[1], self.dp_size)),
                self._timeout(),
            )
        except CoordError as failure:  # no group to go on with: every later round raises it
            pending._outcome = self.failed = failure
            raise
        self._leave(settlement.completed, str(error))
        if answer is not None:  # this rank was behind: the round is done
            pending._outcome = answer_from(answer, self.dp_size, pending.kind, pending.site)
            self.completed += 1
        else:
            self._post_device(pending)

    def _leave(self, at: int, why: str) -> Welcome:
        """Onto the device path from round `at`: its handshake, and a rejoiner for coordd."""
        self.path, self.switched_at, self.failed = DEVICE, at, None
        now = time.monotonic()
        self.switches.append((at, DEVICE, why, now))
        self.pacing.fell_back(now)
        self.rejoiner = Rejoiner(self._new_client, self.pacing, f"coordd-rejoin-{self.dp_rank}")
        return self.device.connect(self._timeout())

    def _vote(self) -> None:
        """The vote before round `started`: back to coordd if every rank has one epoch."""
        rejoiner = self.rejoiner
        assert rejoiner is not None
        mine = rejoiner.epoch
        epochs = [row[0] for row in self._gather([mine], "vote")]
        if not returns(epochs):
            if mine and mine < max(epochs):
                rejoiner.drop_stale()
            return
        client = rejoiner.take()
        self.rejoiner = None
        if client is None:  # dropped since the vote: if this fails, the round settles again
            client = self._new_client()
            with contextlib.suppress(CoordinatorUnavailable):
                client.connect(self._timeout())
        now = time.monotonic()
        self.pacing.came_back(now)
        self.coordd, self.path, self._open = client, COORDD, None
        self.switches.append((self.started, COORDD, f"epoch {epochs[0]}", now))

    def _not_registered(self) -> ProtocolError:
        return ProtocolError("not registered: call connect() first", rank=self.dp_rank)

    def _new_client(self) -> CoordClient:
        return CoordClient(config=self.config, context=self._context)

    def _gather(self, row: list[int], what: str) -> list[list[int]]:
        timeout = self._timeout()
        return gather_rows(self._group, row, self.dp_rank, self.dp_size, timeout, what)

    def _timeout(self) -> float:
        if self._switch_timeout is not None:
            return self._switch_timeout
        return self.coordd.wait_timeout if self.coordd is not None else self.device.wait_timeout


class _DeviceGather:
    """A gather round on the device path: one SUM all-reduce of `[dp, 2 + n]` int64 rows
    (site code, n, the values), checked as coordd checks a gather round. The row goes straight
    into the device client's buffers for that width (made once, reused once read): no tensor
    is made per gather."""

    def __init__(self, client: FallbackClient, pending: FallbackPending) -> None:
        self.client, self.pending = client, pending
        row = [site_code(pending.site), 0]
        row += map(int, pending.report)
        row[1] = len(row) - 2
        self.exchange = client.device._post(row, len(row), torch.int64)

    def done(self) -> bool:
        return self.exchange.is_completed()

    def wait(self, timeout: float | None) -> GatherResult:
        timeout = self.client.device.wait_timeout if timeout is None else timeout
        rows = self.exchange.rows(time.monotonic() + timeout, timeout)
        pending = self.pending
        codes = [row[0] for row in rows]
        code = majority(codes)
        for rank, row in enumerate(rows):
            if row[0] != code:
                mine = site_code(pending.site)
                want = f"gather:{pending.site}" if code == mine else f"gather site {code:x}"
                got = f"gather:{pending.site}" if row[0] == mine else f"gather site {row[0]:x}"
                raise StepMismatch(rank, pending.seq, want, pending.seq, got)
            if row[1] != rows[0][1]:
                raise InvalidReport(rank, "values", row[1], f"{rows[0][1]} values, as rank 0's")
        return GatherResult(
            epoch=DEVICE_EPOCH, seq=pending.seq, site=pending.site, rows=[r[2:] for r in rows]
        )
