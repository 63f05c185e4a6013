"""The rogue peer: garbage, truncated, oversized and misdirected frames at a live coordd.

coordd must drop every one (counting it) and keep the real ranks coordinating. Afterwards the
rogue checks that coordd still answers, and that it still refuses, with a typed answer to the
sender alone, a report from a peer that never registered and a Hello for a rank out of range.
"""

from __future__ import annotations

import random
import socket
import time
from collections import Counter

import msgspec
import zmq

from coordd.client.transport import close_dealer, open_dealer
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
from coordd.tools.chaos.history import (
    HistoryWriter,
    Inject,
    Note,
    Refused,
    error_info,
    wait_for_round,
)
from coordd.tools.chaos.spec import WorkerSpec

#: Frames coordd's own decoder sees (and must count as dropped); the rest libzmq refuses.
APP_LEVEL = ("invalid_msgpack", "truncated", "wrong_shape", "wrong_direction", "multipart", "empty")
TRANSPORT_LEVEL = ("oversized", "not_zmtp")


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


def _send_not_zmtp(address: str, payload: bytes) -> None:
    """Bytes that are not ZMTP at all, on a plain socket."""
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


def _send_oversized(context: zmq.Context, address: str, size: int) -> None:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 500)
    sock.connect(address)
    try:
        if sock.poll(1000, zmq.POLLOUT):
            sock.send(b"\x00" * size, zmq.NOBLOCK)
    finally:
        sock.close()


def _answer(sock: zmq.Socket, timeout: float) -> object | None:
    if not sock.poll(int(timeout * 1000), zmq.POLLIN):
        return None
    try:
        return decode_from_coordinator(sock.recv())
    except ProtocolError:
        return None


def run_rogue(spec: WorkerSpec, log: HistoryWriter) -> int:
    rng = random.Random(f"rogue:{spec.seed}")
    context: zmq.Context = zmq.Context.instance()
    identity = f"rogue-{rng.getrandbits(32):08x}".encode()
    sock, monitor = open_dealer(
        context,
        spec.address,
        identity,
        heartbeat_interval=spec.heartbeat_interval,
        heartbeat_timeout=spec.heartbeat_timeout,
    )
    sent: Counter[str] = Counter()
    try:
        if not sock.poll(5000, zmq.POLLOUT):
            log.write(Note(t=time.monotonic(), what="rogue could not connect"))
            return 0
        wait_for_round(spec.trigger_log, spec.trigger_seq, spec.deadline)
        log.write(Inject(t=time.monotonic(), fault=spec.fault, detail=f"{spec.frames} frames"))
        categories = APP_LEVEL + TRANSPORT_LEVEL
        for i in range(spec.frames):
            category = categories[i % len(categories)] if i < len(categories) else None
            category = category or rng.choice(categories)
            if category == "oversized":
                _send_oversized(context, spec.address, MAX_MESSAGE_BYTES + rng.randint(1, 1 << 16))
            elif category == "not_zmtp":
                _send_not_zmtp(spec.address, rng.randbytes(rng.randint(1, 512)))
            else:
                sock.send_multipart(bad_frame(rng, category, spec.dp_size), zmq.NOBLOCK)
            sent[category] += 1
            time.sleep(rng.uniform(0.0, 0.004))
        for category, count in sorted(sent.items()):
            log.write(Note(t=time.monotonic(), what="sent", detail=category, count=count))
        _probe(sock, spec, log)
    finally:
        close_dealer(sock, monitor)
    return 0


def _probe(sock: zmq.Socket, spec: WorkerSpec, log: HistoryWriter) -> None:
    """coordd still answers, and refuses a stranger's report and an out-of-range Hello."""
    timeout = spec.wait_timeout
    sock.send(encode(Heartbeat(nonce=7)))
    pong = _answer(sock, timeout)
    log.write(Note(t=time.monotonic(), what="pong" if pong == Heartbeat(nonce=7) else "no pong"))
    stranger = StepReport(num_tokens=1, num_tokens_padded=1, dp_rank=0, epoch=0, seq=0)
    sock.send(encode(stranger))
    answer = _answer(sock, timeout)
    if isinstance(answer, StepFailed):
        error = error_from_failure(answer)
        log.write(Refused(t=time.monotonic(), error=error_info(error), what="stranger report"))
    else:
        log.write(Note(t=time.monotonic(), what="stranger report not refused", detail=repr(answer)))
    hello = Hello(
        dp_size=spec.dp_size,
        dp_rank=spec.dp_size + 3,
        config_fingerprint=spec.fingerprint,
        incarnation="rogue",
    )
    sock.send(encode(hello))
    answer = _answer(sock, timeout)
    if isinstance(answer, Reject):
        log.write(
            Refused(t=time.monotonic(), error=error_info(error_from_reject(answer)), what="hello")
        )
    else:
        log.write(Note(t=time.monotonic(), what="hello not refused", detail=repr(answer)))
