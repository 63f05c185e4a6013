"""A DP all-reduce of a small integer tensor, done as a coordd gather round (what a rank sends
and how the result is made from the rows: `coordd.vllm.reduce`).

Each rank sends its contribution, coordd answers every rank with all contributions in rank
order, and each rank reduces them locally with the collective's own op (SUM, MAX or MIN), in
rank order. For integer tensors that is bit-identical to gloo's or NCCL's result, whatever the
tensor's layout. vLLM's per-step worker syncs write only their own column of a [rows, dp]
tensor, so those travel as that column only (`Layout.COLUMN`: 7 values for Model Runner V2's
[7, dp], whatever dp is); the engine syncs' tiny vectors ([2], [1]), which every rank writes
whole, travel whole (`Layout.WHOLE`). The layout is part of the site label, so ranks that sent
different layouts fail the round with a StepMismatch instead of being added up wrongly.

The per-sync path (`Exchange.sync_`) reads the tensor once into a host list, takes the column
from it by slicing, writes every rank's row into that same list and packs it into a buffer
made once per shape and dtype (`_Plan`), which the tensor copies from: no torch tensor is made
and nothing is reshaped per sync (the torch-built rows and reshapes were ~60 us of CPU a sync,
most of the plugin's own cost). The client checks every answer against the round first (dp
rows, this rank's own row as sent, every row's length, the dead ranks): a misfit is its
`InvalidAnswer`, a `ProtocolError` naming coordd, never a tensor reduced from wrong values.
"""

# Whole though over 500 lines: one sync's path (prepare, start, collect, reduce) over one
# link per group; split, the hot path would cross modules for the state it keeps per group.

from __future__ import annotations

import atexit
import ctypes
import multiprocessing.util
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from coordd.client import CoordClient
from coordd.proto.errors import CoordinatorUnavailable
from coordd.proto.messages import max_gather_values
from coordd.vllm import early, sites
from coordd.vllm.early import EarlyRound
from coordd.vllm.enable import PluginSettings
from coordd.vllm.fallback import JOIN_WAIT, GroupPath
from coordd.vllm.groups import GroupIdentity
from coordd.vllm.reduce import Layout, ReduceOp, can_gather, reduce_rows

_CLOSED = "client closed"

#: struct codes of the integer dtypes, native byte order, standard sizes (as torch stores them).
_STRUCT_CODES = {
    torch.bool: "?",
    torch.uint8: "B",
    torch.int8: "b",
    torch.int16: "h",
    torch.int32: "i",
    torch.int64: "q",
}
#: Tensor memory views kept (vLLM makes its sync tensor anew each time; the allocator mostly
#: hands back the same few addresses).
_MAX_VIEWS = 256


def _close_link(link: GroupLink, goodbye: bool = True) -> None:
    if link.path is not None:
        link.path.close()
    if link.client is not None:
        link.client.close(goodbye=goodbye)


def _copy_reduced(tensor: torch.Tensor, result: torch.Tensor) -> list[int]:
    tensor.copy_(result)
    return [int(v) for v in result.reshape(-1).tolist()]


def _memory_at(address: int, nbytes: int) -> memoryview:
    """A writable view of `nbytes` of memory at `address` (a live CPU tensor's own)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


#: Shapes a process keeps a plan for (vLLM syncs a handful; past this the plans start over).
_MAX_PLANS = 64


class _Plan:
    """What a sync of one shape and dtype needs, made on its first call: how many values a
    rank sends per layout, whether they fit a round, and the buffer the result is packed into
    (`view`: a CPU tensor of that shape and dtype over it) where the tensor's own memory
    cannot take it (a GPU or strided tensor)."""

    __slots__ = (
        "buf",
        "column_fits",
        "count",
        "dims",
        "dtype",
        "nbytes",
        "numel",
        "pack",
        "shape",
        "unpack",
        "view",
        "whole_fits",
    )

    def __init__(self, shape: torch.Size, dtype: torch.dtype, dp_size: int) -> None:
        numel = 1
        for n in shape:
            numel *= n
        self.shape, self.dtype, self.dims, self.numel = shape, dtype, len(shape), numel
        column = len(shape) > 0 and shape[-1] == dp_size and numel > 0
        self.count = numel // dp_size if column else 0  # 0: no column layout for this shape
        limit = max_gather_values(dp_size)
        self.column_fits = column and self.count <= limit
        self.whole_fits = numel <= limit
        layout = f"={numel}{_STRUCT_CODES[dtype]}"
        self.pack = struct.Struct(layout).pack_into
        self.unpack = struct.Struct(layout).unpack_from
        self.nbytes = struct.calcsize(layout)
        self.buf = bytearray(max(1, self.nbytes))
        self.view = torch.frombuffer(self.buf, dtype=dtype)[:numel].view(shape)


#: Forks of this process's line so far (a child's count is one more than its parent's at the
#: fork): `Exchange.link` compares it instead of asking the pid every sync.
_forks = [0]
os.register_at_fork(after_in_child=lambda: _forks.__setitem__(0, _forks[0] + 1))


@dataclass(slots=True)
class _Prepared:
    """One sync's values as `Exchange._prepare` read them: the plan, the tensor's values
    (`flat`, written over with the result), what this rank sends, its layout, whether the
    result goes straight into the tensor's memory (`direct`, at `memory`), and the site."""

    plan: _Plan
    flat: list[int]
    own: list[int]
    layout: Layout
    direct: bool
    memory: memoryview | bytearray
    site: str


@dataclass
class GroupLink:
    """This process's client for one coordd group, and how many coordd rounds it has run.
    With the fallback on, `path` says which path the group's syncs take (`client` is None
    while it is vLLM's own)."""

    identity: GroupIdentity
    client: CoordClient | None
    lock: threading.Lock = field(default_factory=threading.Lock)
    rounds: int = 0
    path: GroupPath | None = None
    #: The process group its syncs came with (None until the first that brings one).
    group: Any = None


#: Seconds `Exchange.close` waits for its ZeroMQ context to end (the Goodbyes to go out).
TERM_WAIT = 2.0
#: Seconds between looks for coordd's socket while a first sync waits for it to appear.
SOCKET_POLL = 0.1


class Exchange:
    """The process's clients, one per coordd group, each made on the group's first sync.

    Keyed by process id too: a process forked after a sync gets its own clients (a ZeroMQ
    socket must not cross a fork)."""

    def __init__(
        self,
        settings: PluginSettings,
        trace: Callable[[GroupIdentity, str], None] | None = None,
    ) -> None:
        self.settings = settings
        #: Called with each sync's group and site label (COORDD_VLLM_TRACE).
        self.trace = trace
        self._links: dict[str, GroupLink] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._forks = _forks[0]
        self._context: zmq.Context | None = None
        self._plans: dict[tuple[torch.dtype, torch.Size, str, int], _Plan] = {}
        self._views: dict[tuple[int, int], memoryview] = {}
        self._exit_hook_pid: int | None = None
        #: How many times vLLM rebuilt a group's process group under a link (`_regroup`).
        self.regroups = 0
        #: Rounds `start_` began, by group, for the group's next `sync_` to collect.
        self._early: dict[str, EarlyRound] = {}
        #: Called after each sync with its group, site, window (seconds from the early start
        #: to the sync; 0 for a round started at the sync) and wait (seconds blocked there).
        self.on_sync: Callable[[GroupIdentity, str, float, float], None] | None = None

    def _hook_exit(self) -> None:
        """Say Goodbye when this process exits normally (the caller holds `_lock`): atexit for
        a plain interpreter exit, and multiprocessing's exit finalizers, which a
        multiprocessing child (vLLM's engine cores and workers) runs instead of atexit."""
        pid = os.getpid()
        if self._exit_hook_pid == pid:
            return
        self._exit_hook_pid = pid
        ref = weakref.ref(self)

        def close() -> None:
            exchange = ref()
            if exchange is not None and exchange._pid == os.getpid():
                exchange.close()

        atexit.register(close)
        multiprocessing.util.Finalize(None, close, exitpriority=100)

    def _prepare(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        identity: GroupIdentity,
        column: bool,
        skip: int,
        sync: str,
    ) -> _Prepared | None:
        """What a sync of `tensor` sends and where its result goes; None if the tensor is not
        an integer one (`can_gather`) or its values do not fit one round (decided by dtype and
        shape alone, so every rank decides the same)."""
        dp_size, dp_rank = identity.dp_size, identity.dp_rank
        shape, dtype = tensor.shape, tensor.dtype
        key = (dtype, shape, identity.name, dp_size)
        plan = self._plans.get(key)
        if plan is None:
            if not can_gather(tensor):
                return None
            if len(self._plans) >= _MAX_PLANS:
                self._plans = {}
            plan = self._plans[key] = _Plan(shape, dtype, dp_size)
        # one host list, no torch call past the tensor's attributes: a CPU tensor's bytes are
        # read where they are and unpacked (torch's tolist cost more than the rest together)
        direct = bool(plan.numel and tensor.is_cpu and tensor.is_contiguous())
        memory: memoryview | bytearray = plan.buf  # where the result is packed
        if direct:
            # A view of the tensor's memory, by address and size: used only now, while this
            # live tensor occupies exactly those bytes (a view kept from an earlier tensor at
            # the same address is the same memory, and is never read or written otherwise).
            # Writes through it do not bump the tensor's version counter, which only autograd
            # reads, and an integer tensor is never part of autograd.
            where = (tensor.data_ptr(), plan.nbytes)
            view = self._views.get(where)
            if view is None:
                if len(self._views) >= _MAX_VIEWS:
                    self._views = {}
                self._views[where] = memory = _memory_at(*where)
            else:
                memory = view
            flat = list(plan.unpack(memory))
        else:
            host = tensor if tensor.is_cpu else tensor.cpu()
            flat = host.reshape(-1).tolist()
        layout = Layout.WHOLE
        if column and plan.count and 0 <= dp_rank < dp_size:
            own = flat[dp_rank::dp_size]
            # zero outside its column: every zero of the tensor but the column's own zeros
            if flat.count(0) - own.count(0) == plan.numel - plan.count:
                layout = Layout.COLUMN
        if layout is Layout.COLUMN:
            if not plan.column_fits:
                return None
        else:
            if not plan.whole_fits:
                return None
            own = flat
        if dtype is torch.bool:  # True/False go over the wire as ints
            own = [int(v) for v in own]
        # label_of looks from its caller's caller's caller: past this method and sync_/start_
        site = sites.label_of(op, dtype, shape, layout, plan, 3 + skip, sync)
        if self.trace is not None:
            self.trace(identity, site)
        return _Prepared(plan, flat, own, layout, direct, memory, site)

    def start_(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        identity: GroupIdentity,
        column: bool,
        skip: int = 0,
        sync: str = "",
    ) -> bool:
        """Send this rank's values of the sync on `tensor` now, and leave the round for the
        group's next `sync_` to collect (`coordd.vllm.early`); `tensor` is not touched. False,
        with nothing sent, where this sync's round is made at the sync this time (the group on
        vLLM's own path, or coordd lost); `early.NotStarted` naming why where it never can start
        early: the tensor is not in host memory (reading a device tensor here would wait for
        the device: vLLM's NCCL path), or `sync_` would take vLLM's path for it (decided by
        dtype and shape). A round started earlier and never collected is vLLM's sync skipped:
        `SkippedSync`."""
        if not tensor.is_cpu:
            raise early.NotStarted(
                f"the sync's tensor is on {tensor.device} (vLLM's NCCL path: "
                "disable_nccl_for_dp_synchronization is false)"
            )
        prepared = self._prepare(tensor, op, identity, column, skip, sync)
        if prepared is None:
            raise early.NotStarted(
                f"the sync's {tensor.dtype} tensor of shape {list(tensor.shape)} cannot be "
                "gathered in one round (it takes vLLM's own collective)"
            )
        link = self.link(identity)
        with link.lock:
            self._check_collected(identity, prepared.site)
            if link.client is None:  # on vLLM's own path (or not joined yet): at the sync
                return False
            try:
                pending = link.client.start_gather(prepared.site, prepared.own)
            except CoordinatorUnavailable:
                if link.path is None:
                    raise
                return False  # the sync's round meets the same loss and settles
            self._early[identity.name] = EarlyRound(
                prepared.site, prepared.own, pending, early.now(), early.step()
            )
        return True

    def _check_collected(self, identity: GroupIdentity, then: str) -> None:
        """Raise `SkippedSync` (the link closed without Goodbye) if the group's early round
        is still uncollected: its sync was never made."""
        left = self._early.pop(identity.name, None)
        if left is not None:
            self._abort(identity)
            raise early.SkippedSync(
                identity.dp_rank, identity.name, left.pending.seq, left.site, then
            )

    def abandon(self, identity: GroupIdentity) -> None:
        """The sync of the group's early round will not come (the step raised before it): end
        the round on this rank and leave the group without Goodbye (`_abort`)."""
        if self._early.pop(identity.name, None) is not None:
            self._abort(identity)

    def _abort(self, identity: GroupIdentity) -> None:
        """Close the group's link without a Goodbye: coordd counts this rank lost (its sync
        went wrong), so every peer is told at once, naming it."""
        link = self._links.pop(identity.name, None)
        if link is not None:
            _close_link(link, goodbye=False)

    def sync_(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        identity: GroupIdentity,
        column: bool,
        skip: int = 0,
        sync: str = "",
        group: Any = None,
    ) -> bool:
        """The collective on `tensor`, in place, as one gather round: its own column if
        `column` (a worker sync) and the tensor is zero outside it, else the whole tensor,
        labelled with the vLLM call site it was called from (`sites.label_of`, which looks
        from `skip` frames above this method's caller: the plugin's own frames, known to be
        there, skipped without being looked at; `sync`: the sync function's name where a
        patch stands in for it). The round is the one `start_` began for this sync if there
        is one (its values and site checked against this sync's: `EarlyStartMismatch`), else
        a new one. False, with nothing sent and `tensor` untouched, if the tensor is not an
        integer one (`can_gather`) or its values do not fit one round (the caller then takes
        vLLM's path; decided by dtype and shape alone, so every rank decides the same).
        With the fallback on (`coordd.vllm.fallback`), `group` is the group's own gloo group,
        and False also means the group is on vLLM's own path: the caller runs vLLM's own
        collective, as it does for what cannot be gathered. Never in starting mode (an early
        call that reached here would make a whole round): `early.NotStarted`."""
        early.refuse_starting("Exchange.sync_")
        prepared = self._prepare(tensor, op, identity, column, skip, sync)
        if prepared is None:
            return False
        link = self.link(identity)
        with link.lock:
            if group is not link.group and group is not None:
                self._regroup(link, group)
            path = link.path
            if path is None:
                self._round(link, tensor, op, prepared)
                return True
            if link.client is None:
                if not path.joined:
                    link.client = path.join(group, min(JOIN_WAIT, self.settings.connect_timeout))
                else:
                    link.client = path.own_round(group, self.settings.connect_timeout)
                if link.client is None:
                    return False
            try:
                result = self._round(link, tensor, op, prepared)
            except CoordinatorUnavailable as error:
                if error.detail == _CLOSED:  # this process is closing its links: no switch
                    raise
                return self._fall_back(link, path, group, error, tensor, prepared)
            path.completed_on_coordd(prepared.site, result)
            return True

    def _fall_back(
        self,
        link: GroupLink,
        path: GroupPath,
        group: Any,
        error: CoordinatorUnavailable,
        tensor: torch.Tensor,
        prepared: _Prepared,
    ) -> bool:
        """coordd was lost in this sync's round: settle over the group's gloo group; True if
        this rank took the round's result from a rank ahead, else False (vLLM's own path)."""
        self._early.pop(link.identity.name, None)
        client, link.client = link.client, None
        if client is not None:
            client.close(goodbye=False)
        answer = path.fall_back(group, error, (prepared.site, prepared.plan.numel))
        if answer is None:
            return False
        tensor.copy_(torch.tensor(answer, dtype=torch.int64).reshape(tensor.shape))
        return True

    def _round(
        self, link: GroupLink, tensor: torch.Tensor, op: ReduceOp, prepared: _Prepared
    ) -> list[int]:
        """The sync as one coordd round (the caller holds the link's lock): the result, in
        `tensor` and as a flat list."""
        identity = link.identity
        assert link.client is not None
        plan, flat, own, layout = prepared.plan, prepared.flat, prepared.own, prepared.layout
        dp_size = identity.dp_size
        # The client checks the answer against the round it asked (seq, site, dp rows, this
        # rank's own row as sent, every row's length, an empty row only for a dead rank): a
        # misfit raises its InvalidAnswer (a ProtocolError naming coordd) here, before the
        # tensor is touched.
        started = self._early.pop(identity.name, None) if self._early else None
        if started is None:
            began = early.now() if self.on_sync is not None else 0.0
            rows = link.client.gather(prepared.site, own, timeout=self.settings.sync_timeout)
            window = 0.0
        else:
            try:
                started.check(identity.dp_rank, identity.name, prepared.site, own)
            except (early.EarlyStartMismatch, early.SkippedSync):
                self._abort(identity)
                raise
            began = early.now()
            window = began - started.began
            rows = started.pending.wait(self.settings.sync_timeout)
        if self.on_sync is not None:
            self.on_sync(identity, prepared.site, window, early.now() - began)
        link.rounds += 1
        if layout is Layout.COLUMN and op is ReduceOp.SUM:
            # vLLM's worker syncs: the sum is the columns side by side, value i of rank r
            # at flat[i * dp + r]; `flat` is this call's own list, written over in place
            count = plan.count
            for rank, row in enumerate(rows):
                flat[rank::dp_size] = row if row else [0] * count  # left out: zeros
        else:
            if not (layout is Layout.WHOLE and own and all(rows)):
                # a rank left out of a whole-tensor round, a column MAX/MIN: the general
                # path (torch's, as before; no vLLM sync takes it)
                return _copy_reduced(tensor, reduce_rows(rows, tensor, layout, op))
            if op is ReduceOp.SUM:
                flat = [sum(values) for values in zip(*rows, strict=True)]
            elif op is ReduceOp.MAX:
                flat = [max(values) for values in zip(*rows, strict=True)]
            else:
                flat = [min(values) for values in zip(*rows, strict=True)]
        try:
            # straight into the tensor's memory (torch's copy_ was the path's costliest
            # call, ~15 us of CPU a sync in vLLM's rank processes), else via the plan's
            plan.pack(prepared.memory, 0, *flat)
        except struct.error:  # past the dtype's range: wrapped, as the collective does
            return _copy_reduced(tensor, reduce_rows(rows, tensor, layout, op))
        if not prepared.direct:
            tensor.copy_(plan.view)
        return flat

    def link(self, identity: GroupIdentity) -> GroupLink:
        """The client for `identity`'s group. With the fallback on, its path, which registers
        at the group's first sync (`GroupPath.join`); without, connected (within the connect
        timeout) on first use, raising the client's CoordError (Rejected,
        CoordinatorUnavailable) if it cannot."""
        link = self._links.get(identity.name)
        if (
            link is not None
            and (link.identity is identity or link.identity == identity)
            and self._forks == _forks[0]
        ):
            return link
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's sockets are not ours
                self._links, self._context, self._pid = {}, None, os.getpid()
                self._early = {}
            self._forks = _forks[0]
            link = self._links.get(identity.name)
            if link is not None and link.identity == identity:
                return link
            if link is not None:  # vLLM rebuilt the group (elastic EP): a new registration
                _close_link(link)
                self._early.pop(identity.name, None)
            if self._context is None:
                self._context = zmq.Context()
            self._hook_exit()
            if self.settings.fallback:
                link = GroupLink(identity, None)
                link.path = self._new_path(identity)
                self._links[identity.name] = link
                return link
            client = self._new_client(identity)
            try:
                self._connect(client)
            except BaseException:
                client.close()
                raise
            link = GroupLink(identity, client)
            self._links[identity.name] = link
            return link

    def _regroup(self, link: GroupLink, group: Any) -> None:
        """A sync came with another process group than the link's (the caller holds the link's
        lock). The first is no change; a later one means vLLM rebuilt the group with the same
        ranks (fault tolerance's `retry` re-inits the DP groups): the group registers again,
        on the same client (a new connection would race the old one's close, `rank_taken`),
        which opens a new epoch for a failed group; with the fallback on, over a new path
        that votes on the new group."""
        first = link.group is None
        link.group = group
        if first:
            return
        self.regroups += 1
        self._early.pop(link.identity.name, None)
        if link.path is not None:
            link.path.close()
            client, link.client = link.client, None
            link.path = self._new_path(link.identity, client)
        elif link.client is not None:
            link.client.connect(timeout=self.settings.connect_timeout)

    def _new_path(self, identity: GroupIdentity, client: CoordClient | None = None) -> GroupPath:
        return GroupPath(
            identity, lambda: self._new_client(identity), self.settings.sync_timeout, client=client
        )

    def _new_client(self, identity: GroupIdentity) -> CoordClient:
        return CoordClient(
            self.settings.address,
            dp_rank=identity.dp_rank,
            dp_size=identity.dp_size,
            group=identity.name,
            config_fingerprint=identity.fingerprint,
            wait_timeout=self.settings.sync_timeout,
            context=self._context,
        )

    def _connect(self, client: CoordClient) -> None:
        """Register within the connect timeout, waiting for a coordd that has not made its
        socket yet (a sidecar may start after vLLM: the client alone fails at once there)."""
        deadline = time.monotonic() + self.settings.connect_timeout
        while True:
            # looked at before the try too: a socket made during a try that found none is
            # there when the try fails, and that try is retried all the same
            missing = client.connection.no_socket_file() is not None
            try:
                client.connect(timeout=max(0.05, deadline - time.monotonic()))
                return
            except CoordinatorUnavailable:
                missing = missing or client.connection.no_socket_file() is not None
                if not missing or time.monotonic() >= deadline:
                    raise
            time.sleep(SOCKET_POLL)

    def rounds(self) -> dict[str, int]:
        """Gather rounds completed so far, by group (tests compare it with the syncs made)."""
        return {name: link.rounds for name, link in self._links.items()}

    def close(self) -> None:
        """Close every client (a Goodbye to coordd); idempotent. The context's term (which
        lets the Goodbyes out: each socket lingers up to GOODBYE_LINGER_MS) is bounded by
        TERM_WAIT, so an exit path never hangs on a socket some other thread still holds."""
        with self._lock:
            for link in self._links.values():
                _close_link(link)
            self._links = {}
            self._early = {}
            context, self._context = self._context, None
            if context is not None and self._pid == os.getpid():
                ending = threading.Thread(target=context.term, name="coordd-term", daemon=True)
                ending.start()
                ending.join(TERM_WAIT)
