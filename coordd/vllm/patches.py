"""The patch points: where vLLM 0.33's DP syncs call their collective, routed through coordd.

vLLM's own sync functions still build their tensors and compute every decision from the
result; only the collective underneath becomes a gather round (`Exchange.all_reduce_`). Each
point is one module or class attribute, so every importer of a sync function is covered
without rebinding names, and syncs that vLLM answers locally (`should_skip_dp_coordination()`,
a reused `DPSyncState`) never reach a patch point and make no round.

  A  vllm.v1.worker.dp_utils.dist             a stand-in for torch.distributed whose all_reduce
                                               on the worker DP group goes to coordd (V1 runner,
                                               drafter, extract-hidden-states, forward context)
  B  GroupCoordinator.cpu_all_reduce_          routed when called on the worker DP group
                                               (Model Runner V2 and its speculators)
  C  vllm.config.parallel.cpu_all_reduce_      the engine-state SUM (ParallelConfig.sync_dp_state)
  D  ParallelConfig.has_unfinished_dp and      the static methods wrapped: MAX and MIN over the
     ParallelConfig.sync_kv_cache_memory_size  engine DP group
  E  ParallelConfig.stateless_init_dp_group    registers the engine-core DP group it creates

`install()` first checks that every target exists and looks as expected; if any does not (a
vLLM whose code moved), it logs a warning naming it and patches nothing, so vLLM keeps its own
collectives. Async or non-integer all-reduces, and other groups, always take vLLM's path.
"""

from __future__ import annotations

import logging
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as torch_dist

from coordd.vllm import sites
from coordd.vllm.enable import PluginSettings
from coordd.vllm.exchange import Exchange, Layout, ReduceOp, can_gather
from coordd.vllm.groups import GroupIdentity, engine_group, worker_group

log = logging.getLogger("coordd.vllm")

#: The vLLM release line the patch points were read from.
SUPPORTED = "0.33"


class PatchRefused(RuntimeError):
    """A patch target is missing or not what this plugin was written against."""


def site_label(op: ReduceOp, tensor: torch.Tensor, layout: Layout) -> str:
    """What a sync is, the same on every rank that runs it (`coordd.vllm.sites`): the vLLM
    sync function, its first caller outside the sync modules, the op, dtype, shape and layout.
    A rank that skipped or added a sync sends another label, which coordd reports as a
    StepMismatch naming it."""
    return sites.label(op, tensor, layout, depth=2)


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
    lock: threading.Lock = field(default_factory=threading.Lock)


_state = _State()


def installed() -> bool:
    return bool(_state.saved)


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


#: Frames `Exchange.sync_` skips before it looks for the call site: `_sync_` and the patch.
_SKIP = 2


def _sync_(tensor: torch.Tensor, op: ReduceOp, identity: GroupIdentity, column: bool) -> bool:
    """Run the collective as a gather round; False (nothing done) if the values do not fit
    one round, so the caller takes vLLM's own path (decided by shape: every rank agrees).
    vLLM's worker syncs (`column`) write only their own column, which is all that goes; if
    one ever does not, the whole tensor goes (and its label says so: ranks that disagree fail
    loudly, never add up wrongly)."""
    exchange = _state.exchange
    # the label is looked for from the patch's caller: past this function and the patch
    return exchange is not None and exchange.sync_(tensor, op, identity, column, _SKIP)


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
        if ours is not None and not async_op and _state.exchange is not None:
            identity = _worker_route(group)
            if identity is not None and _sync_(tensor, ours, identity, True):
                return None
        return torch_dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


# -- the checks and the install ---------------------------------------------------------------


def _targets() -> dict[str, Any]:
    """Import the patch targets and check each is what the patches expect; raises
    PatchRefused naming the first that is not."""
    try:
        import vllm.config.parallel as config_parallel
        import vllm.distributed.utils as dist_utils
        import vllm.v1.worker.dp_utils as v1_dp_utils
        from vllm.distributed import parallel_state
    except ImportError as exc:
        raise PatchRefused(f"cannot import a patched vLLM module: {exc}") from exc
    parallel_config = config_parallel.ParallelConfig
    coordinator = getattr(parallel_state, "GroupCoordinator", None)

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise PatchRefused(what)

    need(
        v1_dp_utils.__dict__.get("dist") is torch_dist,
        "A: vllm.v1.worker.dp_utils.dist is not torch.distributed",
    )
    need(callable(v1_dp_utils.__dict__.get("_run_ar")), "A: vllm.v1.worker.dp_utils._run_ar")
    need(
        callable(v1_dp_utils.__dict__.get("should_skip_dp_coordination")),
        "A: vllm.v1.worker.dp_utils.should_skip_dp_coordination",
    )
    need(hasattr(parallel_state, "_DP"), "B: vllm.distributed.parallel_state._DP")
    need(
        coordinator is not None and callable(coordinator.__dict__.get("cpu_all_reduce_")),
        "B: GroupCoordinator.cpu_all_reduce_",
    )
    util = config_parallel.__dict__.get("cpu_all_reduce_")
    need(
        util is dist_utils.__dict__.get("cpu_all_reduce_") and callable(util),
        "C: vllm.config.parallel.cpu_all_reduce_ is not vllm.distributed.utils.cpu_all_reduce_",
    )
    need(callable(parallel_config.__dict__.get("sync_dp_state")), "C: ParallelConfig.sync_dp_state")
    for name in ("has_unfinished_dp", "sync_kv_cache_memory_size"):
        need(
            isinstance(parallel_config.__dict__.get(name), staticmethod),
            f"D: ParallelConfig.{name} is not a staticmethod",
        )
    need(
        callable(parallel_config.__dict__.get("stateless_init_dp_group")),
        "E: ParallelConfig.stateless_init_dp_group",
    )
    return dict(
        v1_dp_utils=v1_dp_utils,
        config_parallel=config_parallel,
        parallel_config=parallel_config,
        coordinator=coordinator,
        parallel_state=parallel_state,
    )


def install(settings: PluginSettings) -> bool:
    """Route vLLM's DP syncs through coordd in this process; idempotent. Returns True if the
    patches are in place, False if vLLM's shape differs (a warning says where)."""
    with _state.lock:
        if _state.saved:
            return True
        try:
            targets = _targets()
        except PatchRefused as exc:
            log.warning(
                "coordd vLLM plugin NOT installed, vLLM keeps its own DP collectives: %s "
                "(the plugin is written against vLLM %s.x)",
                exc,
                SUPPORTED,
            )
            return False
        import vllm

        version = str(getattr(vllm, "__version__", "?"))
        if not version.startswith(SUPPORTED + "."):
            log.warning(
                "coordd vLLM plugin: vLLM %s is not %s.x; its patch targets look as expected, "
                "installing anyway",
                version,
                SUPPORTED,
            )
        _state.exchange = Exchange(settings)
        _patch_all(**targets)
    log.info(
        "coordd vLLM plugin installed (coordd at %s): DP syncs are gather rounds",
        settings.address or "the default ipc path",
    )
    return True


def _replace(obj: Any, name: str, value: Any) -> None:
    _state.saved.append((obj, name, obj.__dict__[name]))
    setattr(obj, name, value)


def _patch_all(
    v1_dp_utils: types.ModuleType,
    config_parallel: types.ModuleType,
    parallel_config: type,
    coordinator: type,
    parallel_state: types.ModuleType,
) -> None:
    # A
    _replace(v1_dp_utils, "dist", DistShim())

    # B
    original_cpu_all_reduce_ = coordinator.__dict__["cpu_all_reduce_"]

    def cpu_all_reduce_(self: Any, tensor: torch.Tensor) -> torch.Tensor:
        # (`_sync_` refuses what `can_gather` would, on its first sight of a dtype and shape)
        if self is parallel_state._DP and _sync_(
            tensor, ReduceOp.SUM, _worker_identity(self), True
        ):
            return tensor
        return original_cpu_all_reduce_(self, tensor)

    cpu_all_reduce_.coordd_patch = True  # type: ignore[attr-defined]
    _replace(coordinator, "cpu_all_reduce_", cpu_all_reduce_)

    # C: its only caller in 0.33 is ParallelConfig.sync_dp_state, on the engine DP group
    original_util = config_parallel.__dict__["cpu_all_reduce_"]

    def util_cpu_all_reduce_(tensor: torch.Tensor, group: Any, timeout: Any = None) -> torch.Tensor:
        if (
            isinstance(group, torch_dist.ProcessGroup)
            and can_gather(tensor)
            and _state.exchange is not None
            and _sync_(tensor, ReduceOp.SUM, _engine_route(group), False)
        ):
            return tensor
        return original_util(tensor, group, timeout)

    _replace(config_parallel, "cpu_all_reduce_", util_cpu_all_reduce_)

    # D
    original_unfinished = parallel_config.__dict__["has_unfinished_dp"].__func__

    def has_unfinished_dp(dp_group: Any, has_unfinished: bool) -> bool:
        if not isinstance(dp_group, torch_dist.ProcessGroup) or _state.exchange is None:
            return bool(original_unfinished(dp_group, has_unfinished))
        tensor = torch.tensor([has_unfinished], dtype=torch.int32, device="cpu")
        if not _sync_(tensor, ReduceOp.MAX, _engine_route(dp_group), False):
            return bool(original_unfinished(dp_group, has_unfinished))
        return bool(tensor.item())

    _replace(parallel_config, "has_unfinished_dp", staticmethod(has_unfinished_dp))

    original_kv = parallel_config.__dict__["sync_kv_cache_memory_size"].__func__

    def sync_kv_cache_memory_size(dp_group: Any, kv_cache_memory: int) -> int:
        if not isinstance(dp_group, torch_dist.ProcessGroup) or _state.exchange is None:
            return int(original_kv(dp_group, kv_cache_memory))
        if kv_cache_memory == -1:  # vLLM's "no limit" before its MIN
            kv_cache_memory = torch.iinfo(torch.int64).max
        tensor = torch.tensor([kv_cache_memory], dtype=torch.int64, device="cpu")
        if not _sync_(tensor, ReduceOp.MIN, _engine_route(dp_group), False):
            return int(original_kv(dp_group, kv_cache_memory))
        return int(tensor.item())

    _replace(parallel_config, "sync_kv_cache_memory_size", staticmethod(sync_kv_cache_memory_size))

    # E
    original_init = parallel_config.__dict__["stateless_init_dp_group"]

    def stateless_init_dp_group(self: Any, return_store: bool = False) -> Any:
        made = original_init(self, return_store=return_store)
        register_engine_group(made[0] if return_store else made)
        return made

    _replace(parallel_config, "stateless_init_dp_group", stateless_init_dp_group)


def uninstall() -> None:
    """Put vLLM's own attributes back and close the clients (tests; a process that is done)."""
    with _state.lock:
        for obj, name, value in reversed(_state.saved):
            setattr(obj, name, value)
        _state.saved.clear()
        if _state.exchange is not None:
            _state.exchange.close()
        _state.exchange = None
        _state.worker = None
        _state.engine.clear()


def wrapped(fn: Callable[..., Any]) -> bool:
    """True if `fn` is one of this module's patches (tests)."""
    return bool(getattr(fn, "coordd_patch", False))
