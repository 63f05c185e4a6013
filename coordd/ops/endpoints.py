"""coordd's HTTP endpoints (/metrics, /livez, /readyz, /status) on the daemon's own event loop.

A small asyncio server (`asyncio.start_server`) on the same loop as the ROUTER socket, rather
than prometheus_client's threaded server: everything coordd counts is then read and written
by one thread, so the counters need no lock on the round path, and a scrape sees a consistent
snapshot (never half a round). A request is answered in one callback (rendering is
microseconds to a millisecond); a slow or silent client only holds its own connection,
which has a deadline. HTTP/1.1, GET and HEAD, one request per connection.

Beside an ipc bind, coordd serves the same endpoints on a UNIX socket next to its own,
`PATH.http` (`status_socket`), mode 0600, always (no flag): `coordd status` with no options
finds the coordd of its user's default address there, with or without --metrics-port.

At most `max_connections` are held at once (each holds a file descriptor), so half-open
connections cannot fill coordd's descriptor table (libzmq aborts on EMFILE). At the cap, a
new connection makes room by closing the one that has waited longest for its request to end
(a slow or silent client); if none is waiting, the new one is closed. A probe that sends its
request at once (/livez from a kubelet) is so still answered under a flood of half-open ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import socket
import stat
import urllib.parse
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from coordd.core._daemon_defaults import DEFAULT_MAX_HTTP_CONNECTIONS
from coordd.ops.collector import CoorddCollector, make_registry
from coordd.ops.status_doc import server_readiness, status_document
from coordd.proto.address import MAX_IPC_PATH_BYTES, AddressError, check_address

if TYPE_CHECKING:
    from coordd.ops.view import ServerView

log = logging.getLogger("coordd.http")

#: (status, content type, body) for one GET.
Response = tuple[int, str, bytes]
#: A handler, given the request's query parameters (`?group=NAME`; empty when none).
Route = Callable[..., Response]

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
_TEXT = "text/plain; charset=utf-8"
_NONE: Mapping[str, str] = {}
_REQUEST_LIMIT = 8192
_IO_TIMEOUT = 5.0
#: The status socket's name beside coordd's ipc socket: PATH + STATUS_SUFFIX.
STATUS_SUFFIX = ".http"


def status_socket(address: str) -> str | None:
    """Where the coordd bound at `address` serves its HTTP endpoints on a UNIX socket: the
    ipc path + ".http"; None for tcp, an abstract ipc name, or a path too long to add to."""
    try:
        endpoint = check_address(address, binding=True)
    except AddressError:
        return None
    if endpoint.scheme != "ipc" or endpoint.abstract:
        return None
    path = endpoint.path + STATUS_SUFFIX
    return path if len(os.fsencode(path)) <= MAX_IPC_PATH_BYTES else None


class HttpEndpoints:
    """Serve `routes` (path -> handler) on host:port from the running event loop."""

    def __init__(
        self, routes: dict[str, Route], max_connections: int = DEFAULT_MAX_HTTP_CONNECTIONS
    ) -> None:
        self.routes = routes
        self.max_connections = max_connections
        #: connections open now, and how many were closed unanswered at the cap
        self.open = 0
        self.refused = 0
        #: connections still reading their request, oldest first
        self._waiting: dict[asyncio.StreamWriter, None] = {}
        self._server: asyncio.Server | None = None
        self._unix: asyncio.Server | None = None
        self.unix_path = ""
        #: the status socket's (st_dev, st_ino) as bound: `close` unlinks only that file
        self._unix_bound = (0, 0)
        self.url = ""

    async def start(self, host: str, port: int) -> str:
        """Listen; returns the base URL (the real port when `port` is 0)."""
        self._server = await asyncio.start_server(
            self._handle, host, port, limit=_REQUEST_LIMIT, reuse_address=True
        )
        bound = self._server.sockets[0].getsockname()
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        self.url = f"http://{shown}:{bound[1]}"
        return self.url

    async def start_unix(self, path: str) -> None:
        """Listen on the UNIX socket `path` too, replacing a dead coordd's socket left there
        (the caller holds the ipc path's lock: no live coordd serves it).

        Nothing here follows a symlink another user may swap in (the directory may be
        writable by others): only a socket of coordd's own user is unlinked, the mode 0600
        comes from the umask at bind (no chmod by path), and `close` unlinks the path only
        while it is still the socket bound here."""
        with contextlib.suppress(FileNotFoundError):
            found = os.lstat(path)
            if stat.S_ISSOCK(found.st_mode) and found.st_uid == os.getuid():
                os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old_umask = os.umask(0o177)
            try:
                sock.bind(path)
            finally:
                os.umask(old_umask)
            bound = os.lstat(path)
            if not stat.S_ISSOCK(bound.st_mode) or bound.st_uid != os.getuid():
                raise OSError(errno.EEXIST, "replaced by another file as it was bound")
            self._unix_bound = (bound.st_dev, bound.st_ino)
            self._unix = await asyncio.start_unix_server(
                self._handle, sock=sock, limit=_REQUEST_LIMIT
            )
        except BaseException:
            sock.close()
            raise
        self.unix_path = path

    async def close(self) -> None:
        for server in (self._server, self._unix):
            if server is not None:
                server.close()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(server.wait_closed(), 1.0)
        self._server = None
        if self._unix is not None:
            self._unix = None
            with contextlib.suppress(OSError):
                now = os.lstat(self.unix_path)
                if (now.st_dev, now.st_ino) == self._unix_bound:
                    os.unlink(self.unix_path)

    def respond(self, method: str, target: str) -> Response:
        """The response to one request line (also used directly by tests)."""
        if method not in ("GET", "HEAD"):
            return 405, _TEXT, b"only GET and HEAD\n"
        path, _, query = target.partition("?")
        route = self.routes.get(path)
        if route is None:
            return 404, _TEXT, ("endpoints: " + " ".join(sorted(self.routes)) + "\n").encode()
        try:
            return route(dict(urllib.parse.parse_qsl(query)))
        except Exception:
            log.exception("endpoint %s failed", target)
            return 500, _TEXT, b"internal error\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open >= self.max_connections:
            self.refused += 1
            if not self._waiting:
                writer.transport.abort()  # every slot is answering: no room for this one
                return
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            oldest.transport.abort()  # its handler sees the connection end, and returns
        self.open += 1
        self._waiting[writer] = None
        try:
            await self._answer(reader, writer)
        finally:
            self._waiting.pop(writer, None)
            self.open -= 1

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _IO_TIMEOUT)
                self._waiting.pop(writer, None)
                method, target, _version = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            except (ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                if writer.transport.is_closing():
                    return  # closed to make room, or by the client: nobody to answer
                status, ctype, body = 400, _TEXT, b"bad request\n"
                method = "GET"
            else:
                status, ctype, body = self.respond(method, target)
            header = (
                f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"
                f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Cache-Control: no-store\r\nConnection: close\r\n\r\n"
            ).encode("latin-1")
            writer.write(header if method == "HEAD" else header + body)
            await asyncio.wait_for(writer.drain(), _IO_TIMEOUT)
        except (asyncio.TimeoutError, ConnectionError):
            # A client that does not read its answer: abort, which drops what is buffered
            # (close() would keep it until the client reads, outside max_connections).
            writer.transport.abort()
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)


def coordd_routes(server: ServerView) -> dict[str, Route]:
    """The four endpoints of one coordd (every group it serves)."""
    registry = make_registry(CoorddCollector(server, lambda: server_readiness(server)))

    def metrics(params: Mapping[str, str] = _NONE) -> Response:
        return 200, CONTENT_TYPE_LATEST, generate_latest(registry)

    def livez(params: Mapping[str, str] = _NONE) -> Response:
        return 200, _TEXT, b"ok\n"

    def readyz(params: Mapping[str, str] = _NONE) -> Response:
        ready, why = server_readiness(server)
        return (200 if ready else 503), _TEXT, (why + "\n").encode()

    def status(params: Mapping[str, str] = _NONE) -> Response:
        """Every group with at most STATUS_RANK_ROWS rank rows in all; `?group=NAME`: that
        group with all its ranks."""
        group = params.get("group")
        if group is not None and group not in server.groups:
            return 404, _TEXT, f"no group {group[:80]!a} (see /status)\n".encode()
        body = json.dumps(status_document(server, group=group), indent=1).encode()
        return 200, "application/json", body + b"\n"

    return {"/metrics": metrics, "/livez": livez, "/readyz": readyz, "/status": status}
