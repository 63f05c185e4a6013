"""The exchanges the benchmark compares, as one rank sees them: `start(i)` then `wait(handle)`.

Every method carries the same reports (round i's report of rank r comes from the shared table),
and every one but the floor ends with the round's decision in hand, so the figures compare
like with like: coordd over ipc and tcp, a minimal blocking pyzmq hub (the ZeroMQ limit), a gloo
all_reduce(SUM) of the int32 [fields x dp] matrix as vLLM's V1 runner does it, vLLM's own
`cpu_all_reduce_` (recursive doubling over gloo p2p) on Model Runner V2's int32 [7 x dp]
matrix, the device-path client (on gloo, and on NCCL where there is a GPU per rank), the bare
collective each device path is measured against, and the raw-socket floor.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

from coordd.client._config import ClientConfig
from coordd.proto.messages import StepReport
from coordd.tools.bench.workload import (
    FIELDS,
    TABLE_SIZE,
    column,
    decision_from_matrix,
    expected_floor_reply,
    expected_payload,
    floor_report,
    payload,
)

COORDD_IPC = "coordd-ipc"
COORDD_TCP = "coordd-tcp"
HUB = "zmq-hub"
GLOO = "gloo"
VLLM = "vllm-cpu-all-reduce"
VLLM_PLUGIN = "vllm-plugin"
DEVICE = "device-gloo"
GLOO_BARE = "gloo-bare"
DEVICE_NCCL = "device-nccl"
NCCL_BARE = "nccl-bare"
FLOOR = "floor"
#: Every method, in the order the tables list them.
ALL_METHODS = (
    COORDD_IPC,
    COORDD_TCP,
    HUB,
    FLOOR,
    GLOO,
    VLLM,
    VLLM_PLUGIN,
    DEVICE,
    GLOO_BARE,
    DEVICE_NCCL,
    NCCL_BARE,
)
#: Each device path and its floor: the same collective, bare (the run prints their ratio).
DEVICE_FLOORS = {DEVICE: GLOO_BARE, DEVICE_NCCL: NCCL_BARE}
#: The methods on an NCCL group: one CUDA device per rank.
NCCL_METHODS = (DEVICE_NCCL, NCCL_BARE)
#: Methods whose start() runs the whole exchange (nothing to overlap): not in the overlap phase.
BLOCKING_METHODS = (VLLM, VLLM_PLUGIN)
#: The plugin method's coordd group (beside coordd-ipc's default group, on the same coordd):
#: the name the plugin gives vLLM's worker DP group at TP=PP=1, which coordd admits by default.
PLUGIN_GROUP = "dp-tp0-pp0"
#: Model Runner V2's DP matrix: int32 [7 x dp], one column per rank (vllm/v1/worker/gpu/dp_utils).
VLLM_ROWS = 7
#: Longest a rank waits for one round before the run fails (no hang, ever).
ROUND_TIMEOUT = 60.0


def bench_config(rank: int, dp: int) -> ClientConfig:
    """The settings of every benchmarked client, on either path."""
    return ClientConfig(
        dp_rank=rank, dp_size=dp, config_fingerprint="coordd-bench", wait_timeout=ROUND_TIMEOUT
    )


class Method(Protocol):
    name: str

    def start(self, i: int) -> Any: ...
    def wait(self, handle: Any) -> Any: ...
    def check(self, i: int, result: Any) -> bool: ...
    def close(self) -> None: ...


class _Checked:
    """Shared check: a decision must equal the policy applied to every rank's round-i report."""

    tables: Sequence[Sequence[StepReport]]

    def check(self, i: int, result: Any) -> bool:
        return bool(payload(result) == expected_payload(self.tables, i))


class _ClientMethod(_Checked):
    """A client with `CoordClient`'s surface: `start(report)` -> pending, `pending.wait()`."""

    client: Any
    reports: Sequence[StepReport]

    def start(self, i: int) -> Any:
        return self.client.start(self.reports[i % TABLE_SIZE])

    def wait(self, handle: Any) -> Any:
        return handle.wait()

    def close(self) -> None:
        self.client.close()


class CoorddMethod(_ClientMethod):
    """The blocking client (`CoordClient.start` / `PendingStep.wait`) against a coordd."""

    def __init__(
        self, name: str, address: str, rank: int, tables: Sequence[Sequence[StepReport]]
    ) -> None:
        from coordd.client.sync import CoordClient

        self.name = name
        self.tables = tables
        self.reports = tables[rank]
        self.client = CoordClient(address, config=bench_config(rank, len(tables)))
        self.client.connect(timeout=30)


def init_gloo(store_path: str, rank: int, dp: int, ifname: str = "") -> None:
    """Join the default torch.distributed group (gloo over `ifname`, loopback by default)."""
    import torch
    import torch.distributed as dist

    if ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=dp,
            timeout=timedelta(seconds=ROUND_TIMEOUT),
        )


def shutdown_gloo() -> None:
    """Leave the torch.distributed group, if this process joined one."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        dist.destroy_process_group()


class GlooMethod(_Checked):
    """vLLM's exchange: zeros([fields, dp], int32), own column set, all_reduce(SUM), then rules."""

    name = GLOO

    def __init__(self, rank: int, tables: Sequence[Sequence[StepReport]]) -> None:
        import torch
        import torch.distributed as dist

        self._torch = torch
        self._dist = dist
        self.tables = tables
        self.rank = rank
        self.dp = len(tables)
        self.columns = [torch.tensor(column(r), dtype=torch.int32) for r in tables[rank]]

    def start(self, i: int) -> Any:
        matrix = self._torch.zeros(len(FIELDS), self.dp, dtype=self._torch.int32)
        matrix[:, self.rank] = self.columns[i % TABLE_SIZE]
        return matrix, self._dist.all_reduce(matrix, async_op=True)

    def wait(self, handle: Any) -> Any:
        matrix, work = handle
        work.wait()
        return decision_from_matrix(matrix.tolist())

    def close(self) -> None:
        pass


def vllm_unavailable() -> str | None:
    """None if vLLM's `cpu_all_reduce_` imports here, else why not (checked without importing
    vLLM: that costs seconds, paid in the rank processes only)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return (
            "vLLM is not importable in this Python (run the bench with a vLLM environment's "
            "python and PYTHONPATH set to this checkout)"
        )
    return None


def import_cpu_all_reduce() -> Any:
    """What vLLM's DP sync runs on the CPU group, on vLLM's CPU platform unless told otherwise:
    0.33's `vllm.distributed.utils.cpu_all_reduce_`; 0.32 has none, and its `_run_ar` calls
    `torch.distributed.all_reduce(tensor, group=group)`, which this returns in its place."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        from vllm.distributed.utils import cpu_all_reduce_
    except ImportError:
        import torch.distributed as dist

        def all_reduce(tensor: Any, group: Any) -> Any:
            dist.all_reduce(tensor, group=group)
            return tensor

        return all_reduce
    return cpu_all_reduce_


def vllm_column(report: StepReport) -> list[int]:
    """A report as its column of MRV2's [7 x dp] matrix: num_tokens, cudagraph mode, uniform
    token count (the padded count stands in), max_query_len (-1: none), allow_ubatching,
    num_reqs (has_unfinished stands in), allow_skip_drafts."""
    return [
        report.num_tokens,
        report.cudagraph_mode,
        report.num_tokens_padded,
        -1,
        int(report.want_ubatch),
        int(report.has_unfinished),
        0,
    ]


def decision_from_vllm_matrix(rows: Sequence[Sequence[int]]) -> Any:
    return decision_from_matrix([rows[0], rows[2], rows[4], rows[1], rows[5]])


class VllmAllReduceMethod(_Checked):
    """vLLM's own DP sync on the default group (0.33's `cpu_all_reduce_`: recursive doubling,
    gloo send/recv; 0.32's gloo `all_reduce`), over MRV2's int32 [7 x dp] matrix. It blocks
    until done: start() runs the exchange."""

    name = VLLM

    def __init__(self, rank: int, tables: Sequence[Sequence[StepReport]]) -> None:
        import torch
        import torch.distributed as dist

        self._torch = torch
        self._reduce = import_cpu_all_reduce()
        self._group = dist.group.WORLD
        self.tables = tables
        self.rank = rank
        self.dp = len(tables)
        self.columns = [torch.tensor(vllm_column(r), dtype=torch.int32) for r in tables[rank]]

    def start(self, i: int) -> Any:
        matrix = self._torch.zeros(VLLM_ROWS, self.dp, dtype=self._torch.int32)
        matrix[:, self.rank] = self.columns[i % TABLE_SIZE]
        return self._reduce(matrix, self._group)

    def wait(self, handle: Any) -> Any:
        return decision_from_vllm_matrix(handle.tolist())

    def close(self) -> None:
        pass


def plugin_sync(address: str, rank: int, dp: int) -> Any:
    """The coordd vLLM plugin's per-sync path as patch point B runs it (`Exchange.sync_`:
    site label, own-column check, gather round, reduce into the tensor in place), on a group
    of its own; returns `reduce(tensor)` for worker tensors and `reduce(tensor, whole=True)`
    for the engine's state vector."""
    from coordd.vllm.enable import PluginSettings
    from coordd.vllm.exchange import Exchange, ReduceOp
    from coordd.vllm.groups import GroupIdentity

    # the bench's ranks have no gloo group to fall back on: the coordd path alone, fail-stop
    settings = PluginSettings(
        address, connect_timeout=30, sync_timeout=ROUND_TIMEOUT, fallback=False
    )
    exchange = Exchange(settings)
    identity = GroupIdentity(PLUGIN_GROUP, rank, dp, "coordd-bench")
    exchange.link(identity)  # connected now, not in the first timed round
    sync_, op = exchange.sync_, ReduceOp.SUM

    def reduce(tensor: Any, whole: bool = False) -> Any:
        sync_(tensor, op, identity, not whole)
        return tensor

    reduce.close = exchange.close  # type: ignore[attr-defined]
    return reduce


class VllmPluginMethod(VllmAllReduceMethod):
    """The same MRV2 int32 [7 x dp] sync as `VllmAllReduceMethod`, through the coordd vLLM
    plugin's per-sync path (`plugin_sync`) instead of vLLM's `cpu_all_reduce_`."""

    name = VLLM_PLUGIN

    def __init__(self, address: str, rank: int, tables: Sequence[Sequence[StepReport]]) -> None:
        import torch

        torch.set_num_threads(1)
        self._torch = torch
        self._sync = plugin_sync(address, rank, len(tables))
        self._reduce = lambda matrix, _group: self._sync(matrix)
        self._group = None
        self.tables = tables
        self.rank = rank
        self.dp = len(tables)
        self.columns = [torch.tensor(vllm_column(r), dtype=torch.int32) for r in tables[rank]]

    def close(self) -> None:
        self._sync.close()


class HubMethod(_Checked):
    """The minimal blocking pyzmq hub: send the msgpack report, block in recv for the decision."""

    name = HUB

    def __init__(self, address: str, rank: int, tables: Sequence[Sequence[StepReport]]) -> None:
        from coordd.tools.bench.hub import HubRank

        self.tables = tables
        self.reports = tables[rank]
        self.conn = HubRank(address, rank, timeout=ROUND_TIMEOUT)

    def start(self, i: int) -> Any:
        self.conn.start(self.reports[i % TABLE_SIZE])

    def wait(self, handle: Any) -> Any:
        return self.conn.wait()

    def close(self) -> None:
        self.conn.close()


def device_client_class() -> type | None:
    """The device-path client, or None where it cannot import (torch is the `device` extra)."""
    try:
        from coordd.client.device import DeviceCoordClient
    except ImportError:
        return None
    return DeviceCoordClient


def nccl_unavailable(dp: int | None = None) -> str | None:
    """None if the NCCL methods can run here (with `dp` ranks: NCCL takes one GPU per rank,
    "Duplicate GPU detected" otherwise), else why not."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install 'coordd[device]')"
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return "no CUDA device here"
    if not dist.is_available() or not dist.is_nccl_available():
        return "this torch has no NCCL"
    gpus = torch.cuda.device_count()
    if dp is not None and dp > gpus:
        return f"dp={dp} needs {dp} CUDA devices (NCCL takes one per rank); this host has {gpus}"
    return None


_nccl_group: Any = None


def nccl_group(rank: int) -> Any:
    """An NCCL group of every rank beside the default (gloo) one, this rank on cuda:rank; made
    once per process (every rank makes it, in the same order)."""
    global _nccl_group
    if _nccl_group is None:
        import torch
        import torch.distributed as dist

        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        torch.cuda.set_device(rank)
        _nccl_group = dist.new_group(backend="nccl")
    return _nccl_group


class DeviceMethod(_ClientMethod):
    """The device-path client (start, wait, close: `CoordClient`'s surface), on the default
    gloo group, or (`nccl`) on an NCCL group over cuda:rank."""

    def __init__(self, rank: int, tables: Sequence[Sequence[StepReport]], nccl: bool = False):
        cls = device_client_class()
        if cls is None:
            raise RuntimeError("the device path needs torch: pip install 'coordd[device]'")
        self.name = DEVICE_NCCL if nccl else DEVICE
        self.tables = tables
        self.reports = tables[rank]
        group, device = (nccl_group(rank), f"cuda:{rank}") if nccl else (None, None)
        self.client = cls(
            config=bench_config(rank, len(tables)), process_group=group, device=device
        )
        self.client.connect(timeout=30)


class BareMethod:
    """A device path's floor: its int64 [dp x fields] matrix made once, this rank's row put in
    (one copy, from pinned host memory on CUDA), one SUM all_reduce, and the sum read back on
    the host (through pinned memory on CUDA); no session, no policy. The result is the matrix
    as lists, checked for every rank's token count."""

    def __init__(self, rank: int, tables: Sequence[Sequence[StepReport]], nccl: bool = False):
        import torch
        import torch.distributed as dist

        from coordd.client.device import NUM_FIELDS, encode_row

        self.name = NCCL_BARE if nccl else GLOO_BARE
        self._dist = dist
        self.tables = tables
        self.dp = len(tables)
        self.group = nccl_group(rank) if nccl else None
        device = torch.device("cuda", rank) if nccl else torch.device("cpu")
        self.cuda = nccl
        self.staged = []
        for report in tables[rank]:
            staged = torch.zeros((self.dp, NUM_FIELDS), dtype=torch.int64, pin_memory=nccl)
            staged[rank] = torch.tensor(encode_row(report, 0, 0), dtype=torch.int64)
            self.staged.append(staged)
        self.matrix = torch.zeros((self.dp, NUM_FIELDS), dtype=torch.int64, device=device)
        self.out = (
            torch.zeros((self.dp, NUM_FIELDS), dtype=torch.int64, pin_memory=True)
            if nccl
            else self.matrix
        )

    def start(self, i: int) -> Any:
        self.matrix.copy_(self.staged[i % TABLE_SIZE], non_blocking=True)
        return self._dist.all_reduce(self.matrix, group=self.group, async_op=True)

    def wait(self, handle: Any) -> Any:
        handle.wait()
        if self.cuda:
            self.out.copy_(self.matrix)
        return self.out.tolist()

    def check(self, i: int, result: Any) -> bool:
        want = [self.tables[r][i % TABLE_SIZE].num_tokens for r in range(self.dp)]
        return bool([row[0] for row in result] == want)

    def close(self) -> None:
        pass


class FloorMethod:
    """Raw UNIX sockets to the floor hub: fixed-size reports out, their concatenation back."""

    name = FLOOR

    def __init__(self, path: str, rank: int, tables: Sequence[Sequence[StepReport]]) -> None:
        from coordd.tools.bench.floor import FloorRank

        self.tables = tables
        self.reports = tables[rank]
        self.conn = FloorRank(path, rank, len(tables), timeout=ROUND_TIMEOUT)

    def start(self, i: int) -> Any:
        self.conn.start(floor_report(self.reports[i % TABLE_SIZE], i))

    def wait(self, handle: Any) -> Any:
        return self.conn.wait()

    def check(self, i: int, result: Any) -> bool:
        return bool(result == expected_floor_reply(self.tables, i))

    def close(self) -> None:
        self.conn.close()
