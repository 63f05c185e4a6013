"""The ZeroMQ limit: a minimal blocking pyzmq hub doing coordd's job and nothing else.

One ROUTER socket, one thread, no event loop: each round it receives one msgpack `StepReport`
from each of the dp ranks (a DEALER each, its routing id its rank), applies `decide()` to
them in rank order, encodes the `StepDecision` once and sends it to every rank. A rank sends
its report, then blocks in recv. No handshake, no epochs, no sequence checks, no failure
handling, no observer: what is left is pyzmq, msgspec and the policy, so coordd's latency
over this one is what its protocol and event loop cost on top of ZeroMQ.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import msgspec
import zmq

from coordd.proto.messages import StepDecision, StepReport
from coordd.proto.policy import decide
from coordd.testing.process import stop_process

READY = "hub ready on "


def serve(address: str, dp: int, timeout: float) -> int:
    ctx = zmq.Context(1)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    sock.bind(address)
    print(f"{READY}{sock.getsockopt_string(zmq.LAST_ENDPOINT)}", flush=True)
    decode = msgspec.msgpack.Decoder(StepReport).decode
    encode = msgspec.msgpack.Encoder().encode
    reports: list[StepReport | None] = [None] * dp
    idents: list[bytes] = [b""] * dp
    try:
        while True:
            for _ in range(dp):
                ident, data = sock.recv_multipart(copy=True)
                rank = int(ident)
                idents[rank] = ident
                reports[rank] = decode(data)
            reply = encode(decide(reports))
            for ident in idents:
                sock.send_multipart((ident, reply))
    except zmq.Again:
        return 0  # no rank for `timeout`: the run is over
    finally:
        sock.close(0)
        ctx.term()


class HubRank:
    """One rank's DEALER: `start` sends the report, `wait` blocks for the decision."""

    def __init__(self, address: str, rank: int, timeout: float = 60.0) -> None:
        self.ctx = zmq.Context(1)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
        self.sock.setsockopt(zmq.ROUTING_ID, str(rank).encode())
        self.sock.connect(address)
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(StepDecision).decode

    def start(self, report: StepReport) -> None:
        self.sock.send(self._encode(report))

    def wait(self) -> StepDecision:
        return self._decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class HubProcess:
    """The hub as a child process, ready once it has bound; `address` is where it listens."""

    def __init__(self, dp: int, bind: str, timeout: float = 120.0) -> None:
        self.argv = [
            sys.executable,
            "-m",
            "coordd.tools.bench.hub",
            "--dp",
            str(dp),
            "--bind",
            bind,
            "--timeout",
            str(timeout),
        ]
        self.address = bind
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 15.0) -> HubProcess:
        from coordd.tools.bench.floor import read_ready_line

        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        self.address = read_ready_line(self.proc, READY, timeout, "pyzmq hub")
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout)


def main() -> int:
    p = argparse.ArgumentParser(description="the minimal blocking pyzmq hub of `coordd bench`")
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--bind", required=True, help="ZeroMQ endpoint (ipc://... or tcp://...)")
    p.add_argument("--timeout", type=float, default=120.0, help="longest wait for a rank, s")
    args = p.parse_args()
    return serve(args.bind, args.dp, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
