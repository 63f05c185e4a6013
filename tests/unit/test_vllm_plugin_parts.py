"""The plugin's parts that each caught no planted bug before (issue 18), held here without vLLM
(torch only, a stand-in for vLLM's parallel_state where a part reads it):

- the exchange's slow path (COLUMN MAX/MIN) keeps each rank's values in its own column when a
  middle rank's row is left out (it must not renumber the ranks after it);
- a site label names the caller's qualname, so two syncs from one module are told apart;
- only the worker DP group's own cpu_group/device_group is routed as that group (not TP, not
  WORLD, not None);
- a dp=1 adapter answers locally whatever data_parallel_rank vLLM's config carries.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from coordd.client.dp_coordination import DPGroupConfig, VllmAdapter  # noqa: E402
from coordd.proto.errors import CoordinatorUnavailable  # noqa: E402
from coordd.vllm import patches  # noqa: E402
from coordd.vllm.enable import PluginSettings  # noqa: E402
from coordd.vllm.exchange import Exchange  # noqa: E402
from coordd.vllm.reduce import Layout, ReduceOp, contribution, reduce_rows  # noqa: E402


@pytest.mark.parametrize("op", [ReduceOp.MAX, ReduceOp.MIN, ReduceOp.SUM])
@pytest.mark.parametrize("missing", [1, 2])
def test_a_left_out_middle_rank_leaves_the_others_in_their_own_columns(
    op: ReduceOp, missing: int
) -> None:
    dp = 4
    tensors = []
    for rank in range(dp):
        t = torch.zeros(3, dp, dtype=torch.int32)
        t[:, rank] = torch.tensor([10 + rank, 20 + rank, 30 + rank], dtype=torch.int32)
        tensors.append(t)
    rows = [
        [] if r == missing else contribution(t, Layout.COLUMN, r) for r, t in enumerate(tensors)
    ]
    got = reduce_rows(rows, tensors[0], Layout.COLUMN, op)
    present = [t for r, t in enumerate(tensors) if r != missing]
    want = present[0].clone()
    for t in present[1:]:
        want = {ReduceOp.SUM: want + t, ReduceOp.MAX: torch.maximum(want, t),
                ReduceOp.MIN: torch.minimum(want, t)}[op]
    assert torch.equal(got, want), (got, want)
    if op is not ReduceOp.MIN:
        for rank in range(dp):
            expected = [0, 0, 0] if rank == missing else [10 + rank, 20 + rank, 30 + rank]
            assert got[:, rank].tolist() == expected, rank


def _label_from_one() -> str:
    return patches.site_label(ReduceOp.SUM, torch.zeros(4, 2, dtype=torch.int32), Layout.COLUMN)


def _label_from_another() -> str:
    return patches.site_label(ReduceOp.SUM, torch.zeros(4, 2, dtype=torch.int32), Layout.COLUMN)


def test_two_syncs_from_one_module_have_two_labels() -> None:
    one, another = _label_from_one(), _label_from_another()
    assert one != another
    assert f"{__name__}:_label_from_one|" in one
    assert f"{__name__}:_label_from_another|" in another
    assert one.endswith("|sum|int32[4,2]|col")
    named = patches.site_label(ReduceOp.MAX, torch.zeros(1, dtype=torch.int32), Layout.WHOLE,
                               "ParallelConfig.has_unfinished_dp")
    assert named.startswith("ParallelConfig.has_unfinished_dp@")


def test_only_the_worker_dp_groups_own_groups_are_routed(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_group, device_group, tp_group, world = object(), object(), object(), object()
    ps = types.ModuleType("vllm.distributed.parallel_state")
    ps._DP = SimpleNamespace(cpu_group=cpu_group, device_group=device_group)  # type: ignore[attr-defined]
    distributed = types.ModuleType("vllm.distributed")
    distributed.parallel_state = ps  # type: ignore[attr-defined]
    vllm = types.ModuleType("vllm")
    vllm.distributed = distributed  # type: ignore[attr-defined]
    for name, module in (("vllm", vllm), ("vllm.distributed", distributed),
                         ("vllm.distributed.parallel_state", ps)):
        monkeypatch.setitem(sys.modules, name, module)
    identity = object()
    monkeypatch.setattr(patches, "_worker_identity", lambda coordinator: identity)
    assert patches._worker_route(cpu_group) is identity
    assert patches._worker_route(device_group) is identity
    for other in (None, tp_group, world):
        assert patches._worker_route(other) is None, other
    ps._DP = None  # type: ignore[attr-defined]
    assert patches._worker_route(cpu_group) is None


@pytest.mark.parametrize("rank", [0, 1, 5])
def test_a_dp1_adapter_ignores_the_configs_rank(rank: int) -> None:
    adapter = VllmAdapter(DPGroupConfig(data_parallel_size=1), None, dp_rank=0, as_tensor=False)
    pc = SimpleNamespace(data_parallel_size=1, data_parallel_rank=rank)
    assert adapter.coordinate_batch_across_dp(7, True, pc, 8, True, 2) == (False, None, 2)


@pytest.mark.parametrize(("version", "line"), [
    ("0.32", "0.32"), ("0.32.0", "0.32"), ("0.32.1+cpu", "0.32"), ("0.33.0", "0.33"),
    ("0.33.0rc1", "0.33"), ("0.320", None), ("0.320.1", None), ("0.331", None),
    ("0.3", None), ("0.31.2", None), ("0.34.0", None), ("1.32.0", None), ("", None),
])
def test_a_release_belongs_to_a_supported_line_only_by_its_dotted_prefix(
    version: str, line: str | None
) -> None:
    """Issue 28, planted bug: `release_line` taking "0.320" for 0.32 (a bare prefix) passed
    every test: each named a real release. A line is the version itself or its prefix up to
    a dot, so 0.320 (or 0.331) gets the warning and an untouched vLLM."""
    assert patches.release_line(version) == line


class _AppearingSocket:
    """A client whose first registration finds no socket file, which coordd makes while that
    try fails: the file is missing at the look before the try and there at the look after."""

    def __init__(self) -> None:
        self.tries = 0
        self.connection = self

    def no_socket_file(self) -> str | None:
        return ": no socket file" if self.tries == 0 else None

    def connect(self, timeout: float) -> None:
        self.tries += 1
        if self.tries == 1:
            raise CoordinatorUnavailable("cannot reach coordd: no socket file")


def test_a_first_sync_retries_a_try_that_found_no_socket_made_meanwhile() -> None:
    """A try that failed for a missing socket file is retried even when the file is there by
    the time the failure is seen (a coordd binding at that moment)."""
    exchange = Exchange(PluginSettings("ipc:///nonexistent/c.sock", connect_timeout=5.0))
    client = _AppearingSocket()
    exchange._connect(client)  # type: ignore[arg-type]
    assert client.tries == 2
