"""The gather-reduce primitive and the plugin's settings: torch only, no vLLM, no coordd, so
these run in the main venv too."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from coordd.vllm.enable import PluginSettings, SettingsError, settings_from_env  # noqa: E402
from coordd.vllm.reduce import (  # noqa: E402
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
    assert not on.overlap  # the early start is opt-in (it did not pay on the CPU engine)
    assert settings_from_env({"COORDD_VLLM": "1", "COORDD_VLLM_OVERLAP": "1"}).overlap  # type: ignore[union-attr]
    with pytest.raises(SettingsError, match="COORDD_VLLM='maybe'"):
        settings_from_env({"COORDD_VLLM": "maybe"})
    with pytest.raises(SettingsError, match="COORDD_VLLM_CONNECT_TIMEOUT"):
        settings_from_env({"COORDD_VLLM": "1", "COORDD_VLLM_CONNECT_TIMEOUT": "-1"})


# -- the per-sync path (Exchange.sync_) with a stand-in client ---------------------------------

from coordd.proto.errors import InvalidAnswer, ProtocolError  # noqa: E402
from coordd.vllm import sites  # noqa: E402
from coordd.vllm.exchange import Exchange, GroupLink  # noqa: E402
from coordd.vllm.groups import GroupIdentity  # noqa: E402


class Answers:
    """A client whose gather answers with rows given by the test (what the real client hands
    over once it has checked them against the round), or raises `error`; it records what this
    rank sent."""

    def __init__(self, rows: list[list[int]] | None = None, error: Exception | None = None) -> None:
        self.rows = rows
        self.error = error
        self.sent: list[tuple[str, list[int]]] = []

    def gather(self, site: str, values: list[int], timeout: float | None = None) -> list:
        self.sent.append((site, list(values)))
        if self.error is not None:
            raise self.error
        assert self.rows is not None
        return [list(row) for row in self.rows]


def _exchange(rank: int, dp: int, client: Answers) -> tuple[Exchange, GroupIdentity]:
    identity = GroupIdentity("dp-tp0-pp0", rank, dp, "fp")
    exchange = Exchange(PluginSettings("ipc:///nowhere", fallback=False))
    exchange._links[identity.name] = GroupLink(identity, client)  # type: ignore[arg-type]
    return exchange, identity


def _collective(tensors: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    acc = tensors[0].to(torch.int64)
    for t in tensors[1:]:
        t = t.to(torch.int64)
        acc = {"sum": acc + t, "max": torch.maximum(acc, t), "min": torch.minimum(acc, t)}[op.value]
    return acc.to(tensors[0].dtype)


def _group_sync(
    tensors: list[torch.Tensor], op: ReduceOp, column: bool, dead: tuple[int, ...] = ()
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Every rank's sync_ of its tensor: what each sent first, then each with the rows coordd
    would answer (dead ranks' rows empty); returns the results and the rows."""
    dp = len(tensors)
    sent = []
    for rank, t in enumerate(tensors):  # what each rank sends (a probe answered with an error)
        probe = Answers(error=ProtocolError("probe"))
        exchange, identity = _exchange(rank, dp, probe)
        with pytest.raises(ProtocolError, match="probe"):
            exchange.sync_(t.clone(), op, identity, column)
        sent.append(probe.sent[0][1])
    rows = [[] if rank in dead else row for rank, row in enumerate(sent)]
    out = []
    for rank, t in enumerate(tensors):
        if rank in dead:
            continue
        exchange, identity = _exchange(rank, dp, Answers(rows))
        mine = t.clone()
        assert exchange.sync_(mine, op, identity, column)
        out.append(mine)
    return out, rows


@pytest.mark.parametrize("dp", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8, torch.bool])
def test_a_column_sync_is_the_collective_and_sends_the_column_only(
    dp: int, dtype: torch.dtype
) -> None:
    ranks = [_column_tensor(7, dp, r, seed=dp + r).to(dtype) for r in range(dp)]
    got, rows = _group_sync(ranks, ReduceOp.SUM, column=True)
    want = _collective(ranks, ReduceOp.SUM)
    assert all(g.dtype == dtype and torch.equal(g, want) for g in got)
    assert rows == [contribution(t, Layout.COLUMN, r) for r, t in enumerate(ranks)]
    assert all(type(v) is int for row in rows for v in row)  # bools go as ints


def test_a_column_sync_with_a_rank_left_out_gives_it_zeros() -> None:
    ranks = [_column_tensor(4, 3, r, seed=r) for r in range(3)]
    got, _ = _group_sync(ranks, ReduceOp.SUM, column=True, dead=(1,))
    ranks[1].zero_()
    assert all(torch.equal(g, _collective(ranks, ReduceOp.SUM)) for g in got)


@pytest.mark.parametrize("op", list(ReduceOp))
def test_whole_and_non_column_syncs_are_the_collective(op: ReduceOp) -> None:
    # engine syncs ([2] SUM, [1] MAX/MIN) and a worker tensor written outside its column
    for tensors, column in (
        ([torch.tensor([1, 0], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32)], 0),
        ([torch.tensor([2**62], dtype=torch.int64), torch.tensor([5], dtype=torch.int64)], 0),
        ([torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)] * 2, 1),
    ):
        got, rows = _group_sync(tensors, op, column=bool(column))
        assert all(len(row) == tensors[0].numel() for row in rows)  # the whole tensor went
        assert all(torch.equal(g, _collective(tensors, op)) for g in got)


def test_a_sum_past_the_dtype_wraps_as_the_collective_does() -> None:
    big = torch.tensor([2**31 - 1], dtype=torch.int32)
    got, _ = _group_sync([big, big.clone()], ReduceOp.SUM, column=False)
    assert got[0].tolist() == [(2 * (2**31 - 1)) - 2**32]


def test_an_answer_the_client_refuses_leaves_the_tensor_untouched() -> None:
    """The client checks every answer against the round (tests/unit/test_session.py: dp rows,
    the own row as sent, lengths, dead ranks); its InvalidAnswer, naming coordd, comes out of
    the sync as it is, and nothing is reduced into the tensor."""
    t = torch.zeros(3, 2, dtype=torch.int32)
    t[:, 0] = torch.tensor([0, 1, 2])
    before = t.clone()
    refused = InvalidAnswer(7, "rows", "1 rows", "2 rows, one per rank")
    exchange, identity = _exchange(0, 2, Answers(error=refused))
    with pytest.raises(InvalidAnswer) as info:
        exchange.sync_(t, ReduceOp.SUM, identity, True)
    assert info.value is refused and info.value.at_fault == "coordd"
    assert torch.equal(t, before)


# -- site labels --------------------------------------------------------------------------------


def _module(name: str, source: str) -> dict:
    space: dict = {"__name__": name}
    exec(compile(source, f"<{name}>", "exec"), space)
    return space


#: A stand-in for vLLM: a sync function in a sync module, a collective in vllm.distributed,
#: and two callers (the runner, the drafter) in their own modules.
_COLLECTIVE = _module(
    "vllm.distributed.parallel_state",
    "def all_reduce_(label, t):\n    return label(t)\n",
)
_SYNC = _module(
    "vllm.v1.worker.gpu.dp_utils",
    "def sync_padding(label, t):\n    return all_reduce_(label, t)\n",
)
_SYNC["all_reduce_"] = _COLLECTIVE["all_reduce_"]
_RUNNER = _module(
    "vllm.v1.worker.gpu.model_runner",
    "class GPUModelRunner:\n"
    "    def execute_model(self, label, t):\n        return sync_padding(label, t)\n"
    "    def twice(self, label, t):\n"
    "        return sync_padding(label, t), sync_padding(label, t)\n",
)
_DRAFTER = _module(
    "vllm.v1.spec_decode.eagle",
    "class EagleProposer:\n"
    "    def propose(self, label, t):\n        return sync_padding(label, t)\n",
)
_RUNNER["sync_padding"] = _DRAFTER["sync_padding"] = _SYNC["sync_padding"]


#: The plugin's side, as a patch calls it (a frame of coordd.vllm, looked past).
_plugin_label = _module(
    "coordd.vllm.stub",
    "from coordd.vllm import sites\n"
    "from coordd.vllm.exchange import Layout, ReduceOp\n"
    "def label(t):\n    return sites.label(ReduceOp.SUM, t, Layout.COLUMN)\n",
)["label"]


def test_a_site_label_names_the_sync_function_and_its_callers_qualname() -> None:
    t = torch.zeros(7, 2, dtype=torch.int32)
    runner = _RUNNER["GPUModelRunner"]().execute_model(_plugin_label, t)
    drafter = _DRAFTER["EagleProposer"]().propose(_plugin_label, t)
    assert runner == (
        "sync_padding@vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model"
        "|sum|int32[7,2]|col"
    )
    assert (
        drafter == "sync_padding@vllm.v1.spec_decode.eagle:EagleProposer.propose|sum|int32[7,2]|col"
    )
    # once per call site: the same string again, whoever asked first
    assert _RUNNER["GPUModelRunner"]().execute_model(_plugin_label, t) is runner
    assert _DRAFTER["EagleProposer"]().propose(_plugin_label, t) is drafter
    # the shape is part of it: a dp=4 tensor at the same site is another label
    assert _RUNNER["GPUModelRunner"]().execute_model(_plugin_label, torch.zeros(7, 4)) == (
        runner.replace("int32[7,2]", "float32[7,4]")
    )
    # two calls from one caller (two lines) name the same sync the same way
    first, second = _RUNNER["GPUModelRunner"]().twice(_plugin_label, t)
    assert first == second == runner.replace("execute_model", "twice")


def test_a_site_label_is_capped_from_the_callers_front() -> None:
    long = _module("x" * 300, "def caller(label, t):\n    return sync_padding(label, t)\n")
    long["sync_padding"] = _SYNC["sync_padding"]
    got = long["caller"](_plugin_label, torch.zeros(3, dtype=torch.int64))
    assert len(got) == sites.MAX_SITE and got.startswith("sync_padding@x")
    assert got.endswith("x:caller|sum|int64[3]|col")


def test_a_tensor_not_contiguous_in_memory_gets_the_same_values() -> None:
    dp = 3
    ranks = []
    for r in range(dp):
        t = torch.zeros(dp, 5, dtype=torch.int32).T  # [5, dp], strided
        t[:, r] = torch.arange(5, dtype=torch.int32) * (r + 1)
        assert not t.is_contiguous()
        ranks.append(t)
    got, _ = _group_sync(ranks, ReduceOp.SUM, column=True)
    assert all(not g.is_contiguous() for g in got)
    assert all(torch.equal(g, _collective(ranks, ReduceOp.SUM)) for g in got)


def test_a_patched_sync_is_labelled_with_vllms_sync_function_and_its_caller() -> None:
    """Through `patches._sync_` from a patch (a coordd.vllm frame), as vLLM's syncs reach it:
    the label names vLLM's sync function and its caller, not the plugin's frames."""
    from coordd.vllm import patches

    stub = _module(
        "coordd.vllm.stub_patch",
        "from coordd.vllm import patches\n"
        "from coordd.vllm.exchange import ReduceOp\n"
        "def all_reduce_(identity, t):\n"
        "    assert patches._sync_(t, ReduceOp.SUM, identity, True)\n",
    )
    sync = _module(
        "vllm.v1.worker.gpu.dp_utils",
        "def sync_padding(identity, t):\n    return all_reduce_(identity, t)\n",
    )
    sync["all_reduce_"] = stub["all_reduce_"]
    runner = _module(
        "vllm.v1.worker.gpu.model_runner",
        "class GPUModelRunner:\n"
        "    def execute_model(self, identity, t):\n        return sync_padding(identity, t)\n",
    )
    runner["sync_padding"] = sync["sync_padding"]
    t = torch.zeros(7, 2, dtype=torch.int32)
    t[:, 1] = torch.arange(7, dtype=torch.int32)
    client = Answers([[9] * 7, list(range(7))])
    exchange, identity = _exchange(1, 2, client)
    saved = patches._state.exchange
    patches._state.exchange = exchange
    try:
        runner["GPUModelRunner"]().execute_model(identity, t)
    finally:
        patches._state.exchange = saved
    assert client.sent == [
        (
            "sync_padding@vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model"
            "|sum|int32[7,2]|col",
            list(range(7)),
        )
    ]
    assert t[:, 0].tolist() == [9] * 7 and t[:, 1].tolist() == list(range(7))


def test_what_a_round_cannot_carry_is_left_to_vllm_untouched() -> None:
    client = Answers([[0], [0]])
    exchange, identity = _exchange(0, 2, client)
    floats = torch.ones(7, 2)
    assert not exchange.sync_(floats, ReduceOp.SUM, identity, True)
    wide = torch.zeros(2, 300, dtype=torch.int64)  # 600 values: more than a round takes
    assert not exchange.sync_(wide, ReduceOp.SUM, identity, False)
    assert client.sent == [] and floats.eq(1).all() and not wide.any()
