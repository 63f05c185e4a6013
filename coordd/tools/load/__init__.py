"""Load generators against a live coordd, and honest ranks that time their rounds meanwhile
(issue 11, part B): every load is bounded in count and time and stops by itself.

Run one from the command line (it is a separate process, so it does not share the measuring
process's interpreter lock):

    python -m coordd.tools.load garbage ADDRESS --peers 50 --messages 20000 --repeat 3
    python -m coordd.tools.load fast ADDRESS --seconds 5
    python -m coordd.tools.load multipart ADDRESS --parts 2000000
    python -m coordd.tools.load unread ADDRESS --peers 20 --messages 10000
    python -m coordd.tools.load connections ADDRESS --count 1000 --seconds 5   (raw sockets)
    python -m coordd.tools.load http HOST:PORT --count 1000 --seconds 5
    python -m coordd.tools.load claims ADDRESS --count 900 --peers 20 --seconds 5   (id claims)
    python -m coordd.tools.load handshakes tcp://127.0.0.1:PORT --peers 20 --count 200
        (handshakes kept in flight, over tcp from --count loopback addresses; with a leaked
        rank key from $COORDD_CURVE_*)

or all of them with figures: `python -m coordd.tools.load measure --dp 4`.
`LOADS` names them; `start_load(kind, address, ...)` starts one as a child process;
`HonestRounds` drives dp real clients through rounds and keeps each round's latency;
`ProcessGauge` samples a process's RSS and descriptors.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType

import zmq

from coordd.client._config import curve_keys_from_env
from coordd.client.sync import CoordClient
from coordd.proto.messages import StepReport, encode
from coordd.testing.process import CoorddProcess, die_with_parent
from coordd.testing.rogue import APP_LEVEL, bad_frame

LOADS = (
    "garbage",
    "fast",
    "multipart",
    "unread",
    "connections",
    "http",
    "claims",
    "member",
    "storm",
    "handshakes",
)


def _dealer(
    context: zmq.Context, address: str, *, ping_ms: int = 100, routing_id: bytes = b""
) -> zmq.Socket:
    """A DEALER to coordd; a CURVE client with the keys a rank would use
    ($COORDD_CURVE_SERVER_KEY, $COORDD_CURVE_CLIENT_KEY: a flood from a leaked rank key)."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    curve = curve_keys_from_env()
    if curve is not None:
        sock.curve_serverkey = curve.server_public
        sock.curve_publickey = curve.public
        sock.curve_secretkey = curve.secret
    sock.setsockopt(zmq.SNDHWM, 0)
    if ping_ms:
        sock.setsockopt(zmq.HEARTBEAT_IVL, ping_ms)
    sock.connect(address)
    return sock


def garbage(address: str, peers: int = 50, messages: int = 20_000, repeat: int = 1) -> int:
    """`peers` DEALERs (pinging every 100 ms) each queue `messages` bad frames as fast as they
    can, then all disconnect at once; `repeat` times. The libzmq 4.3.5 abort
    (`!_io_error`, stream_engine_base.cpp:310) came from exactly this. A peer coordd refused
    in its handshake has nowhere to queue and stops. Returns frames queued."""
    rng = random.Random(11)
    frames = [bad_frame(rng, rng.choice(APP_LEVEL), 4) for _ in range(64)]
    sent = 0
    for _ in range(repeat):
        context = zmq.Context()
        socks = [_dealer(context, address) for _ in range(peers)]
        try:
            live = list(socks)
            for i in range(messages):
                message = frames[i % len(frames)]
                for sock in live:
                    try:
                        sock.send_multipart(message, zmq.NOBLOCK)
                    except zmq.Again:  # refused in its handshake: no connection to queue on
                        live.remove(sock)
                        continue
                    sent += 1
                if not live:
                    break
            time.sleep(0.05)
        finally:
            for sock in socks:
                sock.close(linger=0)
            _term_soon(context)
        time.sleep(0.2)
    return sent


def _term_soon(context: zmq.Context) -> None:
    """End `context` without waiting on it: libzmq 4.3.5's zmq_ctx_term can hang for good
    after coordd refused the context's connections in their handshake (its memory gate),
    even with every socket closed at linger 0; the load's process exits regardless."""
    threading.Thread(target=context.term, daemon=True).start()


def fast(address: str, seconds: float = 5.0) -> int:
    """One peer sending reports it never registered for, as fast as it can, for `seconds`."""
    context = zmq.Context()
    sock = _dealer(context, address, ping_ms=0)
    sock.setsockopt(zmq.SNDHWM, 1000)
    payload = encode(StepReport(num_tokens=1, num_tokens_padded=1, dp_rank=0, epoch=1, seq=0))
    sent = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            for _ in range(256):
                sock.send(payload)  # blocks at the HWM: as fast as coordd's side takes them
            sent += 256
    finally:
        sock.close(linger=0)
        context.term()
    return sent


def member(address: str, seconds: float = 5.0, group: str = "enginecore", dp: int = 1) -> int:
    """A member that floods: registers as rank 0 of `group` (dp `dp`; with a leaked rank key
    over CURVE, see `_dealer`), then sends 1 KiB of junk as fast as it can for `seconds`
    (issue 21: the cut-off applied only to peers that held no rank, and coordd grew from 34
    to 700+ MB in 4 s). Its DEALER reconnects under the same routing id when cut off (then a
    stranger). Returns frames sent."""
    from coordd.proto.messages import Hello, Welcome, decode_from_coordinator

    context = zmq.Context()
    sock = _dealer(context, address, ping_ms=0, routing_id=f"flood-{os.getpid()}".encode())
    hello = Hello(
        dp_size=dp, dp_rank=0, config_fingerprint="load", incarnation="flood", group=group
    )
    sent = 0
    try:
        sock.send(encode(hello))
        answer = decode_from_coordinator(sock.recv()) if sock.poll(10_000) else None
        if not isinstance(answer, Welcome):
            print(f"not welcomed: {answer}", file=sys.stderr, flush=True)
            return 0
        junk = b"\xc1" + bytes(1023)  # 0xc1: never msgpack
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(256):
                try:
                    sock.send(junk, zmq.NOBLOCK)
                except zmq.Again:  # cut off, reconnecting (or at the HWM)
                    time.sleep(0.001)
                    continue
                sent += 1
    finally:
        sock.close(linger=0)
        _term_soon(context)
    return sent


def storm(address: str, processes: int = 10, sockets: int = 192, seconds: float = 5.0) -> int:
    """A reconnect storm: `processes` processes of `sockets` DEALERs each that send nothing
    (libzmq reconnects each 100 ms after coordd closes it), for `seconds` (issue 21: at a
    hard NOFILE of 1024 libzmq aborted coordd on EMFILE in its ipc accept). Returns sockets."""
    import signal

    kids = []
    for _ in range(processes):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            context = zmq.Context()
            context.setsockopt(zmq.MAX_SOCKETS, sockets + 64)
            socks = []
            for i in range(sockets):
                sock = context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.ROUTING_ID, f"storm-{os.getpid()}-{i}".encode())
                sock.connect(address)
                socks.append(sock)
            time.sleep(seconds)
            os._exit(0)
        kids.append(pid)

    def end(*_: object) -> None:
        for kid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(kid, signal.SIGKILL)
        os._exit(0)

    signal.signal(signal.SIGTERM, end)
    for kid in kids:
        os.waitpid(kid, 0)
    return processes * sockets


def handshakes(address: str, in_flight: int = 20, seconds: float = 5.0, sources: int = 0) -> int:
    """Keep `in_flight` handshakes going for `seconds` (libzmq DEALERs; a CURVE client with a
    leaked rank key if $COORDD_CURVE_* say so, see `_dealer`): each is closed once admitted,
    or 0.5 s after it began if not (a CURVE handshake takes several round trips), and another
    begins. Over tcp with `sources`, each comes
    from the next of that many loopback addresses (127.x.y.z: each its own source to
    coordd's rate before sources were grouped). Returns handshakes admitted."""
    context = zmq.Context()
    context.setsockopt(zmq.MAX_SOCKETS, 4 * in_flight + 64)
    rng = random.Random(os.getpid())
    base = rng.randrange(1, 200)
    flying: list[tuple[zmq.Socket, zmq.Socket, float]] = []
    admitted = made = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            while len(flying) < in_flight:
                target = address
                if sources and address.startswith("tcp://"):
                    n = made % sources
                    source = f"127.{base}.{n // 250 % 250}.{n % 250 + 1}"
                    target = f"tcp://{source}:0;{address.removeprefix('tcp://')}"
                made += 1
                sock = context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                curve = curve_keys_from_env()
                if curve is not None:
                    sock.curve_serverkey = curve.server_public
                    sock.curve_publickey = curve.public
                    sock.curve_secretkey = curve.secret
                monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
                sock.connect(target)
                flying.append((sock, monitor, time.monotonic()))
            time.sleep(0.005)
            now = time.monotonic()
            kept = []
            for sock, monitor, began in flying:
                done = bool(monitor.poll(0))
                admitted += done
                if done or now - began > 0.5:
                    sock.disable_monitor()
                    monitor.close(linger=0)
                    sock.close(linger=0)
                else:
                    kept.append((sock, monitor, began))
            flying = kept
    finally:
        for sock, monitor, _ in flying:
            monitor.close(linger=0)
            sock.close(linger=0)
        _term_soon(context)
    return admitted


def multipart(address: str, parts: int = 2_000_000) -> int:
    """One message of `parts` empty parts (2 bytes each on the wire)."""
    context = zmq.Context()
    sock = _dealer(context, address, ping_ms=0)
    try:
        sock.poll(5000, zmq.POLLOUT)
        for _ in range(parts - 1):
            sock.send(b"", zmq.SNDMORE)
        sock.send(b"")
        time.sleep(0.5)  # let it leave
    finally:
        sock.close(linger=2000)
        context.term()
    return parts


def unread(address: str, peers: int = 20, messages: int = 10_000, hold: float = 2.0) -> int:
    """`peers` peers that send reports they never registered for (each answered with a
    refusal) and never read a reply; they stay connected `hold` seconds after sending."""
    context = zmq.Context()
    payload = encode(StepReport(num_tokens=1, num_tokens_padded=1, dp_rank=0, epoch=1, seq=0))
    socks = [_dealer(context, address, ping_ms=0) for _ in range(peers)]
    try:
        for _ in range(messages):
            for sock in socks:
                sock.send(payload, zmq.NOBLOCK)
        time.sleep(hold)
    finally:
        for sock in socks:
            sock.close(linger=0)
        context.term()
    return peers * messages


def connections(address: str, count: int = 1000, seconds: float = 5.0) -> int:
    """`count` raw connections to coordd's ZeroMQ port that never handshake (a key-less
    client of tcp+CURVE, a port scanner), held `seconds`. Returns how many connected."""
    return _hold(lambda: _raw_connect(address), count, seconds)


def _raw_connect(address: str) -> socket.socket:
    if address.startswith("ipc://"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(1.0)
        sock.connect(address[len("ipc://") :])
        return sock
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=1.0)
    return sock


def http(hostport: str, count: int = 1000, seconds: float = 5.0) -> int:
    """`count` half-open HTTP connections (a request line, never its end), held `seconds`."""
    host, port = hostport.removeprefix("http://").rsplit(":", 1)

    def half_open() -> socket.socket:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=1.0)
        try:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        except OSError:
            sock.close()
            raise
        return sock

    return _hold(half_open, count, seconds)


def _hold(open_one: Callable[[], socket.socket], count: int, seconds: float) -> int:
    """Open up to `count` connections with `open_one` (a refused one is retried after 10 ms)
    and hold them until `seconds` have passed; how many were held."""
    held: list[socket.socket] = []
    end = time.monotonic() + seconds
    try:
        for _ in range(count):
            if time.monotonic() >= end:
                break
            try:
                held.append(open_one())
            except OSError:
                time.sleep(0.01)
        time.sleep(max(0.0, end - time.monotonic()))
    finally:
        for sock in held:
            sock.close()
    return len(held)


def start_load(
    kind: str, address: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start load `kind` (one of LOADS) against `address` as a child process (with `env`, that
    environment instead of this process's: a leaked key's, say)."""
    if kind not in LOADS:
        raise ValueError(f"load kind must be one of {LOADS}, got {kind!r}")
    argv = [sys.executable, "-m", "coordd.tools.load", kind, address, *args]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, env=env, preexec_fn=die_with_parent())


def wait_load(load: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait for a load started by `start_load` to end; past `timeout` it is killed and
    TimeoutError names it (a load that hangs must not hang the test that started it)."""
    try:
        load.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        load.kill()
        load.wait()
        raise TimeoutError(f"load {load.args!r} did not end within {timeout}s") from None


class ProcessGauge:
    """Samples a process's resident memory and open descriptors (Linux /proc) every
    `interval` seconds in a thread; `peak_rss_mb`, `peak_fds` and `alive` afterwards."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid = pid
        self.interval = interval
        self.peak_rss_mb = 0.0
        self.peak_fds = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss_mb(self) -> float:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    @property
    def alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().split(") ", 1)[1][0] not in "ZX"
        except OSError:
            return False

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak_rss_mb = max(self.peak_rss_mb, self.rss_mb())
                self.peak_fds = max(self.peak_fds, self.fds())
                self.samples += 1
            except OSError:
                return
            self._stop.wait(self.interval)

    def __enter__(self) -> ProcessGauge:
        self._thread.start()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)


class HonestRounds:
    """`dp` real clients of one group driven through rounds from one thread (every rank
    starts, then every rank waits), until stopped or `max_rounds`; keeps each round's
    latency (first start to last decision), and every error."""

    def __init__(
        self, address: str, dp: int, *, group: str = "default", wait_timeout: float = 10.0
    ) -> None:
        self.clients = [
            CoordClient(address, dp_rank=r, dp_size=dp, config_fingerprint="load", group=group)
            for r in range(dp)
        ]
        self.wait_timeout = wait_timeout
        self.latencies: list[float] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def connect(self, timeout: float = 10.0) -> HonestRounds:
        for client in self.clients:
            client.connect(timeout=timeout)
        return self

    def round(self) -> float:
        report = StepReport(num_tokens=8, num_tokens_padded=8)
        t0 = time.perf_counter()
        pending = [c.start(report) for c in self.clients]
        for p in pending:
            p.wait(timeout=self.wait_timeout)
        return time.perf_counter() - t0

    def run(self, rounds: int) -> list[float]:
        """`rounds` rounds now; their latencies."""
        out = [self.round() for _ in range(rounds)]
        self.latencies.extend(out)
        return out

    def start(self, max_rounds: int = 1_000_000, pause: float = 0.0) -> HonestRounds:
        """Run rounds in a thread until `stop()` (or the first error, or `max_rounds`)."""

        def loop() -> None:
            for _ in range(max_rounds):
                if self._stop.is_set():
                    return
                try:
                    self.latencies.append(self.round())
                except Exception as exc:  # a failed round is data for the caller
                    self.errors.append(exc)
                    return
                if pause:
                    time.sleep(pause)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 15.0) -> list[float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.latencies

    def close(self) -> None:
        self.stop()
        for client in self.clients:
            client.close()

    def __enter__(self) -> HonestRounds:
        return self.connect()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def p50_ms(latencies: Sequence[float]) -> float:
    return statistics.median(latencies) * 1000 if latencies else float("nan")


#: The loads `measure` runs, with their arguments (each bounded in count and time).
MEASURED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("garbage", ("--peers", "50", "--messages", "20000", "--repeat", "2")),
    ("fast", ("--seconds", "4")),
    ("multipart", ("--parts", "2000000")),
    ("unread", ("--peers", "20", "--messages", "10000", "--seconds", "1")),
    ("connections", ("--count", "1000", "--seconds", "4")),
    ("http", ("--count", "1000", "--seconds", "4")),
    ("claims", ("--count", "900", "--peers", "20", "--seconds", "4")),
    ("member", ("--seconds", "4", "--dp", "4")),
)


def measure(
    dp: int = 4,
    quiet_rounds: int = 300,
    limit: float = 60.0,
    only: Sequence[str] = (),
    extra: Sequence[str] = (),
    runs: int = 1,
) -> int:
    """For each load of MEASURED (or those named in `only`), `runs` times, against a fresh
    coordd (ipc, metrics on): honest-round p50 at `dp` quiet and during the load, coordd's
    peak RSS and descriptors, whether it lived.
    `extra` are more coordd options. Prints one line per run, and with `runs` > 1 a line per
    load of the ratio's and the peak's spread (a burst's peak varies from run to run on busy
    cores); returns 1 if coordd died under any."""
    import tempfile

    died = 0
    print(
        f"{'load':<12} {'quiet p50':>10} {'load p50':>9} {'ratio':>6} {'rounds':>7} "
        f"{'peak RSS':>9} {'peak FDs':>8}  coordd"
    )
    spread: dict[str, list[tuple[float, float]]] = {}
    for kind, load_args in [m for m in MEASURED for _ in range(runs)]:
        if only and kind not in only:
            continue
        with tempfile.TemporaryDirectory(prefix="coordd-load-") as tmp:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = int(probe.getsockname()[1])
            proc = CoorddProcess(
                dp,
                f"ipc://{tmp}/c.sock",
                ["--log-level", "error", "--metrics-port", str(port), *extra],
            ).start()
            try:
                with HonestRounds(proc.address, dp) as ranks, ProcessGauge(proc.pid) as gauge:
                    ranks.run(20)
                    quiet = p50_ms(ranks.run(quiet_rounds))
                    target = f"127.0.0.1:{port}" if kind == "http" else proc.address
                    load = start_load(kind, target, *load_args)
                    during: list[float] = []
                    end = time.monotonic() + limit
                    error = ""
                    while load.poll() is None and time.monotonic() < end:
                        try:
                            during.extend(ranks.run(1))
                        except Exception as exc:
                            error = type(exc).__name__
                            break
                    if load.poll() is None:
                        load.kill()
                    load.wait()
                    alive = gauge.alive
                died += not alive
                busy = p50_ms(during)
                state = "alive" if alive else "DIED"
                print(
                    f"{kind:<12} {quiet:>8.2f}ms {busy:>7.2f}ms {busy / quiet:>6.1f} "
                    f"{len(during):>7} {gauge.peak_rss_mb:>7.0f}MB {gauge.peak_fds:>8}  "
                    f"{state}{' ' + error if error else ''}",
                    flush=True,
                )
                spread.setdefault(kind, []).append((busy / quiet, gauge.peak_rss_mb))
            finally:
                proc.stop()
    for kind, seen in spread.items() if runs > 1 else ():
        ratios = sorted(r for r, _ in seen)
        peaks = sorted(p for _, p in seen)
        print(
            f"{kind:<12} {len(seen)} runs: ratio {ratios[0]:.1f}-{ratios[-1]:.1f} (median "
            f"{statistics.median(ratios):.1f}), peak RSS {peaks[0]:.0f}-{peaks[-1]:.0f} MB "
            f"(median {statistics.median(peaks):.0f})",
            flush=True,
        )
    return 1 if died else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coordd.tools.load", description=__doc__)
    p.add_argument("kind", choices=(*LOADS, "measure"))
    p.add_argument("address", nargs="?", default="")
    p.add_argument("--peers", type=int, default=50)
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--parts", type=int, default=2_000_000)
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--only", default="", help="measure: a comma list of loads (default all)")
    p.add_argument("--coordd-args", default="", help="measure: more coordd options, one string")
    p.add_argument("--runs", type=int, default=1, help="measure: runs of each load (spread)")
    args = p.parse_args(argv)
    if args.kind == "measure":
        only = [k for k in args.only.split(",") if k]
        unknown = sorted(set(only) - set(LOADS))
        if unknown:
            p.error(f"--only: unknown loads {unknown}; known: {', '.join(LOADS)}")
        return measure(args.dp, only=only, extra=args.coordd_args.split(), runs=args.runs)
    if args.kind == "garbage":
        n = garbage(args.address, args.peers, args.messages, args.repeat)
    elif args.kind == "fast":
        n = fast(args.address, args.seconds)
    elif args.kind == "multipart":
        n = multipart(args.address, args.parts)
    elif args.kind == "storm":
        n = storm(args.address, args.peers, args.count, args.seconds)
    elif args.kind == "handshakes":
        n = handshakes(args.address, args.peers, args.seconds, sources=args.count)
    elif args.kind == "member":
        n = member(args.address, args.seconds, dp=args.dp)
    elif args.kind == "unread":
        n = unread(args.address, args.peers, args.messages, hold=args.seconds)
    elif args.kind == "connections":
        n = connections(args.address, args.count, args.seconds)
    elif args.kind == "claims":
        from coordd.tools.load.claims import attack

        result = attack(args.address, args.count, args.seconds, in_flight=args.peers)
        print(result.summary(), file=sys.stderr, flush=True)
        n = result.idless_admitted
    else:
        n = http(args.address, args.count, args.seconds)
    print(n, flush=True)
    if args.kind in ("garbage", "handshakes"):
        os._exit(0)  # a context left terming (see _term_soon) would hold the exit
    return 0
