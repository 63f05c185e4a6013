"""The V1 runner's window (coordd.vllm.runner): where the plugin starts the sync early, read
from `execute_model`'s source, and the `_prepare_inputs` wrapper's order of calls. Pure: stand-in
runner classes with vLLM's shape, no vLLM, no sockets."""

from __future__ import annotations

import contextlib
import inspect
import textwrap
from types import SimpleNamespace
from typing import Any

import pytest

from coordd.vllm import early, runner

#: vLLM's `dist` in `_run_ar`'s module (never called here).
dist = SimpleNamespace(all_reduce=lambda tensor, group=None: None)


def coordinate_batch_across_dp(**kwargs: Any) -> Any:
    """vLLM's dp_utils functions from the sync function down to its all-reduce, cut to their
    calls: a `with` after the all-reduce, as vLLM's `_synchronize_dp_ranks` has."""
    return _synchronize_dp_ranks(**kwargs)


def _synchronize_dp_ranks(**kwargs: Any) -> Any:
    tensor = _run_ar(**kwargs)
    with contextlib.nullcontext():
        return tensor


def _run_ar(**kwargs: Any) -> Any:
    tensor = list(kwargs)
    dist.all_reduce(tensor, group=None)
    return tensor


class Runner:
    """vLLM's `execute_model`, cut to the lines the window check reads."""

    def execute_model(self, scheduler_output: Any) -> Any:
        num_reqs = self.input_batch.num_reqs  # type: ignore[attr-defined]
        tokens = [scheduler_output.num_scheduled_tokens[i] for i in range(num_reqs)]
        num_scheduled_tokens_np = tokens
        max_num_scheduled_tokens = int(num_scheduled_tokens_np.max())  # type: ignore[attr-defined]
        num_tokens_unpadded = scheduler_output.total_num_scheduled_tokens
        _ = self._prepare_inputs(scheduler_output, num_scheduled_tokens_np)
        return self._determine_batch_execution_and_padding(
            num_tokens=num_tokens_unpadded,
            num_reqs=num_reqs,
            num_scheduled_tokens_np=num_scheduled_tokens_np,
            max_num_scheduled_tokens=max_num_scheduled_tokens,
            use_cascade_attn=False,
            num_encoder_reqs=len(scheduler_output.scheduled_encoder_inputs),
            allow_microbatching=self._allow_microbatching(num_reqs, num_scheduled_tokens_np),
        )

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: Any) -> Any:
        return "prepared"

    def _determine_batch_execution_and_padding(self, **kwargs: Any) -> Any:
        mode = len(kwargs)
        return coordinate_batch_across_dp(mode=mode, **kwargs)

    def _allow_microbatching(self, num_reqs: int, num_scheduled_tokens_np: Any) -> bool:
        return True


def sources() -> dict[str, str]:
    """The sources `window_in` reads, by function, as it finds them for `Runner`."""
    return {
        "execute_model": inspect.getsource(Runner.execute_model),
        "_determine_batch_execution_and_padding": inspect.getsource(
            Runner._determine_batch_execution_and_padding
        ),
        **{
            fn.__name__: inspect.getsource(fn)
            for fn in (coordinate_batch_across_dp, _synchronize_dp_ranks, _run_ar)
        },
    }


def variant(name: str, old: str, new: str) -> dict[str, str]:
    """`sources()` with one piece of function `name` changed."""
    changed = sources()
    text = textwrap.dedent(changed[name])
    assert text.count(old) == 1, old
    changed[name] = text.replace(old, new)
    return changed


PREPARE = "    _ = self._prepare_inputs(scheduler_output, num_scheduled_tokens_np)\n"
SYNC = "    return self._determine_batch_execution_and_padding("


def between(line: str) -> tuple[str, str]:
    """`line` put between `_prepare_inputs` and the sync in `execute_model`."""
    return PREPARE, PREPARE + f"    {line}\n"


#: vLLM-like changes to `execute_model` that move a sync input out of the window, each with
#: what the check says.
VARIANTS = {
    # Model Runner V2's order: the input preparation needs the sync's answer
    "SyncBeforePrepare": (
        PREPARE + SYNC,
        "    out = self._determine_batch_execution_and_padding(",
        "no sync after _prepare_inputs",
    ),
    # the sync reads a value `_prepare_inputs` computes
    "CascadeOn": ("use_cascade_attn=False", "use_cascade_attn=_", "sync call differs"),
    # the sync's tokens counted another way than the early start counts them
    "OtherTokenCount": (
        "num_tokens_unpadded = scheduler_output.total_num_scheduled_tokens",
        "num_tokens_unpadded = sum(num_scheduled_tokens_np)",
        "sets num_tokens_unpadded = sum(num_scheduled_tokens_np)",
    ),
    "ReassignsAnInput": (*between("num_reqs = len(_)"), "stores into num_reqs"),
    "AddsToAnInput": (*between("num_reqs += 1"), "stores into num_reqs"),
    "StoresIntoAnInput": (
        *between("num_scheduled_tokens_np[0] = 0"),
        "stores into num_scheduled_tokens_np[0]",
    ),
    "StoresAnAttribute": (
        *between("scheduler_output.total_num_scheduled_tokens = 0"),
        "stores into scheduler_output.total_num_scheduled_tokens",
    ),
    "SetsItsOwnState": (*between("self.input_batch = None"), "stores into self.input_batch"),
    "MutatesByMethod": (
        *between("num_scheduled_tokens_np.sort()"),
        "calls num_scheduled_tokens_np.sort",
    ),
    "MutatesThroughACall": (
        *between("print(scheduler_output)"),
        "passes scheduler_output to print",
    ),
    "ReturnsEarly": (*between("if not _: return None"), "leaves the block (return)"),
    "RaisesEarly": (*between("if not _: raise ValueError"), "leaves the block (raise)"),
    "WithBetween": (*between("with open('/dev/null'): pass"), "has a with statement"),
    "TryBetween": (*between("try: pass\n    finally: pass"), "has a try statement"),
    "SyncInAnotherBlock": (SYNC, "    if _:\n        return None\n" + SYNC, ""),
    "PrepareRebinds": (
        PREPARE,
        "    _, num_reqs = self._prepare_inputs(scheduler_output, num_scheduled_tokens_np)\n",
        "_prepare_inputs call stores into num_reqs",
    ),
}
#: Functions the early call unwinds, each with a statement put before its call towards the
#: all-reduce that `Started` would run (or catch) on its way out.
UNWOUND = {
    "WithInTheSyncFunction": (
        "_determine_batch_execution_and_padding",
        "    mode = len(kwargs)\n",
        "    mode = len(kwargs)\n    with contextlib.nullcontext():\n        pass\n",
        "_determine_batch_execution_and_padding has a with statement before its call to "
        "coordinate_batch_across_dp",
    ),
    "TryFinallyAroundTheCall": (
        "coordinate_batch_across_dp",
        "    return _synchronize_dp_ranks(**kwargs)\n",
        "    try:\n        return _synchronize_dp_ranks(**kwargs)\n    finally:\n        pass\n",
        "coordinate_batch_across_dp has a try/finally before its call to _synchronize_dp_ranks",
    ),
    "ExceptBaseException": (
        "_synchronize_dp_ranks",
        "    tensor = _run_ar(**kwargs)\n",
        "    try:\n        tensor = _run_ar(**kwargs)\n    except (ValueError, BaseException):\n"
        "        tensor = None\n",
        "_synchronize_dp_ranks catches BaseException before its call to _run_ar",
    ),
    "BareExcept": (
        "_run_ar",
        "    dist.all_reduce(tensor, group=None)\n",
        "    try:\n        dist.all_reduce(tensor, group=None)\n    except:\n        pass\n",
        "_run_ar catches BaseException before its call to dist.all_reduce",
    ),
    "NoAllReduce": (
        "_run_ar",
        "    dist.all_reduce(tensor, group=None)\n",
        "    dist.broadcast(tensor, 0)\n",
        "_run_ar makes no call to dist.all_reduce",
    ),
}


def test_the_window_is_found_in_vllms_order() -> None:
    assert runner.window_in(Runner) == ""
    assert runner.window_in_sources(sources()) == ""


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_runner_whose_sync_reads_other_values_gets_no_early_start(name: str) -> None:
    """Issue 36: the check compared three assignments and the call's keywords; an
    execute_model that reassigned or mutated an input between `_prepare_inputs` and the sync,
    or returned between them, passed it."""
    old, new, why = VARIANTS[name]
    said = runner.window_in_sources(variant("execute_model", old, new))
    assert said and why in said, said


@pytest.mark.parametrize("name", list(UNWOUND))
def test_code_that_started_would_run_or_catch_on_its_way_out_gets_no_early_start(
    name: str,
) -> None:
    """Issue 36: nothing checked that the functions `Started` unwinds run no code on the
    way out (a `with`, a `try/finally`) and do not catch it (`except BaseException`)."""
    function, old, new, why = UNWOUND[name]
    said = runner.window_in_sources(variant(function, old, new))
    assert why in said, said


def test_try_except_exception_and_with_after_the_call_are_allowed() -> None:
    """`Started` is a BaseException: an `except Exception` lets it through, and code after
    the all-reduce never runs in the early call."""
    ok = variant(
        "_run_ar",
        "    dist.all_reduce(tensor, group=None)\n",
        "    try:\n        dist.all_reduce(tensor, group=None)\n    except Exception:\n"
        "        raise\n    with contextlib.nullcontext():\n        pass\n",
    )
    assert runner.window_in_sources(ok) == ""


def test_the_sync_path_is_followed_where_each_function_finds_the_next() -> None:
    """`window_in` reads each function of the path from the globals of the one before (the
    runner's module, then vLLM's dp_utils): one that is not there is named, and so is a sync
    function that makes no call towards the all-reduce."""
    elsewhere = type("Elsewhere", (Runner,), {SYNC_NAME: textwrap.dedent})
    assert runner.window_in(elsewhere) == (
        "coordinate_batch_across_dp is not found where Elsewhere calls it"
    )
    direct = type("Direct", (Runner,), {SYNC_NAME: _sync_without_dp_utils})
    assert runner.window_in(direct) == (f"{SYNC_NAME} makes no call to coordinate_batch_across_dp")


SYNC_NAME = "_determine_batch_execution_and_padding"


def _sync_without_dp_utils(self: Any, **kwargs: Any) -> Any:
    return _run_ar(**kwargs)


def test_a_runner_without_the_methods_gets_no_early_start() -> None:
    bare = type("Bare", (), {"execute_model": lambda self: None})
    assert "Bare._prepare_inputs is missing" in runner.window_in(bare)


def _wrapped(cls: type, calls: list[str], raises: BaseException | None = None) -> Any:
    def original(self: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> str:
        calls.append("prepare")
        if raises is not None:
            raise raises
        return "prepared"

    def start(model_runner: Any, scheduler_output: Any, tokens: Any) -> None:
        calls.append(f"start {tokens}")
        raise early.Started

    return runner.prepare_inputs_starting_early(
        original, cls, start, lambda: calls.append("abandon")
    )


def test_the_round_starts_before_prepare_inputs() -> None:
    calls: list[str] = []
    prepare = _wrapped(Runner, calls)
    assert prepare(Runner(), "out", [1, 2]) == "prepared"
    assert calls == ["start [1, 2]", "prepare"]


def test_a_prepare_inputs_that_raises_abandons_the_started_round() -> None:
    calls: list[str] = []
    prepare = _wrapped(Runner, calls, raises=ValueError("bad input"))
    with pytest.raises(ValueError, match="bad input"):
        prepare(Runner(), "out", [3])
    assert calls == ["start [3]", "prepare", "abandon"]


def test_a_subclass_with_its_own_step_keeps_vllms_order() -> None:
    """A runner that overrides `_determine_batch_execution_and_padding` (or `execute_model`)
    may make another sync: no early start for it."""

    class Own(Runner):
        def _determine_batch_execution_and_padding(self, **kwargs: Any) -> Any:
            return None

    calls: list[str] = []
    prepare = _wrapped(Runner, calls)
    assert prepare(Own(), "out", [1]) == "prepared"
    assert calls == ["prepare"]


def test_starting_mode_is_per_thread_and_ends_with_its_block() -> None:
    import threading

    seen: list[bool] = []
    with early.StartingMode():
        assert early.starting()
        thread = threading.Thread(target=lambda: seen.append(early.starting()))
        thread.start()
        thread.join(5)
    assert seen == [False] and not early.starting()
