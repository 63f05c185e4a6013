"""The vLLM adapter against vLLM's rules, written out here on their own.

`vllm_reference` below transcribes what vllm/v1/worker/dp_utils.py does with its all-reduced
4 x dp int32 matrix (rows: unpadded tokens, padded tokens, micro-batch vote, CUDA-graph mode;
dead ranks' columns filled with neutral values as `neutralize_dead_dp_columns` does), and
`vote` what vllm/v1/worker/ubatch_utils.py's `check_ubatch_thresholds` does. Every table row
states its expected outcome by hand; the row must match the transcription *and* what the adapter
produces (its report per rank -> coordd.proto.policy.decide -> vLLM's result shape).
"""

from __future__ import annotations

import enum
import itertools
import sys
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import msgspec
import pytest
import torch

from coordd.client.dp_coordination import (
    BETWEEN_STATE_SYNCS,
    VLLM_DP_UTILS,
    AdapterNotBound,
    DPGroupConfig,
    VllmAdapter,
    bind,
    build_report,
    coordinate_batch_across_dp,
    dp_state,
    finish_dp_coordination,
    local_result,
    should_skip_dp_coordination,
    skip_dp_coordination,
    start_dp_coordination_async,
    state_report,
    vllm_result,
    wants_microbatching,
)
from coordd.proto.errors import InvalidAnswer, InvalidReport
from coordd.proto.messages import StepDecision, StepKind, StepReport
from coordd.proto.policy import decide

INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Call:
    """One rank's arguments to coordinate_batch_across_dp."""

    tokens: int
    allow: bool = False
    padded: int | None = None
    uniform: bool | None = None
    mode: int = 0


def vote(cfg: DPGroupConfig, call: Call) -> bool:
    """ubatch_utils.check_ubatch_thresholds, reached only when microbatching is allowed."""
    if not call.allow:
        return False
    use_ubatching = cfg.enable_dbo or cfg.ubatch_size > 1
    if not use_ubatching:
        return False
    threshold = cfg.dbo_decode_token_threshold if call.uniform else cfg.dbo_prefill_token_threshold
    return call.tokens >= threshold


def vllm_reference(
    cfg: DPGroupConfig, calls: list[Call | None]
) -> tuple[bool, list[int] | None, int]:
    """dp_utils.coordinate_batch_across_dp over the gathered matrix; None = a dead rank."""
    if len(calls) == 1:
        assert calls[0] is not None
        return False, None, calls[0].mode
    n = 2 if cfg.enable_dbo else cfg.ubatch_size
    orig, padded, ubatch, mode = [], [], [], []
    for call in calls:
        if call is None:  # neutralize_dead_dp_columns: rows 0, 2, 3 neutral; row 1 stays 0
            orig.append(INT32_MAX)
            padded.append(0)
            ubatch.append(1)
            mode.append(INT32_MAX)
            continue
        orig.append(call.tokens)
        padded.append(call.tokens if call.padded is None else call.padded)
        ubatch.append(1 if vote(cfg, call) else 0)
        mode.append(call.mode)
    synced_mode = min(mode)
    should_ubatch = all(v == 1 for v in ubatch)
    if should_ubatch and (max(padded) // n) * (n - 1) >= min(orig):
        should_ubatch = False
    should_pad = synced_mode != 0 or should_ubatch
    across = [max(padded)] * len(calls) if should_pad else padded
    return should_ubatch, across, synced_mode


DBO = DPGroupConfig(data_parallel_size=2, enable_dbo=True)
DBO3 = DPGroupConfig(data_parallel_size=3, enable_dbo=True)
OFF = DPGroupConfig(data_parallel_size=2)
U3 = DPGroupConfig(data_parallel_size=2, ubatch_size=3)

# (name, config, one Call per rank (None = dead), expected (should_ubatch, across, mode))
CASES: list[tuple[str, DPGroupConfig, list[Call | None], tuple[bool, list[int] | None, int]]] = [
    ("padding off: every rank NONE, no micro-batching: own padded counts",
     OFF, [Call(10, padded=16), Call(20, padded=24)], (False, [16, 24], 0)),
    ("padding off: padded defaults to the unpadded count",
     OFF, [Call(10), Call(7)], (False, [10, 7], 0)),
    ("padding on: a CUDA-graph mode pads everyone to the max",
     OFF, [Call(10, padded=16, mode=2), Call(20, padded=24, mode=2)], (False, [24, 24], 2)),
    ("mixed modes FULL + PIECEWISE: the minimum, and padding",
     OFF, [Call(10, padded=16, mode=2), Call(20, padded=24, mode=1)], (False, [24, 24], 1)),
    ("mixed modes FULL + NONE: NONE wins, padding off",
     OFF, [Call(10, padded=16, mode=2), Call(20, padded=24, mode=0)], (False, [16, 24], 0)),
    ("micro-batching: all vote yes (decode >= 32), last micro-batch not empty",
     DBO, [Call(64, True, 64, True, 2), Call(40, True, 48, True, 2)], (True, [64, 64], 2)),
    ("micro-batching forces padding even in NONE mode",
     DBO, [Call(64, True, 64, True, 0), Call(40, True, 48, True, 0)], (True, [64, 64], 0)),
    ("micro-batching vetoed by one rank (decode 20 < 32)",
     DBO, [Call(64, True, 64, True, 2), Call(20, True, 24, True, 2)], (False, [64, 64], 2)),
    ("micro-batching vetoed by one rank that does not allow it",
     DBO, [Call(64, True, 64, True, 0), Call(64, False, 64, True, 0)], (False, [64, 64], 0)),
    ("micro-batching vetoed by the emptiness rule (128 // 2 >= 33)",
     DBO, [Call(64, True, 128, True, 0), Call(33, True, 40, True, 0)], (False, [128, 40], 0)),
    ("emptiness rule at its edge: 65 // 2 * 1 = 32 < 33 keeps micro-batching",
     DBO, [Call(33, True, 65, True, 0), Call(33, True, 33, True, 0)], (True, [65, 65], 0)),
    ("the vote uses the unpadded count: 31 tokens padded to 64 votes no",
     DBO, [Call(31, True, 64, True, 2), Call(64, True, 64, True, 2)], (False, [64, 64], 2)),
    ("prefill threshold: mixed batches need >= 512",
     DBO, [Call(600, True, 600, False), Call(512, True, 512, False)], (True, [600, 600], 0)),
    ("prefill threshold: 511 in a mixed batch votes no",
     DBO, [Call(600, True, 600, False), Call(511, True, 511, False)], (False, [600, 511], 0)),
    ("micro-batching disabled for the group: no vote above any threshold",
     OFF, [Call(4096, True, 4096, False), Call(4096, True, 4096, False)],
     (False, [4096, 4096], 0)),
    ("ubatch_size=3: three micro-batches while (P // 3) * 2 < U (400 < 512)",
     U3, [Call(600, True, 600, False), Call(512, True, 512, False)], (True, [600, 600], 0)),
    ("ubatch_size=3: the emptiness rule with n=3 (900 // 3 * 2 = 600 >= 550)",
     U3, [Call(900, True, 900, False), Call(550, True, 550, False)], (False, [900, 550], 0)),
    ("dead rank, padding off: its entry is 0",
     DBO3, [Call(10, padded=16), None, Call(20, padded=24)], (False, [16, 0, 24], 0)),
    ("dead rank, padding on: its entry is the max; it never lowers the mode",
     DBO3, [Call(10, padded=16, mode=2), None, Call(20, padded=24, mode=2)],
     (False, [24, 24, 24], 2)),
    ("dead rank never vetoes micro-batching nor lowers the minimum token count",
     DBO3, [Call(64, True, 64, True, 2), None, Call(40, True, 48, True, 2)],
     (True, [64, 64, 64], 2)),
    ("dp=1 returns at once: (False, None, mode)",
     DPGroupConfig(data_parallel_size=1, enable_dbo=True), [Call(64, True, 64, True, 1)],
     (False, None, 1)),
]


def adapter_outcome(
    cfg: DPGroupConfig, calls: list[Call | None], torch_module: object = None
) -> tuple[bool, object, int]:
    """What the adapter yields: each live rank's report, the policy, vLLM's result shape."""
    if cfg.data_parallel_size == 1:
        call = calls[0]
        assert call is not None
        adapter = VllmAdapter(cfg, None, as_tensor=torch_module is not None)
        return adapter.coordinate_batch_across_dp(
            call.tokens, call.allow, None, call.padded, call.uniform, call.mode
        )
    reports: list[StepReport | None] = [
        None if c is None else build_report(cfg, c.tokens, c.allow, c.padded, c.uniform, c.mode,
                                            dp_rank=r)
        for r, c in enumerate(calls)
    ]
    decision = decide(reports, cfg.num_ubatches)
    assert decision.dead_ranks == [r for r, c in enumerate(calls) if c is None]
    return vllm_result(decision, torch_module)


@pytest.mark.parametrize(("name", "cfg", "calls", "expected"), CASES, ids=[c[0] for c in CASES])
def test_rule_table(name: str, cfg: DPGroupConfig, calls: list[Call | None],
                    expected: tuple[bool, list[int] | None, int]) -> None:
    assert vllm_reference(cfg, calls) == expected, "the hand-written row contradicts vLLM's rules"
    assert adapter_outcome(cfg, calls) == expected


@pytest.mark.parametrize(("name", "cfg", "calls", "expected"), CASES, ids=[c[0] for c in CASES])
def test_rule_table_as_tensors(name: str, cfg: DPGroupConfig, calls: list[Call | None],
                               expected: tuple[bool, list[int] | None, int]) -> None:
    should_ubatch, across, mode = adapter_outcome(cfg, calls, torch)
    assert (should_ubatch, mode) == (expected[0], expected[2])
    if expected[1] is None:
        assert across is None
        return
    assert isinstance(across, torch.Tensor)
    assert across.dtype == torch.int32 and across.device.type == "cpu"
    assert across.tolist() == expected[1]


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("tokens", [0, 31, 32, 33, 511, 512, 513, 8192])
@pytest.mark.parametrize("cfg", [
    DBO, OFF, U3, DPGroupConfig(data_parallel_size=2, ubatch_size=1),
    DPGroupConfig(data_parallel_size=2, enable_dbo=True, dbo_decode_token_threshold=0,
                  dbo_prefill_token_threshold=100),
])
def test_vote_matches_check_ubatch_thresholds(cfg: DPGroupConfig, tokens: int,
                                              uniform: bool) -> None:
    call = Call(tokens, True, tokens + 8, uniform)
    assert wants_microbatching(cfg, tokens, uniform) == vote(cfg, call)
    assert build_report(cfg, tokens, True, tokens + 8, uniform).want_ubatch == vote(cfg, call)
    assert build_report(cfg, tokens, False, tokens + 8, uniform).want_ubatch is False


def test_group_config_mirrors_vllm_properties() -> None:
    assert (DBO.use_ubatching, DBO.num_ubatches) == (True, 2)
    assert (U3.use_ubatching, U3.num_ubatches) == (True, 3)
    assert (OFF.use_ubatching, OFF.num_ubatches) == (False, 1)  # vLLM: 0; the wire needs >= 1
    pc = SimpleNamespace(data_parallel_size=8, enable_dbo=True, ubatch_size=0,
                         dbo_decode_token_threshold=16, dbo_prefill_token_threshold=256)
    cfg = DPGroupConfig.from_parallel_config(pc, extra_fingerprint="deepseek-r1")
    assert cfg == DPGroupConfig(8, True, 0, 16, 256, "deepseek-r1")
    pc.dp_sync_interval = 8
    assert DPGroupConfig.from_parallel_config(pc).dp_sync_interval == 8
    assert cfg.client_options() == {"dp_size": 8, "config_fingerprint": cfg.fingerprint(),
                                    "num_ubatches": 2}


def test_fingerprint_binds_every_group_setting() -> None:
    base = DPGroupConfig(data_parallel_size=4, enable_dbo=True)
    variants = [
        DPGroupConfig(data_parallel_size=8, enable_dbo=True),
        DPGroupConfig(data_parallel_size=4, enable_dbo=False),
        DPGroupConfig(data_parallel_size=4, enable_dbo=True, ubatch_size=3),
        DPGroupConfig(data_parallel_size=4, enable_dbo=True, dbo_decode_token_threshold=33),
        DPGroupConfig(data_parallel_size=4, enable_dbo=True, dbo_prefill_token_threshold=511),
        DPGroupConfig(data_parallel_size=4, enable_dbo=True, extra_fingerprint="model-b"),
        DPGroupConfig(data_parallel_size=4, enable_dbo=True, dp_sync_interval=32),
    ]
    prints = {v.fingerprint() for v in variants}
    assert base.fingerprint() == DPGroupConfig(data_parallel_size=4, enable_dbo=True).fingerprint()
    assert len(prints) == len(variants) and base.fingerprint() not in prints
    assert all(len(p) <= 256 for p in prints)


@pytest.mark.parametrize(("field", "value"), [
    ("data_parallel_size", 0), ("ubatch_size", -1), ("dbo_decode_token_threshold", -1),
    ("dbo_prefill_token_threshold", 1.5), ("dp_sync_interval", 0),
])
def test_bad_group_config_names_the_field(field: str, value: object) -> None:
    kw: dict[str, object] = {"data_parallel_size": 2, field: value}
    with pytest.raises(ValueError, match=field):
        DPGroupConfig(**kw)  # type: ignore[arg-type]


class RuntimeMode(enum.Enum):
    """Shaped like vLLM's CUDAGraphMode for the runtime modes it passes here."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (2, 0)


def test_report_fields_and_bad_arguments_name_the_rank() -> None:
    r = build_report(DBO, 40, True, 48, True, RuntimeMode.FULL, dp_rank=3, want_pause=True)
    assert r == StepReport(num_tokens=40, num_tokens_padded=48, want_ubatch=True,
                           cudagraph_mode=2, has_unfinished=True, want_pause=True)
    assert build_report(DBO, 0, False).has_unfinished is False  # an idle (dummy) step
    assert build_report(DBO, 0, False, has_unfinished=True).has_unfinished is True
    with pytest.raises(InvalidReport) as info:
        build_report(DBO, 40, True, 48, None, dp_rank=3)
    assert (info.value.rank, info.value.field) == (3, "uniform_decode")
    with pytest.raises(InvalidReport) as info:
        build_report(DBO, 4.5, False, dp_rank=1)  # type: ignore[arg-type]
    assert (info.value.rank, info.value.field, info.value.value) == (1, "num_tokens_unpadded", 4.5)
    with pytest.raises(InvalidReport) as info:
        build_report(DBO, 4, False, 8, None, RuntimeMode.FULL_DECODE_ONLY, dp_rank=2)
    assert (info.value.rank, info.value.field) == (2, "cudagraph_mode")


def test_dp1_needs_no_client_and_both_entry_points_agree() -> None:
    cfg = DPGroupConfig(data_parallel_size=1, enable_dbo=True)
    adapter = VllmAdapter(cfg, as_tensor=False)
    handle = start_dp_coordination_async(64, True, None, 64, True, 2, adapter=adapter)
    assert handle.done()
    assert finish_dp_coordination(handle) == (False, None, 2)
    assert adapter.coordinate_draft_batch_across_dp(5, 8, 2) == (2, 8, None)
    assert adapter.has_unfinished_dp(True) is True
    assert adapter.sync_dp_state(False, True) == (False, True)


@pytest.mark.parametrize("mode", [RuntimeMode.PIECEWISE, RuntimeMode.FULL, 2, 0])
def test_dp1_returns_the_mode_exactly_as_passed(mode: object) -> None:
    """vLLM's early exit returns `cudagraph_mode` itself: an enum stays that enum."""
    adapter = VllmAdapter(DPGroupConfig(data_parallel_size=1), as_tensor=False)
    pc = SimpleNamespace(data_parallel_size=1, data_parallel_rank=0)
    for result in (
        adapter.coordinate_batch_across_dp(64, False, pc, 64, None, mode),
        coordinate_batch_across_dp(64, False, pc, cudagraph_mode=mode, adapter=adapter),
        coordinate_batch_across_dp(64, False, pc, cudagraph_mode=mode),  # unbound: dp=1 exits
        finish_dp_coordination(start_dp_coordination_async(64, False, None, 64, None, mode,
                                                           adapter=adapter)),
    ):
        assert result == (False, None, mode) and result[2] is mode
    draft = adapter.coordinate_draft_batch_across_dp(5, 8, mode)
    assert draft.cudagraph_mode is mode and draft == (mode, 8, None)


class NoRound:
    """A client that fails the test if a round starts."""

    def start(self, report: StepReport, kind: object = None) -> object:
        raise AssertionError(f"a round started under skip: {report}")


def skip_reference(cfg: DPGroupConfig, call: Call) -> tuple[bool, list[int], int]:
    """dp_utils.coordinate_batch_across_dp under should_skip_dp_coordination()."""
    padded = call.tokens if call.padded is None else call.padded
    n = 2 if cfg.enable_dbo else cfg.ubatch_size
    ubatch = vote(cfg, call) and not (padded // n) * (n - 1) >= call.tokens
    return ubatch, [padded] * cfg.data_parallel_size, call.mode


SKIP_CALLS = [Call(10, padded=16, mode=2), Call(64, True, 64, True, 2), Call(40, True, 96, True),
              Call(600, True, 600, False, 1), Call(7)]


@pytest.mark.parametrize("cfg", [DBO, DBO3, OFF, U3], ids=["dbo", "dbo3", "off", "ubatch3"])
def test_coordds_skip_dp_coordination_answers_locally_with_no_round(cfg: DPGroupConfig) -> None:
    adapter = VllmAdapter(cfg, NoRound(), dp_rank=1, as_tensor=True)  # type: ignore[arg-type]
    assert not should_skip_dp_coordination()
    with skip_dp_coordination():
        assert should_skip_dp_coordination()
        for call in SKIP_CALLS:
            ubatch, across, mode = adapter.coordinate_batch_across_dp(
                call.tokens, call.allow, None, call.padded, call.uniform, call.mode)
            assert isinstance(across, torch.Tensor) and across.dtype == torch.int32
            assert (ubatch, across.tolist(), mode) == skip_reference(cfg, call)
            handle = adapter.start_dp_coordination_async(call.tokens, False, None, call.padded)
            assert handle.done() and handle.decision is None
        draft = adapter.coordinate_draft_batch_across_dp(3, 8, RuntimeMode.FULL)
        assert draft.cudagraph_mode is RuntimeMode.FULL and draft.num_tokens_padded == 8
        assert adapter.has_unfinished_dp(True) is True
    assert not should_skip_dp_coordination()


def test_vllms_own_skip_dp_coordination_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside vLLM, its own context variable (vllm.v1.worker.dp_utils) says skip."""
    flag = {"skip": False}
    fake = ModuleType(VLLM_DP_UTILS)
    fake.should_skip_dp_coordination = lambda: flag["skip"]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, VLLM_DP_UTILS, fake)
    adapter = VllmAdapter(DBO, NoRound(), dp_rank=0, as_tensor=False)  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="a round started"):
        adapter.coordinate_batch_across_dp(10, False, None, 16)
    flag["skip"] = True
    assert adapter.coordinate_batch_across_dp(10, False, None, 16, None, 2) == (False, [16, 16], 2)
    monkeypatch.delitem(sys.modules, VLLM_DP_UTILS)
    assert not should_skip_dp_coordination()  # vLLM not imported: never asked, never imported
    assert VLLM_DP_UTILS not in sys.modules


class Answer:
    """A client whose every round is answered with one decision: the group's, made by the test."""

    def __init__(self, decision: StepDecision) -> None:
        self.decision = decision
        self.kinds: list[str] = []

    def start(self, report: StepReport, kind: object = "forward") -> Answer:
        self.kinds.append(str(getattr(kind, "value", kind)))
        return self

    def wait(self, timeout: float | None = None) -> StepDecision:
        return self.decision


DRAFT_CASES = [
    # (config, per-rank (unpadded, padded, mode), expected per-rank padded, synced mode)
    ("padding off, different counts: each rank keeps its own", OFF,
     [(3, 5, 0), (9, 12, 0)], [5, 12], 0),
    ("padding off at dp=3, rank 0 the largest", DBO3,
     [(20, 24, 0), (3, 4, 2), (9, 12, 1)], [24, 4, 12], 0),
    ("padding on: everyone gets the max", DBO3,
     [(20, 24, 2), (3, 4, 2), (9, 12, 1)], [24, 24, 24], 1),
]


@pytest.mark.parametrize(("name", "cfg", "ranks", "padded", "synced"), DRAFT_CASES,
                         ids=[c[0] for c in DRAFT_CASES])
@pytest.mark.parametrize("as_enum", [False, True], ids=["int", "enum"])
def test_the_drafter_helper_returns_this_ranks_count_and_the_synced_mode(
        name: str, cfg: DPGroupConfig, ranks: list[tuple[int, int, int]], padded: list[int],
        synced: int, as_enum: bool) -> None:
    """As SpecDecodeBaseProposer._determine_batch_execution_and_padding: re-dispatch with the
    synced mode at this rank's own entry. With padding off the entries differ, so a helper that
    gave every rank rank 0's count would fail here."""
    reports = [build_report(cfg, u, False, p, None, m, dp_rank=r)
               for r, (u, p, m) in enumerate(ranks)]
    decision = decide(reports, cfg.num_ubatches, kind=StepKind.DRAFT)
    for rank, (unpadded, own_padded, mode) in enumerate(ranks):
        client = Answer(decision)
        adapter = VllmAdapter(cfg, client, dp_rank=rank, as_tensor=True)
        given = RuntimeMode(mode) if as_enum else mode
        got = adapter.coordinate_draft_batch_across_dp(unpadded, own_padded, given)
        assert client.kinds == ["draft"]
        assert got.num_tokens_padded == padded[rank], f"rank {rank}"
        assert got.num_tokens_across_dp.tolist() == padded
        assert got.num_tokens_across_dp[rank].item() == got.num_tokens_padded
        if as_enum:
            assert got.cudagraph_mode is RuntimeMode(synced)
        else:
            assert type(got.cudagraph_mode) is int and got.cudagraph_mode == synced


def test_vllm_call_shapes_and_a_wrong_config_are_typed_errors() -> None:
    cfg = DPGroupConfig(data_parallel_size=2)
    sent = StepReport(num_tokens=4, num_tokens_padded=8, has_unfinished=True)  # as reported
    decision = decide([sent, sent])
    adapter = VllmAdapter(cfg, Answer(decision), dp_rank=1, as_tensor=False)
    pc = SimpleNamespace(data_parallel_size=2, data_parallel_rank=1)
    # vLLM's runner call, all keywords
    assert coordinate_batch_across_dp(
        num_tokens_unpadded=4, parallel_config=pc, allow_microbatching=False,
        num_tokens_padded=8, uniform_decode=False, cudagraph_mode=0, adapter=adapter,
    ) == (False, [8, 8], 0)
    # positional, vLLM's order
    assert adapter.coordinate_batch_across_dp(4, False, pc, 8, False, 0) == (False, [8, 8], 0)
    with pytest.raises(TypeError, match="parallel_config"):  # the old order: padded third
        adapter.coordinate_batch_across_dp(4, False, 8, None, None, 0)
    with pytest.raises(ValueError, match="data_parallel_size is 4"):
        adapter.coordinate_batch_across_dp(4, False, SimpleNamespace(data_parallel_size=4))
    with pytest.raises(ValueError, match="data_parallel_rank is 0"):
        adapter.coordinate_batch_across_dp(
            4, False, SimpleNamespace(data_parallel_size=2, data_parallel_rank=0))
    with pytest.raises(TypeError):  # parallel_config is required, as in vLLM
        coordinate_batch_across_dp(4, False, adapter=adapter)  # type: ignore[call-arg]


class CountRounds:
    def __init__(self) -> None:
        self.rounds = 0

    def start(self, report: StepReport, kind: object = "state") -> CountRounds:
        assert str(getattr(kind, "value", kind)) == "state"
        self.rounds += 1
        return self

    def wait(self, timeout: float | None = None) -> StepDecision:
        return decide([state_report(False, False), state_report(True, False)],
                      kind=StepKind.STATE)


@pytest.mark.parametrize(("interval", "steps", "synced_at"), [
    (16, 40, [1, 16, 32]), (1, 3, [1, 2, 3]), (5, 11, [1, 5, 10]),
])
def test_the_state_sync_runs_on_step_1_and_every_dp_sync_interval(
        interval: int, steps: int, synced_at: list[int]) -> None:
    """DPEngineCoreProc._has_global_unfinished_reqs: step 1, then every dp_sync_interval."""
    cfg = DPGroupConfig(data_parallel_size=2, dp_sync_interval=interval)
    client = CountRounds()
    adapter = VllmAdapter(cfg, client, dp_rank=0, as_tensor=False)  # type: ignore[arg-type]
    seen = []
    for step in range(1, steps + 1):
        before = client.rounds
        state = adapter.has_global_unfinished_reqs(False, False)
        if client.rounds > before:
            seen.append(step)
            assert state == (True, False)  # the other rank has work
        else:
            assert state == BETWEEN_STATE_SYNCS
    assert seen == synced_at
    assert DPGroupConfig(data_parallel_size=2).dp_sync_interval == 16


def test_dp_above_1_needs_a_client_and_a_rank_in_range() -> None:
    with pytest.raises(ValueError, match="needs a client"):
        VllmAdapter(DBO)
    with pytest.raises(ValueError, match="dp_rank 2"):
        VllmAdapter(DPGroupConfig(data_parallel_size=1), dp_rank=2)


def test_module_level_calls_need_a_binding() -> None:
    bind(None)
    with pytest.raises(AdapterNotBound):
        coordinate_batch_across_dp(1, False, None)
    with pytest.raises(AdapterNotBound):
        coordinate_batch_across_dp(1, False, SimpleNamespace(data_parallel_size=2))
    adapter = VllmAdapter(DPGroupConfig(data_parallel_size=1), as_tensor=False)
    bind(adapter)
    try:
        assert coordinate_batch_across_dp(1, False, None, cudagraph_mode=2) == (False, None, 2)
    finally:
        bind(None)


def sync_dp_state_reference(unfinished: list[bool], pending: list[bool]) -> tuple[bool, bool]:
    """vllm/config/parallel.py `sync_dp_state`: one SUM all-reduce of [has_unfinished, pause]."""
    dp, pause_count = len(pending), sum(pending)
    return sum(unfinished) > 0 or pause_count % dp != 0, pause_count == dp


@pytest.mark.parametrize("bits", list(itertools.product([False, True], repeat=6)))
def test_state_round_answers_sync_dp_state(bits: tuple[bool, ...]) -> None:
    unfinished, pending = list(bits[:3]), list(bits[3:])
    decision = decide([state_report(u, p) for u, p in zip(unfinished, pending, strict=True)])
    assert dp_state(decision) == sync_dp_state_reference(unfinished, pending)
    # proper fields: a state report carries no tokens, and its flags mean what they say
    assert decision.all_idle
    assert decision.any_unfinished == any(unfinished)
    assert (decision.any_pause, decision.should_pause) == (any(pending), all(pending))


def test_the_ubatch_rule_is_defined_once_in_proto() -> None:
    """client.dp_coordination's skip path and proto's policy use one `last_ubatch_empty` (it was
    written twice, with its first two arguments in opposite orders); by keyword, a swap cannot
    pass."""
    from coordd.client import dp_coordination as client_vllm
    from coordd.proto import policy

    assert client_vllm.last_ubatch_empty is policy.last_ubatch_empty
    # 96 padded tokens in 2 micro-batches of 48: with 40 real tokens the last one is padding
    assert policy.last_ubatch_empty(max_padded=96, min_tokens=40, num_ubatches=2)
    assert not policy.last_ubatch_empty(max_padded=96, min_tokens=49, num_ubatches=2)
    assert policy.last_ubatch_empty(96, 64, 3) and not policy.last_ubatch_empty(96, 65, 3)
    report = build_report(DBO, 40, True, 96, uniform_decode=True)  # votes yes (40 >= 32)
    assert report.want_ubatch
    assert local_result(DBO, report, 0)[0] is False  # its own last micro-batch is empty
    report = build_report(DBO, 60, True, 96, uniform_decode=True)
    assert local_result(DBO, report, 0)[0] is True


@pytest.mark.parametrize(
    ("field", "changes"),
    [
        ("num_tokens_across_dp[1]", {"num_tokens_across_dp": [2**40, 2**40]}),  # torch: overflow
        ("num_tokens_across_dp", {"num_tokens_across_dp": [2**40, 8]}),
        ("num_tokens_across_dp[1]", {"num_tokens_across_dp": [8, 0]}),  # its own count 0
        ("num_tokens_across_dp", {"num_tokens_across_dp": [-3, 8]}),
        ("dead_ranks", {"dead_ranks": [1]}),
        ("all_idle", {"all_idle": True}),
        ("any_unfinished", {"any_unfinished": False}),
        ("kind", {"kind": StepKind.DRAFT}),
    ],
)
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_the_adapter_checks_a_decision_against_its_own_report(
    field: str, changes: dict[str, object], as_tensor: bool
) -> None:
    """Issue 28, defect 7: from a client that hands over what it got (the device path, or any
    StepClient), a decision that contradicts this rank's report was returned as vLLM's result;
    for 2**40 torch raised a bare RuntimeError. Now the typed InvalidAnswer naming coordd."""
    cfg = DPGroupConfig(data_parallel_size=2)
    sent = StepReport(num_tokens=4, num_tokens_padded=8, has_unfinished=True)
    honest = decide([sent, sent])
    bad = msgspec.structs.replace(honest, **changes)
    ok = VllmAdapter(cfg, Answer(honest), dp_rank=1, as_tensor=as_tensor)
    assert ok.coordinate_batch_across_dp(4, False, None, 8, has_unfinished=True)[0] is False
    adapter = VllmAdapter(cfg, Answer(bad), dp_rank=1, as_tensor=as_tensor)
    with pytest.raises(InvalidAnswer) as caught:
        adapter.coordinate_batch_across_dp(4, False, None, 8, has_unfinished=True)
    assert caught.value.field == field and caught.value.at_fault == "coordd"
    assert adapter.last_decision is None, "none of it is used"
