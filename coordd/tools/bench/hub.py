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
import sys

import msgspec
import zmq

from coordd.proto.messages import StepDecision, StepReport
from coordd.proto.policy import decide
from coordd.tools.bench.child import HubChild

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


class HubProcess(HubChild):
    """The hub as a child process, ready once it has bound; `address` is where it listens."""

    module = "coordd.tools.bench.hub"
    where_flag = "--bind"
    ready = READY
    what = "pyzmq hub"


def main() -> int:
    p = argparse.ArgumentParser(description="the minimal blocking pyzmq hub of `coordd bench`")
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--bind", required=True, help="ZeroMQ endpoint (ipc://... or tcp://...)")
    p.add_argument("--timeout", type=float, default=120.0, help="longest wait for a rank, s")
    args = p.parse_args()
    return serve(args.bind, args.dp, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
