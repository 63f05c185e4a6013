"""Scale: dp = 16 .. 256 simulated ranks (asyncio clients, a few per process) on one coordd.

Each simulator process runs `AsyncCoordClient`s on one uvloop loop: every round it starts all
of its ranks' reports, then awaits all their decisions. coordd's CPU time per round comes from
its own accounting (/proc, every thread), read by the parent around the timed rounds; its
resident memory after them.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Union

import msgspec

from coordd.bench import procstat, stats
from coordd.bench.runner import BenchError
from coordd.bench.workload import TABLE_SIZE, expected_payload, payload, report_table
from coordd.procs import CoorddProcess
from proto.messages import StepDecision

_IDLE_TIMEOUT = 900.0
_ROUND_TIMEOUT = 60.0


class SimSetup(msgspec.Struct, frozen=True):
    address: str
    dp: int
    ranks: list[int]
    seed: int = 0


class Rounds(msgspec.Struct, frozen=True, tag="rounds"):
    n: int
    check: bool


class SimStop(msgspec.Struct, frozen=True, tag="stop"):
    pass


class SimReady(msgspec.Struct, frozen=True, tag="ready"):
    ranks: int


class SimDone(msgspec.Struct, frozen=True, tag="done"):
    latency_ns: list[int]
    completed: int
    checked: int
    mismatches: int


class SimError(msgspec.Struct, frozen=True, tag="error"):
    text: str


_to_sim = msgspec.msgpack.Decoder(Union[Rounds, SimStop])
_from_sim = msgspec.msgpack.Decoder(Union[SimReady, SimDone, SimError])


async def _simulate(conn: Connection, setup: SimSetup) -> None:
    from client.aio import AsyncCoordClient

    tables = [report_table(r, setup.seed) for r in range(setup.dp)]
    clients = [
        AsyncCoordClient(
            setup.address,
            dp_rank=r,
            dp_size=setup.dp,
            config_fingerprint="coordd-bench",
            wait_timeout=_ROUND_TIMEOUT,
        )
        for r in setup.ranks
    ]
    loop = asyncio.get_running_loop()
    try:
        await asyncio.gather(*(c.connect(timeout=60) for c in clients))
        conn.send_bytes(msgspec.msgpack.encode(SimReady(ranks=len(clients))))
        round_index = 0
        while await loop.run_in_executor(None, conn.poll, _IDLE_TIMEOUT):
            order = _to_sim.decode(conn.recv_bytes())
            if isinstance(order, SimStop):
                return
            latency: list[int] = []
            completed = checked = mismatches = 0
            clock = time.perf_counter_ns
            for _ in range(order.n):
                i = round_index % TABLE_SIZE
                t0 = clock()
                futures = [c.start(tables[c.dp_rank][i]) for c in clients]
                done, _pending = await asyncio.wait(futures, timeout=_ROUND_TIMEOUT)
                latency.append(clock() - t0)
                if len(done) != len(futures):
                    raise TimeoutError(f"round {round_index}: no decision in {_ROUND_TIMEOUT}s")
                decisions = [f.result() for f in futures]
                completed += all(type(d) is StepDecision for d in decisions)
                if order.check:
                    want = expected_payload(tables, round_index)
                    checked += len(decisions)
                    mismatches += sum(payload(d) != want for d in decisions)
                round_index += 1
            done_msg = SimDone(latency, completed, checked, mismatches)
            conn.send_bytes(msgspec.msgpack.encode(done_msg))
    finally:
        for c in clients:
            await c.close()


def sim_main(conn: Connection, setup_bytes: bytes) -> None:
    """A simulator process's entry point (multiprocessing, spawn)."""
    setup = msgspec.msgpack.decode(setup_bytes, type=SimSetup)
    try:
        import uvloop

        uvloop.run(_simulate(conn, setup))
    except Exception:
        conn.send_bytes(msgspec.msgpack.encode(SimError(traceback.format_exc())))
    finally:
        conn.close()


@dataclass
class ScaleOptions:
    dps: list[int]
    procs: int = 4
    rounds: int = 300
    warmup: int = 30
    seed: int = 0


class _Sims:
    def __init__(self, address: str, dp: int, procs: int, seed: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for p in range(procs):
            setup = SimSetup(address, dp, list(range(p, dp, procs)), seed)
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=sim_main, args=(child, msgspec.msgpack.encode(setup)), daemon=True
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def collect(self, timeout: float, what: str) -> list[Any]:
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(self.conns):
            pending = [c for i, c in enumerate(self.conns) if i not in got]
            ready = wait(pending, max(0.0, deadline - time.monotonic()))
            if not ready:
                raise BenchError(f"{what}: simulators silent for {timeout:.0f}s")
            for conn in ready:
                i = self.conns.index(conn)  # type: ignore[arg-type]
                try:
                    msg = _from_sim.decode(conn.recv_bytes())  # type: ignore[union-attr]
                except EOFError:
                    raise BenchError(f"{what}: simulator {i} exited") from None
                if isinstance(msg, SimError):
                    raise BenchError(f"{what}: simulator {i} failed:\n{msg.text}")
                got[i] = msg
        return [got[i] for i in range(len(self.conns))]

    def send(self, message: Any) -> None:
        data = msgspec.msgpack.encode(message)
        for conn in self.conns:
            conn.send_bytes(data)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(msgspec.msgpack.encode(SimStop()))
        for proc in self.procs:
            proc.join(timeout=15)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()


def run_scale_dp(dp: int, opts: ScaleOptions, log: Any = print) -> dict[str, Any]:
    procs = max(1, min(opts.procs, dp))
    with (
        tempfile.TemporaryDirectory(prefix="coordd-bench-scale-") as tmp,
        CoorddProcess(dp, f"ipc://{tmp}/coordd.sock", ["--log-level", "error"]) as coordd,
    ):
        sims = _Sims(coordd.address, dp, procs, opts.seed)
        try:
            sims.collect(300.0, f"scale dp={dp}: connecting")
            log(f"scale dp={dp}: {procs} processes, {opts.rounds} rounds")
            sims.send(Rounds(n=opts.warmup, check=True))
            warm = sims.collect(120.0 + opts.warmup * 1.0, f"scale dp={dp}: warm-up")
            before = procstat.sample(coordd.pid)
            began = time.perf_counter()
            sims.send(Rounds(n=opts.rounds, check=False))
            timed = sims.collect(120.0 + opts.rounds * 1.0, f"scale dp={dp}: rounds")
            wall = time.perf_counter() - began
            after = procstat.sample(coordd.pid)
        finally:
            sims.close()
    # A process's round spans from its first start to its last decision: the round as the
    # slowest rank of the process sees it.
    latency = [x for part in timed for x in part.latency_ns]
    per_thread = procstat.cpu_delta_ns(before, after)
    cpu_us = sum(per_thread.values()) / opts.rounds / 1000.0
    return {
        "dp": dp,
        "procs": procs,
        "rounds": opts.rounds,
        "completed": min(part.completed for part in timed),
        "checked": sum(part.checked for part in warm),
        "mismatches": sum(part.mismatches for part in warm),
        **stats.summary(latency),
        "rounds_per_s": opts.rounds / wall,
        "coordd_cpu_us_per_round": cpu_us,
        "coordd_cpu_us_per_rank_round": cpu_us / dp,
        "coordd_cpu_us_per_round_by_thread": {
            name: ns / opts.rounds / 1000.0 for name, ns in sorted(per_thread.items())
        },
        "coordd_ctx_switches_per_round": (after.ctx_switches - before.ctx_switches) / opts.rounds,
        "coordd_rss_mb": after.rss_bytes / 2**20,
        "coordd_peak_rss_mb": after.hwm_bytes / 2**20,
    }


def run_scale(opts: ScaleOptions, log: Any = print) -> list[dict[str, Any]]:
    return [run_scale_dp(dp, opts, log) for dp in opts.dps]
