"""SGLang 0.5.23's own DP attention syncs give the same tensors through coordd as through its
gloo groups, on every rank, with real rank processes in SGLang's real distributed setup (CPU,
gloo) and a real coordd process; and a rank out of step is a typed error naming it where gloo
waits or pairs the wrong syncs.

Runs in the SGLang venv (`.ci/sglang-env`); skipped where SGLang is not installed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip(
    "sglang", reason="SGLang is not installed here (run tests/sglang in .ci/sglang-env)"
)

from coordd.testing import CoorddProcess
from tests.sglang.ranks import (
    SYNCS,
    Fault,
    Outcome,
    Ranks,
    Spec,
    check_crashes,
    free_port,
    tiny_model,
)

#: coordd's step timeout where the test is about it (a stopped rank), in seconds; elsewhere
#: LONG_TIMEOUT, so that a loaded machine never makes a step late.
STEP_TIMEOUT = 2.0
LONG_TIMEOUT = 30.0
#: Seconds a stock run's ranks may stay blocked before the test calls it a hang.
HANG_BOUND = STEP_TIMEOUT + 2.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(tmp_path_factory.mktemp("tiny"))


def run(
    tmp_path: Path,
    model: str,
    world: int,
    dp: int,
    steps: int = 6,
    seed: int = 1,
    fault: Fault | None = None,
    stock_wait: float = 60.0,
    step_timeout: float = LONG_TIMEOUT,
) -> tuple[tuple[list[Outcome], list[int]], tuple[list[Outcome], list[int]]]:
    """`world` ranks of one SGLang deployment (TP=world, DP attention at `dp`) twice at once:
    stock (gloo), and with the plugin and a real coordd (`--step-timeout step_timeout`). Each
    run's outcomes and its ranks that sent none (blocked: within `stock_wait` for stock)."""
    os.environ["COORDD_SGLANG_SYNC_TIMEOUT"] = str(LONG_TIMEOUT * 2)
    coordd = CoorddProcess(
        world,
        f"ipc://{tmp_path}/coordd.sock",
        ["--step-timeout", str(step_timeout), "--heartbeat-timeout", str(LONG_TIMEOUT)],
    )
    address = coordd.start().address
    try:
        specs = [
            Spec(world, dp, free_port(), model, steps, seed, a, fault) for a in (None, address)
        ]
        stock, ours = (Ranks(lambda _, spec=spec: spec, world) for spec in specs)
        ours_result = ours.collect()
        return stock.collect(stock_wait), ours_result
    finally:
        coordd.stop()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,dp", [(2, 2), (4, 4), (4, 2)])
def test_every_sync_is_identical_through_coordd(
    tmp_path: Path, model: str, world: int, dp: int
) -> None:
    (stock, stock_blocked), (ours, blocked) = run(tmp_path, model, world, dp, seed=world + dp)
    assert not stock_blocked and not blocked
    check_crashes(stock + ours)
    for a, b in zip(stock, ours, strict=True):
        assert a.error is None and b.error is None, (a.error, b.error)
        assert len(a.results) == len(b.results) == 6 * len(SYNCS)
        diffs = [(x, y) for x, y in zip(a.results, b.results, strict=True) if x != y]
        assert not diffs, f"rank {a.rank}: {len(diffs)} syncs differ, first: {diffs[0]}"
        # every sync was a coordd round: two a step on the TP group, one on WORLD
        assert b.rounds == {"dp-tpall-pp0": 12, "dp-tpall-ppall": 6}, b.rounds
    # and every rank computed the same from each sync
    for k in range(len(stock[0].results)):
        assert len({repr(o.results[k]) for o in ours}) == 1, ours[0].results[k][:2]


def _named(outcomes: list[Outcome], kind: str, culprit: int, within: float) -> None:
    every = [(o.rank, o.error) for o in outcomes]
    for o in outcomes:
        assert o.error is not None, every
        name, ranks, _, elapsed = o.error
        assert name == kind and ranks == (culprit,), every
        assert elapsed < within, every


def faulted(
    tmp_path: Path,
    model: str,
    world: int,
    fault: Fault,
    stock_wait: float = 60.0,
    step_timeout: float = LONG_TIMEOUT,
) -> tuple[list[Outcome], list[int], list[Outcome]]:
    """The same faulty run stock (ranks that sent nothing within `stock_wait`: blocked) and
    with the plugin; prints both outcomes (the fault table of docs/sglang.md)."""
    (stock, stock_blocked), (ours, blocked) = run(
        tmp_path,
        model,
        world,
        world,
        fault=fault,
        stock_wait=stock_wait,
        step_timeout=step_timeout,
    )
    check_crashes(stock + ours)
    assert not blocked
    at = fault.step
    for o in stock:
        waited = o.step_times[at] if len(o.step_times) > at else float("nan")
        print(
            f"{fault.kind} dp={world} stock rank {o.rank}: {o.error} step {at} took {waited:.2f} s"
        )
    for r in stock_blocked:
        print(f"{fault.kind} dp={world} stock rank {r}: blocked past {stock_wait:.1f} s, no error")
    for o in ours:
        error = o.error and f"{o.error[0]} naming {list(o.error[1])} after {o.error[3]:.2f} s"
        print(f"{fault.kind} dp={world} coordd rank {o.rank}: {error}")
    return stock, stock_blocked, ours


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_a_skipped_sync_is_named_at_once_where_gloo_hangs(
    tmp_path: Path, model: str, world: int
) -> None:
    fault = Fault("skip", step=2)
    stock, blocked, ours = faulted(tmp_path, model, world, fault, stock_wait=HANG_BOUND)
    # gloo: no error; the culprit's next collective meets its peers' skipped one, and the
    # peers at least wait for good (here every rank: the culprit's next is another kind)
    assert set(range(world - 1)) <= set(blocked), blocked
    assert all(o.error is None for o in stock), [o.error for o in stock]
    _named(ours, "StepMismatch", world - 1, within=LONG_TIMEOUT)
    assert all(len(o.results) == 2 * len(SYNCS) for o in ours)  # nothing after the skip


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_a_sync_from_another_site_is_named_where_gloo_pairs_it(
    tmp_path: Path, model: str, world: int
) -> None:
    stock, blocked, ours = faulted(tmp_path, model, world, Fault("another", step=1))
    assert not blocked and all(o.error is None for o in stock)  # gloo: no error at all
    _named(ours, "StepMismatch", world - 1, within=LONG_TIMEOUT)
    text = ours[0].error[2] if ours[0].error else ""
    assert "tp_sync_elsewhere" in text and "tp_sync:" in text, text


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_a_stopped_rank_is_named_after_the_step_timeout_where_gloo_waits(
    tmp_path: Path, model: str, world: int
) -> None:
    pause = STEP_TIMEOUT + 1.5
    stock, blocked, ours = faulted(
        tmp_path, model, world, Fault("stop", step=1, pause=pause), step_timeout=STEP_TIMEOUT
    )
    # gloo: the peers wait the whole pause with no error
    assert not blocked and all(o.error is None for o in stock)
    assert all(o.step_times[1] >= pause for o in stock[:-1]), [o.step_times for o in stock]
    peers, culprit = ours[:-1], ours[-1]
    _named(peers, "StepTimeout", world - 1, within=LONG_TIMEOUT)
    assert culprit.error is not None and culprit.error[1] == (world - 1,), culprit.error


@pytest.mark.timeout(240)
def test_a_rank_that_cannot_send_its_row_leaves_and_its_peers_are_told_at_once(
    tmp_path: Path, model: str
) -> None:
    world = 4
    stock, blocked, ours = faulted(tmp_path, model, world, Fault("tworows", step=1))
    assert not blocked and all(o.error is None for o in stock)  # gloo: summed, no error
    *peers, culprit = ours
    assert culprit.error is not None and culprit.error[:2] == ("InvalidReport", (world - 1,))
    # it left without Goodbye: the peers, waiting in that round, are told at once
    _named(peers, "RankLost", world - 1, within=LONG_TIMEOUT)


def test_sglang_is_the_pinned_version() -> None:
    import sglang

    assert sglang.__version__ == os.environ.get("COORDD_SGLANG_VERSION", "0.5.23")
