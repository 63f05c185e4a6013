"""coordd's ZAP handler: which connections may finish their handshake.

libzmq asks the ZAP handler of a socket's context about every connection before it reads a
single message from it, so the handshake is the cheapest place to say no. coordd's handler
says no for three reasons:

- an unknown CURVE client key (status 400: the client fails at once; the key will not change);
- memory pressure (`coordd.io._memory`; status 300: the client's handshake stalls until coordd's
  HANDSHAKE_IVL, then it reconnects and is let in once the pressure is over); with a rate, a
  quiet source (a rank's process) is still let in within it, as the pressure may be a
  flood's own handshakes in flight;
- too many handshakes (`coordd.core._handshake.HandshakeRate`; status 300 too).

Why a handshake rate: a ROUTER names a connection that brings no routing id
`\\x00` + a 32-bit counter, and libzmq aborts the process if that name is already held by a
connection that chose it (`Assertion failed: ok`, socket_base.cpp:2113, libzmq 4.3.5). The
counter starts from a secret (`coordd.io._identity.new_router`), but a peer holding C chosen names
spread over the 2^32 values while it makes id-less connections at a rate `a` hits one in
2^32 / (C * a) seconds on average. coordd cannot refuse a chosen name (it never sees it before
the peer sends, and a name held silently never sends), so both factors are bounded instead:

- `a` by this rate: every id-less connection is one admitted handshake;
- C by the stranger grace (`coordd.core._admission.Admission.expire`): a connection that has
  said no Hello STRANGER_GRACE seconds after it was accepted is shut down, so every held name
  costs an admitted handshake per grace period, from the same budget.

With R handshakes a second and a grace of T seconds, C * a is at most (R*T/2) * (R/2) =
R^2*T/4 (`hits_per_second`). At the defaults (20 a second in all, an eighth of it
from one source, T = 5 s): ~17 years from one source, ~99 days from many sources together
(`mean_seconds_to_abort`). Honest ranks need neither more: a whole engine connects within the
burst, and a rank says Hello as soon as it is connected.

A connection that has said Hello is exempt from the grace, so a Hello from a routing id that
starts with a zero byte (libzmq's own names, or a peer imitating them) is refused and does not
count: no exempt connection holds a name the counter can reach.

Sources are a tcp peer's IP address and an ipc peer's process (libzmq gives the ZAP handler
`localhost:uid:gid:pid` there). A source over its share is refused without spending the shared
budget, so one busy source does not keep the others out. A tcp source is also charged to its
group (`coordd.core._handshake.source_group`), which gets half the rate: with CURVE its client
key (checked first: an unknown key is refused 400 and spends nothing, so a known key's
handshake never waits behind a stranger's), else every loopback address together, an IPv4
address's /24 (`--handshake-ipv4-prefix`) or an IPv6 address's /64; so many addresses of one
host (127.0.0.0/8, a /64) count as one, and a source of a busy group never takes the reserve.

The ZAP thread reads every request queued (up to ZAP_BATCH) and answers one of each quiet
source first (`HandshakeRate.quiet`), then the rest in turn: libzmq keeps a request whose
connection has closed, so a peer that keeps reopening its connections queues many that nobody
waits for, and a rank's request must not wait behind them.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq
from zmq.utils import z85

from coordd.core._admission import Pressure
from coordd.core._handshake import SOURCE_SHARE as SOURCE_SHARE  # `coordd serve --help` shows it
from coordd.core._handshake import HandshakeRate

log = logging.getLogger("coordd")

#: libzmq asks the ZAP handler bound here (one per context) before admitting a connection.
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = "coordd"
#: The ZAP protocol version libzmq speaks.
ZAP_VERSION = b"1.0"
#: A temporary refusal (300) is answered this late. Answered at once, libzmq 4.3.5 often
#: closes the connection within milliseconds (always through a relay hop), which a client
#: cannot tell from a wrong key and gives up on; held 1 s, the handshake stalls, which the
#: client knows for coordd's "not now" (it counts failures 0.5 s or more after connecting as
#: stalls), and retries until its own deadline. Under coordd's 5 s HANDSHAKE_IVL.
REFUSAL_DELAY = 1.0
#: Most refusals held REFUSAL_DELAY at once (`HandshakeGate.max_stalled`; the server sets a
#: quarter of its connection cap). Each holds a descriptor while it waits (and its client's
#: handshake stalls up to HANDSHAKE_IVL), and a reconnect storm holding too many would make
#: libzmq abort coordd on EMFILE in its ipc accept. Past this many, a refusal is answered at
#: once: its connection closes
#: and frees its descriptor within milliseconds (the client retries after its reconnect
#: interval); only the storm's own connections go that way, an honest rank's still waits.
MAX_STALLED = 256
#: Most ZAP requests read before any is answered (`HandshakeGate._quiet_first` orders them).
ZAP_BATCH = 4096
#: The interpreter's switch interval in `coordd serve` (Python's default is 5 ms). pyzmq lets
#: the interpreter lock go around every frame it reads or sends, so the ZAP thread takes it
#: back many times a request; a shorter interval lets it answer handshakes while the loop
#: thread is busy with a flood's accepts, and costs nothing when no handshakes come.
SWITCH_INTERVAL = 0.0005
#: How libzmq names an ipc peer to ZAP: `localhost:UID:GID:PID`.
IPC_SOURCE = b"localhost:"
#: The ZAP status texts of the temporary refusals (status 300).
REFUSAL = b"coordd is over its memory budget (--max-rss-mb): try again"
RATE_REFUSAL = b"coordd admits at most --max-handshake-rate handshakes a second: try again"

#: The gate serving each context's ZAP endpoint (one per context): `coordd serve` with CURVE
#: starts it with the key check first, and the server's memory budget and rate then share it.
_GATES: dict[int, HandshakeGate] = {}
_GATES_LOCK = threading.Lock()


def _read_batch(sock: zmq.Socket[bytes]) -> list[list[bytes]]:
    """The ZAP requests queued now, up to ZAP_BATCH: (routing id, delimiter, request...)."""
    batch: list[list[bytes]] = []
    while len(batch) < ZAP_BATCH:
        try:
            envelope = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
        if len(envelope) >= 2:  # libzmq sends id, delimiter, request
            batch.append(envelope)
    return batch


class HandshakeGate:
    """The ZAP handler, in its own thread (the loop may be busy dropping what a flood queued).

    Closing a stranger's connection is not enough under a flood: a ZeroMQ peer reconnects
    within ~100 ms and sends its backlog again, and coordd reads the monitor's ACCEPTED event
    only after libzmq has started reading the new connection. Refused here, a connection
    costs an accept and a handshake, and no queued message.

    Statuses: 200 admitted (with CURVE, the User-Id is the client's z85 key: the key-to-rank
    binding reads it at Hello); 400 an unknown key, whatever else holds; 300 memory pressure
    (`pressure`, the flag the server's admission sets, or `over()` says so) or over the
    handshake rate (`rate`), answered REFUSAL_DELAY late."""

    def __init__(
        self,
        context: zmq.Context,
        curve: Callable[[str, bytes], bool] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        #: Memory pressure: the one flag the server's admission sets (`share_pressure`).
        self.pressure = Pressure()
        #: Asked for each handshake too (`MemoryWatch.over`): refuse if it says so.
        self.over: Callable[[], bool] = lambda: False
        self.curve = curve
        #: The handshake rate, or None (no limit).
        self.rate: HandshakeRate | None = None
        self.clock = clock or time.monotonic
        #: refused for memory pressure (300), admitted (200), refused for their key (400)
        self.refused = 0
        self.admitted = 0
        self.bad_keys = 0
        #: refusals answered at once, with MAX_STALLED already held (`max_stalled`)
        self.hurried = 0
        self.max_stalled = MAX_STALLED
        #: ipc handshakes admitted, (process id, when), for admission's spares
        #: (`coordd.core._admission.Admission.handshakes`; deque appends are thread-safe)
        self.handshakes: deque[tuple[int, float]] | None = None
        #: told of every handshake (the descriptor watch: `coordd.io._limits.DescriptorWatch`)
        self.on_handshake: Callable[[], None] | None = None
        #: addresses whose connection registered a rank (the loop appends, this thread takes
        #: them into the rate: `HandshakeRate.earn`; deque appends are thread-safe)
        self.earned: deque[bytes] = deque(maxlen=4096)
        self._context_id = id(context)
        self._sock = context.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError:
            self._sock.close(linger=0)
            raise
        # stop() wakes the thread through this pair (no timed polling: idle costs nothing)
        wake = f"inproc://coordd-zap-stop-{id(self):x}"
        self._wake_in = context.socket(zmq.PAIR)
        self._wake_in.bind(wake)
        self._wake_out = context.socket(zmq.PAIR)
        self._wake_out.connect(wake)
        self._thread = threading.Thread(target=self._run, name="coordd-zap", daemon=True)
        self._stopped = False

    @classmethod
    def start(
        cls, context: zmq.Context, curve: Callable[[str, bytes], bool] | None = None
    ) -> HandshakeGate | None:
        """The context's gate, serving: this process's own if one was started on `context`
        (CURVE starts it first), else a new one; None if something else serves ZAP there."""
        with _GATES_LOCK:
            gate = _GATES.get(id(context))
            if gate is not None:
                if curve is not None and gate.curve is None:
                    gate.curve = curve
                return gate
            try:
                gate = cls(context, curve)
            except zmq.ZMQError:
                return None
            _GATES[id(context)] = gate
        gate._thread.start()
        return gate

    @property
    def refusing(self) -> bool:
        """Whether coordd is over its memory budget (new handshakes refused)."""
        return self.pressure.on

    @refusing.setter
    def refusing(self, on: bool) -> None:
        self.pressure.on = on

    def decide(self, request: list[bytes]) -> list[bytes]:
        """The reply to one ZAP request (version, request id, domain, address, routing id,
        mechanism, credentials...)."""
        version = request[0] if request else b""
        request_id = request[1] if len(request) > 1 else b""

        def reply(status: bytes, text: bytes, user: bytes = b"") -> list[bytes]:
            return [ZAP_VERSION, request_id, status, text, user, b""]

        if version != ZAP_VERSION or len(request) < 6:
            return reply(b"400", b"malformed ZAP request")
        user = b""
        if self.curve is not None:
            mechanism, credentials = request[5], request[6:]
            if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
                self.bad_keys += 1
                return reply(b"400", b"CURVE required")
            user = z85.encode(credentials[0])
            if not self.curve(request[2].decode("utf-8", "replace"), user):
                self.bad_keys += 1
                return reply(b"400", b"unknown CURVE key")
        pressed = self.refusing or self.over()
        rate = self.rate
        earned = self.earned
        while earned and rate is not None:
            rate.earn(earned.popleft())
        if rate is None:
            if pressed:
                self.refused += 1
                return reply(b"300", REFUSAL)
        else:
            # over the memory budget only a quiet source gets in (a rank's process, not the
            # handshakes in flight that may be what grew coordd)
            address = request[3]
            group = rate.group_of(address, user)
            if not rate.admit(address, self.clock(), group, quiet_only=pressed):
                if pressed:
                    self.refused += 1
                    return reply(b"300", REFUSAL)
                return reply(b"300", RATE_REFUSAL)
        self.admitted += 1
        handshakes = self.handshakes
        if handshakes is not None and request[3].startswith(IPC_SOURCE):
            pid = request[3].rsplit(b":", 1)[-1]
            if pid.isdigit():
                handshakes.append((int(pid), self.clock()))
        return reply(b"200", b"OK", user)

    def _run(self) -> None:
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        # refusals answered REFUSAL_DELAY late (a FIFO: one delay, so due times only grow)
        later: deque[tuple[float, list[bytes]]] = deque()
        while True:
            now = time.monotonic()
            while later and later[0][0] <= now:
                try:
                    sock.send_multipart(later.popleft()[1])
                except zmq.ZMQError:  # pragma: no cover
                    return
            timeout = None if not later else max(0, math.ceil((later[0][0] - now) * 1000))
            try:
                ready = dict(poller.poll(timeout))
                if self._wake_in in ready:
                    return
                if sock not in ready:
                    continue
                batch = _read_batch(sock)
            except zmq.ZMQError:  # pragma: no cover - the context is going away
                return
            for envelope in self._quiet_first(batch):
                answer = self._answer(envelope[2:])
                if answer[2] == b"300":
                    if len(later) < self.max_stalled:
                        later.append((time.monotonic() + REFUSAL_DELAY, [*envelope[:2], *answer]))
                        continue
                    self.hurried += 1  # each held refusal holds a descriptor: answered now
                try:
                    sock.send_multipart([*envelope[:2], *answer])
                except zmq.ZMQError:  # pragma: no cover
                    return

    def _quiet_first(self, batch: list[list[bytes]]) -> list[list[bytes]]:
        """`batch` with one request of each quiet source first (`HandshakeRate.quiet`; a
        source's later ones in the batch wait with the rest), otherwise in the order read.
        Under a reconnect flood the queue holds requests of connections closed already, and a
        rank's answered in turn would wait behind them past its spare."""
        rate = self.rate
        if rate is None or len(batch) < 2:
            return batch
        while self.earned:
            rate.earn(self.earned.popleft())
        now = self.clock()
        quiet: list[list[bytes]] = []
        rest: list[list[bytes]] = []
        seen: set[bytes] = set()
        for envelope in batch:
            source = envelope[5] if len(envelope) > 5 else b""
            if source not in seen and rate.quiet(source, now):
                quiet.append(envelope)
            else:
                rest.append(envelope)
            seen.add(source)
        return quiet + rest if quiet else batch

    def _answer(self, request: list[bytes]) -> list[bytes]:
        """`decide`, told to the descriptor watch first; a bug refuses (500), not stops."""
        if self.on_handshake is not None:
            try:
                self.on_handshake()
            except Exception:  # pragma: no cover - the watch logs its own failures
                log.exception("descriptor watch failed")
        try:
            return self.decide(request)
        except Exception:  # a bug here must not stop every future handshake
            log.exception("ZAP request failed; refused")
            request_id = request[1] if len(request) > 1 else b""
            return [ZAP_VERSION, request_id, b"500", b"internal error", b"", b""]

    def stop(self) -> None:
        """Stop serving (once; CURVE and the server may both ask)."""
        with _GATES_LOCK:
            if self._stopped:
                return
            self._stopped = True
            if _GATES.get(self._context_id) is self:
                del _GATES[self._context_id]
        if self._thread.is_alive():
            self._wake_out.send(b"")
            self._thread.join(timeout=2.0)
        for sock in (self._sock, self._wake_in, self._wake_out):
            sock.close(linger=0)
