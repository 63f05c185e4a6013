"""The rogue peer: garbage, truncated, oversized and misdirected frames at a live coordd.

coordd must drop every one (counting it) and keep the real ranks coordinating. Afterwards the
rogue checks that coordd still answers, and that it still refuses, with a typed answer to the
sender alone, a report from a peer that never registered and a Hello for a rank out of range.
The rogue is any peer, not a rank: it uses a plain DEALER, not the client.
"""

from __future__ import annotations

import random
import socket
import time
from collections import Counter
from collections.abc import Callable
from types import TracebackType

import msgspec
import zmq

from coordd.proto.defaults import HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT
from coordd.proto.errors import ProtocolError
from coordd.proto.messages import (
    MAX_MESSAGE_BYTES,
    Heartbeat,
    Hello,
    Reject,
    StepDecision,
    StepFailed,
    StepKind,
    StepReport,
    Welcome,
    decode_from_coordinator,
    encode,
    error_from_failure,
    error_from_reject,
)
from coordd.testing.history import HistoryWriter, Note, Refused, error_info

#: Frames coordd's own decoder sees (and must count as dropped); the rest libzmq refuses.
APP_LEVEL = ("invalid_msgpack", "truncated", "wrong_shape", "wrong_direction", "multipart", "empty")
TRANSPORT_LEVEL = ("oversized", "not_zmtp")
CATEGORIES = APP_LEVEL + TRANSPORT_LEVEL
#: How often a probe's question is sent again while no answer that fits it came back.
RESEND = 1.0
#: The probe's stranger report is for a seq far past any round's, so its refusal is told
#: apart from answers to reports sent before it.
PROBE_SEQ = 1 << 40


def _valid_frames(rng: random.Random, dp: int) -> list[bytes]:
    report = StepReport(
        num_tokens=rng.randint(0, 4096),
        num_tokens_padded=4096,
        dp_rank=rng.randrange(dp),
        seq=rng.randint(0, 100),
    )
    hello = Hello(dp_size=dp, dp_rank=rng.randrange(dp), config_fingerprint="x", incarnation="y")
    return [encode(report), encode(hello)]


def bad_frame(rng: random.Random, category: str, dp: int) -> list[bytes]:
    """One bad message (as its frames) of the given category."""
    if category == "invalid_msgpack":  # 0xc1 is never used in msgpack
        return [b"\xc1" + rng.randbytes(rng.randint(0, 64))]
    if category == "truncated":
        whole = rng.choice(_valid_frames(rng, dp))
        return [whole[: rng.randint(1, len(whole) - 1)]]
    if category == "wrong_shape":
        return [
            rng.choice(
                [
                    msgspec.msgpack.encode(["report", "x", 1]),
                    msgspec.msgpack.encode({"type": "report"}),
                    msgspec.msgpack.encode(["nosuchtag", 1, 2]),
                    msgspec.msgpack.encode(12345),
                ]
            )
        ]
    if category == "wrong_direction":
        return [
            rng.choice(
                [
                    encode(Welcome(epoch=1, next_seq=0, dp_size=dp)),
                    encode(
                        StepDecision(
                            epoch=1,
                            seq=0,
                            kind=StepKind.FORWARD,
                            num_tokens_across_dp=[1] * dp,
                            should_ubatch=False,
                            should_pad=False,
                            cudagraph_mode=0,
                            any_unfinished=True,
                            all_idle=False,
                        )
                    ),
                ]
            )
        ]
    if category == "multipart":
        return [*_valid_frames(rng, dp)[:1], rng.randbytes(8)]
    if category == "empty":
        return [b""]
    raise ValueError(category)


def send_not_zmtp(address: str, payload: bytes) -> None:
    """Bytes that are not ZMTP at all, on a plain socket (ipc:// or tcp://)."""
    if address.startswith("ipc://"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target: object = address[len("ipc://") :]
    else:
        host, port = address[len("tcp://") :].rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        target = (host, int(port))
    sock.settimeout(1.0)
    try:
        sock.connect(target)  # type: ignore[arg-type]
        sock.sendall(payload)
        time.sleep(0.02)
    except OSError:
        pass
    finally:
        sock.close()


def send_oversized(context: zmq.Context, address: str, size: int) -> None:
    """One frame of `size` bytes on a fresh DEALER: libzmq on coordd's side must refuse it."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 500)
    sock.connect(address)
    try:
        if sock.poll(1000, zmq.POLLOUT):
            sock.send(b"\x00" * size, zmq.NOBLOCK)
    finally:
        sock.close()


class RoguePeer:
    """A peer at `address` that sends coordd bad frames, then probes that coordd held up."""

    def __init__(
        self,
        address: str,
        dp_size: int,
        *,
        seed: object = 0,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
        context: zmq.Context | None = None,
    ) -> None:
        self.address = address
        self.dp_size = dp_size
        self.rng = random.Random(f"rogue:{seed}")
        self.context: zmq.Context = context or zmq.Context.instance()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, f"rogue-{self.rng.getrandbits(32):08x}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_interval * 1000))
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout * 1000))
        self.sock.connect(address)
        self.sent: Counter[str] = Counter()

    def connected(self, timeout: float) -> bool:
        """Whether the pipe to coordd came up within `timeout` seconds."""
        return bool(self.sock.poll(int(timeout * 1000), zmq.POLLOUT))

    def send(self, category: str) -> None:
        """One bad message of `category` (one of `CATEGORIES`)."""
        if category == "oversized":
            size = MAX_MESSAGE_BYTES + self.rng.randint(1, 1 << 16)
            send_oversized(self.context, self.address, size)
        elif category == "not_zmtp":
            send_not_zmtp(self.address, self.rng.randbytes(self.rng.randint(1, 512)))
        else:
            self.sock.send_multipart(bad_frame(self.rng, category, self.dp_size), zmq.NOBLOCK)
        self.sent[category] += 1

    def flood(self, frames: int, pause: float = 0.004) -> Counter[str]:
        """`frames` bad messages: every category once, then seeded picks; counts by category."""
        for i in range(frames):
            category = CATEGORIES[i] if i < len(CATEGORIES) else self.rng.choice(CATEGORIES)
            self.send(category)
            time.sleep(self.rng.uniform(0.0, pause))
        return self.sent

    def _ask(self, question: bytes, fits: Callable[[object], bool], timeout: float) -> object:
        """Send `question` until an answer that `fits` it comes back (within `timeout`);
        answers that don't fit (late ones to earlier messages) are passed over. Sent again
        every RESEND seconds: coordd may drop an answer to a stranger (its answer rate, a
        silent connection closed at the grace), and a probe must not fail on that. The last
        answer that did not fit, or None, if none fits in time."""
        deadline = time.monotonic() + timeout
        other: object | None = None
        while True:
            self.sock.send(question)
            resend = min(deadline, time.monotonic() + RESEND)
            while (left := resend - time.monotonic()) > 0:
                if not self.sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                    break
                try:
                    answer = decode_from_coordinator(self.sock.recv())
                except ProtocolError:
                    continue
                if fits(answer):
                    return answer
                other = answer
            if time.monotonic() >= deadline:
                return other

    def probe(self, log: HistoryWriter, timeout: float, fingerprint: str = "") -> None:
        """coordd still answers, and refuses a stranger's report and an out-of-range Hello.

        The three share `timeout` (each gets at least RESEND), and each waits for its own
        answer (resent meanwhile), so answers still coming to what the peer sent before, and
        a dropped one, don't decide it: on a loaded machine coordd may answer seconds late. Each
        outcome is logged as the checker's rogue rules expect ("pong", a `Refused` for
        "stranger report" and for "hello")."""
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(RESEND, deadline - time.monotonic())

        ping = Heartbeat(nonce=self.rng.getrandbits(62))
        answer = self._ask(encode(ping), lambda a: a == ping, left())
        log.write(Note(t=time.monotonic(), what="pong" if answer == ping else "no pong"))
        seq = PROBE_SEQ + self.rng.getrandbits(20)
        stranger = StepReport(num_tokens=1, num_tokens_padded=1, dp_rank=0, epoch=0, seq=seq)

        def refusal(a: object) -> bool:
            return isinstance(a, StepFailed) and a.seq == seq

        answer = self._ask(encode(stranger), refusal, left())
        if isinstance(answer, StepFailed) and refusal(answer):
            error = error_info(error_from_failure(answer))
            log.write(Refused(t=time.monotonic(), error=error, what="stranger report"))
        else:
            what = "stranger report not refused"
            log.write(Note(t=time.monotonic(), what=what, detail=repr(answer)))
        hello = Hello(
            dp_size=self.dp_size,
            dp_rank=self.dp_size + 3,
            config_fingerprint=fingerprint,
            incarnation="rogue",
        )
        answer = self._ask(encode(hello), lambda a: isinstance(a, (Reject, Welcome)), left())
        if isinstance(answer, Reject):
            error = error_info(error_from_reject(answer))
            log.write(Refused(t=time.monotonic(), error=error, what="hello"))
        else:
            log.write(Note(t=time.monotonic(), what="hello not refused", detail=repr(answer)))

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RoguePeer:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
