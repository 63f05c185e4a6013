"""The gather-reduce primitive and the plugin's settings: torch only, no vLLM, no coordd, so
these run in the main venv too."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from coordd.vllm.enable import PluginSettings, SettingsError, settings_from_env  # noqa: E402
from coordd.vllm.exchange import (  # noqa: E402
    Layout,
    ReduceOp,
    can_gather,
    contribution,
    fits,
    own_column_only,
    reduce_rows,
)


def _column_tensor(rows: int, dp: int, rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.zeros(rows, dp, dtype=torch.int32)
    t[:, rank] = torch.randint(-5, 700, (rows,), generator=g, dtype=torch.int32)
    return t


@pytest.mark.parametrize("dp", [2, 3, 4, 8])
@pytest.mark.parametrize("op", list(ReduceOp))
def test_columns_reduce_to_what_the_collective_gives(dp: int, op: ReduceOp) -> None:
    ranks = [_column_tensor(7, dp, r, seed=dp * 10 + r) for r in range(dp)]
    rows = [contribution(t, Layout.COLUMN, r) for r, t in enumerate(ranks)]
    assert all(len(row) == 7 for row in rows)
    want = ranks[0].clone()
    for t in ranks[1:]:
        want = {"sum": want + t, "max": torch.maximum(want, t), "min": torch.minimum(want, t)}[
            op.value
        ]
    got = reduce_rows(rows, ranks[0], Layout.COLUMN, op)
    assert got.dtype == torch.int32 and got.shape == (7, dp)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "op,values,dtype,want",
    [
        (ReduceOp.SUM, [[1, 0], [0, 1], [1, 1]], torch.int32, [2, 2]),  # sync_dp_state
        (ReduceOp.MAX, [[0], [1], [0]], torch.int32, [1]),  # has_unfinished_dp
        (ReduceOp.MIN, [[2**63 - 1], [5], [2**40]], torch.int64, [5]),  # kv cache size
    ],
)
def test_whole_vectors_reduce_with_the_collectives_op(
    op: ReduceOp, values: list[list[int]], dtype: torch.dtype, want: list[int]
) -> None:
    like = torch.tensor(values[0], dtype=dtype)
    got = reduce_rows(values, like, Layout.WHOLE, op)
    assert got.dtype == dtype and got.tolist() == want


def test_a_rank_left_out_contributes_nothing() -> None:
    like = torch.zeros(2, 3, dtype=torch.int32)
    got = reduce_rows([[4, 5], [], [6, 7]], like, Layout.COLUMN, ReduceOp.SUM)
    assert got.tolist() == [[4, 0, 6], [5, 0, 7]]
    assert reduce_rows([[3], [], [1]], torch.zeros(1), Layout.WHOLE, ReduceOp.MAX).tolist() == [3]


def test_the_column_check_sees_a_write_outside_the_own_column() -> None:
    t = _column_tensor(4, 2, 1, seed=1)
    assert own_column_only(t, 1, 2)
    t[0, 0] = 1
    assert not own_column_only(t, 1, 2)
    # sync_dp_state's [2] at dp=2: every rank writes both slots, never a column
    assert not own_column_only(torch.tensor([1, 1], dtype=torch.int32), 0, 2)
    assert not own_column_only(torch.zeros(3, dtype=torch.int32), 0, 2)


def test_only_integer_tensors_that_fit_a_round_are_gathered() -> None:
    assert can_gather(torch.zeros(7, 4, dtype=torch.int32))
    assert can_gather(torch.zeros(1, dtype=torch.bool))
    assert not can_gather(torch.zeros(7, 4, dtype=torch.float32))
    assert fits(torch.zeros(7, 512, dtype=torch.int32), Layout.COLUMN, 512)
    # past what one frame can carry back (7 values x 4096 ranks), vLLM's own path is taken
    assert not fits(torch.zeros(7, 4096, dtype=torch.int32), Layout.COLUMN, 4096)
    assert not fits(torch.zeros(300, dtype=torch.int64), Layout.WHOLE, 2)


def test_the_plugin_is_off_unless_the_environment_turns_it_on() -> None:
    assert settings_from_env({}) is None
    assert settings_from_env({"COORDD_VLLM": "0", "COORDD_ADDRESS": "ipc:///x"}) is None
    assert settings_from_env({"COORDD_VLLM": "1"}) == PluginSettings(address=None)
    on = settings_from_env(
        {"COORDD_ADDRESS": "tcp://10.0.0.1:5555", "COORDD_VLLM_SYNC_TIMEOUT": "90"}
    )
    assert on == PluginSettings(address="tcp://10.0.0.1:5555", sync_timeout=90.0)
    with pytest.raises(SettingsError, match="COORDD_VLLM='maybe'"):
        settings_from_env({"COORDD_VLLM": "maybe"})
    with pytest.raises(SettingsError, match="COORDD_VLLM_CONNECT_TIMEOUT"):
        settings_from_env({"COORDD_VLLM": "1", "COORDD_VLLM_CONNECT_TIMEOUT": "-1"})
