"""coordd demo's pieces that need no processes: CUDA-graph padding, the workload, verification."""

from __future__ import annotations

import random

import msgspec
import pytest

from coordd.client.dp_coordination import (
    CUDAGRAPH_FULL,
    CUDAGRAPH_NONE,
    CUDAGRAPH_PIECEWISE,
    build_report,
)
from coordd.proto.messages import StepKind
from coordd.proto.policy import decide
from coordd.tools import demo
from coordd.tools.demo import verify
from coordd.tools.demo_rank import (
    MAX_NUM_BATCHED_TOKENS,
    Finished,
    Progress,
    RoundRecord,
    Workload,
    demo_config,
    pad_to_graph,
)


@pytest.mark.parametrize(("tokens", "uniform", "expected"), [
    (0, False, (0, CUDAGRAPH_FULL)),
    (1, True, (1, CUDAGRAPH_FULL)),
    (3, True, (4, CUDAGRAPH_FULL)),
    (9, False, (16, CUDAGRAPH_PIECEWISE)),
    (248, True, (248, CUDAGRAPH_FULL)),
    (250, True, (256, CUDAGRAPH_FULL)),
    (257, False, (272, CUDAGRAPH_PIECEWISE)),
    (512, False, (512, CUDAGRAPH_PIECEWISE)),
    (513, True, (513, CUDAGRAPH_NONE)),
])
def test_padding_to_vllms_default_capture_sizes(tokens: int, uniform: bool,
                                                expected: tuple[int, int]) -> None:
    assert pad_to_graph(tokens, uniform) == expected


def test_workload_batches_are_within_the_scheduler_limits() -> None:
    w = Workload(random.Random(1), 0, 4)
    batches = [w.next_batch() for _ in range(2000)]
    assert all(0 <= b.num_tokens <= MAX_NUM_BATCHED_TOKENS for b in batches)
    assert all(b.num_tokens_padded >= b.num_tokens for b in batches)
    assert any(b.uniform_decode for b in batches) and any(not b.uniform_decode for b in batches)
    assert any(b.cudagraph_mode == CUDAGRAPH_NONE for b in batches)


def _finished(dp: int, steps: int) -> list[Finished]:
    """What `dp` honest ranks would log for `steps` rounds."""
    cfg = demo_config(dp)
    loads = [Workload(random.Random(r), r, dp) for r in range(dp)]
    logs: list[list[RoundRecord]] = [[] for _ in range(dp)]
    for seq in range(steps):
        reports = []
        for w in loads:
            b = w.next_batch()
            reports.append(build_report(cfg, b.num_tokens, True, b.num_tokens_padded,
                                        b.uniform_decode, b.cudagraph_mode))
        decision = decide(reports, cfg.num_ubatches, epoch=5, seq=seq, kind=StepKind.FORWARD)
        for r in range(dp):
            logs[r].append(RoundRecord(reports[r], decision))
    return [Finished(r, steps, logs[r]) for r in range(dp)]


def test_verify_accepts_agreeing_ranks() -> None:
    assert verify(_finished(3, 50), 2) == (50, [])


def test_verify_catches_a_rank_with_another_decision() -> None:
    logs = _finished(3, 20)
    rec = logs[1].records[7]
    changed = msgspec.structs.replace(rec.decision, should_pause=not rec.decision.should_pause)
    logs[1].records[7] = RoundRecord(rec.report, changed)
    _, problems = verify(logs, 2)
    assert problems == ["seq 7: ranks got different decisions"]


def test_verify_catches_a_decision_that_is_not_the_policy() -> None:
    logs = _finished(2, 20)
    rec = logs[0].records[3]
    logs[0].records[3] = RoundRecord(
        msgspec.structs.replace(rec.report, num_tokens_padded=rec.report.num_tokens_padded + 999),
        rec.decision,
    )
    assert verify(logs, 2)[1] == ["seq 3: decision differs from the policy"]


def test_verify_reports_rank_errors_and_missing_rounds() -> None:
    logs = _finished(2, 10)
    logs[1] = Finished(1, 4, logs[1].records[:4], "RankLost: rank(s) [0] lost")
    _, problems = verify(logs, 2)
    assert problems == ["rank 1: RankLost: rank(s) [0] lost",
                        "ranks logged different numbers of rounds: [4, 10]"]


def test_demo_without_rich_prints_plain_lines_and_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """rich is the `demo` extra, not a dependency: the demo runs without it, and says so."""
    import sys

    from coordd.tools.demo import PlainView, make_view

    for name in ("rich", "rich.console", "rich.live", "rich.table"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    view = make_view("title", plain=False)
    assert isinstance(view, PlainView)
    assert "coordd[demo]" in capsys.readouterr().err


def test_the_recent_column_is_the_last_seconds_not_the_whole_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: a 4000-sample window held all of a 5 s demo, so "recent" equalled "whole run"."""
    clock = [100.0]
    monkeypatch.setattr(demo.time, "monotonic", lambda: clock[0])
    stats = demo.Stats(dp=1)

    def progress(latency: float) -> Progress:
        return Progress(0, 1, [latency / 10], [latency], 8, 8, 0, 0)

    stats.add(progress(0.001))
    clock[0] += demo.RECENT_S + 1
    stats.add(progress(0.002))
    assert stats.recent_latency == [0.002] and stats.latency == [0.001, 0.002]
    assert stats.recent_exposed == [0.0002]
    assert "the exchange overlaps the step" in demo.takeaway(stats)
    assert "(10%)" in demo.takeaway(stats)
