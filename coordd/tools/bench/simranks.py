"""Simulated ranks for the scale run: many ranks per process, each with its own DEALER socket.

Two kinds, so the run shows both coordd's capacity and what the library costs a rank:
- `aio`: `AsyncCoordClient`s on one uvloop loop, as an asyncio engine would use them;
- `lean`: the least a rank can do per round over ZeroMQ (the real `RankSession` envelope and
  wire format, one epoll over all sockets, no futures), so that on a small machine the
  simulators' own CPU takes as little as possible from coordd's.
Every decision is checked: in warm-up rounds against the policy; in timed rounds (lean) all of a
round's decisions must be byte-identical (coordd encodes one per round) and for the right seq.
"""

from __future__ import annotations

import asyncio
import os
import select
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Union

import msgspec
import zmq

from coordd.proto.messages import StepDecision, StepKind, decode_from_coordinator, encode
from coordd.tools.bench import procstat
from coordd.tools.bench.workload import TABLE_SIZE, expected_payload, payload, report_table

IDLE_TIMEOUT = 900.0
ROUND_TIMEOUT = 60.0
CLIENTS = ("lean", "aio")
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)


class SimSetup(msgspec.Struct, frozen=True):
    address: str
    dp: int
    ranks: list[int]
    client: str = "lean"
    seed: int = 0
    #: Each rank's address (in `ranks` order), where ranks go to their node's relay; empty:
    #: every rank at `address`.
    addresses: list[str] = []

    def address_of(self, index: int) -> str:
        return self.addresses[index] if self.addresses else self.address


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
    cpu_ns_by_thread: dict[str, int] = {}


class SimError(msgspec.Struct, frozen=True, tag="error"):
    text: str


to_sim = msgspec.msgpack.Decoder(Union[Rounds, SimStop])
from_sim = msgspec.msgpack.Decoder(Union[SimReady, SimDone, SimError])


class _Tally:
    """One order's figures, and this process's CPU over it (per thread kind)."""

    def __init__(self) -> None:
        self.latency: list[int] = []
        self.completed = self.checked = self.mismatches = 0
        self.before = procstat.sample(os.getpid())

    def done(self) -> bytes:
        by_thread: dict[str, int] = {}
        after = procstat.sample(os.getpid())
        for name, ns in procstat.cpu_delta_ns(self.before, after).items():
            kind = procstat.thread_kind(name)
            by_thread[kind] = by_thread.get(kind, 0) + ns
        return msgspec.msgpack.encode(
            SimDone(self.latency, self.completed, self.checked, self.mismatches, by_thread)
        )


# -- aio ----------------------------------------------------------------------------------------


async def _all(futures: list[asyncio.Future[StepDecision]]) -> list[StepDecision]:
    """Every future's result, in order (lighter than asyncio.wait: most are done already)."""
    return [await f for f in futures]


async def _simulate_aio(conn: Connection, setup: SimSetup) -> None:
    from coordd.client.aio import AsyncCoordClient

    tables = [report_table(r, setup.seed) for r in range(setup.dp)]
    clients = [
        AsyncCoordClient(
            setup.address_of(k),
            dp_rank=r,
            dp_size=setup.dp,
            config_fingerprint="coordd-bench",
            wait_timeout=ROUND_TIMEOUT,
        )
        for k, r in enumerate(setup.ranks)
    ]
    loop = asyncio.get_running_loop()
    try:
        await asyncio.gather(*(c.connect(timeout=60) for c in clients))
        conn.send_bytes(msgspec.msgpack.encode(SimReady(ranks=len(clients))))
        round_index = 0
        while await loop.run_in_executor(None, conn.poll, IDLE_TIMEOUT):
            order = to_sim.decode(conn.recv_bytes())
            if isinstance(order, SimStop):
                return
            tally = _Tally()
            clock = time.perf_counter_ns
            for _ in range(order.n):
                i = round_index % TABLE_SIZE
                t0 = clock()
                futures = [c.start(tables[c.dp_rank][i]) for c in clients]
                try:
                    decisions = await asyncio.wait_for(_all(futures), ROUND_TIMEOUT)
                except asyncio.TimeoutError:
                    raise TimeoutError(
                        f"round {round_index}: no decision in {ROUND_TIMEOUT}s"
                    ) from None
                tally.latency.append(clock() - t0)
                tally.completed += all(type(d) is StepDecision for d in decisions)
                if order.check:
                    want = expected_payload(tables, round_index)
                    tally.checked += len(decisions)
                    tally.mismatches += sum(payload(d) != want for d in decisions)
                round_index += 1
            conn.send_bytes(tally.done())
    finally:
        for c in clients:
            await c.close()


# -- lean ---------------------------------------------------------------------------------------


class _LeanRanks:
    """This process's ranks: a `RankSession` and a DEALER each, one epoll over all sockets."""

    def __init__(self, setup: SimSetup) -> None:
        from coordd.client._session import RankSession
        from coordd.client._transport import open_dealer

        self.sessions = [
            RankSession(dp_rank=r, dp_size=setup.dp, config_fingerprint="coordd-bench")
            for r in setup.ranks
        ]
        context: zmq.Context = zmq.Context.instance()
        self.pairs = [
            open_dealer(
                context,
                setup.address_of(k),
                s.identity,
                heartbeat_interval=1.0,
                heartbeat_timeout=5.0,
            )
            for k, s in enumerate(self.sessions)
        ]
        self.socks = [sock for sock, _monitor in self.pairs]
        self.epoll = select.epoll()
        self.index: dict[int, int] = {}
        for k, sock in enumerate(self.socks):
            fd = int(sock.getsockopt(zmq.FD))
            self.epoll.register(fd, select.EPOLLIN)
            self.index[fd] = k

    def register(self, timeout: float) -> None:
        from coordd.client._session import Registered

        deadline = time.monotonic() + timeout
        for session, sock in zip(self.sessions, self.socks, strict=True):
            left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            if not sock.poll(left_ms, zmq.POLLOUT):
                raise TimeoutError(f"rank {session.dp_rank}: coordd not reachable")
            sock.send(encode(session.hello_message))
        for session, data in zip(self.sessions, self.gather(deadline), strict=True):
            event = session.receive(decode_from_coordinator(data))
            if type(event) is not Registered:
                raise RuntimeError(f"rank {session.dp_rank} was not registered: {event!r}")

    def gather(self, deadline: float) -> list[bytes]:
        """One frame from every socket: check each once, then only those whose FD fired."""
        socks = self.socks
        out: list[bytes | None] = [None] * len(socks)
        pending = len(socks)
        check: Any = range(len(socks))
        while True:
            for k in check:
                sock = socks[k]  # EVENTS on every fired socket: it re-arms the FD
                if int(sock.getsockopt(_EVENTS)) & _POLLIN and out[k] is None:
                    out[k] = sock.recv(_NOBLOCK)
                    pending -= 1
            if not pending:
                return out  # type: ignore[return-value]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{pending} ranks got no answer within the deadline")
            check = [self.index[fd] for fd, _ in self.epoll.poll(remaining)]

    def close(self) -> None:
        from coordd.client._transport import close_dealer

        self.epoll.close()
        for sock, monitor in self.pairs:
            close_dealer(sock, monitor)


def _simulate_lean(conn: Connection, setup: SimSetup) -> None:
    tables = [report_table(r, setup.seed) for r in range(setup.dp)]
    ranks = _LeanRanks(setup)
    try:
        ranks.register(240.0)
        conn.send_bytes(msgspec.msgpack.encode(SimReady(ranks=len(ranks.socks))))
        round_index = 0
        forward = StepKind.FORWARD
        pairs = list(zip(ranks.sessions, ranks.socks, strict=True))
        while conn.poll(IDLE_TIMEOUT):
            order = to_sim.decode(conn.recv_bytes())
            if isinstance(order, SimStop):
                return
            tally = _Tally()
            clock = time.perf_counter_ns
            for _ in range(order.n):
                i = round_index % TABLE_SIZE
                t0 = clock()
                for session, sock in pairs:
                    report = session.report(tables[session.dp_rank][i], forward)
                    sock.send(encode(report), _NOBLOCK)
                replies = ranks.gather(time.monotonic() + ROUND_TIMEOUT)
                tally.latency.append(clock() - t0)
                first = replies[0]
                decision = decode_from_coordinator(first)
                same = all(r == first for r in replies)
                right = type(decision) is StepDecision and decision.seq == report.seq and same
                tally.completed += right
                if order.check:
                    want = expected_payload(tables, round_index)
                    tally.checked += len(replies)
                    good = right and payload(decision) == want  # type: ignore[arg-type]
                    tally.mismatches += 0 if good else len(replies)
                round_index += 1
            conn.send_bytes(tally.done())
    finally:
        ranks.close()


def sim_main(conn: Connection, setup_bytes: bytes) -> None:
    """A simulator process's entry point (multiprocessing, spawn)."""
    setup = msgspec.msgpack.decode(setup_bytes, type=SimSetup)
    try:
        if setup.client == "aio":
            import uvloop

            uvloop.run(_simulate_aio(conn, setup))
        else:
            _simulate_lean(conn, setup)
    except Exception:
        conn.send_bytes(msgspec.msgpack.encode(SimError(traceback.format_exc())))
    finally:
        conn.close()
