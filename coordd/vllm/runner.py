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
import functools
import inspect
import itertools
import sys
import textwrap
from collections.abc import Callable, Mapping
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


#: The statement after `_prepare_inputs` in `execute_model`'s block that makes the sync.
SYNC = "self._determine_batch_execution_and_padding"
#: The calls from the sync function down to its all-reduce, each made in the one before
#: (vllm.v1.worker.dp_utils, the same in 0.32 and 0.33): the frames `early.Started` unwinds.
SYNC_PATH = (
    "_determine_batch_execution_and_padding",
    "coordinate_batch_across_dp",
    "_synchronize_dp_ranks",
    "_run_ar",
    "dist.all_reduce",
)
#: What the sync reads: nothing between `_prepare_inputs` and the sync may rebind them; the
#: ones that are objects may not be mutated either (a store into them, a method call on them,
#: or passing them to a call).
INPUTS = frozenset(
    {
        "self",
        "scheduler_output",
        "num_scheduled_tokens_np",
        "num_reqs",
        "num_tokens_unpadded",
        "max_num_scheduled_tokens",
    }
)
OBJECT_INPUTS = frozenset({"self", "scheduler_output", "num_scheduled_tokens_np"})


def window_in(runner_class: Any) -> str:
    """Why `runner_class.execute_model` does not open the window this module starts the sync
    in (`window_in_sources` on the sources of `execute_model`, the sync function and the
    functions down to its all-reduce, each found where the one before finds it); "" if it
    does."""
    for name in ("execute_model", "_prepare_inputs", SYNC_PATH[0]):
        if not callable(getattr(runner_class, name, None)):
            return f"{runner_class.__name__}.{name} is missing"
    sources: dict[str, str] = {}
    fn: Any = runner_class.execute_model
    for name in ("execute_model", *SYNC_PATH[:-1]):
        if name == SYNC_PATH[0]:
            fn = getattr(runner_class, name)
        elif name != "execute_model":
            fn = getattr(fn, "__globals__", {}).get(name)
            if not callable(fn):
                return f"{name} is not found where {runner_class.__name__} calls it"
        try:
            sources[name] = inspect.getsource(fn)
        except (OSError, TypeError) as exc:
            return f"cannot read {name}: {exc}"
    return window_in_sources(sources)


def window_in_sources(sources: Mapping[str, str]) -> str:
    """Why these sources (by function name: `execute_model` and every `SYNC_PATH` function but
    the all-reduce) do not open the window; "" if they do. `execute_model` sets `ASSIGNED`,
    calls `PREPARE`, and makes the sync with `SYNC_KEYWORDS` in a later statement of the same
    block, with nothing between the two that leaves the block or rebinds or mutates `INPUTS`;
    and no function the early call unwinds (`SYNC_PATH`) has a `with`, a `try/finally` or an
    `except BaseException` before its call towards the all-reduce, which `Started` would run."""
    trees: dict[str, ast.AST] = {}
    for name in ("execute_model", *SYNC_PATH[:-1]):
        if name not in sources:
            return f"no source for {name}"
        try:
            trees[name] = ast.parse(textwrap.dedent(sources[name]))
        except SyntaxError as exc:
            return f"cannot parse {name}: {exc}"
    why = _step_window(trees["execute_model"])
    if why:
        return why
    for name, callee in itertools.pairwise(SYNC_PATH):
        why = _unwound(name, trees[name], callee)
        if why:
            return why
    return ""


def _ordered(tree: ast.AST) -> list[Any]:
    """Assignments and calls in source order (ast.walk is breadth-first)."""
    return sorted(
        (n for n in ast.walk(tree) if isinstance(n, ast.Assign | ast.Call)),
        key=lambda n: (n.lineno, n.col_offset),
    )


def _step_window(tree: ast.AST) -> str:
    """`window_in_sources`'s rules for `execute_model`."""
    assigned: dict[str, str] = {}
    prepare: ast.Call | None = None
    for node in _ordered(tree):
        if isinstance(node, ast.Assign):
            if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                assigned[node.targets[0].id] = ast.unparse(node.value)
            continue
        text = ast.unparse(node.func)
        if text == "self._prepare_inputs" and prepare is None:
            if ast.unparse(node) != PREPARE:
                return f"execute_model calls {ast.unparse(node)}, not {PREPARE}"
            for name, value in ASSIGNED.items():
                if assigned.get(name) != value:
                    return f"execute_model sets {name} = {assigned.get(name)}, not {value}"
            prepare = node
        elif text == SYNC and prepare is not None:
            keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
            if node.args or keywords != SYNC_KEYWORDS:
                return f"execute_model's sync call differs: {ast.unparse(node)}"
            return _between(tree, prepare, node)
    return "execute_model makes no sync after _prepare_inputs"


def _statement_of(tree: ast.AST, call: ast.AST) -> tuple[list[ast.stmt], int] | None:
    """The block (a statement list) whose statement holds `call`, innermost, and its index."""
    found = None
    for node in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if not isinstance(block, list):
                continue
            for i, stmt in enumerate(block):
                holds = isinstance(stmt, ast.stmt) and any(n is call for n in ast.walk(stmt))
                if holds and (found is None or stmt.lineno >= found[0][found[1]].lineno):
                    found = (block, i)
    return found


def _between(tree: ast.AST, prepare: ast.Call, sync: ast.Call) -> str:
    """Why the statements from `_prepare_inputs`'s to the sync's may change what the sync
    reads; "" if they cannot."""
    at_prepare, at_sync = _statement_of(tree, prepare), _statement_of(tree, sync)
    if at_prepare is None or at_sync is None or at_prepare[0] is not at_sync[0]:
        return "execute_model's sync is not in _prepare_inputs's block"
    block, first, last = at_prepare[0], at_prepare[1], at_sync[1]
    prepared = block[first]
    if isinstance(prepared, ast.Assign | ast.AugAssign | ast.AnnAssign):
        targets = prepared.targets if isinstance(prepared, ast.Assign) else [prepared.target]
        why = _rebinds(targets)
        if why:
            return f"execute_model's _prepare_inputs call {why}"
    elif not isinstance(prepared, ast.Expr):
        return "execute_model's _prepare_inputs call is not a statement of its own"
    for stmt in block[first + 1 : last]:
        why = _changes(stmt)
        if why:
            return f"between _prepare_inputs and the sync, execute_model {why} (line {stmt.lineno})"
    return ""


def _root(node: ast.AST) -> str | None:
    """The name an attribute, subscript or starred chain starts from."""
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Starred | ast.Call):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _rebinds(targets: list[Any]) -> str:
    for target in targets:
        if isinstance(target, ast.Tuple | ast.List):
            why = _rebinds(list(target.elts))
            if why:
                return why
            continue
        root = _root(target)
        if root in INPUTS:
            return f"stores into {ast.unparse(target)}"
    return ""


def _changes(stmt: ast.stmt) -> str:
    """What in `stmt` leaves the block or may change one of `INPUTS`; "" if nothing."""
    for node in ast.walk(stmt):
        if isinstance(node, ast.Return | ast.Break | ast.Continue | ast.Raise):
            return f"leaves the block ({type(node).__name__.lower()})"
        if isinstance(node, ast.Yield | ast.YieldFrom | ast.Await):
            return f"suspends ({type(node).__name__.lower()})"
        if isinstance(node, ast.With | ast.AsyncWith | ast.Try | ast.TryStar):
            return f"has a {type(node).__name__.lower()} statement"
        targets: list[Any] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign | ast.NamedExpr | ast.For):
            targets = [node.target]
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = {(a.asname or a.name).partition(".")[0] for a in node.names}
            if names & INPUTS:
                return f"imports over {sorted(names & INPUTS)[0]}"
        elif isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute) and _root(node.func.value) in OBJECT_INPUTS:
                return f"calls {ast.unparse(node.func)}"
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                if _root(arg) in OBJECT_INPUTS:
                    return f"passes {ast.unparse(arg)} to {ast.unparse(node.func)}"
        why = _rebinds(targets)
        if why:
            return why
    return ""


def _catches_base(handler: ast.ExceptHandler) -> bool:
    """Whether `handler` catches `early.Started` (a BaseException): bare, or naming
    BaseException (alone or in a tuple)."""
    if handler.type is None:
        return True
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(ast.unparse(n).rpartition(".")[2] == "BaseException" for n in names)


def _unwound(name: str, tree: ast.AST, callee: str) -> str:
    """Why `Started`, raised under `name`'s call of `callee`, would run code of `name` on its
    way out (or `name` makes no such call); "" if it would not."""
    calls = [n for n in _ordered(tree) if isinstance(n, ast.Call)]
    call = next((c for c in calls if ast.unparse(c.func) == callee), None)
    if call is None:
        return f"{name} makes no call to {callee}"
    for node in ast.walk(tree):
        if getattr(node, "lineno", call.lineno + 1) > call.lineno:
            continue
        if isinstance(node, ast.With | ast.AsyncWith):
            return f"{name} has a with statement before its call to {callee} (line {node.lineno})"
        if isinstance(node, ast.Try | ast.TryStar):
            if node.finalbody:
                return f"{name} has a try/finally before its call to {callee} (line {node.lineno})"
            if any(_catches_base(h) for h in node.handlers):
                return (
                    f"{name} catches BaseException before its call to {callee} (line {node.lineno})"
                )
    return ""


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
    refused: Callable[[str], None] = lambda why: None,
) -> Callable[..., Any]:
    """`original` (`_prepare_inputs`) preceded by `start(runner, scheduler_output,
    num_scheduled_tokens)` for runners whose step is `runner_class`'s own (a subclass that
    overrides one of the three methods keeps vLLM's order: no early start). If `original`
    raises, `abandon()` ends the started round (the sync will not come). A start that ends in
    `early.NotStarted` is told to `refused` with its `why`; one with a why (this process's
    sync can never start early) is the last: `start` is not called again."""
    checked: dict[type, bool] = {}
    names = ("execute_model", "_determine_batch_execution_and_padding", "_allow_microbatching")
    never: list[str] = []

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
        if not never and own_step(type(self)):
            step = sys._getframe(1)  # execute_model's: only a sync under it collects the round
            try:
                with early.InStep(step):
                    start(self, scheduler_output, num_scheduled_tokens)
            except early.Started:
                pass
            except early.NotStarted as refusal:
                if refusal.why:
                    never.append(refusal.why)
                refused(refusal.why)
        try:
            return original(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
        except BaseException:
            abandon()
            raise

    _prepare_inputs.coordd_patch = True  # type: ignore[attr-defined]
    return _prepare_inputs
