"""Scale: dp = 16 .. 1024 simulated ranks, many per process, on one coordd over ipc, and
(with `relay_ranks`) through relays: a root coordd and one relay process per `relay_ranks`
ranks (`coordd serve --relay-to`), each rank at its relay, flat and tree interleaved per dp.

A few simulator processes (`simranks`) each run a share of the ranks: every round they send all
of their ranks' reports, then collect all the decisions. coordd's CPU time per round comes from
its own accounting (/proc, every thread), read by the parent around the timed rounds; its
resident memory after them; the simulators report their own CPU the same way. Through relays,
the root's CPU is the "coordd" figure and each relay's is read the same way.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import msgspec

from coordd.testing.process import CoorddProcess
from coordd.tools.bench import procstat, stats
from coordd.tools.bench.rank_phases import BenchError
from coordd.tools.bench.simranks import (
    CLIENTS,
    Rounds,
    SimError,
    SimSetup,
    SimStop,
    from_sim,
    sim_main,
)

#: Every coordd of the phase: quiet, with no handshake pacing and no memory budget: 1024
#: simulated ranks of a few processes would otherwise connect at --max-handshake-rate's pace
#: (20 a second, an ipc process 1/8 of it), and a flat coordd of 1024 ranks holds about 110 MB,
#: over --max-rss-mb's 64, where it refuses new handshakes: registration stalls. The rounds are
#: what is measured (the relays hold 32 ranks each: both defaults are theirs).
COORDD_ARGS = ["--log-level", "error", "--max-handshake-rate", "0", "--max-rss-mb", "0"]


@dataclass
class ScaleOptions:
    dps: list[int]
    clients: list[str] = field(default_factory=lambda: list(CLIENTS))
    procs: int = 4
    rounds: int = 300
    warmup: int = 30
    seed: int = 0
    #: Ranks per relay (0: flat only); each dp then runs flat and through dp / relay_ranks
    #: relays, interleaved.
    relay_ranks: int = 0


class _Sims:
    def __init__(
        self,
        address: str,
        dp: int,
        procs: int,
        client: str,
        seed: int,
        rank_address: list[str] | None = None,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for p in range(procs):
            ranks = list(range(p, dp, procs))
            at = [rank_address[r] for r in ranks] if rank_address else []
            setup = SimSetup(address, dp, ranks, client, seed, at)
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
                    msg = from_sim.decode(conn.recv_bytes())  # type: ignore[union-attr]
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


def _root_args(relay_ranks: int) -> list[str]:
    """The coordd's flags: a root (`--relay-root`) when relays speak to it."""
    return [*COORDD_ARGS, "--relay-root"] if relay_ranks else COORDD_ARGS


def _start_relays(
    tmp: str, dp: int, root: str, relay_ranks: int, stack: contextlib.ExitStack
) -> list[CoorddProcess]:
    """One relay process per `relay_ranks` ranks (the last takes the rest), each started
    and ready before the next; all end with `stack`."""
    relays = []
    for i, lo in enumerate(range(0, dp, relay_ranks)):
        hi = min(dp, lo + relay_ranks) - 1
        relay = CoorddProcess(
            dp,
            f"ipc://{tmp}/relay{i}.sock",
            [
                "--log-level",
                "error",
                "--relay-to",
                root,
                "--relay-ranks",
                f"{lo}-{hi}",
                "--relay-name",
                f"node{i}",
            ],
        )
        relays.append(relay)
    for relay in relays:
        stack.enter_context(relay)
    return relays


def run_scale_dp(
    dp: int, client: str, opts: ScaleOptions, log: Any = print, relay_ranks: int = 0
) -> dict[str, Any]:
    procs = max(1, min(opts.procs, dp))
    layout = f"relays of {relay_ranks}" if relay_ranks else "flat"
    with (
        tempfile.TemporaryDirectory(prefix="coordd-bench-scale-") as tmp,
        CoorddProcess(dp, f"ipc://{tmp}/coordd.sock", _root_args(relay_ranks)) as coordd,
        contextlib.ExitStack() as stack,
    ):
        relays: list[CoorddProcess] = []
        rank_address: list[str] | None = None
        if relay_ranks:
            relays = _start_relays(tmp, dp, coordd.address, relay_ranks, stack)
            rank_address = [relays[r // relay_ranks].address for r in range(dp)]
        sims = _Sims(coordd.address, dp, procs, client, opts.seed, rank_address)
        try:
            sims.collect(300.0, f"scale dp={dp}: connecting")
            log(
                f"scale dp={dp} {layout}: {client} ranks in {procs} processes, {opts.rounds} rounds"
            )
            sims.send(Rounds(n=opts.warmup, check=True))
            warm = sims.collect(120.0 + opts.warmup * 1.0, f"scale dp={dp}: warm-up")
            before = procstat.sample(coordd.pid)
            relays_before = [procstat.sample(r.pid) for r in relays]
            began = time.perf_counter()
            sims.send(Rounds(n=opts.rounds, check=False))
            timed = sims.collect(120.0 + opts.rounds * 1.0, f"scale dp={dp}: rounds")
            wall = time.perf_counter() - began
            after = procstat.sample(coordd.pid)
            relays_after = [procstat.sample(r.pid) for r in relays]
        finally:
            sims.close()
    relay_cpu_us = [
        sum(procstat.cpu_delta_ns(b, a).values()) / opts.rounds / 1000.0
        for b, a in zip(relays_before, relays_after, strict=True)
    ]
    # A process's round spans from its first start to its last decision: the round as the
    # slowest rank of the process sees it.
    latency = [x for part in timed for x in part.latency_ns]
    per_thread = procstat.cpu_delta_ns(before, after)
    cpu_us = sum(per_thread.values()) / opts.rounds / 1000.0
    return {
        "dp": dp,
        "client": client,
        "layout": layout,
        "relays": len(relays),
        "relay_cpu_us_per_round": relay_cpu_us,
        "relay_cpu_us_per_round_mean": sum(relay_cpu_us) / len(relays) if relays else 0.0,
        "relay_rss_mb": [a.rss_bytes / 2**20 for a in relays_after],
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
        # The simulated ranks' own CPU (their processes share this machine's cores with coordd).
        "ranks_cpu_us_per_rank_round_by_thread": {
            kind: sum(part.cpu_ns_by_thread.get(kind, 0) for part in timed) / opts.rounds / dp / 1e3
            for kind in sorted({k for part in timed for k in part.cpu_ns_by_thread})
        },
        "coordd_rss_mb": after.rss_bytes / 2**20,
        "coordd_peak_rss_mb": after.hwm_bytes / 2**20,
    }


def run_root_alone(dp: int, opts: ScaleOptions, log: Any = print) -> dict[str, Any]:
    """The root by itself: its relays simulated in this process (as the flat rows' ranks are
    simulated, many per process), each sending its bundle every round, then reading the
    answer. What the root costs per round with no relay process sharing its cores."""
    import zmq

    from coordd.proto.messages import StepKind, encode
    from coordd.proto.relay_messages import RelayBundle, RelayHello, decode_from_root
    from coordd.tools.bench.workload import report_table

    k = opts.relay_ranks
    spans = [list(range(lo, min(dp, lo + k))) for lo in range(0, dp, k)]
    tables = [report_table(r, opts.seed) for r in range(dp)]
    with (
        tempfile.TemporaryDirectory(prefix="coordd-bench-root-") as tmp,
        CoorddProcess(dp, f"ipc://{tmp}/coordd.sock", _root_args(k)) as coordd,
    ):
        context = zmq.Context()
        socks = []
        try:
            for i, ranks in enumerate(spans):
                sock = context.socket(zmq.DEALER)
                sock.setsockopt(zmq.ROUTING_ID, b"relay:%d" % i)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVTIMEO, 60_000)
                sock.connect(coordd.address)
                hello = RelayHello(
                    group="default",
                    dp_size=dp,
                    ranks=ranks,
                    config_fingerprint="coordd-bench",
                    incarnation="bench",
                    relay=f"node{i}",
                )
                sock.send(encode(hello))
                socks.append(sock)
            welcome = decode_from_root(socks[0].recv()).message
            for sock in socks[1:]:
                sock.recv()
            epoch, seq = welcome.epoch, welcome.next_seq  # type: ignore[union-attr]

            def bundles(n: int) -> list[list[bytes]]:
                out = []
                for r in range(n):
                    row = []
                    for ranks in spans:
                        reps = [tables[x][(seq + r) % len(tables[x])] for x in ranks]
                        padded = [p.num_tokens_padded for p in reps]
                        row.append(
                            encode(
                                RelayBundle(
                                    group="default",
                                    epoch=epoch,
                                    seq=seq + r,
                                    kind=StepKind.FORWARD,
                                    ranks=ranks,
                                    padded=padded,
                                    max_padded=max(padded),
                                    min_tokens=min(p.num_tokens for p in reps),
                                    cudagraph_mode=min(p.cudagraph_mode for p in reps),
                                    all_ubatch=all(p.want_ubatch for p in reps),
                                    all_idle=not any(p.num_tokens for p in reps),
                                    any_unfinished=any(p.has_unfinished for p in reps),
                                )
                            )
                        )
                    out.append(row)
                return out

            payload = bundles(opts.warmup + opts.rounds)
            latency: list[int] = []

            def run(rows: list[list[bytes]], timed: bool) -> None:
                for row in rows:
                    t0 = time.perf_counter_ns()
                    for sock, data in zip(socks, row, strict=True):
                        sock.send(data)
                    for sock in socks:
                        sock.recv()
                    if timed:
                        latency.append(time.perf_counter_ns() - t0)

            log(
                f"scale dp={dp}: the root alone, {len(spans)} relays simulated, "
                f"{opts.rounds} rounds"
            )
            run(payload[: opts.warmup], False)
            before = procstat.sample(coordd.pid)
            began = time.perf_counter()
            run(payload[opts.warmup :], True)
            wall = time.perf_counter() - began
            after = procstat.sample(coordd.pid)
        finally:
            for sock in socks:
                sock.close(linger=0)
            context.term()
    per_thread = procstat.cpu_delta_ns(before, after)
    cpu_us = sum(per_thread.values()) / opts.rounds / 1000.0
    return {
        "dp": dp,
        "client": "lean",
        "layout": f"{len(spans)} relays simulated",
        "relays": len(spans),
        "relay_cpu_us_per_round": [],
        "relay_cpu_us_per_round_mean": 0.0,
        "relay_rss_mb": [],
        "procs": 1,
        "rounds": opts.rounds,
        "completed": opts.rounds,
        "checked": 0,
        "mismatches": 0,
        **stats.summary(latency),
        "rounds_per_s": opts.rounds / wall,
        "coordd_cpu_us_per_round": cpu_us,
        "coordd_cpu_us_per_rank_round": cpu_us / dp,
        "coordd_cpu_us_per_round_by_thread": {
            name: ns / opts.rounds / 1000.0 for name, ns in sorted(per_thread.items())
        },
        "coordd_ctx_switches_per_round": (after.ctx_switches - before.ctx_switches) / opts.rounds,
        "ranks_cpu_us_per_rank_round_by_thread": {},
        "coordd_rss_mb": after.rss_bytes / 2**20,
        "coordd_peak_rss_mb": after.hwm_bytes / 2**20,
    }


def run_scale(opts: ScaleOptions, log: Any = print) -> list[dict[str, Any]]:
    """Every dp and client, flat and (with `relay_ranks`) through relays: the two layouts of
    one dp run back to back, the first of them alternating from one dp to the next, then the
    root alone with its relays simulated (`run_root_alone`)."""
    rows = []
    for client in opts.clients:
        for i, dp in enumerate(opts.dps):
            layouts = [0]
            if opts.relay_ranks and dp > opts.relay_ranks:
                layouts = [0, opts.relay_ranks] if i % 2 == 0 else [opts.relay_ranks, 0]
            for relay_ranks in layouts:
                rows.append(run_scale_dp(dp, client, opts, log, relay_ranks))
            if len(layouts) > 1 and client == opts.clients[0]:
                rows.append(run_root_alone(dp, opts, log))
    return rows
