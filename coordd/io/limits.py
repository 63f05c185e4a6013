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
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import socket
import stat
import struct
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from coordd.core.defaults import BAN_SECONDS

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


class ConnectionGuard:
    """The listener's open connections (by descriptor, oldest first), from its monitor's
    ACCEPTED and DISCONNECTED events; over `cap`, the oldest that holds no registered rank is
    shut down.

    Each descriptor is remembered with the identity of the socket it named when its ACCEPTED
    event was read (`socket_ident`), and a connection is shut down only if its descriptor
    still names that socket: a descriptor number libzmq reused for a newer connection, whose
    close event coordd has not read yet, is left alone (the check and the shutdown act on one
    duplicate of the descriptor, so nothing can slip in between).

    `registered()` gives the descriptors of registered ranks (never evicted); `shutdown` is
    injectable for tests (default: `shutdown(2)` through a duplicate of the descriptor, so
    coordd never closes libzmq's own)."""

    def __init__(
        self,
        cap: int,
        registered: Callable[[], Collection[int]],
        shutdown: Callable[[int, int | None], bool] | None = None,
        ident: Callable[[int], int | None] | None = None,
    ) -> None:
        self.cap = cap
        self._registered = registered
        self._shutdown = shutdown or shutdown_fd
        self._ident = ident or socket_ident
        #: open descriptor -> its socket's identity (insertion order = accept order)
        self.open: OrderedDict[int, int | None] = OrderedDict()
        self.evicted = 0
        self.peak = 0
        #: ipc peers' process ids cut off for flooding -> until when (monotonic seconds)
        self.banned: dict[int, float] = {}
        self.refused = 0
        #: While set (coordd's memory is over its budget), every new connection is shut down
        #: as soon as its ACCEPTED event is read; counted in `refused_memory`.
        self.refusing = False
        self.refused_memory = 0
        #: Called for each connection accepted (the memory guard looks sooner).
        self.on_accept: Callable[[], None] | None = None
        #: Connections this guard shut down (descriptor -> socket identity), until the number
        #: is accepted again: what is still queued from them (a flood's backlog, up to
        #: hundreds of thousands of messages) is dropped undecoded (`from_shut`).
        self.shut: dict[int, int] = {}
        self.dropped_shut = 0
        #: when each open connection's ACCEPTED event was read
        self.accepted_at: dict[int, float] = {}
        self.expired = 0

    def accepted(self, fd: int, now: float = 0.0) -> None:
        """A connection was accepted; one from a process cut off for flooding within
        BAN_SECONDS is shut down at once (its reconnects would flood again)."""
        ident = self._ident(fd)
        # a new connection under this number: its messages are read again (the old one's
        # still queued are then decoded and dropped one by one, as before it was shut)
        self.shut.pop(fd, None)
        if self.on_accept is not None:
            self.on_accept()
        if self.refusing:
            self.refused_memory += 1
            self._shut(fd, ident)
            return
        if self.banned:
            pid = peer_pid(fd, ident)
            until = self.banned.get(pid) if pid is not None else None
            if until is not None and now < until:
                self.refused += 1
                self._shut(fd, ident)
                return
            if until is not None:
                del self.banned[pid]  # type: ignore[arg-type]
        self.open.pop(fd, None)
        self.open[fd] = ident
        self.accepted_at[fd] = now
        self.peak = max(self.peak, len(self.open))

    def cut(self, fd: int, now: float) -> bool:
        """Shut down a flooding peer's connection and, over ipc, refuse its process's
        connections for BAN_SECONDS. True if it was shut down."""
        ident = self.open.get(fd)
        if ident is None:
            return False
        pid = peer_pid(fd, ident)
        done = self._shut(fd, ident)
        if pid is None:
            return done
        if len(self.banned) >= 1024:
            self.banned = {p: t for p, t in self.banned.items() if t > now}
        self.banned[pid] = now + BAN_SECONDS
        # and the same process's other connections that hold no rank (one flood, many sockets)
        keep = set(self._registered())
        for other, other_ident in [
            (f, i) for f, i in self.open.items() if f != fd and f not in keep
        ]:
            if peer_pid(other, other_ident) == pid:
                del self.open[other]
                self._shut(other, other_ident)
        return done

    def closed(self, fd: int) -> None:
        self.open.pop(fd, None)
        self.accepted_at.pop(fd, None)

    def expire(self, before: float, introduced: Collection[int]) -> int:
        """Shut down the connections accepted before `before` that are not in `introduced`
        (they said no Hello); how many were. Call with the monitor drained."""
        victims = []
        for fd in self.open:
            if self.accepted_at.get(fd, before) >= before:
                break  # accept order: the rest are younger
            if fd not in introduced:
                victims.append(fd)
        done = 0
        for fd in victims:
            self.accepted_at.pop(fd, None)
            done += self._shut(fd, self.open.pop(fd))
        self.expired += done
        return done

    def shutdown(self, fd: int) -> bool:
        """Shut down the open connection on `fd` if the descriptor still names the socket
        its ACCEPTED event named (not one whose identity was unknown then). True if done."""
        return self._shut(fd, self.open.get(fd))

    def _shut(self, fd: int, ident: int | None) -> bool:
        """`shutdown(2)` on `fd` if it still names the socket `ident`; never where the
        identity was unknown (the descriptor named no socket when its ACCEPTED was read)."""
        if ident is None or not self._shutdown(fd, ident):
            return False
        self.shut[fd] = ident
        return True

    def from_shut(self, fd: int | None) -> bool:
        """Whether a message that came over descriptor `fd` (its SRCFD) was queued by a
        connection this guard shut down: the number still names that socket, or none. A new
        connection under the number (its ACCEPTED not read yet) names another socket: no."""
        ident = self.shut.get(fd) if fd is not None else None
        if ident is None:
            return False
        now = self._ident(fd)  # type: ignore[arg-type]
        if now is not None and now != ident:
            return False
        self.dropped_shut += 1
        return True

    def over(self) -> int:
        """How many connections beyond the cap."""
        return max(0, len(self.open) - self.cap)

    def strangers(self) -> int:
        """How many open connections hold no registered rank."""
        keep = self._registered()
        return sum(1 for fd in self.open if fd not in keep)

    def enforce(self) -> int:
        """Shut down the oldest unregistered connections beyond the cap; how many were.

        Call with the monitor drained: every descriptor in `open` is then one libzmq holds (a
        close is announced before the descriptor is released)."""
        excess = self.over()
        if not excess:
            return 0
        keep = set(self._registered())
        victims = [fd for fd in self.open if fd not in keep][:excess]
        for fd in victims:
            if self._shut(fd, self.open.pop(fd)):
                self.evicted += 1
        return len(victims)

    def shed(self) -> int:
        """Shut down every connection that holds no registered rank, newest first (coordd's
        memory is over its budget); how many were. Call with the monitor drained."""
        keep = set(self._registered())
        victims = [fd for fd in reversed(self.open) if fd not in keep]
        done = 0
        for fd in victims:
            done += self._shut(fd, self.open.pop(fd))
        return done


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


class TokenBucket:
    """At most `rate` events a second, `burst` at once (what coordd answers strangers)."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.tokens = burst
        self.at = clock()
        self.denied = 0

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        self.denied += 1
        return False
