"""CI's short chaos run: every fault kind, a few seeds each, real coordd and rank processes.

Short timeouts (step 2 s, heartbeat 0.2/1.0 s) and dp 2..4 keep the whole file near a minute on
two cores; `coordd chaos --seeds 20` is the full suite (see docs/contributing.md). A failing
scenario keeps its directory (coordd's log, every process's history) and the assertion message
says where.
"""

from __future__ import annotations

import os

import pytest

from coordd.tools.chaos import netns
from coordd.tools.chaos.spec import Fault, Settings
from coordd.tools.chaos.suite import run_suite
from coordd.tools.chaos.summary import failures, summarize, table

SEEDS = range(int(os.environ.get("COORDD_CHAOS_SEEDS", "3")))
SETTINGS = Settings(
    step_timeout=2.0, heartbeat_interval=0.2, heartbeat_timeout=1.0, min_dp=2, max_dp=4, rounds=30
)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fault", list(Fault), ids=[f.value for f in Fault])
def test_fault_is_detected_with_no_wrong_decision_and_no_hang(fault: Fault) -> None:
    results = run_suite([fault], SEEDS, SETTINGS, parallel=len(SEEDS))
    print("\n" + table(summarize(results)))
    if fault is Fault.NETWORK_CUT and netns.unavailable() is None:
        mine = f"{netns.PREFIX}{os.getpid()}-"
        assert not [n for n in netns.namespaces() if n.startswith(mine)], "namespace left behind"
    skipped = [r.skipped for r in results if r.skipped]
    if skipped:
        assert len(skipped) == len(results), "a kind is skipped for every seed or none"
        pytest.skip(skipped[0])
    assert all(r.ok for r in results), failures(results)
    assert all(r.injected for r in results)
    assert sum(r.wrong_decisions for r in results) == 0
    assert sum(r.hangs for r in results) == 0
    if SCENARIO_DETECTS[fault]:
        assert all(r.detected for r in results)
        # A smaller dp_size waits one step timeout for the group to re-form before its refusal.
        slack = SETTINGS.step_timeout if fault is Fault.DP_SIZE_MISMATCH else 0.0
        assert all(
            r.ttd is not None and r.ttd <= SETTINGS.detection_bound + slack
            for r in results
            if fault not in NO_DETECTION_TIME
        )
    else:
        assert all(r.detected is None and r.failed_rounds == 0 for r in results)


#: Which kinds have something to detect (a straggler under the timeout, and coordd's loss
#: under ranks on a FallbackClient, must just be absorbed).
ABSORBED = {
    Fault.STRAGGLER,
    Fault.COORDD_LOST_FALLBACK,
    Fault.COORDD_BACK_FALLBACK,
    Fault.COORDD_FLAPPING,
    Fault.COORDD_PARTIAL_ANSWER,
}
SCENARIO_DETECTS = {f: f not in ABSORBED for f in Fault}
#: Hostile peers outside the group: refused at the door, the group never fails, no time to it.
NO_DETECTION_TIME = {
    Fault.GARBAGE_FRAMES,
    Fault.STRANGER_NOISE,
    Fault.TAKEOVER_ATTEMPT,
    Fault.ID_CLAIMS,
    Fault.JUNK_GROUPS,
}
