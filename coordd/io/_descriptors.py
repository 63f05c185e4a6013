"""Which connection a descriptor names now, for the rank wire and the relay wire alike.

libzmq reports a connection's close (on the monitor) before it releases the descriptor, and a
new connection can reuse the number before the server has read that close; frames an older
connection queued on the number may also be read long after it closed. A peer that registered
(a rank or a relay) is bound to its descriptor and to the socket (`limits.socket_ident`) it
said its Hello over, so that `claim` can tell a new connection from a stale backlog.
"""

from __future__ import annotations

from collections.abc import Callable

from coordd.io import _limits as limits

__all__ = ["Descriptors"]


class Descriptors:
    """The server's record of registered descriptors: whose each is, and which closes were
    carried out before their monitor event was read (`claim`) or wait for frames (`closing`).

    `owner(fd)`: the peer registered over `fd` (a rank's or a relay's), or None.
    `close(fd)`: carry out the close of `fd`'s connection (the server's `_connection_closed`).
    """

    def __init__(self, owner: Callable[[int], bytes | None], close: Callable[[int], None]) -> None:
        self._owner = owner
        self._close = close
        #: Descriptors whose close was read and waits for what its connection sent first.
        self.closing: set[int] = set()
        #: Descriptors whose close was carried out before its event was read.
        self._closed_early: set[int] = set()
        #: The socket each descriptor's registered peer said its Hello over.
        self._sockets: dict[int, tuple[bytes, int | None]] = {}
        self.socket_ident: Callable[[int], int | None] = limits.socket_ident

    def claim(self, peer: bytes, fd: int) -> bool:
        """Before a Hello from `peer` over `fd` is tracked on `fd` (a rank's or a relay's): if
        another peer registered over `fd` and its socket is gone from `fd`, that connection is
        closed and `fd` is a new one's, so its close is carried out now and skipped when its
        event is read. Otherwise the newcomer would be tracked on `fd` and the old close then
        end it, leaving the old rank (or relay) held. False while the owner's socket is still
        on `fd`: the frame was queued by an older connection on that number, which is gone,
        and the owner stays."""
        owner = self._owner(fd)
        if owner is None or owner == peer:
            return True
        held = self._sockets.get(fd)
        socket = held[1] if held is not None and held[0] == owner else None
        if socket is not None and socket == self.socket_ident(fd):
            return False
        if fd in self.closing:
            self.closing.discard(fd)
        else:
            self._closed_early.add(fd)
        self._close(fd)
        return True

    def note(self, peer: bytes, fd: int) -> None:
        """`peer` registered over `fd`: remember its socket, for `claim`."""
        held = self._sockets.get(fd)
        if held is None or held[0] != peer:
            self._sockets[fd] = (peer, self.socket_ident(fd))

    def forget(self, fd: int) -> None:
        """`fd`'s connection closed."""
        self._sockets.pop(fd, None)

    def closed_early(self, fd: int) -> bool:
        """True (once) if the close of `fd` just read was carried out already by `claim`."""
        if fd in self._closed_early:
            self._closed_early.discard(fd)
            return True
        return False
