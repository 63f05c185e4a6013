"""The patch points: where vLLM 0.32's and 0.33's DP syncs call their collective, via coordd.

vLLM's own sync functions still build their tensors and compute every decision from the
result; only the collective underneath becomes a gather round (`Exchange.sync_`). Each
point is one module or class attribute, so every importer of a sync function is covered
without rebinding names, and syncs that vLLM answers locally (`should_skip_dp_coordination()`,
a reused `DPSyncState`) never reach a patch point and make no round.

  A  vllm.v1.worker.dp_utils.dist             a stand-in for torch.distributed whose all_reduce
                                               on the worker DP group goes to coordd (V1 runner,
                                               drafter, extract-hidden-states, forward context)
  B  Model Runner V2 and its speculators (vllm.v1.worker.gpu.dp_utils):
     0.33: GroupCoordinator.cpu_all_reduce_    routed when called on the worker DP group ([7, dp])
     0.32: vllm.v1.worker.gpu.dp_utils.dist    a stand-in as in A ([6, dp])
  C  the engine-state SUM of ParallelConfig.sync_dp_state:
     0.33: vllm.config.parallel.cpu_all_reduce_  its only caller is sync_dp_state
     0.32: ParallelConfig.sync_dp_state        a staticmethod calling torch.distributed itself:
                                               wrapped as D is
  D  ParallelConfig.has_unfinished_dp and      the static methods wrapped: MAX and MIN over the
     ParallelConfig.sync_kv_cache_memory_size  engine DP group
  E  ParallelConfig.stateless_init_dp_group    registers the engine-core DP group it creates
  F  DPEngineCoreProc.shutdown                 says Goodbye to coordd first (vLLM SIGKILLs an
                                               engine core ~5 s after its SIGTERM; the rest of
                                               its shutdown may not finish)
  G  GPUModelRunner._prepare_inputs            the V1 runner's sync round starts before it
                                               (coordd.vllm.runner; only with
                                               COORDD_VLLM_OVERLAP=1, off by default);
                                               patched when vLLM imports the runner's module
                                               (coordd.vllm.lazy), which the plugin never does

An early call (G's, in `early.StartingMode`) is refused at every patch point with
`early.NotStarted` before it makes a link, a round or a collective; only A, on the worker DP
group's CPU tensor, starts a round. A refusal that says why ends G's early start in this
process (a WARNING, counted in `startup()`).

A clean exit is a Goodbye, not a lost rank: F on the engine core's exit path, and an exit hook
(atexit, and multiprocessing's exit finalizers, which vLLM's worker processes run) in every
process that made a link. A process that dies without either is lost, as it should be.

`install()` imports none of the patched modules (`POINT_MODULES`): a point whose module the
process has loaded is patched at install, any other when vLLM imports its module
(`coordd.vllm.lazy`), before vLLM can call through it. Each point is checked before it is
patched: if a point loaded at install does not look as expected (a vLLM whose code moved), or
the release is none of `SUPPORTED`, the install logs one warning naming why and patches
nothing, so vLLM keeps its own collectives; a point that fails its check when its module is
imported later is left to vLLM alone, with a warning naming it. Async or non-integer
all-reduces, and other groups, always take vLLM's path.
"""

# Whole though over 500 lines: every patch point of both vLLM versions, installed and undone
# together; split, an install and its undo would live apart.

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as torch_dist

from coordd.proto.errors import CoordError
from coordd.vllm import early, lazy, runner, sites, timings
from coordd.vllm.enable import TIMINGS_ENV, PluginSettings
from coordd.vllm.exchange import Exchange
from coordd.vllm.groups import GroupIdentity, engine_group, worker_group
from coordd.vllm.reduce import Layout, ReduceOp, can_gather

#: A child of vLLM's own logger, so its lines show in vLLM's output, in vLLM's format.
log = logging.getLogger("vllm.coordd")

#: The vLLM release lines whose patch points were read from their sources.
SUPPORTED = ("0.32", "0.33")
#: The V1 runner's module: G and the step timings patch it once vLLM has imported it.
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
#: Why no round starts early while the V1 runner is not loaded in this process.
RUNNER_PENDING = "vLLM's V1 runner is not loaded in this process"
#: COORDD_VLLM_TRACE=1: print each sync's site label the first time this process makes it.
_TRACE = os.environ.get("COORDD_VLLM_TRACE", "") == "1"
_traced: set[str] = set()


class PatchRefused(RuntimeError):
    """A patch target is missing or not what this plugin was written against."""


def site_label(op: ReduceOp, tensor: torch.Tensor, layout: Layout, sync: str = "") -> str:
    """What a sync is, the same on every rank that runs it (`coordd.vllm.sites`): the vLLM
    sync function, its first caller outside the sync modules (so a drafter's sync differs
    from the runner's), the op, dtype, shape and layout. A rank that skipped or added a sync
    sends another label, which coordd reports as a StepMismatch naming it. `sync`: the sync
    function's name when a patch stands in for it (no frame of vLLM's sync module is on the
    stack then)."""
    return sites.label(op, tensor, layout, depth=2, sync=sync)


@dataclass
class _State:
    """The plugin's state in this process."""

    exchange: Exchange | None = None
    #: (obj, name, original value) for every attribute replaced, in order.
    saved: list[tuple[Any, str, Any]] = field(default_factory=list)
    #: vLLM's worker DP GroupCoordinator and its identity (recomputed if vLLM swaps `_DP`).
    worker: tuple[Any, GroupIdentity] | None = None
    #: id(process group) -> (process group, identity or None until its first sync)
    engine: dict[int, tuple[Any, GroupIdentity | None]] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    #: Why the V1 runner's round does not start early ("" when it does).
    no_overlap: str = "not installed"
    #: Overlap asked for (COORDD_VLLM_OVERLAP), and what the step timings' mode is then.
    overlap: bool = False
    timings_mode: str = ""
    #: Drop the waits for modules not yet imported (`lazy.when_imported`: the patch points'
    #: and the runner's) that have not fired.
    waits: list[Callable[[], None]] = field(default_factory=list)
    #: The per-step timings (COORDD_VLLM_TIMINGS), if any, and the attributes they replaced.
    clock: Any = None
    timed: list[tuple[Any, str, Any]] = field(default_factory=list)
    #: The start-up line, until vLLM's log can show it, and its part before the V1 runner's.
    line: str = ""
    head: str = ""
    #: Faults this process logged, by error (each is logged once per rebuild of its groups).
    said: set[tuple[int, str]] = field(default_factory=set)
    #: The start-up line's data (`startup()`): the release, coordd's address, the early start's
    #: counts (its state is `no_overlap`'s, which `startup()` reads).
    data: dict[str, Any] = field(default_factory=dict)
    #: Whether the runner's first early start has checked the path its sync takes.
    path_checked: bool = False


_state = _State()


def installed() -> bool:
    """Whether the plugin is installed in this process (its patch points are patched now or
    when vLLM imports their modules)."""
    return _state.exchange is not None


def exchange() -> Exchange | None:
    """The process's exchange while the plugin is installed (tests read its round counts)."""
    return _state.exchange


# -- which group a collective belongs to -----------------------------------------------------


def _worker_identity(coordinator: Any) -> GroupIdentity:
    cached = _state.worker
    if cached is None or cached[0] is not coordinator:
        cached = (coordinator, worker_group())
        _state.worker = cached
    return cached[1]


def _worker_route(group: Any) -> GroupIdentity | None:
    """The worker DP group's identity if `group` is its cpu_group or device_group."""
    from vllm.distributed import parallel_state as ps

    dp = ps._DP
    if dp is None or group is None:
        return None
    if group is not dp.cpu_group and group is not dp.device_group:
        return None
    return _worker_identity(dp)


def _worker_cpu_group() -> Any:
    """The worker DP group's gloo group (a worker sync may run on its device group)."""
    from vllm.distributed import parallel_state as ps

    return ps._DP.cpu_group


def register_engine_group(process_group: Any) -> None:
    """Mark a process group as an engine-state DP group (patch E; C and D do it lazily, since
    a spawned engine core creates its group before vLLM loads plugins)."""
    with _state.lock:
        known = _state.engine.get(id(process_group))
        if known is None or known[0] is not process_group:
            _state.engine[id(process_group)] = (process_group, None)


def _engine_route(process_group: Any) -> GroupIdentity:
    known = _state.engine.get(id(process_group))
    if known is None or known[0] is not process_group:
        register_engine_group(process_group)
        known = _state.engine[id(process_group)]
    if known[1] is None:
        identity = engine_group(process_group)
        _state.engine[id(process_group)] = (process_group, identity)
        return identity
    return known[1]


#: Frames `Exchange.sync_` skips before it looks for the call site: `_sync_` and the patch
#: (at least those two stand between it and vLLM's frames on every patch's path).
_SKIP = 2


def _sync_(
    tensor: torch.Tensor,
    op: ReduceOp,
    identity: GroupIdentity,
    column: bool,
    sync: str = "",
    group: Any = None,
) -> bool:
    """Run the collective as a gather round; False (nothing done) if the tensor is not an
    integer one or its values do not fit one round, so the caller takes vLLM's own path
    (decided by dtype and shape: every rank agrees). vLLM's worker syncs (`column`) write
    only their own column, which is all that goes; if one ever does not, the whole tensor
    goes (and its label says so: ranks that disagree fail loudly, never add up wrongly).
    `sync`: as `site_label`'s; `group`: the group's gloo group, where the fallback settles
    and votes (`coordd.vllm.fallback`)."""
    exchange = _state.exchange
    if _state.line:
        _say_installed()
    try:
        return exchange is not None and exchange.sync_(
            tensor, op, identity, column, _SKIP, sync, group
        )
    except CoordError as error:
        _say_fault(identity, error)
        raise


def _engine_sync(tensor: torch.Tensor, op: ReduceOp, dp_group: Any, sync: str) -> bool:
    """`_sync_` for an engine-core sync on `dp_group` (the whole tensor, the group's own gloo
    group to fall back on)."""
    return _sync_(tensor, op, _engine_route(dp_group), False, sync, dp_group)


def _start_(tensor: torch.Tensor, op: ReduceOp, identity: GroupIdentity) -> bool:
    """Start the round of the V1 runner's sync now (`coordd.vllm.early`); False if it cannot
    start early (it then runs at the sync)."""
    exchange = _state.exchange
    if _state.line:
        _say_installed()
    try:
        return exchange is not None and exchange.start_(tensor, op, identity, True, _SKIP)
    except CoordError as error:
        _say_fault(identity, error)
        raise


def _say_fault(identity: GroupIdentity, error: CoordError) -> None:
    """One ERROR line in vLLM's log for a sync's fault, naming the culprit (the error's text);
    the error itself goes on up through vLLM's step."""
    text = f"{type(error).__name__}: {error}"
    exchange = _state.exchange
    said = (exchange.regroups if exchange is not None else 0, text)  # again after a rebuild
    if said not in _state.said and len(_state.said) < 64:
        _state.said.add(said)
        log.error(
            "coordd: DP sync of group %s (rank %d) failed: %s",
            identity.name,
            identity.dp_rank,
            text,
        )


def _trace(identity: GroupIdentity, site: str) -> None:
    """COORDD_VLLM_TRACE=1: print a sync's site label the first time this process makes it."""
    if site not in _traced:
        _traced.add(site)
        print(
            f"coordd vLLM plugin: {identity.name} rank {identity.dp_rank}: sync {site}",
            file=sys.stderr,
            flush=True,
        )


_OPS = {
    torch_dist.ReduceOp.SUM: ReduceOp.SUM,
    torch_dist.ReduceOp.MAX: ReduceOp.MAX,
    torch_dist.ReduceOp.MIN: ReduceOp.MIN,
}


def _reduce_op(op: Any) -> ReduceOp | None:
    for torch_op, ours in _OPS.items():
        if op == torch_op:
            return ours
    return None


# -- A: the V1 runner's `dist` ----------------------------------------------------------------


class DistShim(types.ModuleType):
    """Stands in for `torch.distributed` inside vllm.v1.worker.dp_utils: `all_reduce` on the
    worker DP group goes to coordd; every other name and call is torch.distributed's own."""

    coordd_patch = True

    def __init__(self) -> None:
        super().__init__("torch.distributed")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch_dist, name)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: Any = torch_dist.ReduceOp.SUM,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        ours = _reduce_op(op)
        if early.starting():  # the early start's run of the sync: never vLLM's collective
            if ours is None or async_op:
                raise early.NotStarted(f"the sync's all-reduce ({op}, async_op={async_op})")
            identity = _worker_route(group)
            if identity is None:
                raise early.NotStarted("the sync's all-reduce is not on the worker DP group")
            if _start_(tensor, ours, identity):
                raise early.Started
            raise early.NotStarted  # at the sync this time (vLLM's own path, coordd lost)
        if ours is not None and not async_op and _state.exchange is not None:
            identity = _worker_route(group)
            if identity is not None and _sync_(
                tensor, ours, identity, True, group=_worker_cpu_group()
            ):
                return None
        return torch_dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


# -- the checks and the install ---------------------------------------------------------------


def release_line(version: str) -> str | None:
    """The supported release line `version` belongs to ("0.32", "0.33"), or None."""
    for line in SUPPORTED:
        if version == line or version.startswith(line + "."):
            return line
    return None


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise PatchRefused(what)


def _is_torch_dist(module: types.ModuleType, where: str, label: str) -> None:
    _need(
        module.__dict__.get("dist") is torch_dist, f"{label}: {where}.dist is not torch.distributed"
    )


#: Each patch point's module: the one whose import brings the point's targets into a process,
#: or (B in 0.33, whose target is GroupCoordinator's) its only caller in vLLM. A point whose
#: module this process has loaded is checked and patched at install, any other when vLLM
#: imports its module (`lazy`), before vLLM can call through it: importing them all at install
#: was most of its CPU (tests/vllm/install_cost.py).
POINT_MODULES = {
    "A": "vllm.v1.worker.dp_utils",
    "B": "vllm.v1.worker.gpu.dp_utils",
    "C-E": "vllm.config.parallel",
    "F": "vllm.v1.engine.core",
}


def _loaded(name: str) -> types.ModuleType:
    """A module the point's module imports itself (so loaded by now): refused if it is not."""
    module = sys.modules.get(name)
    _need(module is not None, f"{name} is not loaded")
    assert module is not None
    return module


def _check_a(line: str, v1_dp_utils: types.ModuleType) -> Callable[[], None]:
    parallel_state = _loaded("vllm.distributed.parallel_state")
    _is_torch_dist(v1_dp_utils, "vllm.v1.worker.dp_utils", "A")
    _need(callable(v1_dp_utils.__dict__.get("_run_ar")), "A: vllm.v1.worker.dp_utils._run_ar")
    _need(
        callable(v1_dp_utils.__dict__.get("should_skip_dp_coordination")),
        "A: vllm.v1.worker.dp_utils.should_skip_dp_coordination",
    )
    _need(hasattr(parallel_state, "_DP"), "A: vllm.distributed.parallel_state._DP")
    return lambda: _replace(v1_dp_utils, "dist", DistShim())


def _check_b(line: str, v2_dp_utils: types.ModuleType) -> Callable[[], None]:
    parallel_state = _loaded("vllm.distributed.parallel_state")
    _need(hasattr(parallel_state, "_DP"), "B: vllm.distributed.parallel_state._DP")
    _need(
        callable(v2_dp_utils.__dict__.get("sync_cudagraph_and_dp_padding")),
        "B: vllm.v1.worker.gpu.dp_utils.sync_cudagraph_and_dp_padding",
    )
    if line == "0.33":
        coordinator: Any = getattr(parallel_state, "GroupCoordinator", None)
        _need(
            coordinator is not None and callable(coordinator.__dict__.get("cpu_all_reduce_")),
            "B: GroupCoordinator.cpu_all_reduce_",
        )
        return lambda: _patch_b(coordinator, parallel_state)
    _is_torch_dist(v2_dp_utils, "vllm.v1.worker.gpu.dp_utils", "B")
    return lambda: _replace(v2_dp_utils, "dist", DistShim())


def _check_c_e(line: str, config_parallel: types.ModuleType) -> Callable[[], None]:
    parallel_config = getattr(config_parallel, "ParallelConfig", None)
    _need(isinstance(parallel_config, type), "C: vllm.config.parallel.ParallelConfig")
    assert isinstance(parallel_config, type)
    sync_dp_state = parallel_config.__dict__.get("sync_dp_state")
    if line == "0.33":
        dist_utils = _loaded("vllm.distributed.utils")
        util = config_parallel.__dict__.get("cpu_all_reduce_")
        _need(
            util is dist_utils.__dict__.get("cpu_all_reduce_") and callable(util),
            "C: vllm.config.parallel.cpu_all_reduce_ is not vllm.distributed.utils.cpu_all_reduce_",
        )
        _need(
            callable(sync_dp_state) and not isinstance(sync_dp_state, staticmethod),
            "C: ParallelConfig.sync_dp_state is not a method",
        )
    else:  # 0.32
        _need(
            isinstance(sync_dp_state, staticmethod),
            "C: ParallelConfig.sync_dp_state is not a staticmethod",
        )
        assert isinstance(sync_dp_state, staticmethod)
        _need(
            list(inspect.signature(sync_dp_state.__func__).parameters)
            == ["dp_group", "has_unfinished", "pending_pause"],
            "C: ParallelConfig.sync_dp_state(dp_group, has_unfinished, pending_pause)",
        )
    for name in ("has_unfinished_dp", "sync_kv_cache_memory_size"):
        _need(
            isinstance(parallel_config.__dict__.get(name), staticmethod),
            f"D: ParallelConfig.{name} is not a staticmethod",
        )
    _need(
        callable(parallel_config.__dict__.get("stateless_init_dp_group")),
        "E: ParallelConfig.stateless_init_dp_group",
    )
    return lambda: _patch_c_e(line, config_parallel, parallel_config)


def _check_f(line: str, engine_core: types.ModuleType) -> Callable[[], None]:
    dp_engine: Any = getattr(engine_core, "DPEngineCoreProc", None)
    _need(
        isinstance(dp_engine, type) and callable(dp_engine.__dict__.get("shutdown")),
        "F: vllm.v1.engine.core.DPEngineCoreProc.shutdown",
    )
    return lambda: _patch_f(dp_engine)


#: Each point's check: the point's module -> its patch, or PatchRefused naming what differs.
_CHECKS: dict[str, Callable[[str, types.ModuleType], Callable[[], None]]] = {
    "A": _check_a,
    "B": _check_b,
    "C-E": _check_c_e,
    "F": _check_f,
}


def _targets(line: str) -> list[Callable[[], None]]:
    """Import every patch point's module and check it against release line `line`: the
    patches, or PatchRefused naming the first target that differs (tests: the install itself
    imports none of them)."""
    try:
        modules = {point: importlib.import_module(name) for point, name in POINT_MODULES.items()}
    except ImportError as exc:
        raise PatchRefused(f"cannot import a patched vLLM module: {exc}") from exc
    return [_CHECKS[point](line, module) for point, module in modules.items()]


def _refuse(why: str) -> bool:
    log.warning(
        "coordd vLLM plugin NOT installed, vLLM keeps its own DP collectives: %s "
        "(the plugin supports vLLM %s)",
        why,
        " and ".join(f"{line}.x" for line in SUPPORTED),
    )
    return False


def install(settings: PluginSettings) -> bool:
    """Route vLLM's DP syncs through coordd in this process; idempotent. Returns True if the
    plugin is installed (the points whose modules are loaded patched, the others waiting for
    vLLM to import theirs), False if this vLLM is not a supported release or a loaded point's
    shape differs from that release's (one warning says why; nothing is patched then)."""
    with _state.lock:
        if _state.exchange is not None:
            return True
        try:
            import vllm
        except ImportError as exc:
            return _refuse(f"cannot import vllm: {exc}")
        version = str(getattr(vllm, "__version__", "?"))
        line = release_line(version)
        if line is None:
            return _refuse(f"vLLM {version} is not a supported release")
        # (a module another thread is importing is waited for, as `import` would)
        loaded = {p: lazy.loaded(name) for p, name in POINT_MODULES.items()}
        try:  # every point loaded here is checked before any is patched
            ready = [_CHECKS[p](line, module) for p, module in loaded.items() if module]
        except PatchRefused as exc:
            return _refuse(f"vLLM {version}: {exc}")
        _state.exchange = Exchange(settings, trace=_trace if _TRACE else None)
        for patch in ready:
            patch()
        for point, module in loaded.items():
            if module is None:
                then = functools.partial(_point_loaded, point, line)
                _state.waits.append(lazy.when_imported(POINT_MODULES[point], then))
        _state.overlap = settings.overlap
        _state.no_overlap = RUNNER_PENDING if settings.overlap else OVERLAP_OFF
        _state.data = {
            "vllm": version,
            "address": settings.address or "the default ipc path",
            "early_refused": 0,
            "not_started": 0,
        }
        _state.head = (
            f"coordd vLLM plugin installed for vLLM {version}, coordd at "
            f"{settings.address or 'the default ipc path'}: every DP sync (V1 runner, drafters, "
            "Model Runner V2, engine cores) is a coordd round; "
        )
        _state.line = _line()
        _state.timings_mode = "plugin" if os.environ.get(TIMINGS_ENV, "").strip() else ""
        if settings.overlap or _state.timings_mode:
            _state.waits.append(lazy.when_imported(RUNNER_MODULE, _runner_loaded))
    _say_installed()
    return True


def _point_loaded(point: str, line: str, module: types.ModuleType) -> None:
    """Patch point `point` once vLLM has imported its module (inside that import, before any
    caller can reach it). If its target differs from what the patch expects, only this point
    is left to vLLM, with a warning naming it: its syncs have made no round yet, and every
    rank of its groups runs the same vLLM, so all take vLLM's own path there alike."""
    try:
        with _state.lock:
            if _state.exchange is None:  # uninstalled meanwhile
                return
            _CHECKS[point](line, module)()
    except PatchRefused as exc:
        log.warning(
            "coordd vLLM plugin: patch point %s NOT installed, vLLM keeps its own collective "
            "there: %s",
            point,
            exc,
        )
    except Exception:
        log.exception("coordd vLLM plugin: patching %s failed; vLLM keeps its own", module.__name__)


def _line() -> str:
    """The start-up line's text: its head, then what it says of the early start."""
    return _state.head + _overlap_clause()


def _overlap_clause() -> str:
    """What the start-up line says of the V1 runner's early start."""
    why = _state.no_overlap
    if not why:
        return (
            "the V1 runner's round starts before _prepare_inputs and is collected at its sync "
            "(COORDD_VLLM_OVERLAP=0 turns that off)"
        )
    if why == RUNNER_PENDING:
        return (
            "the V1 runner's round starts before _prepare_inputs once vLLM loads that runner "
            "here, if its execute_model has the window (COORDD_VLLM_OVERLAP=0 turns that off)"
        )
    if _state.data.get("early_refused"):
        return f"every round starts at vLLM's sync (the early start is refused: {why})"
    return f"every round starts at vLLM's sync ({why})"


def _runner_loaded(module: types.ModuleType) -> None:
    """G and the step timings, once vLLM has imported the V1 runner's module (inside that
    import: whatever goes wrong here is logged, and vLLM keeps its own runner)."""
    try:
        with _state.lock:
            runner_class = getattr(module, "GPUModelRunner", None)
            if _state.timings_mode == "stock":
                if runner_class is not None:
                    _time_runner(runner_class, "stock")
                return
            if _state.exchange is None:  # uninstalled meanwhile
                return
            why = _state.no_overlap if not _state.overlap else _window(runner_class)
            if not why and runner_class is not None:
                _patch_runner(runner_class)
            _state.no_overlap = why
            if _state.timings_mode and runner_class is not None:
                _time_runner(runner_class, "off" if why else "on")
            pending = bool(_state.line)
            if _state.overlap and why:
                _early_refused(why)  # says the line again if it is not out yet
            elif pending:  # not said yet: the start-up line says what was decided
                _state.line = _line()
        if not pending and _state.overlap and not why:
            log.info("coordd vLLM plugin: vLLM's V1 runner loaded: %s", _overlap_clause())
    except Exception:
        log.exception("coordd vLLM plugin: patching vLLM's V1 runner failed; it runs as vLLM's")


def _say_installed() -> None:
    """The start-up line, in vLLM's log: now if vLLM's logging shows it already, else at the
    process's first sync (a process may load plugins before vLLM configures its logging). Its
    data (`startup()`) goes with it as the record's `coordd` attribute."""
    line = _state.line
    if line and log.isEnabledFor(logging.INFO) and log.hasHandlers():
        _state.line = ""
        log.info("%s", line, extra={"coordd": startup()})


def startup() -> dict[str, Any]:
    """The start-up line's data, as it stands now: `vllm`, `address`, `overlap` (whether the
    V1 runner's round starts early in this process), `no_overlap` (why not, "" if it does),
    `early_refused` (early starts refused for good: 0 or 1) and `not_started` (early starts
    that left their round to the sync, this time only). `overlap` and `no_overlap` are read
    from `_state.no_overlap`, the one place the early start's state is kept."""
    data, why = _state.data, _state.no_overlap
    return {**data, "overlap": not why, "no_overlap": why} if data else {}


def _early_refused(why: str) -> None:
    """The V1 runner's early start can never start in this process (`why`): a WARNING (an
    early start was asked for and is not made), counted in the start-up line's data, which
    the line says too if it is not out yet; the step clock times what runs, overlap off."""
    _state.no_overlap = why
    data = _state.data
    data["early_refused"] = data.get("early_refused", 0) + 1
    if _state.line:
        _state.line = _line()
    if _state.clock is not None:
        _state.clock.mode = "off"
    log.warning(
        "coordd vLLM plugin: the V1 runner's DP sync round starts at vLLM's sync, not before "
        "_prepare_inputs: %s",
        why,
    )


def overlapping() -> bool:
    """True if the V1 runner's round starts early in this process."""
    return installed() and not _state.no_overlap


#: Why the runner's round starts at its sync when the early start was not asked for.
OVERLAP_OFF = (
    "COORDD_VLLM_OVERLAP=0, the default: the early start did not pay on the CPU engine; "
    "COORDD_VLLM_OVERLAP=1 turns it on"
)


def _window(runner_class: type | None) -> str:
    """Why the V1 runner class's sync does not start early ("" if it does)."""
    if runner_class is None:
        return f"{RUNNER_MODULE} has no GPUModelRunner"
    return runner.window_in(runner_class)


def _patch_runner(runner_class: type) -> None:
    """G: the V1 runner's `_prepare_inputs`, preceded by its sync's early start."""

    def start(model_runner: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> None:
        if _state.exchange is None:
            return
        if not _state.path_checked:
            _state.path_checked = True
            why = _sync_path(model_runner)
            if why:
                raise early.NotStarted(why)
        runner.start_sync(model_runner, scheduler_output, num_scheduled_tokens)

    def abandon() -> None:
        exchange, worker = _state.exchange, _state.worker
        if exchange is not None and worker is not None:
            exchange.abandon(worker[1])

    def refused(why: str) -> None:
        if why:
            _early_refused(why)
        elif _state.data:
            _state.data["not_started"] = _state.data.get("not_started", 0) + 1

    original = runner_class.__dict__["_prepare_inputs"]
    _replace(
        runner_class,
        "_prepare_inputs",
        runner.prepare_inputs_starting_early(original, runner_class, start, abandon, refused),
    )


def _sync_path(model_runner: Any) -> str:
    """Why the runner's DP sync can never start early in this process ("" if it can): it
    makes none (DP size 1), or it goes over NCCL on the device (vLLM's `_get_device_and_group`:
    the DP group's device unless `disable_nccl_for_dp_synchronization`), where the early call
    would copy its tensor to the device and be refused, every step."""
    config = getattr(model_runner, "parallel_config", None)
    if config is None:
        return ""
    if getattr(config, "data_parallel_size", 2) <= 1:
        return "data_parallel_size is 1: the runner makes no DP sync"
    if getattr(config, "disable_nccl_for_dp_synchronization", True):
        return ""
    from vllm.distributed import parallel_state as ps

    device = getattr(ps._DP, "device", None)
    if device is None or torch.device(device).type == "cpu":
        return ""
    return (
        f"vLLM's DP sync runs over NCCL on {device} (disable_nccl_for_dp_synchronization is "
        "false); --disable-nccl-for-dp-synchronization puts it on the CPU group"
    )


def _time_runner(runner_class: type, mode: str) -> None:
    """COORDD_VLLM_TIMINGS=DIR: time the V1 runner's steps and their sync in this process
    (`coordd.vllm.timings`), the sync's wait as the exchange reports it."""
    directory = os.environ.get(TIMINGS_ENV, "").strip()
    if not directory or _state.clock is not None:
        return
    clock = timings.make_clock(directory, mode)
    sync = "_determine_batch_execution_and_padding"
    for name, timer in (
        (sync, timings.timed(clock, runner_class.__dict__[sync], "sync")),
        ("execute_model", timings.stepped(clock, runner_class.__dict__["execute_model"])),
    ):
        _state.timed.append((runner_class, name, runner_class.__dict__[name]))
        setattr(runner_class, name, timer)
    _state.clock = clock
    if _state.exchange is not None:
        _state.exchange.on_sync = clock.on_sync


def install_stock_timings() -> None:
    """COORDD_VLLM_TIMINGS with the plugin off: stock vLLM's steps timed the same way, once
    vLLM loads its V1 runner."""
    with _state.lock:
        if _state.timings_mode:
            return
        _state.timings_mode = "stock"
        _state.waits.append(lazy.when_imported(RUNNER_MODULE, _runner_loaded))


def _replace(obj: Any, name: str, value: Any) -> None:
    _state.saved.append((obj, name, obj.__dict__[name]))
    setattr(obj, name, value)


def leave() -> None:
    """Say Goodbye to coordd for every group this process syncs in and close the links (the
    process is shutting down: a clean exit, not a lost rank). The patches stay: a sync after
    this connects again."""
    exchange = _state.exchange
    if exchange is not None:
        exchange.close()


def _engine_state_sum(dp_group: Any, has_unfinished: bool, pending_pause: bool) -> torch.Tensor:
    tensor = torch.tensor([int(has_unfinished), int(pending_pause)], dtype=torch.int32)
    if not _engine_sync(tensor, ReduceOp.SUM, dp_group, "ParallelConfig.sync_dp_state"):
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.SUM, group=dp_group)
    return tensor


def _patch_b(coordinator: type, parallel_state: types.ModuleType) -> None:
    """B in 0.33: Model Runner V2 calls the DP group's cpu_all_reduce_ (in 0.32 B is A's
    stand-in, in Model Runner V2's module)."""
    original_cpu_all_reduce_ = coordinator.__dict__["cpu_all_reduce_"]

    def cpu_all_reduce_(self: Any, tensor: torch.Tensor) -> torch.Tensor:
        early.refuse_starting("B: GroupCoordinator.cpu_all_reduce_")
        # (`_sync_` refuses what `can_gather` would, on its first sight of a dtype and shape)
        if self is parallel_state._DP and _sync_(
            tensor, ReduceOp.SUM, _worker_identity(self), True, group=self.cpu_group
        ):
            return tensor
        return original_cpu_all_reduce_(self, tensor)

    cpu_all_reduce_.coordd_patch = True  # type: ignore[attr-defined]
    _replace(coordinator, "cpu_all_reduce_", cpu_all_reduce_)


def _patch_c_e(line: str, config_parallel: types.ModuleType, parallel_config: type) -> None:
    """C, D and E: the engine-state syncs and the engine DP group's creation."""
    if line == "0.33":
        # C: its only caller in 0.33 is ParallelConfig.sync_dp_state, on the engine DP group
        original_util = config_parallel.__dict__["cpu_all_reduce_"]

        def util_cpu_all_reduce_(
            tensor: torch.Tensor, group: Any, timeout: Any = None
        ) -> torch.Tensor:
            early.refuse_starting("C: vllm.config.parallel.cpu_all_reduce_")
            if (
                isinstance(group, torch_dist.ProcessGroup)
                and can_gather(tensor)
                and _state.exchange is not None
                and _sync_(tensor, ReduceOp.SUM, _engine_route(group), False, group=group)
            ):
                return tensor
            return original_util(tensor, group, timeout)

        _replace(config_parallel, "cpu_all_reduce_", util_cpu_all_reduce_)
    else:
        # C: the staticmethod, wrapped as D's are (vLLM's own arithmetic on the SUM)
        original_sync = parallel_config.__dict__["sync_dp_state"].__func__

        def sync_dp_state(
            dp_group: Any, has_unfinished: bool, pending_pause: bool
        ) -> tuple[bool, bool]:
            early.refuse_starting("C: ParallelConfig.sync_dp_state")
            if not isinstance(dp_group, torch_dist.ProcessGroup) or _state.exchange is None:
                return tuple(original_sync(dp_group, has_unfinished, pending_pause))
            tensor = _engine_state_sum(dp_group, has_unfinished, pending_pause)
            dp_size = dp_group.size()
            pause_count = int(tensor[1].item())
            has_unfinished_global = int(tensor[0].item()) > 0 or pause_count % dp_size != 0
            return has_unfinished_global, pause_count == dp_size

        sync_dp_state.coordd_patch = True  # type: ignore[attr-defined]
        _replace(parallel_config, "sync_dp_state", staticmethod(sync_dp_state))

    # D
    original_unfinished = parallel_config.__dict__["has_unfinished_dp"].__func__

    def has_unfinished_dp(dp_group: Any, has_unfinished: bool) -> bool:
        early.refuse_starting("D: ParallelConfig.has_unfinished_dp")
        if not isinstance(dp_group, torch_dist.ProcessGroup) or _state.exchange is None:
            return bool(original_unfinished(dp_group, has_unfinished))
        tensor = torch.tensor([has_unfinished], dtype=torch.int32, device="cpu")
        if not _engine_sync(tensor, ReduceOp.MAX, dp_group, "ParallelConfig.has_unfinished_dp"):
            return bool(original_unfinished(dp_group, has_unfinished))
        return bool(tensor.item())

    has_unfinished_dp.coordd_patch = True  # type: ignore[attr-defined]
    _replace(parallel_config, "has_unfinished_dp", staticmethod(has_unfinished_dp))

    original_kv = parallel_config.__dict__["sync_kv_cache_memory_size"].__func__

    def sync_kv_cache_memory_size(dp_group: Any, kv_cache_memory: int) -> int:
        early.refuse_starting("D: ParallelConfig.sync_kv_cache_memory_size")
        if not isinstance(dp_group, torch_dist.ProcessGroup) or _state.exchange is None:
            return int(original_kv(dp_group, kv_cache_memory))
        if kv_cache_memory == -1:  # vLLM's "no limit" before its MIN
            kv_cache_memory = torch.iinfo(torch.int64).max
        tensor = torch.tensor([kv_cache_memory], dtype=torch.int64, device="cpu")
        sync = "ParallelConfig.sync_kv_cache_memory_size"
        if not _engine_sync(tensor, ReduceOp.MIN, dp_group, sync):
            return int(original_kv(dp_group, kv_cache_memory))
        return int(tensor.item())

    sync_kv_cache_memory_size.coordd_patch = True  # type: ignore[attr-defined]
    _replace(parallel_config, "sync_kv_cache_memory_size", staticmethod(sync_kv_cache_memory_size))

    # E
    original_init = parallel_config.__dict__["stateless_init_dp_group"]

    def stateless_init_dp_group(self: Any, return_store: bool = False) -> Any:
        early.refuse_starting("E: ParallelConfig.stateless_init_dp_group")
        made = original_init(self, return_store=return_store)
        register_engine_group(made[0] if return_store else made)
        return made

    stateless_init_dp_group.coordd_patch = True  # type: ignore[attr-defined]
    _replace(parallel_config, "stateless_init_dp_group", stateless_init_dp_group)


def _patch_f(dp_engine: type) -> None:
    """F: the engine core's exit says Goodbye first."""
    original_shutdown = dp_engine.__dict__["shutdown"]

    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            leave()  # first: the rest may be cut short by vLLM's SIGKILL
        except Exception:  # never in the way of vLLM's own shutdown
            log.exception("coordd vLLM plugin: leaving coordd's groups failed")
        return original_shutdown(self, *args, **kwargs)

    shutdown.coordd_patch = True  # type: ignore[attr-defined]
    _replace(dp_engine, "shutdown", shutdown)


def uninstall() -> None:
    """Put vLLM's own attributes back and close the clients (tests; a process that is done)."""
    with _state.lock:
        for cancel in _state.waits:
            cancel()
        _state.waits.clear()
        for obj, name, value in reversed(_state.timed + _state.saved):
            setattr(obj, name, value)
        _state.saved.clear()
        _state.timed.clear()
        if _state.exchange is not None:
            _state.exchange.close()
        _state.exchange = None
        _state.worker = None
        _state.engine.clear()
        _state.no_overlap = "not installed"
        _state.overlap = False
        _state.timings_mode = ""
        _state.clock = None
        _state.line = _state.head = ""
        _state.data = {}
        _state.path_checked = False


def wrapped(fn: Callable[..., Any]) -> bool:
    """True if `fn` is one of this module's patches (tests)."""
    return bool(getattr(fn, "coordd_patch", False))
