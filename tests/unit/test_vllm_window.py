"""The V1 runner's window (coordd.vllm.runner): where the plugin starts the sync early, read
from `execute_model`'s source, and the `_prepare_inputs` wrapper's order of calls. Pure: stand-in
runner classes with vLLM's shape, no vLLM, no sockets."""

from __future__ import annotations

import importlib.util
import inspect
import textwrap
from pathlib import Path
from typing import Any

import pytest

from coordd.vllm import early, runner


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
        return kwargs

    def _allow_microbatching(self, num_reqs: int, num_scheduled_tokens_np: Any) -> bool:
        return True


def variant(tmp_path: Path, name: str, old: str, new: str) -> type:
    """`Runner` with one piece of `execute_model` changed: a class of its own module, so the
    window check reads its source as it reads vLLM's."""
    source = textwrap.dedent(inspect.getsource(Runner))
    assert source.count(old) == 1, old
    path = tmp_path / f"{name.lower()}.py"
    path.write_text("from typing import Any\n\n" + source.replace(old, new))
    spec = importlib.util.spec_from_file_location(f"window_{name.lower()}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Runner  # type: ignore[no-any-return]


PREPARE = "        _ = self._prepare_inputs(scheduler_output, num_scheduled_tokens_np)\n"
#: vLLM-like changes that move a sync input out of the window, each with what the check says.
VARIANTS = {
    # Model Runner V2's order: the input preparation needs the sync's answer
    "SyncBeforePrepare": (
        PREPARE + "        return self._determine_batch_execution_and_padding(",
        "        out = self._determine_batch_execution_and_padding(",
        "no sync after _prepare_inputs",
    ),
    # the sync reads a value `_prepare_inputs` computes
    "CascadeOn": (
        "use_cascade_attn=False",
        "use_cascade_attn=_",
        "sync call differs",
    ),
    # the sync's tokens counted another way than the early start counts them
    "OtherTokenCount": (
        "num_tokens_unpadded = scheduler_output.total_num_scheduled_tokens",
        "num_tokens_unpadded = sum(num_scheduled_tokens_np)",
        "sets num_tokens_unpadded = sum(num_scheduled_tokens_np)",
    ),
}


def test_the_window_is_found_in_vllms_order() -> None:
    assert runner.window_in(Runner) == ""


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_runner_whose_sync_reads_other_values_gets_no_early_start(
    tmp_path: Path, name: str
) -> None:
    old, new, why = VARIANTS[name]
    assert why in runner.window_in(variant(tmp_path, name, old, new))


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
