"""An in-memory tree for the relay cores' tests: a root `TreeCoordinator`, relays
(`RelayCoordinator`) and ranks as inboxes, with time passed in (no sockets, no clock)."""

from __future__ import annotations

from collections import defaultdict

from coordd.proto.coordinator import Send
from coordd.proto.messages import FromCoordinator, Goodbye, Hello, StepReport
from coordd.proto.relay import RelayCoordinator
from coordd.proto.relay_messages import RelayUp
from coordd.proto.snapshot import OnRankLoss
from coordd.proto.tree import TreeCoordinator


def peer(rank: int) -> bytes:
    return b"rank-%d" % rank


class Tree:
    """`layout`: each relay's ranks; rank r's peer is peer(r) on its relay. `dp` is every
    relay's and the root's --dp (the ranks of the layout unless told), `root_dp` the root's
    if another; `on_rank_loss` the root's (relays learn it from its Welcome)."""

    def __init__(
        self,
        layout: list[list[int]],
        step_timeout: float = 5.0,
        dp: int | None = None,
        root_dp: int | None = None,
        on_rank_loss: OnRankLoss = OnRankLoss.FAIL,
    ) -> None:
        self.dp = dp or sum(len(r) for r in layout)
        self.root = TreeCoordinator(
            root_dp or self.dp,
            group="g",
            epoch=1000,
            step_timeout=step_timeout,
            on_rank_loss=on_rank_loss,
        )
        self.up: list[tuple[bytes, RelayUp]] = []
        self.relays: dict[bytes, RelayCoordinator] = {}
        self.relay_of: dict[int, RelayCoordinator] = {}
        for i, ranks in enumerate(layout):
            name = b"relay-%d" % i
            relay = RelayCoordinator(
                self.dp,
                group="g",
                ranks=frozenset(ranks),
                uplink=lambda m, name=name: self.up.append((name, m)),
                epoch=1,
                step_timeout=step_timeout,
                relay=f"node{i}",
            )
            self.relays[name] = relay
            for r in ranks:
                self.relay_of[r] = relay
        self.inbox: dict[int, list[FromCoordinator]] = defaultdict(list)
        #: root messages handled, per round (the root's work)
        self.root_inputs = 0

    def _deliver(self, sends: list[Send] | tuple[Send, ...]) -> None:
        for peers, msg in sends:
            for p in peers:
                self.inbox[int(p.split(b"-")[1])].append(msg)

    def pump(self, now: float) -> None:
        while self.up:
            name, msg = self.up.pop(0)
            self.root_inputs += 1
            for peers, answer in self.root.receive(name, msg, now):
                for p in peers:
                    self._deliver(self.relays[p].from_root(answer, now))  # type: ignore[arg-type]

    def hello(self, rank: int, now: float = 0.0, **fields: object) -> None:
        fields.setdefault("dp_size", self.dp)
        h = Hello(dp_rank=rank, config_fingerprint="f", incarnation="i", **fields)  # type: ignore[arg-type]
        self._deliver(self.relay_of[rank].receive(peer(rank), h, now))
        self.pump(now)

    def goodbye(self, rank: int, now: float = 0.0) -> None:
        self._deliver(self.relay_of[rank].receive(peer(rank), Goodbye(), now))
        self.pump(now)

    def send(self, rank: int, report: object, now: float = 0.0) -> None:
        self._deliver(self.relay_of[rank].receive(peer(rank), report, now))  # type: ignore[arg-type]
        self.pump(now)

    def lose_rank(self, rank: int, now: float = 0.0) -> None:
        self._deliver(self.relay_of[rank].peer_lost(peer(rank), now))
        self.pump(now)

    def lose_relay(self, index: int, now: float = 0.0) -> None:
        name = b"relay-%d" % index
        for peers, answer in self.root.relay_lost(name, now):
            for p in peers:
                self._deliver(self.relays[p].from_root(answer, now))  # type: ignore[arg-type]

    def cut(self, index: int, now: float = 0.0) -> None:
        """A network cut: the root loses relay `index`, and the relay loses the root."""
        self.lose_relay(index, now)
        self._deliver(self.relays[b"relay-%d" % index].root_lost(now, "cut"))

    def deadlines(self, now: float) -> None:
        for relay in self.relays.values():
            self._deliver(relay.on_deadline(now))
        self.pump(now)
        for peers, answer in self.root.on_deadline(now):
            for p in peers:
                self._deliver(self.relays[p].from_root(answer, now))  # type: ignore[arg-type]

    def last(self, rank: int) -> FromCoordinator:
        return self.inbox[rank][-1]

    def report(self, rank: int, seq: int, epoch: int, **fields: object) -> StepReport:
        base = {"num_tokens": 10 + rank, "num_tokens_padded": 16 + rank}
        base.update(fields)
        return StepReport(dp_rank=rank, seq=seq, epoch=epoch, **base)  # type: ignore[arg-type]
