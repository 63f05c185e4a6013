"""coordd's resource limits: file descriptors, connections, and what a stranger may cost.

Why these exist (issue 11, part B):

- libzmq aborts the process when it cannot accept a connection for want of a descriptor on
  ipc (`Too many open files (src/ipc_listener.cpp)`), and its tcp listener spins at 100% CPU
  on EMFILE. So coordd never lets the table fill: the soft NOFILE limit is raised to the hard
  one at start, and the connections that can hold descriptors (ZeroMQ peers, HTTP clients) are
  capped well under it, with a reserve left for what coordd itself opens.
- libzmq gives no way to refuse a connection or to close one peer of a ROUTER. coordd watches
  the listener's accepted and closed descriptors (its socket monitor) and, over the cap, shuts
  down the oldest connection that registered no rank (`shutdown(2)` on libzmq's descriptor:
  libzmq then reads end-of-file and closes it as if the peer had left). A registered rank's
  connection is never chosen, so registered ranks keep working whatever strangers do.
- A descriptor is only a number: libzmq can give a closed connection's number to a new one
  before coordd reads the close. So each is remembered with its socket's identity (inode) from
  its ACCEPTED event, and shut down only if it still names that socket.
- The memory budget (`coordd.io.memory`) uses the same guard to close every stranger at once
  and to refuse new connections while coordd's RSS is over `--max-rss-mb`.

The decisions (which connection, when) are `coordd.core.admission.Admission`'s, pure; what
needs the OS is here: a descriptor's socket identity, the pid at the other end, `shutdown(2)`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import socket
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger("coordd")

#: Descriptors kept free for coordd itself: its sockets' internal pipes (libzmq's mailboxes,
#: the monitor), the event loop, log files, a dup while evicting, and the HTTP listener.
FD_RESERVE = 64


def raise_nofile() -> tuple[int, int]:
    """Raise the soft NOFILE limit to the hard one; returns the (soft, hard) now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or (target != resource.RLIM_INFINITY and soft >= target):
        return soft, hard
    for want in (target, 1 << 16):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            continue
        return want, hard
    return soft, hard


@dataclass(frozen=True)
class ConnectionCaps:
    """How many ZeroMQ and HTTP connections coordd holds at once, fitted to its NOFILE limit."""

    zmq: int
    http: int
    nofile: int

    @classmethod
    def fit(cls, nofile: int, max_connections: int, max_http: int) -> ConnectionCaps:
        """The caps asked for, shrunk to fit `nofile`: each connection holds one descriptor,
        FD_RESERVE stay free, and the ZeroMQ cap is at most half of what is left, since
        connections keep being accepted between the monitor's report and coordd closing
        the excess (a flood can outrun it by that much)."""
        room = max(nofile - FD_RESERVE, 4)
        http = min(max_http, max(1, room // 8))
        zmq_cap = min(max_connections, max(1, (room - http) // 2))
        return cls(zmq=zmq_cap, http=http, nofile=nofile)


def socket_ident(fd: int) -> int | None:
    """The identity of the socket `fd` names now (its inode: unique among open sockets, and
    a reused descriptor number names a new one), or None if `fd` is no socket."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_ino if stat.S_ISSOCK(st.st_mode) else None


@contextlib.contextmanager
def _same_socket(fd: int, ident: int | None) -> Iterator[socket.socket | None]:
    """A duplicate of `fd` if it still names the socket `ident` (any socket if None), else
    None; closed on exit (libzmq's own descriptor is never closed)."""
    try:
        dup_fd = os.dup(fd)
    except OSError:
        yield None
        return
    try:
        if ident is not None and socket_ident(dup_fd) != ident:
            yield None
            return
        try:
            sock = socket.socket(fileno=dup_fd)
        except OSError:
            yield None
            return
        dup_fd = -1  # the socket object owns it now
        with contextlib.closing(sock):
            yield sock
    finally:
        if dup_fd >= 0:
            os.close(dup_fd)


def peer_pid(fd: int, ident: int | None = None) -> int | None:
    """The process id at the other end of a unix socket (SO_PEERCRED), or None (tcp, or `fd`
    no longer names the socket `ident`)."""
    with _same_socket(fd, ident) as sock:
        if sock is None or sock.family != socket.AF_UNIX:
            return None
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            return None
    pid, _uid, _gid = struct.unpack("3i", creds)
    return pid if pid > 0 else None


def shutdown_fd(fd: int, ident: int | None = None) -> bool:
    """End the connection on `fd` (libzmq's) without closing libzmq's descriptor; with
    `ident`, only if `fd` still names that socket. True if it was shut down."""
    with _same_socket(fd, ident) as sock:
        if sock is None:
            return False
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
    return True
