"""Where coordd listens: `--bind` checked, the ipc socket's directory, lock and mode, and every
reason a bind fails as one sentence (`BindError`) that names the option and the fix.

An ipc socket is coordd's only while coordd runs, and only one coordd may own a path:
- a lock file beside the socket (`PATH.lock`, flock'd for coordd's lifetime, holding its pid):
  a second coordd on the same path is refused and names the first one's pid; the kernel drops
  the lock when coordd dies, however it dies;
- a socket file found at the path is removed only when the lock is ours, it is a socket owned by
  this uid, and nothing answers on it (a coordd of a release without the lock, say);
- the socket is created 0600 (0660 with `--ipc-mode 660`: the directory's group, a pod's shared
  fsGroup) whatever the umask, and at exit removed only if it is still the one coordd bound;
- the default runtime directory ($XDG_RUNTIME_DIR/coordd, else /tmp/coordd-<uid>) must be a
  real directory owned by this uid (never followed through a symlink): made 0700 when coordd
  creates it, made 0700 again if loosened; an operator's own directory is left as it is;
- coordd creates no directory but that one (its parent must exist): a `--bind` into a
  directory that does not exist is refused, naming it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field

from coordd.proto.address import AddressError, Endpoint, check_address, runtime_dir

#: `--ipc-mode` choices: the socket's permission bits.
IPC_MODES = {"600": 0o600, "660": 0o660}


class BindError(Exception):
    """coordd cannot listen where `--bind` says; the message says why and what to do."""


def check_bind(address: str) -> Endpoint:
    """`--bind` taken apart, or `BindError` naming the option and the fix."""
    try:
        return check_address(address, binding=True)
    except AddressError as exc:
        raise BindError(f"--bind {address}: {exc}") from None


@dataclass
class IpcSocket:
    """An ipc path coordd owns while it runs: its lock, and the socket it bound there."""

    address: str
    path: str
    lock_path: str
    lock_fd: int
    mode: int
    bound: tuple[int, int, int] | None = None

    @classmethod
    def claim(cls, address: str, mode: int = 0o600) -> IpcSocket | None:
        """Make ready to bind `address` (None for tcp and abstract ipc, which need nothing):
        the directory, the lock, the stale socket gone. `BindError` if coordd may not."""
        endpoint = check_bind(address)
        if endpoint.scheme != "ipc" or endpoint.abstract:
            return None
        path = os.path.abspath(endpoint.path)
        _prepare_directory(address, os.path.dirname(path))
        lock_path = path + ".lock"
        fd = _lock(address, lock_path, mode)
        claimed = cls(address, path, lock_path, fd, mode)
        try:
            _remove_stale(address, path)
        except BaseException:
            claimed.release()
            raise
        return claimed

    def bind(self, sock: object) -> None:
        """`sock.bind(address)` with the socket created `mode` whatever the umask."""
        old = os.umask(0o777 & ~self.mode)
        try:
            sock.bind(self.address)  # type: ignore[attr-defined]
        finally:
            os.umask(old)
        info = os.lstat(self.path)
        if stat.S_ISSOCK(info.st_mode) and info.st_uid == os.getuid():
            os.chmod(self.path, self.mode)  # the umask did it; this says so to a reader
            self.bound = _file_identity(os.lstat(self.path))

    @property
    def paused_path(self) -> str:
        return self.path + ".paused"

    def pause(self) -> bool:
        """Stop new connections without touching the open ones: the bound socket's file is
        renamed aside (a connect() then finds no file and its client retries; libzmq's
        listener keeps its socket). Safe from any thread (a file rename, no ZeroMQ call).
        True if it was paused now."""
        if self.bound is None:
            return False
        try:
            if _file_identity(os.lstat(self.path)) != self.bound:
                return False
            os.rename(self.path, self.paused_path)
            self.bound = _file_identity(os.lstat(self.paused_path))  # a rename moves ctime
        except OSError:
            return False
        return True

    def resume(self) -> bool:
        """Undo `pause` (only the file coordd bound); True if it was resumed now."""
        if self.bound is None:
            return False
        try:
            if _file_identity(os.lstat(self.paused_path)) != self.bound:
                return False
            os.rename(self.paused_path, self.path)
            self.bound = _file_identity(os.lstat(self.path))
        except OSError:
            return False
        return True

    def release(self) -> None:
        """Remove the socket if it is still the one coordd bound, then the lock; idempotent."""
        if self.lock_fd < 0:
            return
        self.resume()
        if self.bound is not None:
            with contextlib.suppress(FileNotFoundError):
                if _file_identity(os.lstat(self.path)) == self.bound:
                    os.unlink(self.path)
            self.bound = None
        # Unlinked while still held: a coordd that opened the old file sees it is gone.
        with contextlib.suppress(FileNotFoundError):
            info = os.lstat(self.lock_path)
            if (info.st_dev, info.st_ino) == _identity(self.lock_fd):
                os.unlink(self.lock_path)
        os.close(self.lock_fd)
        self.lock_fd = -1


#: Linux's SO_ATTACH_FILTER / SO_DETACH_FILTER (Python names neither).
_SO_ATTACH_FILTER = 26
_SO_DETACH_FILTER = 27


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _drop_all_program() -> tuple[bytes, object]:
    """A classic BPF program of one instruction, `ret #0` (keep no byte of any packet), as
    SO_ATTACH_FILTER takes it, and the array it points to (alive until the call is made)."""
    program = (_SockFilter * 1)(_SockFilter(0x06, 0, 0, 0))  # BPF_RET | BPF_K, 0
    prog = _SockFprog(1, ctypes.cast(program, ctypes.POINTER(_SockFilter)))
    return bytes(prog), program


@dataclass
class TcpListeners:
    """libzmq's listening tcp socket(s) for coordd's port, paused without a ZeroMQ call.

    libzmq gives no way to stop one listener from accepting short of `unbind`, a call on the
    ROUTER that only the event loop's thread may make (and that can lose the port to another
    process before coordd binds it again). Instead `pause` attaches a socket filter that drops
    every packet to the listening socket: the kernel then completes no new connection (a SYN
    is dropped and the client sends it again after its retransmission timeout, 1 s, 3 s, ...),
    so at most what is already in the accept queue (ZMQ_BACKLOG, 100) is accepted after it.
    Connections already open have sockets of their own, untouched. `resume` detaches it. Safe
    from any thread; each descriptor is used only while it still names the socket found."""

    sockets: list[tuple[int, int]] = field(default_factory=list)
    paused: bool = False

    @classmethod
    def find(cls, port: int) -> TcpListeners:
        """This process's listening tcp sockets on `port` (Linux /proc; none elsewhere)."""
        found: list[tuple[int, int]] = []
        with contextlib.suppress(OSError):
            for name in os.listdir("/proc/self/fd"):
                fd = int(name)
                with _dup_socket(fd) as sock:
                    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
                        continue
                    try:
                        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                        bound = sock.getsockname()[1]
                    except OSError:
                        continue
                    if listening and bound == port:
                        found.append((fd, os.fstat(fd).st_ino))
        return cls(found)

    def _each(self, option: int, value: bytes | int) -> bool:
        done = False
        for fd, ident in self.sockets:
            with _dup_socket(fd) as sock:
                if sock is None or os.fstat(sock.fileno()).st_ino != ident:
                    continue
                try:
                    sock.setsockopt(socket.SOL_SOCKET, option, value)
                except OSError:
                    continue
                done = True
        return done

    def pause(self) -> bool:
        """Complete no new connection (True if paused now)."""
        if self.paused or not self.sockets:
            return False
        program, keep = _drop_all_program()
        self.paused = self._each(_SO_ATTACH_FILTER, program)
        del keep
        return self.paused

    def resume(self) -> bool:
        """Undo `pause` (True if resumed now)."""
        if not self.paused:
            return False
        self._each(_SO_DETACH_FILTER, 0)
        self.paused = False
        return True


@contextlib.contextmanager
def _dup_socket(fd: int) -> Iterator[socket.socket | None]:
    """A socket object over a duplicate of `fd` (closed on exit; `fd` itself never), or None
    if `fd` is no socket."""
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            yield None
            return
        dup = os.dup(fd)
    except OSError:
        yield None
        return
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        yield None
        return
    with contextlib.closing(sock):
        yield sock


def _file_identity(info: os.stat_result) -> tuple[int, int, int]:
    """A file, told from one made later at the same path (inode numbers are reused)."""
    return info.st_dev, info.st_ino, info.st_ctime_ns


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def _prepare_directory(address: str, directory: str) -> None:
    is_runtime = os.path.abspath(directory) == os.path.abspath(runtime_dir())
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        info = None
    except OSError as exc:
        why = exc.strerror
        raise BindError(f"--bind {address}: cannot use directory {directory}: {why}") from None
    if info is None and not is_runtime:
        # a mistyped path must not become directories (made as root, left behind): coordd
        # makes only its own runtime directory
        raise BindError(
            f"--bind {address}: directory {directory} does not exist: create it first, or "
            f"fix the path (coordd creates only its own runtime directory, {runtime_dir()})"
        )
    if info is None:
        try:
            os.mkdir(directory, mode=0o700)  # the last part only: its parent must exist
        except FileExistsError:
            pass  # made at the same moment by another process: checked below
        except OSError as exc:
            raise BindError(
                f"--bind {address}: cannot create directory {directory} ({exc.strerror}): "
                "bind in a directory this user can write (e.g. $XDG_RUNTIME_DIR or /run/coordd)"
            ) from None
        info = os.lstat(directory)
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            os.chmod(directory, 0o700, follow_symlinks=False)  # makedirs applies the umask
    if stat.S_ISLNK(info.st_mode) and is_runtime:
        raise BindError(
            f"--bind {address}: runtime directory {directory} is a symbolic link: "
            "remove it (coordd makes the directory itself) or bind elsewhere"
        )
    if not stat.S_ISDIR(os.stat(directory).st_mode):
        raise BindError(
            f"--bind {address}: {directory} is not a directory: pick a path in a directory"
        )
    if not is_runtime:
        return
    if info.st_uid != os.getuid():
        raise BindError(
            f"--bind {address}: runtime directory {directory} belongs to uid {info.st_uid}, not "
            f"to coordd's uid {os.getuid()} (another user made it, and could swap the socket): "
            "remove it, set XDG_RUNTIME_DIR, or bind elsewhere"
        )
    if info.st_mode & 0o077:
        logging.getLogger("coordd").warning(
            "runtime directory %s had mode %o: made 0700", directory, info.st_mode & 0o777
        )
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            if (os.fstat(fd).st_dev, os.fstat(fd).st_ino) == (info.st_dev, info.st_ino):
                os.fchmod(fd, 0o700)
        finally:
            os.close(fd)


def _lock(address: str, lock_path: str, mode: int) -> int:
    """Hold `lock_path` (created `mode`, never through a symlink) for as long as coordd runs."""
    for _ in range(10):
        try:
            fd = os.open(
                lock_path,
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                mode,
            )
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise BindError(
                    f"--bind {address}: the lock file {lock_path} is a symbolic link: remove "
                    "it, and bind in a directory only coordd's user can write"
                ) from None
            raise BindError(
                f"--bind {address}: cannot create files in {os.path.dirname(lock_path)} "
                f"({exc.strerror}): bind in a directory this user can write"
            ) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                raise BindError(
                    f"--bind {address}: the lock file {lock_path} is not a file this uid "
                    f"({os.getuid()}) owns: remove it or bind elsewhere"
                )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                raise BindError(
                    f"--bind {address}: another coordd (pid {holder}) serves this path: "
                    "stop it first, or give this one another --bind"
                ) from None
            try:
                now = os.lstat(lock_path)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
                os.close(fd)  # the one who held it removed it as we opened it: again
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
    raise BindError(f"--bind {address}: the lock file {lock_path} keeps changing: try again")


def _remove_stale(address: str, path: str) -> None:
    """With the lock held: a socket at `path` is a dead coordd's, unless something answers."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise BindError(
            f"--bind {address}: {path} exists and is not a socket: remove it or bind elsewhere"
        )
    if info.st_uid != os.getuid():
        raise BindError(
            f"--bind {address}: the socket {path} belongs to uid {info.st_uid}, not to "
            f"coordd's uid {os.getuid()}: coordd removes only its own; remove it or bind elsewhere"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError:
        pass  # refused: nobody listens, the socket is stale
    else:
        raise BindError(
            f"--bind {address}: a live process listens on {path} (a coordd without the lock "
            "file, or another program): stop it first, or give coordd another --bind"
        )
    finally:
        probe.close()
    os.unlink(path)


def explain_bind_failure(address: str, endpoint: Endpoint, errno_: int, text: str) -> str:
    """libzmq's bind error as one sentence naming `--bind` and the fix."""
    where = f"--bind {address}"
    if endpoint.scheme == "tcp":
        port = endpoint.port
        if errno_ == errno.EADDRINUSE:
            return (
                f"{where}: port {port} is in use on {endpoint.host}: stop the process holding it "
                f"(ss -ltnp 'sport = :{port}'), or pick another port (tcp://{endpoint.host}:* "
                "takes any free one)"
            )
        if errno_ == errno.EADDRNOTAVAIL:
            return (
                f"{where}: {endpoint.host} is not an address of this machine: bind one of its "
                "addresses (ip -brief address), 127.0.0.1, or * for every interface"
            )
        if errno_ == errno.EACCES:
            return f"{where}: binding port {port} needs privileges: use a port above 1023"
        if errno_ in (errno.ENODEV, errno.EINVAL):
            return (
                f"{where}: cannot resolve host {endpoint.host!r}: give an IP address, a name this "
                "machine resolves, or * (IPv6 in brackets: tcp://[::1]:PORT)"
            )
    else:
        if errno_ == errno.EADDRINUSE:
            return f"{where}: another process listens on this name: stop it or bind elsewhere"
        if errno_ in (errno.EACCES, errno.EPERM, errno.EROFS):
            return f"{where}: cannot create the socket ({text}): bind where this user can write"
        if errno_ in (errno.ENOENT, errno.ENOTDIR):
            return f"{where}: the socket's directory cannot hold it ({text}): bind elsewhere"
    return f"{where}: cannot listen there: {text}"
