"""The floor: the same gather and broadcast, as fast as plain Python goes here, over UNIX sockets.

A hub process accepts one stream socket per rank; each round it reads one fixed-size report
from every rank (blocking, in rank order: the round needs all of them anyway) and sends the
concatenation back to all. No framing, no decoding, no policy, no event loop, no extra thread:
what remains is the kernel's sockets and the Python calls around them, so coordd's latency over
this one shows what its protocol, ZeroMQ and policy cost.

Every blocking call has a deadline (SO_RCVTIMEO/SO_SNDTIMEO, which keeps the sockets in
plain blocking mode); the hub exits when a rank closes its socket. `path` may also be
`tcp://HOST:PORT` (port 0: any), for the floor across network namespaces.
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import sys
import time

from coordd.tools.bench.child import HubChild
from coordd.tools.bench.workload import FLOOR_REPORT

READY = "floor ready on "
_HELLO = struct.Struct("<i")


def _set_deadline(sock: socket.socket, seconds: float) -> None:
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view`; False on EOF."""
    got = 0
    size = len(view)
    while got < size:
        n = sock.recv_into(view[got:], size - got, socket.MSG_WAITALL)
        if n == 0:
            return False
        got += n
    return True


def _tcp(path: str) -> tuple[str, int] | None:
    """(host, port) of a `tcp://HOST:PORT` path, None for a UNIX socket path."""
    if not path.startswith("tcp://"):
        return None
    host, _, port = path[len("tcp://") :].rpartition(":")
    return host, int(port)


def _socket(path: str) -> socket.socket:
    if _tcp(path) is None:
        return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def serve(path: str, dp: int, timeout: float) -> int:
    listener = _socket(path)
    tcp = _tcp(path)
    if tcp is None:
        if os.path.exists(path):
            os.unlink(path)
        listener.bind(path)
    else:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(tcp)
        host, port = listener.getsockname()[:2]
        path = f"tcp://{host}:{port}"
    listener.listen(dp)
    listener.settimeout(timeout)
    print(f"{READY}{path}", flush=True)
    conns: list[socket.socket | None] = [None] * dp
    hello = bytearray(_HELLO.size)
    for _ in range(dp):
        conn, _addr = listener.accept()
        conn.settimeout(None)
        if tcp is not None:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _set_deadline(conn, timeout)
        if not _recv_exact(conn, memoryview(hello)):
            return 1
        (rank,) = _HELLO.unpack(hello)
        conns[rank] = conn
    listener.close()
    ranks = [c for c in conns if c is not None]
    size = FLOOR_REPORT.size
    buf = bytearray(size * dp)
    view = memoryview(buf)
    slots = [view[r * size : (r + 1) * size] for r in range(dp)]
    waitall = socket.MSG_WAITALL
    try:
        while True:
            for conn, slot in zip(ranks, slots, strict=True):
                if conn.recv_into(slot, size, waitall) != size:
                    return 0  # a rank closed (or sent a torn report): the run is over
            reply = bytes(buf)
            for conn in ranks:
                conn.sendall(reply)
    except OSError:
        return 0
    finally:
        for conn in ranks:
            conn.close()
        if tcp is None and os.path.exists(path):
            os.unlink(path)


class FloorRank:
    """One rank's socket to the hub: `start` sends the report, `wait` reads everyone's."""

    def __init__(self, path: str, rank: int, dp: int, timeout: float = 60.0) -> None:
        self.sock = _socket(path)
        self.sock.settimeout(timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock.connect(_tcp(path) or path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"floor hub at {path} not reachable") from None
                time.sleep(0.01)
        self.sock.settimeout(None)
        _set_deadline(self.sock, timeout)
        self.sock.sendall(_HELLO.pack(rank))
        self.reply_size = FLOOR_REPORT.size * dp

    def start(self, data: bytes) -> None:
        self.sock.sendall(data)

    def wait(self) -> bytes:
        buf = bytearray(self.reply_size)
        if not _recv_exact(self.sock, memoryview(buf)):
            raise ConnectionError("floor hub closed the connection")
        return bytes(buf)

    def close(self) -> None:
        self.sock.close()


class FloorProcess(HubChild):
    """The floor hub as a child process (like `CoorddProcess`), ready once it has bound."""

    module = "coordd.tools.bench.floor"
    where_flag = "--path"
    ready = READY
    what = "floor hub"


def main() -> int:
    p = argparse.ArgumentParser(description="the raw UNIX-socket floor hub of `coordd bench`")
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--path", required=True)
    p.add_argument("--timeout", type=float, default=120.0, help="longest wait for a rank, s")
    args = p.parse_args()
    return serve(args.path, args.dp, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
