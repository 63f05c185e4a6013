"""Loads that flood coordd with messages: bad frames, unregistered reports, a member's junk,
one message of two million parts, replies never read."""

from __future__ import annotations

import os
import random
import sys
import time

import zmq

from coordd.proto.messages import StepReport, encode
from coordd.testing.rogue import APP_LEVEL, bad_frame
from coordd.tools.load._zmq import dealer, term_soon


def garbage(address: str, peers: int = 50, messages: int = 20_000, repeat: int = 1) -> int:
    """`peers` DEALERs (pinging every 100 ms) each queue `messages` bad frames as fast as they
    can, then all disconnect at once; `repeat` times: the pattern behind libzmq 4.3.5's
    `!_io_error` abort. A peer coordd refused in its handshake has nowhere to queue and
    stops. Returns frames queued."""
    rng = random.Random(11)
    frames = [bad_frame(rng, rng.choice(APP_LEVEL), 4) for _ in range(64)]
    sent = 0
    for _ in range(repeat):
        context = zmq.Context()
        socks = [dealer(context, address) for _ in range(peers)]
        try:
            live = list(socks)
            for i in range(messages):
                message = frames[i % len(frames)]
                for sock in live:
                    try:
                        sock.send_multipart(message, zmq.NOBLOCK)
                    except zmq.Again:  # refused in its handshake: no connection to queue on
                        live.remove(sock)
                        continue
                    sent += 1
                if not live:
                    break
            time.sleep(0.05)
        finally:
            for sock in socks:
                sock.close(linger=0)
            term_soon(context)
        time.sleep(0.2)
    return sent


def fast(address: str, seconds: float = 5.0) -> int:
    """One peer sending reports it never registered for, as fast as it can, for `seconds`."""
    context = zmq.Context()
    sock = dealer(context, address, ping_ms=0)
    sock.setsockopt(zmq.SNDHWM, 1000)
    payload = encode(StepReport(num_tokens=1, num_tokens_padded=1, dp_rank=0, epoch=1, seq=0))
    sent = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            for _ in range(256):
                sock.send(payload)  # blocks at the HWM: as fast as coordd's side takes them
            sent += 256
    finally:
        sock.close(linger=0)
        context.term()
    return sent


def member(address: str, seconds: float = 5.0, group: str = "enginecore", dp: int = 1) -> int:
    """A member that floods: registers as rank 0 of `group` (dp `dp`; with a leaked rank key
    over CURVE, see `dealer`), then sends 1 KiB of junk as fast as it can for `seconds`: a
    member must be cut off like a stranger, or coordd's memory grows with the flood. Its
    DEALER reconnects under the same routing id when cut off (then a stranger). Returns frames
    sent."""
    from coordd.proto.messages import Hello, Welcome, decode_from_coordinator

    context = zmq.Context()
    sock = dealer(context, address, ping_ms=0, routing_id=f"flood-{os.getpid()}".encode())
    hello = Hello(
        dp_size=dp, dp_rank=0, config_fingerprint="load", incarnation="flood", group=group
    )
    sent = 0
    try:
        sock.send(encode(hello))
        answer = decode_from_coordinator(sock.recv()) if sock.poll(10_000) else None
        if not isinstance(answer, Welcome):
            print(f"not welcomed: {answer}", file=sys.stderr, flush=True)
            return 0
        junk = b"\xc1" + bytes(1023)  # 0xc1: never msgpack
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(256):
                try:
                    sock.send(junk, zmq.NOBLOCK)
                except zmq.Again:  # cut off, reconnecting (or at the HWM)
                    time.sleep(0.001)
                    continue
                sent += 1
    finally:
        sock.close(linger=0)
        term_soon(context)
    return sent


def multipart(address: str, parts: int = 2_000_000) -> int:
    """One message of `parts` empty parts (2 bytes each on the wire)."""
    context = zmq.Context()
    sock = dealer(context, address, ping_ms=0)
    try:
        sock.poll(5000, zmq.POLLOUT)
        for _ in range(parts - 1):
            sock.send(b"", zmq.SNDMORE)
        sock.send(b"")
        time.sleep(0.5)  # let it leave
    finally:
        sock.close(linger=2000)
        context.term()
    return parts


def unread(address: str, peers: int = 20, messages: int = 10_000, hold: float = 2.0) -> int:
    """`peers` peers that send reports they never registered for (each answered with a
    refusal) and never read a reply; they stay connected `hold` seconds after sending."""
    context = zmq.Context()
    payload = encode(StepReport(num_tokens=1, num_tokens_padded=1, dp_rank=0, epoch=1, seq=0))
    socks = [dealer(context, address, ping_ms=0) for _ in range(peers)]
    try:
        for _ in range(messages):
            for sock in socks:
                sock.send(payload, zmq.NOBLOCK)
        time.sleep(hold)
    finally:
        for sock in socks:
            sock.close(linger=0)
        context.term()
    return peers * messages
