"""`coordd.tools.serve_counts` counts one round's work: at dp=2, every report is one call of
`Coordinator.receive` and every round one `decide`, whatever start-up and shut-down cost."""

from __future__ import annotations

import pytest

from coordd.tools.serve_counts import count_opcodes


@pytest.mark.timeout(240)
def test_the_difference_of_two_runs_is_one_rounds_work() -> None:
    per = count_opcodes(2, rounds=40, base=10)
    receive = per["coordd/proto/coordinator.py:Coordinator.receive"]
    decide = per["coordd/proto/policy.py:decide"]
    assert receive[1] == pytest.approx(2.0)  # calls per round: one per rank's report
    assert decide[1] == pytest.approx(1.0)
    assert receive[0] > 0 and decide[0] > 0
    # start-up cancels out: registration happens once per run, not per round
    assert per.get("coordd/proto/coordinator.py:Coordinator._claim", (0.0, 0.0))[1] == 0.0
