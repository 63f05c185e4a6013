"""A coordd that dies at a chosen round, having answered it to some ranks only: fault injection.

The real coordd answers a round to every rank at once, so the hardest loss of coordd (it
answered rank A's round N and died before rank B's answer left) cannot be produced by a signal
at a chosen moment. This fake can: it runs coordd's own state machine
(`coordd.proto.coordinator.Coordinator`: the real Welcome, StepDecision via
`coordd.proto.policy.decide`, GatherResult, heartbeat echo) behind a ZeroMQ ROUTER, and when the
answer of round `die_at` is due it sends it to the ranks in `answer_to` only, then closes its
socket and exits (`then="exit"`) or closes its socket and stays alive without one
(`then="close"`, until stopped).

    DyingCoordd(dp=2, bind="ipc:///tmp/x/coordd.sock", die_at=5, answer_to=[0]).start()

is a `CoorddProcess` (`.start()` waits for the ready line, `.address`, `.signal`, `.stop()`), so
a test starts it where it would start coordd. From a shell:
`python -m coordd.testing.dying_coordd --bind ADDR --dp 2 --die-at 5 --answer-to 0`.
No step timeout, relays, ZAP or metrics: the rounds and the answers only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

import zmq

from coordd.proto.coordinator import Coordinator
from coordd.proto.errors import ProtocolError
from coordd.proto.messages import GatherResult, Hello, StepDecision, decode_to_coordinator, encode
from coordd.testing.process import READY, CoorddProcess

#: How long the partial answers may take to leave before the socket closes (ms).
LINGER_MS = 2000


class DyingCoordd(CoorddProcess):
    """The fake as a child process (see the module's docstring)."""

    def __init__(
        self,
        dp: int,
        bind: str,
        *,
        die_at: int,
        answer_to: Sequence[int] = (),
        then: str = "exit",
        epoch: int | None = None,
    ) -> None:
        super().__init__(dp, bind)
        answer = ",".join(str(rank) for rank in answer_to)
        self.argv = [
            sys.executable,
            "-m",
            "coordd.testing.dying_coordd",
            "--bind",
            bind,
            "--dp",
            str(dp),
            "--die-at",
            str(die_at),
            f"--answer-to={answer}",
            "--then",
            then,
            *([] if epoch is None else ["--epoch", str(epoch)]),
        ]


def serve(bind: str, dp: int, die_at: int, answer_to: Sequence[int], then: str, epoch: int) -> None:
    """Serve until round `die_at` is answered to `answer_to`; then close (and exit)."""
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.bind(bind)
    address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    print(f"{READY}{address}", flush=True)
    coordinator = Coordinator(dp, epoch=epoch, step_timeout=3600.0)
    ranks: dict[bytes, int] = {}
    while True:
        peer, data = sock.recv_multipart()
        try:
            message = decode_to_coordinator(data)
        except ProtocolError:
            continue
        if type(message) is Hello:
            ranks[peer] = message.dp_rank
        for send in coordinator.receive(peer, message, time.monotonic()):
            answer = send.message
            last = type(answer) in (StepDecision, GatherResult) and answer.seq == die_at  # type: ignore[union-attr]
            peers = [p for p in send.peers if ranks.get(p) in answer_to] if last else send.peers
            frame = encode(answer)
            for to in peers:
                sock.send_multipart([to, frame])
            if last:
                print(
                    f"dying coordd: round {die_at} answered to ranks {sorted(answer_to)}",
                    file=sys.stderr,
                    flush=True,
                )
                sock.close()  # LINGER: the partial answers leave first
                context.term()
                if then == "exit":
                    os._exit(0)
                while True:
                    time.sleep(3600)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bind", required=True)
    parser.add_argument("--dp", type=int, required=True)
    parser.add_argument("--die-at", type=int, required=True, help="the round answered partly")
    parser.add_argument("--answer-to", default="", help="ranks that get it: 0,2 (empty: none)")
    parser.add_argument("--then", choices=("exit", "close"), default="exit")
    parser.add_argument("--epoch", type=int, default=None, help="default: now in ms")
    args = parser.parse_args(argv)
    answer_to = [int(rank) for rank in args.answer_to.split(",") if rank.strip()]
    epoch = args.epoch if args.epoch is not None else int(time.time() * 1000)
    serve(args.bind, args.dp, args.die_at, answer_to, args.then, epoch)


if __name__ == "__main__":
    main()
