"""The patch points: where SGLang 0.5.23's DP attention syncs call their collective, via coordd.

SGLang's own code still builds its tensors and decides everything from the result; only the
collective underneath becomes a gather round. Both points are attributes of
`sglang.srt.managers.scheduler_components.dp_attn` (`DP_ATTN`), which SGLang's
`MLPSyncBatchInfo.all_gather` looks up at every call:

  A  dp_attn.exchange_sync_rows   the gather path (TP group: gloo's all_gather at two ranks,
                                   gather + broadcast above): this rank's row goes to coordd,
                                   every rank's row comes back, in group-rank order
  B  dp_attn.torch                 a stand-in for torch whose `distributed.all_reduce` carries
                                   the elastic WORLD path's SUM as a gather of this rank's slot
                                   and row; every other name is torch's own

Not through SGLang's HookRegistry: a hook cannot reach the all-reduce inside
`MLPSyncBatchInfo.all_gather`, and hooks cannot be undone (tests and the benchmark run SGLang
with and without the plugin in one process). SGLang's plugin framework still loads the plugin
(`coordd.sglang.register`, entry point group `sglang.srt.plugins`).

`install()` first checks the release (`SUPPORTED`) and that both targets look as read in its
source; otherwise it logs one warning naming why and patches nothing. A non-integer tensor, a
device group other than SGLang's TP group or WORLD, or a sync whose tensors do not fit one
round keeps SGLang's own collective (decided by dtype, group and shape: every rank decides the
same).
"""

from __future__ import annotations

import inspect
import logging
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as torch_dist

from coordd.proto.errors import CoordError, InvalidReport
from coordd.proto.messages import max_gather_values
from coordd.sglang import rows, sites
from coordd.sglang.enable import PluginSettings
from coordd.sglang.groups import GroupIdentity, identity_of
from coordd.sglang.links import Links

#: A child of SGLang's logger, so its lines show in SGLang's output, in SGLang's format.
log = logging.getLogger("sglang.coordd")

#: The SGLang releases whose patch points were read from their sources.
SUPPORTED = ("0.5.23",)
DP_ATTN = "sglang.srt.managers.scheduler_components.dp_attn"
#: The sync labels (`coordd.sglang.sites`).
GATHER_SYNC = "exchange_sync_rows"
SUM_SYNC = "MLPSyncBatchInfo.all_gather:all_reduce"

_INTEGER = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


class PatchRefused(RuntimeError):
    """A patch target is missing or not what this plugin was written against."""


@dataclass
class _State:
    links: Links | None = None
    #: (module, name, original value) for every attribute replaced, in order.
    saved: list[tuple[Any, str, Any]] = field(default_factory=list)
    #: id(process group) -> (the group, its identity, or None: not one of ours)
    groups: dict[int, tuple[Any, GroupIdentity | None]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    said: set[str] = field(default_factory=set)


_state = _State()


def installed() -> bool:
    return bool(_state.saved)


def rounds() -> dict[str, int]:
    """Rounds completed in this process, by group (tests compare them with the syncs made)."""
    return dict(_state.links.rounds) if _state.links is not None else {}


def original(name: str) -> Any:
    """SGLang's own value of a patched dp_attn attribute (the benchmark calls both paths)."""
    for _, saved_name, value in _state.saved:
        if saved_name == name:
            return value
    raise KeyError(name)


def _identity(group: Any) -> GroupIdentity | None:
    known = _state.groups.get(id(group))
    if known is None or known[0] is not group:
        known = (group, identity_of(group))
        _state.groups[id(group)] = known
    return known[1]


def _say_fault(identity: GroupIdentity, error: CoordError) -> None:
    """One ERROR line in SGLang's log per distinct fault (at most 64); the error itself goes on
    up through the scheduler's step, which ends the scheduler as a failed collective would."""
    kind = type(error).__name__
    key = f"{identity.name} {kind}: {error}"
    if key in _state.said or len(_state.said) >= 64:
        return
    _state.said.add(key)
    log.error(
        "coordd: DP attention sync of group %s rank %d: %s: %s",
        identity.name,
        identity.dp_rank,
        kind,
        error,
    )


def _gather(identity: GroupIdentity, site: str, values: list[int]) -> tuple[int, list[list[int]]]:
    """One gather round: (its seq, every rank's values)."""
    links = _state.links
    assert links is not None
    try:
        result = links.client(identity).start_gather(site, values).result(links.sync_timeout)
    except CoordError as error:
        _say_fault(identity, error)
        raise
    links.rounds[identity.name] = links.rounds.get(identity.name, 0) + 1
    return result.seq, result.rows


def _own_fault(identity: GroupIdentity, error: CoordError) -> CoordError:
    """This rank cannot send what its sync holds: it leaves the group without Goodbye, so its
    peers are told at once, and raises `error`."""
    if _state.links is not None:
        _state.links.drop(identity.name)
    _say_fault(identity, error)
    return error


def _host(tensor: torch.Tensor) -> list[int]:
    src = tensor.detach()
    return [int(v) for v in (src if src.is_cpu else src.cpu()).reshape(-1).tolist()]


def _fill(tensor: torch.Tensor, flat: list[int]) -> None:
    tensor.copy_(torch.tensor(flat, dtype=tensor.dtype).reshape(tensor.shape))


def _exchange_sync_rows(original_fn: Callable[..., None]) -> Callable[..., None]:
    """A: SGLang's `exchange_sync_rows`, whose gather is a coordd round on SGLang's TP group."""

    def exchange_sync_rows(global_flat: torch.Tensor, local_row: torch.Tensor, group: Any) -> None:
        identity = _identity(group) if _state.links is not None else None
        width = local_row.numel()
        if (
            identity is None
            or local_row.dtype not in _INTEGER
            or width > max_gather_values(identity.dp_size)
        ):
            return original_fn(global_flat, local_row, group)
        site = sites.label(GATHER_SYNC, local_row.dtype, tuple(global_flat.shape), depth=2)
        if global_flat.numel() != width * identity.dp_size:
            raise _own_fault(
                identity,
                InvalidReport(
                    identity.dp_rank,
                    "global_flat",
                    global_flat.numel(),
                    f"{identity.dp_size} rows of {width}",
                ),
            )
        seq, gathered = _gather(identity, site, _host(local_row))
        _fill(global_flat, rows.concat(gathered, width, seq))

    exchange_sync_rows.coordd_patch = True  # type: ignore[attr-defined]
    return exchange_sync_rows


def _all_reduce(
    tensor: torch.Tensor,
    op: Any = torch_dist.ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """B: torch.distributed.all_reduce as dp_attn calls it: a SUM of an integer tensor whose
    last dim is the row width, on WORLD or SGLang's TP group, goes to coordd; any other call is
    torch's own."""
    identity = _identity(group) if _state.links is not None and not async_op else None
    width = tensor.shape[-1] if tensor.dim() else 0
    if (
        identity is None
        or op != torch_dist.ReduceOp.SUM
        or tensor.dtype not in _INTEGER
        or not 0 < width < max_gather_values(identity.dp_size)
    ):
        return torch_dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    site = sites.label(SUM_SYNC, tensor.dtype, tuple(tensor.shape), depth=2)
    try:
        own = rows.slot_row(_host(tensor), width, identity.dp_rank)
    except InvalidReport as error:
        raise _own_fault(identity, error) from None
    seq, gathered = _gather(identity, site, own)
    _fill(tensor, rows.sum_slots(gathered, tensor.numel() // width, width, seq))
    return None


class _Overlay(types.ModuleType):
    """A module that reads as `base` but for the names given: dp_attn's `torch`, whose
    `distributed` is an overlay of torch.distributed with `_all_reduce`."""

    def __init__(self, base: types.ModuleType, **names: Any) -> None:
        super().__init__(base.__name__)
        self.__dict__.update(names)
        self._coordd_base = base

    def __getattr__(self, name: str) -> Any:
        return getattr(self._coordd_base, name)


def _torch_overlay() -> _Overlay:
    return _Overlay(torch, distributed=_Overlay(torch_dist, all_reduce=_all_reduce))


def release_supported(version: str) -> bool:
    return any(version == r or version.startswith(f"{r}.") for r in SUPPORTED)


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise PatchRefused(f"{what} is not as in the supported release")


def _targets() -> types.ModuleType:
    """dp_attn, once both patch points are checked to be where the plugin was written for."""
    import importlib

    dp_attn = importlib.import_module(DP_ATTN)
    sync: Any = dp_attn.__dict__.get("exchange_sync_rows")
    _need(callable(sync), f"{DP_ATTN}.exchange_sync_rows")
    _need(
        list(inspect.signature(sync).parameters) == ["global_flat", "local_row", "group"],
        "exchange_sync_rows(global_flat, local_row, group)",
    )
    _need(dp_attn.__dict__.get("torch") is torch, f"{DP_ATTN}.torch")
    info = dp_attn.__dict__.get("MLPSyncBatchInfo")
    gather: Any = getattr(info, "all_gather", None)
    _need(callable(gather), "MLPSyncBatchInfo.all_gather")
    source = inspect.getsource(gather)
    for call in ("exchange_sync_rows(", "torch.distributed.all_reduce("):
        _need(call in source, f"MLPSyncBatchInfo.all_gather's call {call[:-1]}")
    return dp_attn


def _refuse(why: str) -> bool:
    log.warning(
        "coordd SGLang plugin NOT installed, SGLang keeps its own DP attention collectives: %s "
        "(the plugin supports SGLang %s)",
        why,
        " and ".join(SUPPORTED),
    )
    return False


def install(settings: PluginSettings) -> bool:
    """Route SGLang's DP attention syncs through coordd in this process; idempotent. True if the
    patches are in place; False, after one warning saying why, if this SGLang is not a
    supported release or its code differs from that release's."""
    with _state.lock:
        if _state.saved:
            return True
        try:
            import sglang

            version = str(getattr(sglang, "__version__", "?"))
        except ImportError as exc:
            return _refuse(f"cannot import sglang: {exc}")
        if not release_supported(version):
            return _refuse(f"SGLang {version} is not a supported release")
        try:
            dp_attn = _targets()
        except (PatchRefused, ImportError, OSError, TypeError, ValueError) as exc:
            return _refuse(f"SGLang {version}: {exc}")
        _state.links = Links(settings.address, settings.connect_timeout, settings.sync_timeout)
        for name, value in (
            ("exchange_sync_rows", _exchange_sync_rows(dp_attn.exchange_sync_rows)),
            ("torch", _torch_overlay()),
        ):
            _state.saved.append((dp_attn, name, dp_attn.__dict__[name]))
            setattr(dp_attn, name, value)
    log.info(
        "coordd SGLang plugin installed for SGLang %s, coordd at %s: every DP attention sync "
        "(exchange_sync_rows, the elastic WORLD all-reduce) is a coordd round",
        version,
        settings.address or "the default ipc path",
    )
    return True


def uninstall() -> None:
    """Put SGLang's own attributes back and close the clients (a Goodbye each)."""
    with _state.lock:
        for obj, name, value in reversed(_state.saved):
            setattr(obj, name, value)
        _state.saved.clear()
        _state.groups.clear()
        if _state.links is not None:
            _state.links.close()
        _state.links = None


def wrapped(fn: Any) -> bool:
    """True if `fn` is one of this module's patches (tests)."""
    return bool(getattr(fn, "coordd_patch", False)) or isinstance(fn, _Overlay)
