"""Rounds started before vLLM's sync and collected at it (`Exchange.start_` / `sync_`), against
a real `coordd serve --dp 2` with two ranks' exchanges over real sockets: one round per sync,
the collective's result, and each fault with a round in flight a typed error naming the rank
(and every peer told at once). torch only, no vLLM: these run in the main venv too."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from coordd.proto.coordinator import LEFT_THE_GROUP  # noqa: E402
from coordd.proto.errors import CoordError, RankLost  # noqa: E402
from coordd.testing import CoorddProcess  # noqa: E402
from coordd.vllm.early import EarlyStartMismatch, SkippedSync  # noqa: E402
from coordd.vllm.enable import PluginSettings  # noqa: E402
from coordd.vllm.exchange import Exchange, ReduceOp  # noqa: E402
from coordd.vllm.groups import GroupIdentity  # noqa: E402

pytestmark = pytest.mark.timeout(90)

DP = 2
GROUP = "dp-tp0-pp0"
#: coordd's heartbeat timeout here: a peer's loss must be named long before it (a closed link
#: is seen at once).
HEARTBEAT = 20.0


@pytest.fixture
def coordd(tmp_path: Path) -> Iterator[CoorddProcess]:
    proc = CoorddProcess(
        DP,
        f"ipc://{tmp_path}/coordd.sock",
        ["--heartbeat-timeout", str(HEARTBEAT), "--step-timeout", "30", "--log-level", "error"],
    )
    with proc:
        yield proc


@pytest.fixture
def ranks(coordd: CoorddProcess) -> Iterator[list[tuple[Exchange, GroupIdentity]]]:
    made = []
    for rank in range(DP):
        settings = PluginSettings(
            coordd.address, connect_timeout=15.0, sync_timeout=40.0, fallback=False
        )
        made.append((Exchange(settings), GroupIdentity(GROUP, rank, DP, "fp")))
    try:
        yield made
    finally:
        for exchange, _ in made:
            exchange.close()


def column(rank: int, values: list[int]) -> torch.Tensor:
    """vLLM's V1 runner's sync tensor: [4, dp] int32, this rank's column filled."""
    tensor = torch.zeros(4, DP, dtype=torch.int32)
    tensor[:, rank] = torch.tensor(values, dtype=torch.int32)
    return tensor


def in_thread(fn: Callable[[], Any]) -> Callable[[float], Any]:
    """Run `fn` in a thread; the returned function waits (bounded) and returns or raises."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result(timeout: float) -> Any:
        thread.join(timeout)
        assert not thread.is_alive(), f"no outcome within {timeout} s"
        if "error" in out:
            raise out["error"]
        return out["value"]

    return result


def _outcome(wait: Callable[[float], Any], timeout: float) -> Any:
    """What `wait` returns, or what it raised."""
    try:
        return wait(timeout)
    except BaseException as exc:
        return exc


def collective(
    rank: tuple[Exchange, GroupIdentity], tensor: torch.Tensor, starting: bool
) -> torch.Tensor:
    """One call site for both, as vLLM's sync function is run twice (so both get its label)."""
    exchange, identity = rank
    if starting:
        assert exchange.start_(tensor, ReduceOp.SUM, identity, True)
    else:
        assert exchange.sync_(tensor, ReduceOp.SUM, identity, True)
    return tensor


def sync(rank: tuple[Exchange, GroupIdentity], tensor: torch.Tensor) -> torch.Tensor:
    return collective(rank, tensor, starting=False)


def start(rank: tuple[Exchange, GroupIdentity], tensor: torch.Tensor) -> None:
    collective(rank, tensor, starting=True)


def seq(rank: tuple[Exchange, GroupIdentity]) -> int:
    """The next round this rank's client would report (one round per sync: it moves by one)."""
    exchange, identity = rank
    return int(exchange.link(identity).client.session.next_seq)


VALUES = [[7, 8, 0, 0], [3, 4, 0, 0]]


def expected() -> torch.Tensor:
    return column(0, VALUES[0]) + column(1, VALUES[1])


def test_a_started_round_is_collected_by_its_sync_as_one_round(ranks: list) -> None:
    """Both ranks start early, then sync: the collective's result, one round per sync, and a
    later sync without an early start is the next round."""
    for rank in range(DP):
        start(ranks[rank], column(rank, VALUES[rank]))
    before = [seq(r) for r in ranks]
    waits = [in_thread(lambda r=rank: sync(ranks[r], column(r, VALUES[r]))) for rank in range(DP)]
    for wait in waits:
        assert torch.equal(wait(30), expected())
    assert [seq(r) for r in ranks] == before  # the sync started no round of its own
    assert [r[0].rounds() for r in ranks] == [{GROUP: 1}] * DP
    waits = [in_thread(lambda r=rank: sync(ranks[r], column(r, VALUES[r]))) for rank in range(DP)]
    for wait in waits:
        assert torch.equal(wait(30), expected())
    assert [r[0].rounds() for r in ranks] == [{GROUP: 2}] * DP


def test_one_rank_early_and_one_at_its_sync_meet_in_one_round(ranks: list) -> None:
    """Overlap is per process: a rank with it off (its round made at the sync) and one with it
    on pair their syncs as one round."""
    start(ranks[1], column(1, VALUES[1]))
    waits = [in_thread(lambda r=rank: sync(ranks[r], column(r, VALUES[r]))) for rank in range(DP)]
    for wait in waits:
        assert torch.equal(wait(30), expected())
    assert [r[0].rounds() for r in ranks] == [{GROUP: 1}] * DP


def _peer_told(wait: Callable[[float], Any], culprit: int, since: float) -> float:
    with pytest.raises(RankLost) as lost:
        wait(HEARTBEAT)
    assert lost.value.ranks == (culprit,), lost.value
    assert LEFT_THE_GROUP not in str(lost.value), f"a fault counted as a clean leave: {lost.value}"
    took = time.monotonic() - since
    assert took < HEARTBEAT / 2, f"the peer was told after {took:.1f} s (not at once)"
    return took


def test_a_sync_that_differs_from_its_early_start_is_named_with_the_field(ranks: list) -> None:
    """Rank 1 started with 4 tokens padded, vLLM's sync then computed 5: EarlyStartMismatch
    naming rank 1 and the field, the tensor untouched; rank 0's next sync gets RankLost [1]."""
    for rank in range(DP):
        start(ranks[rank], column(rank, VALUES[rank]))
    first = in_thread(lambda: sync(ranks[0], column(0, VALUES[0])))
    assert torch.equal(first(30), expected())  # the round had both ranks' early values
    at_sync = column(1, [3, 5, 0, 0])
    with pytest.raises(EarlyStartMismatch) as mismatch:
        sync(ranks[1], at_sync)
    error = mismatch.value
    assert (error.rank, error.group, error.field, error.started, error.at_sync) == (
        1,
        GROUP,
        "values[1]",
        4,
        5,
    )
    assert torch.equal(at_sync, column(1, [3, 5, 0, 0]))
    since = time.monotonic()
    _peer_told(in_thread(lambda: sync(ranks[0], column(0, VALUES[0]))), 1, since)


def test_a_sync_of_another_site_than_started_is_named(ranks: list) -> None:
    """A different sync (another call site) comes first: field "site", both labels named."""
    start(ranks[1], column(1, VALUES[1]))
    exchange, identity = ranks[1]
    with pytest.raises(EarlyStartMismatch) as mismatch:
        exchange.sync_(column(1, VALUES[1]), ReduceOp.SUM, identity, True)
    error = mismatch.value
    assert (error.field, error.rank) == ("site", 1)
    assert ":collective|" in str(error.started) and ":test_a_sync_of_another" in str(error.at_sync)


def test_a_round_started_and_never_collected_is_a_skipped_sync(ranks: list) -> None:
    """Rank 1 starts round 0 and vLLM never makes that sync: its next start is SkippedSync
    naming it and the round; rank 0, whose round 0 completed with rank 1's early values, is
    told RankLost [1] in its next sync, at once."""
    for rank in range(DP):
        start(ranks[rank], column(rank, VALUES[rank]))
    first = in_thread(lambda: sync(ranks[0], column(0, VALUES[0])))
    assert torch.equal(first(30), expected())
    with pytest.raises(SkippedSync) as skipped:
        start(ranks[1], column(1, VALUES[1]))
    error = skipped.value
    assert (error.rank, error.group, error.seq) == (1, GROUP, 0)
    assert isinstance(error, CoordError) and error.ranks == (1,)
    since = time.monotonic()
    _peer_told(in_thread(lambda: sync(ranks[0], column(0, VALUES[0]))), 1, since)


class _Runner:
    """vLLM's V1 runner's shape, as the plugin patches it (`runner.prepare_inputs_starting_
    early`): `_prepare_inputs` starts the sync's round; `execute_model` makes the sync after it
    (or, `leave=True`, returns between them); `_dummy_run` makes the same sync on its own."""

    def __init__(self, rank: tuple[Exchange, GroupIdentity]) -> None:
        self.rank = rank
        self.values = VALUES[rank[1].dp_rank]

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: Any) -> None:
        pass

    def _determine_batch_execution_and_padding(self) -> torch.Tensor:
        return sync(self.rank, column(self.rank[1].dp_rank, self.values))

    def _allow_microbatching(self) -> bool:
        return False

    def execute_model(self, leave: bool = False) -> torch.Tensor | None:
        self._prepare_inputs(None, None)
        if leave:  # vLLM left the step before its sync (an early return, a caught error)
            return None
        return self._determine_batch_execution_and_padding()

    def _dummy_run(self) -> torch.Tensor:
        return self._determine_batch_execution_and_padding()


def _patched_runner() -> type[_Runner]:
    from coordd.vllm import runner

    class Runner(_Runner):
        pass

    def begin(self: Runner, scheduler_output: Any, num_scheduled_tokens: Any) -> None:
        start(self.rank, column(self.rank[1].dp_rank, self.values))

    def abandon() -> None:
        raise AssertionError("_prepare_inputs did not raise")

    original = _Runner._prepare_inputs
    Runner._prepare_inputs = runner.prepare_inputs_starting_early(  # type: ignore[method-assign]
        original, Runner, begin, abandon
    )
    return Runner


def test_a_leftover_round_is_a_skipped_sync_at_the_next_sync_of_any_kind(ranks: list) -> None:
    """Issue 36: a sync collected a leftover round if its site and values matched, so a
    `_dummy_run`'s sync (the runner's label) silently took the round another step started.
    A round started in a step is collected only by a sync that step makes; any other sync
    finds it left over: `SkippedSync` naming the round and that sync, and the peer is told."""
    runner_class = _patched_runner()
    runners = [runner_class(rank) for rank in ranks]
    other = in_thread(runners[0].execute_model)
    assert torch.equal(runners[1].execute_model(), expected())  # a step's own sync: collected
    assert torch.equal(other(30), expected())
    assert [seq(rank) for rank in ranks] == [1, 1]
    other = in_thread(runners[0].execute_model)
    assert runners[1].execute_model(leave=True) is None  # round 1 started, its sync never made
    assert torch.equal(other(30), expected())  # rank 1's early values completed it
    with pytest.raises(SkippedSync) as skipped:
        runners[1]._dummy_run()  # same label, same values: 9e28cfc collected round 1 here
    error = skipped.value
    assert (error.rank, error.group, error.seq) == (1, GROUP, 1)
    assert error.site == error.then
    since = time.monotonic()
    _peer_told(in_thread(lambda: sync(ranks[0], column(0, VALUES[0]))), 1, since)


def test_a_step_that_raises_between_start_and_sync_leaves_no_round_open(ranks: list) -> None:
    """The step raised after the early start (`abandon`): rank 1 leaves without Goodbye, rank
    0 is told RankLost [1] at once, and rank 1's next sync registers anew (no round of the
    old registration is waited for)."""
    for rank in range(DP):
        start(ranks[rank], column(rank, VALUES[rank]))
    first = in_thread(lambda: sync(ranks[0], column(0, VALUES[0])))
    assert torch.equal(first(30), expected())
    exchange, identity = ranks[1]
    exchange.abandon(identity)
    assert exchange.rounds() == {}
    since = time.monotonic()
    _peer_told(in_thread(lambda: sync(ranks[0], column(0, VALUES[0]))), 1, since)


def test_coordd_gone_with_a_round_in_flight_is_coordinator_unavailable(
    coordd: CoorddProcess, ranks: list
) -> None:
    """coordd is killed between the early start and the sync: the sync raises the client's
    CoordinatorUnavailable (bounded by the client's heartbeat timeout), never a tensor."""
    import signal

    from coordd.proto.errors import CoordinatorUnavailable

    for rank in range(DP):
        start(ranks[rank], column(rank, VALUES[rank]))
    first = [in_thread(lambda r=rank: sync(ranks[r], column(r, VALUES[r]))) for rank in range(DP)]
    for wait in first:
        assert torch.equal(wait(30), expected())
    start(ranks[0], column(0, VALUES[0]))  # rank 1 has not reported: the round stays open
    coordd.signal(signal.SIGKILL)
    mine = column(0, VALUES[0])
    with pytest.raises(CoordinatorUnavailable):
        in_thread(lambda: sync(ranks[0], mine))(60)
    assert torch.equal(mine, column(0, VALUES[0]))


def test_a_first_sync_waits_for_a_coordd_that_starts_after_it(tmp_path: Path) -> None:
    """A sidecar may come up after vLLM: the first sync waits (within the connect timeout) for
    coordd's socket to appear instead of failing at once."""
    address = f"ipc://{tmp_path}/late.sock"
    ranks = [
        (
            Exchange(PluginSettings(address, connect_timeout=30.0, fallback=False)),
            GroupIdentity(GROUP, r, DP, "fp"),
        )
        for r in range(DP)
    ]
    try:
        waits = [in_thread(lambda r=r: sync(ranks[r], column(r, VALUES[r]))) for r in range(DP)]
        time.sleep(1.0)  # the ranks are waiting for a socket that is not there yet
        with CoorddProcess(DP, address, ["--log-level", "error"]):
            outcomes = [_outcome(wait, 30) for wait in waits]
        # every rank's outcome in the message: a rank that raised leaves the others waiting
        assert all(
            isinstance(got, torch.Tensor) and torch.equal(got, expected()) for got in outcomes
        ), outcomes
    finally:
        for exchange, _ in ranks:
            exchange.close()
