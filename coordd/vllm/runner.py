"""The V1 runner's window: its DP sync's round starts before `_prepare_inputs`.

`GPUModelRunner.execute_model` (0.32 and 0.33; `CPUModelRunner` inherits it) computes every
input of its DP sync, calls `_prepare_inputs(scheduler_output, num_scheduled_tokens_np)`, and
only then `_determine_batch_execution_and_padding(...)`, which dispatches the graph mode and
makes the sync. The plugin wraps `_prepare_inputs`: before it runs, vLLM's own
`_determine_batch_execution_and_padding` is called in starting mode (`coordd.vllm.early`) with
the arguments `execute_model` passes it, so this rank's values leave for coordd while
`_prepare_inputs` runs.

Those arguments are read from `execute_model`'s own source when vLLM loads it (`window_in`): the
plugin starts early only where the call and the assignments it reads are exactly the ones
below, and at every sync `Exchange.sync_` checks the values vLLM sends against those started.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import sys
import textwrap
from collections.abc import Callable
from typing import Any

from coordd.proto.errors import CoordError
from coordd.vllm import early

#: `execute_model`'s assignments that the sync's arguments read, before `_prepare_inputs`.
ASSIGNED = {
    "num_reqs": "self.input_batch.num_reqs",
    "num_tokens_unpadded": "scheduler_output.total_num_scheduled_tokens",
    "max_num_scheduled_tokens": "int(num_scheduled_tokens_np.max())",
}
#: The call that opens the window.
PREPARE = "self._prepare_inputs(scheduler_output, num_scheduled_tokens_np)"
#: The sync's call after it, keyword by keyword.
SYNC_KEYWORDS = {
    "num_tokens": "num_tokens_unpadded",
    "num_reqs": "num_reqs",
    "num_scheduled_tokens_np": "num_scheduled_tokens_np",
    "max_num_scheduled_tokens": "max_num_scheduled_tokens",
    "use_cascade_attn": "False",
    "num_encoder_reqs": "len(scheduler_output.scheduled_encoder_inputs)",
    "allow_microbatching": "self._allow_microbatching(num_reqs, num_scheduled_tokens_np)",
}


def window_in(runner_class: Any) -> str:
    """Why `runner_class.execute_model` does not open the window this module starts the sync
    in (the assignments, then `PREPARE`, then the sync's call with `SYNC_KEYWORDS`); "" if it
    does."""
    for name in ("execute_model", "_prepare_inputs", "_determine_batch_execution_and_padding"):
        if not callable(getattr(runner_class, name, None)):
            return f"{runner_class.__name__}.{name} is missing"
    try:
        source = textwrap.dedent(inspect.getsource(runner_class.execute_model))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError) as exc:
        return f"cannot read {runner_class.__name__}.execute_model: {exc}"
    assigned: dict[str, str] = {}
    prepared = False
    # assignments and calls in source order (ast.walk is breadth-first)
    ordered = sorted(
        (n for n in ast.walk(tree) if isinstance(n, ast.Assign | ast.Call)),
        key=lambda n: (n.lineno, n.col_offset),
    )
    for node in ordered:
        if isinstance(node, ast.Assign):
            if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                assigned[node.targets[0].id] = ast.unparse(node.value)
            continue
        text = ast.unparse(node.func)
        if text == "self._prepare_inputs":
            if ast.unparse(node) != PREPARE:
                return f"execute_model calls {ast.unparse(node)}, not {PREPARE}"
            for name, value in ASSIGNED.items():
                if assigned.get(name) != value:
                    return f"execute_model sets {name} = {assigned.get(name)}, not {value}"
            prepared = True
        elif text == "self._determine_batch_execution_and_padding" and prepared:
            keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
            if node.args or keywords != SYNC_KEYWORDS:
                return f"execute_model's sync call differs: {ast.unparse(node)}"
            return ""
    return "execute_model makes no sync after _prepare_inputs"


def start_sync(runner: Any, scheduler_output: Any, num_scheduled_tokens_np: Any) -> None:
    """Run vLLM's `_determine_batch_execution_and_padding` in starting mode with the arguments
    `execute_model` will pass it (`SYNC_KEYWORDS`): its all-reduce starts the round and
    unwinds the call. A vLLM error there is left for the sync itself to raise; a coordd error
    (coordd gone, the group failed) is raised now."""
    num_reqs = runner.input_batch.num_reqs
    try:
        with early.StartingMode():
            runner._determine_batch_execution_and_padding(
                num_tokens=scheduler_output.total_num_scheduled_tokens,
                num_reqs=num_reqs,
                num_scheduled_tokens_np=num_scheduled_tokens_np,
                max_num_scheduled_tokens=int(num_scheduled_tokens_np.max()),
                use_cascade_attn=False,
                num_encoder_reqs=len(scheduler_output.scheduled_encoder_inputs),
                allow_microbatching=runner._allow_microbatching(num_reqs, num_scheduled_tokens_np),
            )
    except CoordError:
        raise
    except Exception:  # vLLM's own error: the sync raises it again, where vLLM expects it
        return


def prepare_inputs_starting_early(
    original: Callable[..., Any],
    runner_class: type,
    start: Callable[[Any, Any, Any], None],
    abandon: Callable[[], None],
) -> Callable[..., Any]:
    """`original` (`_prepare_inputs`) preceded by `start(runner, scheduler_output,
    num_scheduled_tokens)` for runners whose step is `runner_class`'s own (a subclass that
    overrides one of the three methods keeps vLLM's order: no early start). If `original`
    raises, `abandon()` ends the started round (the sync will not come)."""
    checked: dict[type, bool] = {}
    names = ("execute_model", "_determine_batch_execution_and_padding", "_allow_microbatching")

    def own_step(cls: type) -> bool:
        ok = checked.get(cls)
        if ok is None:
            ok = checked[cls] = all(
                getattr(cls, name) is getattr(runner_class, name) for name in names
            )
        return ok

    @functools.wraps(original)
    def _prepare_inputs(
        self: Any, scheduler_output: Any, num_scheduled_tokens: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if own_step(type(self)):
            step = sys._getframe(1)  # execute_model's: only a sync under it collects the round
            with contextlib.suppress(early.Started, early.NotStarted), early.InStep(step):
                start(self, scheduler_output, num_scheduled_tokens)
        try:
            return original(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
        except BaseException:
            abandon()
            raise

    _prepare_inputs.coordd_patch = True  # type: ignore[attr-defined]
    return _prepare_inputs
