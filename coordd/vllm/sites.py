"""The site label of a DP sync: what a gather round is, the same on every rank that runs it.

A label names the vLLM sync function (the outermost frame in vLLM's sync modules), its first
caller outside them as `module:qualname` (so a drafter's sync differs from the runner's), the
op, dtype, shape and layout. A rank that skipped or added a sync sends another label, which
coordd reports as a StepMismatch naming that rank.

Computed once per call site, not per sync: each code object is classified once (`_CODES`: a
plugin or vLLM collective frame to look past, a sync function, or the caller), so a sync walks
its few frames with one dict lookup each and finds its label in `_LABELS` by the sync
function's and the caller's code objects and the caller's instruction (its line), with the op,
dtype, shape and layout, all by id. (The frame walk that read every frame's module name and
qualname and built the string was ~13 us of CPU a sync in vLLM's rank processes.)
"""

from __future__ import annotations

import sys
import types
from typing import Any

#: Modules whose frames a site label looks through to find the sync function and its caller.
SYNC_MODULES = (
    "vllm.v1.worker.dp_utils",
    "vllm.v1.worker.gpu.dp_utils",
    "vllm.config.parallel",
    "vllm.distributed.",
    "coordd.vllm.",
)
#: Of those, the ones that hold no sync function (the plugin, vLLM's collectives).
_LOOK_PAST = ("coordd.vllm.", "vllm.distributed.")
#: Hello.group and GatherReport.site are ShortStr.
MAX_SITE = 256
#: Labels kept (a process has a few dozen call sites; past this the cache starts over).
_MAX_LABELS = 4096

_PAST, _SYNC, _CALLER = 0, 1, 2
#: id(code object) -> (_PAST | _SYNC | _CALLER, its qualname or, for a caller,
#: "module:qualname", the code object itself). Keys are ids, not the objects (hashing a code
#: object hashes its bytecode and constants on every lookup); each entry holds its object, so
#: no other object can have that id while the entry exists.
_CODES: dict[int, tuple[int, str, types.CodeType]] = {}
#: (ids of the sync function's and the caller's code, the caller's instruction, ids of the
#: op, the token and the layout) -> (the label, the objects whose ids are in the key)
_LABELS: dict[tuple[Any, ...], tuple[str, tuple[Any, ...]]] = {}
#: `label`'s tokens: one object per (dtype, shape)
_TOKENS: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def _classify(frame: types.FrameType) -> tuple[int, str, types.CodeType]:
    code = frame.f_code
    module = frame.f_globals.get("__name__", "")
    qualname = getattr(code, "co_qualname", code.co_name)
    if module.startswith(SYNC_MODULES):
        kind = _PAST if module.startswith(_LOOK_PAST) else _SYNC
        found = (kind, qualname, code)
    else:
        found = (_CALLER, f"{module}:{qualname}", code)
    if len(_CODES) >= _MAX_LABELS:
        _forget()
    _CODES[id(code)] = found
    return found


def _forget() -> None:
    """Start both caches over (a label's key holds code ids that `_CODES` keeps alive)."""
    _CODES.clear()
    _LABELS.clear()
    _TOKENS.clear()


def label(op: Any, tensor: Any, layout: Any, depth: int = 1, sync: str = "") -> str:
    """The label of the sync in progress, looked for from `depth` frames above this call;
    `op` and `layout` are enums with a string `value`, `tensor` has a dtype and a shape;
    `sync` names the sync function where no frame of a sync module is on the stack (a patch
    that stands in for it)."""
    dtype, shape = tensor.dtype, tuple(tensor.shape)
    token = _TOKENS.setdefault((dtype, shape), (dtype, shape))  # one object per pair
    return label_of(op, dtype, shape, layout, token, depth + 1, sync)


def label_of(
    op: Any, dtype: Any, shape: Any, layout: Any, token: Any, depth: int = 1, sync: str = ""
) -> str:
    """`label`, for a caller that has the tensor's dtype and shape at hand and an object that
    stands for the pair (the exchange's plan for them), looked up by its id."""
    frame: types.FrameType | None = sys._getframe(depth)
    codes = _CODES
    sync_code, sync_fn = None, sync or None
    while frame is not None:
        code = frame.f_code
        kind = codes.get(id(code))
        if kind is None:
            kind = _classify(frame)
        if kind[0] == _CALLER:
            break
        if kind[0] == _SYNC:
            sync_code, sync_fn = code, kind[1]  # the outermost sync function wins
        frame = frame.f_back
    if frame is None:
        caller_code, where = None, -1
    else:
        caller_code, where = frame.f_code, frame.f_lasti
    key = (id(sync_code), id(caller_code), where, id(op), id(token), id(layout), sync)
    found = _LABELS.get(key)
    if found is None:
        caller = "?" if caller_code is None else codes[id(caller_code)][1]
        text = _make(sync_fn or "", caller, op, dtype, shape, layout)
        if len(_LABELS) >= _MAX_LABELS:
            _forget()
        found = _LABELS[key] = (text, (sync_code, caller_code, op, token, layout))
    return found[0]


def _make(sync_fn: str, caller: str, op: Any, dtype: Any, shape: Any, layout: Any) -> str:
    dtype_name = str(dtype).removeprefix("torch.")
    dims = ",".join(str(n) for n in shape)
    tail = f"|{op.value}|{dtype_name}[{dims}]|{layout.value}"
    head = f"{sync_fn}@"
    room = MAX_SITE - len(head) - len(tail)
    if len(caller) > room:
        caller = caller[len(caller) - room :]
    return head + caller + tail
