"""Latency, overlap and the engine loop: every method among the same `dp` rank processes.

For each dp, this starts coordd twice (ipc and tcp), the pyzmq hub, the floor hub and a
file store for gloo, spawns dp rank processes that connect to all of them, and has them run the
latency phase (synchronous rounds), the overlap phase (start, work W, wait) with W set from
this run's coordd-ipc round latency, and the engine-level step loop, so every ratio compares
figures taken minutes apart at most. `run_crosshost` runs the latency phase again over tcp with
half the ranks in another network namespace, joined by a veth pair.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from coordd.testing.process import CoorddProcess
from coordd.tools.bench import engine, stats
from coordd.tools.bench.floor import FloorProcess
from coordd.tools.bench.hub import HubProcess
from coordd.tools.bench.methods import (
    ALL_METHODS,
    BLOCKING_METHODS,
    COORDD_IPC,
    COORDD_TCP,
    DEVICE,
    DEVICE_NCCL,
    FLOOR,
    GLOO,
    GLOO_BARE,
    HUB,
    NCCL_METHODS,
    VLLM,
    VLLM_PLUGIN,
    device_client_class,
    nccl_unavailable,
    vllm_unavailable,
)
from coordd.tools.bench.rank import (
    SETTLE_ROUNDS,
    Config,
    ConfigResult,
    Phase,
    PhaseResult,
    RankError,
    RankSetup,
    Stop,
    decode_from_rank,
    encode,
    rank_main,
)

#: Upper bound on one round while estimating a phase's deadline (a loaded 2-core machine).
_SLOW_ROUND_S = 0.02


class BenchError(RuntimeError):
    """A rank or a server failed; names the dp, and the rank and its traceback where known."""


@dataclass
class LatencyOptions:
    dps: list[int]
    methods: list[str]
    rounds: int = 2000
    blocks: int = 10
    warmup: int = 5
    overlap: bool = True
    overlap_rounds: int = 400
    work_multiples: list[float] = field(default_factory=lambda: [1.0, 2.0, 5.0])
    variants: list[str] = field(default_factory=lambda: ["sleep", "spin"])
    seed: int = 0
    #: Run the latency phase (off: only the engine loop, `coordd bench --engine`).
    latency: bool = True
    engine_steps: int = 0
    engine_step_ms: float = 8.0


def available_methods(requested: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The requested methods that can run here, and why the others cannot."""
    skipped: dict[str, str] = {}
    chosen: list[str] = []
    has_torch = importlib.util.find_spec("torch") is not None
    for name in requested:
        if name not in ALL_METHODS:
            raise ValueError(f"unknown method {name!r}: choose from {', '.join(ALL_METHODS)}")
        if name in (GLOO, DEVICE, GLOO_BARE) and not has_torch:
            skipped[name] = "torch is not installed (pip install 'coordd[device]')"
        elif name in (VLLM, VLLM_PLUGIN) and vllm_unavailable():
            skipped[name] = str(vllm_unavailable())
        elif name in NCCL_METHODS and nccl_unavailable():
            skipped[name] = str(nccl_unavailable())
        elif name in (DEVICE, DEVICE_NCCL) and device_client_class() is None:
            skipped[name] = "client/device.py (DeviceCoordClient) is not in this tree yet"
        else:
            chosen.append(name)
    return chosen, skipped


def methods_at(dp: int, methods: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The methods that can run with `dp` ranks, and why the others cannot (the NCCL ones
    need a CUDA device per rank)."""
    why = nccl_unavailable(dp) if any(m in NCCL_METHODS for m in methods) else None
    if why is None:
        return list(methods), {}
    return [m for m in methods if m not in NCCL_METHODS], {
        m: why for m in methods if m in NCCL_METHODS
    }


def coordd_tcp_args() -> list[str]:
    """`--insecure` where `coordd serve` has it (tcp then needs no CURVE keys)."""
    from coordd.cli import add_server_options

    parser = argparse.ArgumentParser(add_help=False)
    os.environ.setdefault("COORDD_DP", "1")  # only so that --dp is not required here
    try:
        add_server_options(parser)
    finally:
        if os.environ.get("COORDD_DP") == "1":
            del os.environ["COORDD_DP"]
    return ["--insecure"] if "--insecure" in parser._option_string_actions else []


class RankGroup:
    """dp spawned rank processes and a pipe to each."""

    def __init__(self, setups: Sequence[RankSetup]) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for setup in setups:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(child, encode(setup)), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def collect(self, timeout: float, what: str) -> list[Any]:
        """One message from every rank within `timeout`; raises `BenchError` otherwise."""
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        pending = set(range(len(self.conns)))
        while pending:
            remaining = deadline - time.monotonic()
            ready = wait([self.conns[i] for i in pending], max(0.0, remaining))
            if not ready:
                raise BenchError(f"{what}: ranks {sorted(pending)} silent for {timeout:.0f}s")
            for conn in ready:
                i = self.conns.index(conn)  # type: ignore[arg-type]
                try:
                    msg = decode_from_rank(conn.recv_bytes())  # type: ignore[union-attr]
                except EOFError:
                    raise BenchError(f"{what}: rank {i} exited") from None
                if isinstance(msg, RankError):
                    raise BenchError(f"{what}: rank {msg.rank} failed:\n{msg.text}")
                got[i] = msg
                pending.discard(i)
        return [got[i] for i in range(len(self.conns))]

    def send(self, message: Any) -> None:
        data = encode(message)
        for conn in self.conns:
            conn.send_bytes(data)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(encode(Stop()))
        for proc in self.procs:
            proc.join(timeout=10)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()


@contextlib.contextmanager
def _servers(
    dp: int, methods: Sequence[str], tmp: str, tcp_host: str = ""
) -> Iterator[tuple[RankSetup, list[Any]]]:
    """Start what the methods need; yield the setup template (rank 0) and the processes.

    With `tcp_host`, every server listens on tcp at that address (the hub and the floor too).
    """
    procs: list[Any] = []
    fields: dict[str, Any] = {"rank": 0, "dp": dp, "methods": list(methods), "servers": {}}
    try:
        quiet = ["--log-level", "error"]
        if COORDD_IPC in methods or VLLM_PLUGIN in methods:
            proc = CoorddProcess(dp, f"ipc://{tmp}/coordd.sock", quiet).start()
            procs.append(proc)
            fields["coordd_ipc"] = proc.address
            fields["servers"][COORDD_IPC] = proc.pid
            fields["servers"][VLLM_PLUGIN] = proc.pid  # the plugin's group: the same coordd
        if COORDD_TCP in methods:
            bind = f"tcp://{tcp_host or '127.0.0.1'}:0"
            proc = CoorddProcess(dp, bind, quiet + coordd_tcp_args()).start()
            procs.append(proc)
            fields["coordd_tcp"] = proc.address
            fields["servers"][COORDD_TCP] = proc.pid
        if HUB in methods:
            bind = f"tcp://{tcp_host}:0" if tcp_host else f"ipc://{tmp}/hub.sock"
            zhub = HubProcess(dp, bind, timeout=900).start()
            procs.append(zhub)
            fields["hub_address"] = zhub.address
            fields["servers"][HUB] = zhub.pid
        if FLOOR in methods:
            path = f"tcp://{tcp_host}:0" if tcp_host else f"{tmp}/floor.sock"
            hub = FloorProcess(dp, path, timeout=900).start()
            procs.append(hub)
            fields["floor_path"] = hub.address
            fields["servers"][FLOOR] = hub.pid
        fields["gloo_store"] = f"{tmp}/gloo-store"
        yield RankSetup(**fields), procs
    finally:
        for proc in reversed(procs):
            proc.stop()


def _phase_timeout(phase: Phase) -> float:
    per_config = phase.rounds + phase.blocks * (phase.warmup + SETTLE_ROUNDS)
    work_s = sum(c.work_us for c in phase.configs) / 1e6
    return 120.0 + per_config * (len(phase.configs) * _SLOW_ROUND_S + work_s)


def _merge(results: Sequence[PhaseResult], index: int) -> dict[str, Any]:
    parts: list[ConfigResult] = [r.results[index] for r in results]
    latency = [x for p in parts for x in p.latency_ns]
    cpu_rounds = max(1, parts[0].cpu_rounds)
    cpu_ns = sum(p.cpu_ns for p in parts) + parts[0].server_cpu_ns
    ctx = sum(p.ctx_switches for p in parts) + parts[0].server_ctx_switches
    by_thread: dict[str, float] = {}
    for p in parts:
        for kind, ns in p.cpu_ns_by_thread.items():
            by_thread[f"ranks {kind}"] = by_thread.get(f"ranks {kind}", 0.0) + ns
    for kind, ns in parts[0].server_cpu_ns_by_thread.items():
        by_thread[f"server {kind}"] = ns
    out: dict[str, Any] = {
        "completed": min(p.completed for p in parts),
        "checked": sum(p.checked for p in parts),
        "mismatches": sum(p.mismatches for p in parts),
        **stats.summary(latency),
        "cpu_us_per_round": cpu_ns / cpu_rounds / 1000.0,
        "server_cpu_us_per_round": parts[0].server_cpu_ns / cpu_rounds / 1000.0,
        "ctx_switches_per_round": ctx / cpu_rounds,
        "cpu_us_per_round_by_thread": {
            k: v / cpu_rounds / 1000.0 for k, v in sorted(by_thread.items())
        },
    }
    if parts[0].exposed_ns:
        exposed = stats.summary([x for p in parts for x in p.exposed_ns])
        work = stats.summary([x for p in parts for x in p.work_ns])
        out.update(
            exposed_p50_us=exposed["p50_us"],
            exposed_p99_us=exposed["p99_us"],
            work_p50_us=work["p50_us"],
        )
    return out


def _latency_phase(
    dp: int, opts: LatencyOptions, group: RankGroup, methods: Sequence[str], log: Any, what: str
) -> list[dict[str, Any]]:
    sync = Phase(
        configs=[Config(m) for m in methods],
        rounds=opts.rounds,
        blocks=opts.blocks,
        warmup=opts.warmup,
    )
    log(f"dp={dp}: {what}, {opts.rounds} rounds x {len(methods)} methods")
    group.send(sync)
    results = group.collect(_phase_timeout(sync), f"dp={dp}: {what}")
    return [
        {"dp": dp, "method": config.method, "rounds": opts.rounds, **_merge(results, i)}
        for i, config in enumerate(sync.configs)
    ]


def engine_modes(methods: Sequence[str]) -> list[str]:
    """The engine-loop modes whose connection is among `methods`."""
    return [mode for mode, method in engine.MODES.items() if method in methods]


def _engine(dp: int, opts: LatencyOptions, group: RankGroup, log: Any) -> list[dict[str, Any]]:
    modes = engine_modes(opts.methods)
    phase = engine.EnginePhase(
        modes=modes, steps=opts.engine_steps, step_ms=opts.engine_step_ms, seed=opts.seed
    )
    log(f"dp={dp}: engine loop, {opts.engine_steps} steps x {len(modes)} ways to sync")
    group.send(phase)
    # a step is at most ~3x step_ms of GPU time plus three rounds
    budget = 120.0 + len(modes) * (opts.engine_steps + engine.WARMUP_STEPS) * (
        3.5 * opts.engine_step_ms / 1000 + 3 * _SLOW_ROUND_S
    )
    results = group.collect(budget, f"dp={dp}: engine loop")
    return engine.merge(dp, results, opts.engine_step_ms)


def run_dp(dp: int, opts: LatencyOptions, log: Any = print) -> dict[str, Any]:
    """Latency, overlap, then the engine loop, for every method among the same dp ranks."""
    methods, skipped = methods_at(dp, opts.methods)
    for name, why in skipped.items():
        log(f"dp={dp}: skipping {name}: {why}")
    if not methods:
        return {"latency": [], "overlap": [], "engine": []}
    opts = dataclasses.replace(opts, methods=methods)
    with (
        tempfile.TemporaryDirectory(prefix="coordd-bench-") as tmp,
        _servers(dp, opts.methods, tmp) as (template, _),
    ):
        group = RankGroup(
            [
                RankSetup(**{**msgspec_fields(template), "rank": r, "seed": opts.seed})
                for r in range(dp)
            ]
        )
        try:
            group.collect(180.0, f"dp={dp}: connecting")
            latency: list[dict[str, Any]] = []
            overlap: list[dict[str, Any]] = []
            if opts.latency:
                latency = _latency_phase(dp, opts, group, opts.methods, log, "latency")
                if opts.overlap and opts.overlap_rounds > 0:
                    overlap = _overlap(dp, opts, group, latency, log)
            rows: list[dict[str, Any]] = []
            if opts.engine_steps > 0 and engine_modes(opts.methods):
                rows = _engine(dp, opts, group, log)
            return {"latency": latency, "overlap": overlap, "engine": rows}
        finally:
            group.close()


#: The methods measured across namespaces: each over tcp.
CROSSHOST_METHODS = (COORDD_TCP, HUB, FLOOR, GLOO, VLLM)


def run_crosshost(dp: int, opts: LatencyOptions, log: Any = print) -> list[dict[str, Any]]:
    """The latency phase over tcp, ranks 0..dp/2-1 (and every server) in this network namespace,
    the others in a second one joined to it by a veth pair (no added delay)."""
    from coordd.tools.chaos.netns import CutNamespace

    methods = [m for m in CROSSHOST_METHODS if m in opts.methods]
    ns = CutNamespace()
    try:
        ns.create()
        with (
            tempfile.TemporaryDirectory(prefix="coordd-bench-") as tmp,
            _servers(dp, methods, tmp, tcp_host=ns.host_ip) as (template, _),
        ):
            setups = []
            for r in range(dp):
                far = r >= (dp + 1) // 2
                setups.append(
                    RankSetup(
                        **{
                            **msgspec_fields(template),
                            "rank": r,
                            "seed": opts.seed,
                            "netns": ns.name if far else "",
                            "gloo_ifname": ns.ns_if if far else ns.host_if,
                        }
                    )
                )
            group = RankGroup(setups)
            try:
                group.collect(180.0, f"dp={dp}: connecting across namespaces")
                rows = _latency_phase(dp, opts, group, methods, log, "latency across namespaces")
            finally:
                group.close()
    finally:
        ns.remove()
    for row in rows:
        row["where"] = "2 netns, veth, tcp"
    return rows


def msgspec_fields(struct: Any) -> dict[str, Any]:
    return {name: getattr(struct, name) for name in struct.__struct_fields__}


def _overlap(
    dp: int,
    opts: LatencyOptions,
    group: RankGroup,
    latency: list[dict[str, Any]],
    log: Any,
) -> list[dict[str, Any]]:
    sync_p50 = {row["method"]: row["p50_us"] for row in latency}
    methods = [m for m in opts.methods if m not in BLOCKING_METHODS]
    if not methods:
        return []
    base_method = COORDD_IPC if COORDD_IPC in sync_p50 else methods[0]
    base_us = sync_p50[base_method]
    configs = [
        Config(m, variant, round(base_us * k, 1))
        for variant in opts.variants
        for k in opts.work_multiples
        for m in methods
    ]
    multiples = [k for _variant in opts.variants for k in opts.work_multiples for _m in methods]
    phase = Phase(
        configs=configs,
        rounds=opts.overlap_rounds,
        blocks=max(1, min(opts.blocks, opts.overlap_rounds // 20)),
        warmup=opts.warmup,
    )
    log(
        f"dp={dp}: overlap, W = {', '.join(f'{k:g}x' for k in opts.work_multiples)} of "
        f"{base_method} p50 {base_us:.0f} us, {len(configs)} configs x {opts.overlap_rounds} rounds"
    )
    group.send(phase)
    results = group.collect(_phase_timeout(phase), f"dp={dp}: overlap")
    rows = []
    for i, (config, k) in enumerate(zip(configs, multiples, strict=True)):
        merged = _merge(results, i)
        rows.append(
            {
                "dp": dp,
                "method": config.method,
                "variant": config.mode,
                "work_multiple": k,
                "work_us": config.work_us,
                "base_method": base_method,
                "rounds": opts.overlap_rounds,
                "sync_p50_us": sync_p50[config.method],
                "exposed_over_sync": merged["exposed_p50_us"] / sync_p50[config.method],
                **merged,
            }
        )
    return rows


def run_latency(opts: LatencyOptions, log: Any = print) -> dict[str, Any]:
    out: dict[str, Any] = {"latency": [], "overlap": [], "engine": []}
    for dp in opts.dps:
        part = run_dp(dp, opts, log)
        for key in out:
            out[key].extend(part[key])
    return out
