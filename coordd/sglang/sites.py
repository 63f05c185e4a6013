"""The site label of an SGLang DP sync: what a gather round is, the same on every rank that
makes it.

A label names the sync (`exchange_sync_rows`, or the WORLD all-reduce of
`MLPSyncBatchInfo.all_gather`), its first caller outside SGLang's DP attention module and this
plugin as `module:qualname:line` (the scheduler makes its syncs from two lines of
`get_next_batch_to_run` and from the disaggregation and PP loops: each is its own site), and the
dtype and shape. A rank that skips a sync and makes another, or syncs from another place, sends
another label, which coordd reports as a StepMismatch naming it.
"""

from __future__ import annotations

import sys
import types
from typing import Any

#: Modules whose frames stand between a caller and the sync (SGLang's DP attention module, the
#: plugin itself).
LOOK_PAST = ("sglang.srt.managers.scheduler_components.dp_attn", "coordd.sglang.")
#: GatherReport.site is a ShortStr.
MAX_SITE = 256
#: Entries kept per cache (a process has a handful of call sites; past this they start over).
_MAX_ENTRIES = 1024

#: id(code object) -> (whether to look past its frames, "module:qualname", the code object:
#: held so that no other object takes its id while the entry exists)
_CODES: dict[int, tuple[bool, str, types.CodeType]] = {}
#: (sync, id(caller code), line, dtype, shape) -> label
_LABELS: dict[tuple[Any, ...], str] = {}


def _classify(frame: types.FrameType) -> tuple[bool, str, types.CodeType]:
    code = frame.f_code
    module = frame.f_globals.get("__name__", "")
    found = (
        module.startswith(LOOK_PAST),
        f"{module}:{getattr(code, 'co_qualname', code.co_name)}",
        code,
    )
    if len(_CODES) >= _MAX_ENTRIES:
        _CODES.clear()
        _LABELS.clear()
    _CODES[id(code)] = found
    return found


def label(sync: str, dtype: Any, shape: tuple[int, ...], depth: int = 1) -> str:
    """The label of the sync in progress, its caller looked for from `depth` frames above."""
    frame: types.FrameType | None = sys._getframe(depth)
    while frame is not None:
        kind = _CODES.get(id(frame.f_code)) or _classify(frame)
        if not kind[0]:
            break
        frame = frame.f_back
    if frame is None:
        key: tuple[Any, ...] = (sync, None, -1, dtype, shape)
    else:
        key = (sync, id(frame.f_code), frame.f_lineno, dtype, shape)
    found = _LABELS.get(key)
    if found is None:
        caller = "?" if frame is None else f"{_CODES[id(frame.f_code)][1]}:{frame.f_lineno}"
        tail = f"|{str(dtype).removeprefix('torch.')}[{','.join(str(n) for n in shape)}]"
        room = MAX_SITE - len(sync) - 1 - len(tail)
        if len(caller) > room:
            caller = caller[len(caller) - room :]
        found = _LABELS[key] = f"{sync}@{caller}{tail}"
    return found
