"""The answer a rank behind takes over the process group is the answer coordd gave, exactly."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from coordd.client.fallback import answer_from, answer_ints, answer_len
from coordd.proto.messages import GatherResult, StepDecision, StepKind
from coordd.proto.policy import decide
from coordd.tools.chaos.seeded_reports import report_for


@pytest.mark.parametrize("dp", [1, 2, 5])
@pytest.mark.parametrize("kind", [StepKind.FORWARD, StepKind.DRAFT, StepKind.STATE])
def test_a_decision_survives_the_fixed_layout(dp: int, kind: StepKind) -> None:
    for seed in range(40):
        reports = [None if seed % 7 == rank else report_for(seed, rank, 3) for rank in range(dp)]
        if all(r is None for r in reports):
            continue
        decision = decide(reports, epoch=1733000000000 + seed, seq=seed * 11, kind=kind)
        ints = answer_ints(decision, dp)
        assert len(ints) == answer_len(dp, None)
        assert answer_from(ints, dp, kind, "step") == decision


def test_gathered_rows_survive_it_a_left_out_rank_too() -> None:
    result = GatherResult(epoch=7, seq=3, site="s", rows=[[1, -2**63, 2**63 - 1], [], [4, 5, 6]],
                          dead_ranks=[1])
    ints = answer_ints(result, 3)
    assert len(ints) == answer_len(3, 3)
    assert answer_from(ints, 3, StepKind.GATHER, "s") == result
    empty = GatherResult(epoch=7, seq=3, site="s", rows=[[], []], dead_ranks=[])
    assert answer_ints(empty, 2)[2:] == [1, 1]


def test_the_layouts_length_is_what_the_rank_behind_expects() -> None:
    decision = StepDecision(epoch=1, seq=0, kind=StepKind.FORWARD, num_tokens_across_dp=[1, 2],
                            should_ubatch=False, should_pad=False, cudagraph_mode=0,
                            any_unfinished=True, all_idle=False)
    assert len(answer_ints(decision, 2)) == answer_len(2, None) != answer_len(2, 0)
