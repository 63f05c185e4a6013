"""coordd's resource limits: file descriptors, connections, and what a stranger may cost.

Why these exist:

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
- The memory budget (`coordd.io._memory`) uses the same guard to close every stranger at once
  and to refuse new connections while coordd's RSS is over `--max-rss-mb`.

The decisions (which connection, when) are `coordd.core._admission.Admission`'s, pure; what
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
import threading
import time
from collections.abc import Callable, Iterator
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


def open_descriptors() -> int | None:
    """How many descriptors this process holds (Linux /proc), or None where it cannot tell."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


class DescriptorWatch:
    """Refuses new connections at the listener before the descriptors run out: libzmq 4.3.5
    aborts the process when its ipc accept fails with EMFILE (`Too many open files`,
    ipc_listener.cpp:297), and a reconnect storm (10 processes x 192 DEALERs that reconnect
    100 ms after each close) accepts faster than coordd closes connections over its cap.

    This process's descriptors are counted at every POKE_EVERY-th handshake (`poke`, from
    the ZAP gate's thread) and by a thread every SLOW_S (every FAST_S while paused, past
    `low`, for ALERT_S after a resume, and while more than QUIET_SLACK descriptors beyond
    the ranks' are open than at the last quiet look, for up to SETTLE_S: a storm is seen as it
    begins, not up to SLOW_S later, when a burst of accepts may have reached the limit); past
    `high` the watch calls `pause()` (the ipc socket's file renamed aside: a connect() finds
    no file and retries; the open connections are untouched), and below `low` `resume()`.
    No ZeroMQ call: safe beside the event loop.

    The marks key on what a storm adds, not on what registered ranks hold (`held`, which the
    server keeps current): with h descriptors held, it pauses past (nofile + h) / 2 and resumes
    below (nofile + 3h) / 4 (at h = 0, `high` and `low`), so the pause lifts once the storm's
    connections are gone, however many descriptors the ranks hold."""

    SLOW_S = 0.1
    FAST_S = 0.002
    #: the handshake gate pokes the watch per handshake: a look every this many
    POKE_EVERY = 4
    #: looks stay FAST_S this long after a resume
    ALERT_S = 1.0
    #: descriptors beyond the ranks' grown since the last quiet look that make looks FAST_S
    QUIET_SLACK = 8
    #: a level held this long is the new quiet one (connections coordd keeps: HTTP, a relay's)
    SETTLE_S = 1.0

    def __init__(
        self,
        nofile: int,
        pause: Callable[[], bool],
        resume: Callable[[], bool],
        count: Callable[[], int | None] = open_descriptors,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nofile = nofile
        self._clock = clock
        self._alert_until = float("-inf")
        # a margin for what is accepted between two looks (a herd of reconnects after a
        # resume: hundreds in a few ms), and a gap so that a resume is not undone at once
        self.high = max(8, nofile // 2)
        self.low = max(4, nofile // 4)
        self._pause = pause
        self._resume = resume
        self._count = count
        self.paused = False
        #: descriptors registered ranks hold (the server sets it from the loop: an int, read
        #: here as it stands)
        self.held = 0
        #: times the listener was paused, and the most descriptors seen
        self.pauses = 0
        self.peak = 0
        self._lock = threading.Lock()
        self._pokes = 0
        #: descriptors beyond the ranks' at the last quiet look, and when they grew past it
        self.quiet: int | None = None
        self._grew_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="coordd-fds", daemon=True)

    def start(self) -> DescriptorWatch:
        self.quiet = self._count()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        if self.paused:
            self._resume()
            self.paused = False

    def poke(self) -> None:
        """A connection is in its handshake (the ZAP gate's thread says so for each): a look
        every POKE_EVERY, so a storm is seen as it starts, at no cost while none comes."""
        self._pokes += 1
        if self._pokes % self.POKE_EVERY == 0:
            self.check()

    def check(self) -> float:
        """One look: pause or resume as the count says; the seconds to the next look."""
        with self._lock:
            return self._check()

    def _check(self) -> float:
        n = self._count()
        if n is None:
            return self.SLOW_S
        self.peak = max(self.peak, n)
        high, low = self.marks()
        if not self.paused and n >= high:
            if self._pause():
                self.paused = True
                self.pauses += 1
                log.warning(
                    "descriptors %d of %d: new connections refused at the listener until "
                    "fewer than %d are open (a reconnect storm?)",
                    n,
                    self.nofile,
                    low,
                )
        elif self.paused and n <= low and self._resume():
            self.paused = False
            # the clients refused meanwhile all reconnect within their reconnect interval
            # (100 ms): hundreds of accepts between two slow looks
            self._alert_until = self._clock() + self.ALERT_S
            log.info("descriptors %d of %d: new connections accepted again", n, self.nofile)
        now = self._clock()
        busy = self.paused or n >= low or now < self._alert_until or self._growing(n, now)
        return self.FAST_S if busy else self.SLOW_S

    def _growing(self, n: int, now: float) -> bool:
        """Whether descriptors beyond the ranks' grew by more than QUIET_SLACK since the last
        quiet look, less than SETTLE_S ago (a storm beginning)."""
        beyond = n - max(0, self.held)
        if self.quiet is None or beyond <= self.quiet + self.QUIET_SLACK:
            self.quiet, self._grew_at = beyond, None
            return False
        if self._grew_at is None:
            self._grew_at = now
        elif now - self._grew_at >= self.SETTLE_S:
            self.quiet, self._grew_at = beyond, None
            return False
        return True

    def marks(self) -> tuple[int, int]:
        """(pause past, resume below): `high` and `low` moved up by what ranks hold."""
        held = min(max(0, self.held), self.nofile)
        return (
            max(self.high, (self.nofile + held) // 2),
            max(self.low, (self.nofile + 3 * held) // 4),
        )

    def _run(self) -> None:
        interval = self.SLOW_S
        while not self._stop.wait(interval):
            try:
                interval = self.check()
            except Exception:  # a bug here must not end the watch silently
                log.exception("descriptor watch failed")
                interval = self.SLOW_S
