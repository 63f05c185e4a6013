"""The SGLang plugin's pure parts, without SGLang: its switches and the rows it sends and
rebuilds (tests/sglang runs them inside SGLang)."""

from __future__ import annotations

import random

import pytest

from coordd.proto.errors import InvalidAnswer, InvalidReport
from coordd.sglang import rows
from coordd.sglang.enable import PluginSettings, SettingsError, settings_from_env


def test_the_plugin_is_off_unless_switched_on() -> None:
    assert settings_from_env({}) is None
    assert settings_from_env({"COORDD_VLLM": "1"}) is None  # vLLM's switch is not SGLang's
    assert settings_from_env({"COORDD_SGLANG": "0", "COORDD_ADDRESS": "ipc:///x"}) is None
    assert settings_from_env({"COORDD_SGLANG": "1"}) == PluginSettings()
    assert settings_from_env(
        {"COORDD_ADDRESS": "tcp://h:5555", "COORDD_SGLANG_SYNC_TIMEOUT": "9"}
    ) == PluginSettings(address="tcp://h:5555", sync_timeout=9.0)
    for bad in (
        {"COORDD_SGLANG": "maybe"},
        {"COORDD_SGLANG": "1", "COORDD_SGLANG_CONNECT_TIMEOUT": "-1"},
    ):
        with pytest.raises(SettingsError):
            settings_from_env(bad)


def test_concat_is_the_rows_in_rank_order_and_refuses_a_short_row() -> None:
    assert rows.concat([[1, 2], [3, 4], [5, 6]], 2, seq=0) == [1, 2, 3, 4, 5, 6]
    with pytest.raises(InvalidAnswer, match=r"rows\[1\]"):
        rows.concat([[1, 2], []], 2, seq=7)


def _sum_of_tensors(tensors: list[list[int]]) -> list[int]:
    """What gloo's SUM all-reduce gives: elementwise, wrapped to int64."""
    out = []
    for values in zip(*tensors, strict=True):
        total = sum(values)
        out.append((total + (1 << 63)) % (1 << 64) - (1 << 63))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_sum_slots_of_slot_rows_is_the_all_reduce(seed: int) -> None:
    """Each rank's tensor: zeros but (maybe) one row, as SGLang's elastic path writes it; two
    ranks may share a slot (a SUM adds them), values near int64's ends wrap as torch's do."""
    rng = random.Random(seed)
    slots, width, ranks = rng.randrange(1, 6), rng.randrange(1, 12), rng.randrange(1, 6)
    tensors = []
    for _ in range(ranks):
        tensor = [0] * (slots * width)
        if rng.random() < 0.8:
            slot = rng.randrange(slots)
            for i in range(width):
                tensor[slot * width + i] = rng.choice(
                    [0, 1, -1, rng.randrange(-(1 << 63), 1 << 63)]
                )
        tensors.append(tensor)
    sent = [rows.slot_row(t, width, rank) for rank, t in enumerate(tensors)]
    assert all(len(s) == width + 1 for s in sent)
    assert rows.sum_slots(sent, slots, width, seq=0) == _sum_of_tensors(tensors)


def test_a_tensor_with_two_rows_is_the_ranks_own_fault() -> None:
    with pytest.raises(InvalidReport) as caught:
        rows.slot_row([1, 0, 0, 2], 2, rank=3)
    assert caught.value.ranks == (3,)


def test_a_slot_out_of_range_is_coordds_misfit() -> None:
    with pytest.raises(InvalidAnswer):
        rows.sum_slots([[5, 1, 1]], slots=2, width=2, seq=1)
