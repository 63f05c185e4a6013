"""Where a rank and coordd meet: the address forms both accept, and the default ipc path.

An address is `ipc://PATH` (a UNIX socket; `ipc://@NAME` is Linux's abstract namespace) or
`tcp://HOST:PORT` (HOST an IPv4 address, a name, `*` for every interface, or an IPv6 literal in
brackets: `tcp://[::1]:5555`; PORT 1..65535, or 0 / `*` for a free port when coordd binds).
`check_address` refuses anything else with one sentence that says what to write instead;
coordd checks `--bind` and a client checks its address with it, before any socket is made.

When nobody says, both use `ipc://<runtime dir>/coordd.sock`: `$XDG_RUNTIME_DIR/coordd` (a
per-user directory systemd makes 0700), else `/tmp/coordd-<uid>`. The /tmp fallback can be made
first by another user, so `runtime_dir_problem` refuses a runtime directory that is a symlink,
not a directory, or not owned by this uid (coordd, and a client reading the default address).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

DEFAULT_SOCKET_NAME = "coordd.sock"
#: Where a client's address came from, as its errors say it.
FROM_ARGUMENT, FROM_ENV, FROM_DEFAULT = "argument", "COORDD_ADDRESS", "default"
#: The longest ipc path: a UNIX socket address holds 108 bytes, the last one a NUL.
MAX_IPC_PATH_BYTES = 107


class AddressError(ValueError):
    """An address coordd and its clients cannot use; the message says what to write instead."""


@dataclass(frozen=True)
class Endpoint:
    """A checked address: `ipc` with `path`, or `tcp` with `host` and `port` ("*" or digits)."""

    scheme: str
    path: str = ""
    host: str = ""
    port: str = ""

    @property
    def ipv6(self) -> bool:
        """A tcp address whose host is an IPv6 literal (libzmq needs ZMQ_IPV6 for it)."""
        return self.scheme == "tcp" and self.host.startswith("[")

    @property
    def abstract(self) -> bool:
        """An ipc address in Linux's abstract namespace (no file, no directory)."""
        return self.scheme == "ipc" and self.path.startswith("@")


def check_address(address: str, *, binding: bool = False) -> Endpoint:
    """`address` taken apart, or `AddressError` saying what is wrong and how to write it.

    `binding`: coordd's --bind (a wildcard host and port 0 or `*` are allowed); else a client's
    address (it needs a host and a port to connect to)."""
    if not isinstance(address, str) or not address.strip():
        raise AddressError("the address is empty: use ipc://PATH or tcp://HOST:PORT")
    if address != address.strip():
        raise AddressError(f"{address!r} has spaces around it: remove them")
    scheme, sep, rest = address.partition("://")
    if not sep:
        guess = f"tcp://{address}" if ":" in address else f"ipc://{address}"
        raise AddressError(
            f"{address!r} has no scheme: write {guess} (or ipc://PATH, tcp://HOST:PORT)"
        )
    if scheme == "ipc":
        return _check_ipc(address, rest)
    if scheme == "tcp":
        return _check_tcp(address, rest, binding)
    raise AddressError(
        f"{address!r}: coordd speaks ipc:// and tcp://, not {scheme}:// "
        "(write ipc://PATH or tcp://HOST:PORT)"
    )


def _check_ipc(address: str, path: str) -> Endpoint:
    if not path:
        raise AddressError(f"{address!r} names no path: write ipc:///run/coordd/coordd.sock")
    size = len(os.fsencode(path))
    if size > MAX_IPC_PATH_BYTES:
        raise AddressError(
            f"ipc path {path!r} is {size} bytes, longer than a UNIX socket address holds "
            f"({MAX_IPC_PATH_BYTES}): use a shorter path (e.g. under $XDG_RUNTIME_DIR or /run)"
        )
    if "\0" in path:
        raise AddressError(f"ipc path {path!r} holds a NUL byte")
    if not path.startswith("@") and (
        path.endswith("/") or os.path.basename(path) in ("", ".", "..")
    ):
        raise AddressError(f"ipc path {path!r} names a directory: add a file name (coordd.sock)")
    return Endpoint("ipc", path=path)


def _check_tcp(address: str, rest: str, binding: bool) -> Endpoint:
    example = "tcp://127.0.0.1:5555"
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0:
            raise AddressError(f"{address!r}: an IPv6 host needs its closing ']' ({example})")
        host, after = rest[: close + 1], rest[close + 1 :]
        if not after.startswith(":"):
            raise AddressError(f"{address!r} has no port: write tcp://{host}:PORT")
        port = after[1:]
        if len(host) <= 2:
            raise AddressError(f"{address!r}: the brackets hold no IPv6 address")
    else:
        host, sep, port = rest.rpartition(":")
        if not sep:
            raise AddressError(
                f"{address!r} has no port: write tcp://{rest or 'HOST'}:PORT (e.g. {example})"
            )
        if ":" in host:
            raise AddressError(f"{address!r}: an IPv6 host goes in brackets: tcp://[{host}]:{port}")
    if not host:
        raise AddressError(f"{address!r} has no host: write {example} (or tcp://*:PORT to bind)")
    if "/" in host or any(c.isspace() for c in host):
        raise AddressError(f"{address!r}: {host!r} is not a host name or address")
    if host == "*" and not binding:
        raise AddressError(f"{address!r}: a client needs coordd's host, not '*' ({example})")
    wildcard = port == "*"
    if not wildcard and (not port.isdigit() or not 0 <= int(port) <= 65535):
        raise AddressError(f"{address!r}: port {port!r} is not a number in 1..65535")
    if not binding and (wildcard or int(port) == 0):
        raise AddressError(f"{address!r}: a client needs coordd's port, not {port!r}")
    return Endpoint("tcp", host=host, port=port)


def runtime_dir() -> str:
    """$XDG_RUNTIME_DIR/coordd, else /tmp/coordd-<uid>; coordd creates it with mode 0700."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base:
        return os.path.join(base, "coordd")
    return os.path.join("/tmp", f"coordd-{os.getuid()}")


def default_address() -> str:
    """`COORDD_ADDRESS` if set, else ipc://<runtime dir>/coordd.sock."""
    return resolve_address(None)[0]


def resolve_address(given: str | None) -> tuple[str, str]:
    """(address, where it came from): `given` (FROM_ARGUMENT), else $COORDD_ADDRESS
    (FROM_ENV), else the default ipc path (FROM_DEFAULT)."""
    if given is not None:
        return given, FROM_ARGUMENT
    env = os.environ.get("COORDD_ADDRESS")
    if env:
        return env, FROM_ENV
    return f"ipc://{os.path.join(runtime_dir(), DEFAULT_SOCKET_NAME)}", FROM_DEFAULT


def runtime_dir_problem(directory: str) -> str | None:
    """Why `directory` must not hold coordd's socket, or None: it is a symlink, not a
    directory, or owned by another uid (who could serve a fake coordd there). Missing: None."""
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        return f"{directory} is a symbolic link: remove it (coordd makes the directory itself)"
    if not stat.S_ISDIR(info.st_mode):
        return f"{directory} is not a directory: remove it or bind elsewhere"
    if info.st_uid != os.getuid():
        return (
            f"{directory} belongs to uid {info.st_uid}, not to uid {os.getuid()} (this "
            "process): another user made it; remove it, set XDG_RUNTIME_DIR, or bind elsewhere"
        )
    return None
