"""One benchmark rank: a process that holds every method's connection and runs what it is told.

The parent sends a `Phase` (configs of method, mode and work; rounds; blocks); every rank runs
the same sequence, interleaving the configs block by block so slow drift of a shared machine
spreads evenly over the methods, and sends back its samples. Control messages are msgspec
Structs over a pipe, like everything else here.
"""

from __future__ import annotations

import os
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Union

import msgspec

from coordd.tools.bench import engine, procstat
from coordd.tools.bench.methods import (
    COORDD_IPC,
    COORDD_TCP,
    DEVICE,
    DEVICE_NCCL,
    FLOOR,
    GLOO,
    GLOO_BARE,
    HUB,
    NCCL_BARE,
    VLLM,
    VLLM_PLUGIN,
    BareMethod,
    CoorddMethod,
    DeviceMethod,
    FloorMethod,
    GlooMethod,
    HubMethod,
    Method,
    VllmAllReduceMethod,
    VllmPluginMethod,
    init_gloo,
    shutdown_gloo,
)
from coordd.tools.bench.workload import report_table

#: Unrecorded rounds between reading /proc and the timed rounds (the read delays this rank).
SETTLE_ROUNDS = 2
#: Longest a rank waits for its next order before it gives up (no hang, ever).
IDLE_TIMEOUT = 900.0


class RankSetup(msgspec.Struct, frozen=True, tag="setup"):
    rank: int
    dp: int
    methods: list[str]
    coordd_ipc: str = ""
    coordd_tcp: str = ""
    floor_path: str = ""
    hub_address: str = ""
    gloo_store: str = ""
    #: The interface gloo binds (default: loopback); across namespaces, this side's veth.
    gloo_ifname: str = ""
    #: A network namespace (`ip netns` name) this rank enters before it opens anything.
    netns: str = ""
    #: method -> pid of the process that serves it (coordd, the floor hub); rank 0 reads it.
    servers: dict[str, int] = {}
    seed: int = 0


class Config(msgspec.Struct, frozen=True):
    method: str
    mode: str = "sync"  # sync | sleep | spin
    work_us: float = 0.0


class Phase(msgspec.Struct, frozen=True, tag="phase"):
    configs: list[Config]
    rounds: int
    blocks: int
    warmup: int


class Stop(msgspec.Struct, frozen=True, tag="stop"):
    pass


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    rank: int


class ConfigResult(msgspec.Struct):
    latency_ns: list[int] = []
    exposed_ns: list[int] = []
    work_ns: list[int] = []
    completed: int = 0
    checked: int = 0
    mismatches: int = 0
    cpu_ns: int = 0
    ctx_switches: int = 0
    server_cpu_ns: int = 0
    server_ctx_switches: int = 0
    cpu_rounds: int = 0
    cpu_ns_by_thread: dict[str, int] = {}
    server_cpu_ns_by_thread: dict[str, int] = {}


class PhaseResult(msgspec.Struct, frozen=True, tag="result"):
    rank: int
    results: list[ConfigResult]


class RankError(msgspec.Struct, frozen=True, tag="error"):
    rank: int
    text: str


ToRank = Union[Phase, engine.EnginePhase, Stop]
FromRank = Union[Ready, PhaseResult, engine.EngineResults, RankError]
encode = msgspec.msgpack.encode
decode_to_rank = msgspec.msgpack.Decoder(ToRank).decode
decode_from_rank = msgspec.msgpack.Decoder(FromRank).decode
decode_setup = msgspec.msgpack.Decoder(RankSetup).decode


def _open(setup: RankSetup) -> dict[str, Method]:
    tables = [report_table(r, setup.seed) for r in range(setup.dp)]
    methods: dict[str, Method] = {}
    for name in setup.methods:
        if name == COORDD_IPC:
            methods[name] = CoorddMethod(name, setup.coordd_ipc, setup.rank, tables)
        elif name == COORDD_TCP:
            methods[name] = CoorddMethod(name, setup.coordd_tcp, setup.rank, tables)
        elif name in (GLOO, DEVICE, VLLM):
            init_gloo(setup.gloo_store, setup.rank, setup.dp, setup.gloo_ifname)
            cls: Any = {GLOO: GlooMethod, DEVICE: DeviceMethod, VLLM: VllmAllReduceMethod}[name]
            methods[name] = cls(setup.rank, tables)
        elif name in (GLOO_BARE, DEVICE_NCCL, NCCL_BARE):
            init_gloo(setup.gloo_store, setup.rank, setup.dp, setup.gloo_ifname)
            nccl = name != GLOO_BARE
            cls = BareMethod if name != DEVICE_NCCL else DeviceMethod
            methods[name] = cls(setup.rank, tables, nccl=nccl)
        elif name == VLLM_PLUGIN:
            methods[name] = VllmPluginMethod(setup.coordd_ipc, setup.rank, tables)
        elif name == FLOOR:
            methods[name] = FloorMethod(setup.floor_path, setup.rank, tables)
        elif name == HUB:
            methods[name] = HubMethod(setup.hub_address, setup.rank, tables)
        else:
            raise ValueError(f"unknown method {name!r}")
    return methods


def _rounds(method: Method, config: Config, first: int, n: int, out: ConfigResult | None) -> list:
    """Run rounds first..first+n-1; record their times in `out` (None: warm-up)."""
    start, wait = method.start, method.wait
    clock = time.perf_counter_ns
    results: list[Any] = []
    append = results.append
    if config.mode == "sync":
        lat = out.latency_ns if out is not None else []
        for i in range(first, first + n):
            t0 = clock()
            result = wait(start(i))
            lat.append(clock() - t0)
            append(result)
        return results
    work_ns = int(config.work_us * 1000)
    sleep_s = config.work_us / 1e6
    spin = config.mode == "spin"
    lat, exposed, work = (
        (out.latency_ns, out.exposed_ns, out.work_ns) if out is not None else ([], [], [])
    )
    for i in range(first, first + n):
        t0 = clock()
        handle = start(i)
        t1 = clock()
        if spin:
            until = t1 + work_ns
            while clock() < until:
                pass
        else:
            time.sleep(sleep_s)
        t2 = clock()
        result = wait(handle)
        t3 = clock()
        lat.append(t3 - t0)
        exposed.append(t3 - t2)
        work.append(t2 - t1)
        append(result)
    return results


def _add(into: dict[str, int], delta: dict[str, int]) -> None:
    for name, ns in delta.items():
        key = procstat.thread_kind(name)
        into[key] = into.get(key, 0) + ns


def _run_phase(setup: RankSetup, methods: dict[str, Method], phase: Phase) -> PhaseResult:
    me = os.getpid()
    out = [ConfigResult() for _ in phase.configs]
    checks: list[list[tuple[int, Any]]] = [[] for _ in phase.configs]
    next_round = dict.fromkeys(methods, 0)
    per_block = [phase.rounds // phase.blocks] * phase.blocks
    for b in range(phase.rounds % phase.blocks):
        per_block[b] += 1
    for block, n in enumerate(per_block):
        shift = block % len(phase.configs)
        order = list(range(len(phase.configs)))
        order = order[shift:] + order[:shift]
        for index in order:
            config = phase.configs[index]
            method = methods[config.method]
            result = out[index]
            first = next_round[config.method]
            warm = _rounds(method, config, first, phase.warmup, None)
            checks[index].extend(enumerate(warm, first))
            first += phase.warmup
            server = setup.servers.get(config.method) if setup.rank == 0 else None
            server_before = procstat.sample(server) if server else None
            before = procstat.sample(me)
            # This thread's own CPU comes from the tight clock below: reading /proc costs this
            # thread (not the others) CPU, which must not count as the method's.
            main_before = time.thread_time_ns()
            settle = _rounds(method, config, first, SETTLE_ROUNDS, None)
            checks[index].extend(enumerate(settle, first))
            first += SETTLE_ROUNDS
            timed = _rounds(method, config, first, n, result)
            main_ns = time.thread_time_ns() - main_before
            after = procstat.sample(me)
            before.cpu_ns["main"] = 0
            after.cpu_ns["main"] = main_ns
            if server and server_before is not None:
                server_after = procstat.sample(server)
                result.server_cpu_ns += server_after.total_cpu_ns - server_before.total_cpu_ns
                result.server_ctx_switches += server_after.ctx_switches - server_before.ctx_switches
                _add(
                    result.server_cpu_ns_by_thread,
                    procstat.cpu_delta_ns(server_before, server_after),
                )
            _add(result.cpu_ns_by_thread, procstat.cpu_delta_ns(before, after))
            result.cpu_ns += after.total_cpu_ns - before.total_cpu_ns
            result.ctx_switches += after.ctx_switches - before.ctx_switches
            result.cpu_rounds += SETTLE_ROUNDS + n
            result.completed += len(timed)
            checks[index].extend(enumerate(timed, first))
            next_round[config.method] = first + n
    for index, config in enumerate(phase.configs):
        method = methods[config.method]
        out[index].checked = len(checks[index])
        out[index].mismatches = sum(not method.check(i, r) for i, r in checks[index])
    return PhaseResult(rank=setup.rank, results=out)


def enter_netns(name: str) -> None:
    """Move this process (its only thread, at start) into network namespace `name`."""
    import ctypes

    clone_newnet = 0x40000000
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, clone_newnet) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def rank_main(conn: Connection, setup_bytes: bytes) -> None:
    """The rank process's entry point (multiprocessing, spawn)."""
    setup = decode_setup(setup_bytes)
    methods: dict[str, Method] = {}
    try:
        if setup.netns:
            enter_netns(setup.netns)
        methods = _open(setup)
        conn.send_bytes(encode(Ready(rank=setup.rank)))
        while conn.poll(IDLE_TIMEOUT):
            order = decode_to_rank(conn.recv_bytes())
            if isinstance(order, Stop):
                break
            if isinstance(order, engine.EnginePhase):
                coordd = methods.get(COORDD_IPC)
                client = coordd.client if isinstance(coordd, CoorddMethod) else None
                plugin = methods.get(VLLM_PLUGIN)
                sync = plugin._sync if isinstance(plugin, VllmPluginMethod) else None
                conn.send_bytes(encode(engine.run_phase(order, setup.rank, setup.dp, client, sync)))
                continue
            conn.send_bytes(encode(_run_phase(setup, methods, order)))
    except Exception:
        conn.send_bytes(encode(RankError(rank=setup.rank, text=traceback.format_exc())))
    finally:
        for method in methods.values():
            method.close()
        shutdown_gloo()
        conn.close()
