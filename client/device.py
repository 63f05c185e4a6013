"""The device path: the same step agreement as one torch.distributed all-reduce, without coordd.

Each rank writes its report into its own row of a zeroed `[dp, FIELDS]` int64 matrix; a SUM
all-reduce then hands every rank every row (an all-gather made of the one collective every
backend has, as vLLM does it). Every rank applies `coordd.proto.policy.decide` to the same
matrix, so all get the same `StepDecision`, equal to the coordd path's for the same reports;
and since every rank sees every row, every rank finds the same fault and raises the same typed
error.

`connect()` exchanges the ranks' `Hello`s the same way and replays them, in rank order, through
the coordinator's own registration rules, so a config mismatch raises the very `Rejected` that
coordd would give. Only this module imports torch (it is in the `device` extra).

Differences from the coordd path, by construction:
- the epoch is always `DEVICE_EPOCH` (0): there is no daemon that could restart;
- a round's expected seq is the shared sequence every rank counts (one per collective since
  `connect`), the device analog of the coordinator's counter; its expected kind is the kind
  most ranks report, ties going to the lowest rank's, and the lowest rank off it is named: the
  same rule as coordd's (`coordd.proto.rounds.majority`; coordd waits for every report of a
  round whose kinds disagree), so both paths name the same culprit whoever reported first;
  when several ranks are at fault in different ways (a skipped seq and a wrong kind), the
  lowest one is named (coordd: a skipped seq at once, as it arrives);
- a lost rank surfaces as the backend's error, so `RankLost` names no rank.
"""

# Whole though over 500 lines: one client shell over one collective, whose parts (connect,
# rounds, gathers, close) all share that collective's state.

from __future__ import annotations

import array
import collections
import contextlib
import ctypes
import datetime
import enum
import functools
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from coordd.client._config import ClientConfig
from coordd.client._session import RankSession, SessionView
from coordd.proto.coordinator import Coordinator
from coordd.proto.errors import (
    CoordError,
    CoordinatorUnavailable,
    ProtocolError,
    RankLost,
    Rejected,
    StepMismatch,
    StepTimeout,
)
from coordd.proto.messages import (
    Hello,
    Reject,
    StepDecision,
    StepKind,
    StepReport,
    Welcome,
    decode_to_coordinator,
    encode,
    error_from_reject,
)
from coordd.proto.policy import decide, validate_report
from coordd.proto.rounds import majority

#: The epoch of every device-path decision and Welcome (coordd's is its start time in ms).
DEVICE_EPOCH = 0
#: Room for one rank's encoded Hello in the handshake (a 2-byte length, then msgpack).
HELLO_BYTES = 4096


class Field(enum.IntEnum):
    """The columns of a rank's row in the step matrix."""

    NUM_TOKENS = 0
    NUM_TOKENS_PADDED = 1
    WANT_UBATCH = 2
    CUDAGRAPH_MODE = 3
    HAS_UNFINISHED = 4
    WANT_PAUSE = 5
    SEQ = 6
    KIND = 7
    FINGERPRINT = 8
    NUM_UBATCHES = 9
    PRESENT = 10


NUM_FIELDS = len(Field)
# Plain ints for the per-round code (an enum member lookup costs more than the check).
_SEQ, _KIND, _FINGERPRINT, _NUM_UBATCHES, _PRESENT = (
    int(f) for f in (Field.SEQ, Field.KIND, Field.FINGERPRINT, Field.NUM_UBATCHES, Field.PRESENT)
)
#: 0 is "no kind", so a row nobody wrote cannot pass for a forward step.
KIND_CODES: dict[StepKind, int] = {kind: i + 1 for i, kind in enumerate(StepKind)}
_KINDS_BY_CODE = {code: kind for kind, code in KIND_CODES.items()}
_INT64_MAX = 2**63 - 1


@functools.lru_cache(maxsize=256)
def fingerprint_hash(fingerprint: str) -> int:
    """A 31-bit hash of the config fingerprint: fits every backend's integer type."""
    digest = hashlib.blake2b(fingerprint.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def encode_row(report: StepReport, fingerprint: int, num_ubatches: int) -> list[int]:
    """One rank's row of the step matrix: a stamped report plus its config (in `Field` order:
    tests/unit/test_device_rows.py holds the two together)."""
    return [
        report.num_tokens,
        report.num_tokens_padded,
        int(report.want_ubatch),
        report.cudagraph_mode,
        int(report.has_unfinished),
        int(report.want_pause),
        report.seq,
        KIND_CODES[report.kind],
        fingerprint,
        num_ubatches,
        1,
    ]


def check_fits(report: StepReport) -> None:
    """The matrix is int64: a larger value is refused here, before the round is posted."""
    for name in ("num_tokens", "num_tokens_padded", "cudagraph_mode"):
        value = getattr(report, name)
        if not -_INT64_MAX <= value <= _INT64_MAX:
            raise ValueError(f"{name}={value} does not fit the device path's int64 matrix")


def _majority_kind(codes: Sequence[int]) -> int:
    """The code most rows carry; a tie goes to the lowest rank's (coordd's rule)."""
    return majority(codes)


def resolve_round(
    rows: Sequence[Sequence[int]], *, seq: int, hellos: Sequence[Hello]
) -> StepDecision:
    """The gathered matrix of one round -> the decision, or the `CoordError` every rank raises.

    `seq` is the shared sequence (the round's expected seq), `hellos` the group's Hellos from
    `connect` (rank order; the lowest rank's sets the group's settings, as in coordd). Checks
    run column by column (one pass in C when all is well); the first faulty rank is named.
    """
    n = len(rows)
    cols = list(zip(*rows, strict=True))
    present = cols[_PRESENT]
    if present.count(1) != n:
        rank = _first(present, lambda v: v != 1)
        raise ProtocolError(
            f"row {rank} of the step matrix has present={present[rank]} (expected 1): "
            "the ranks disagree on the process group or the matrix layout",
            rank=rank,
        )
    _check_config(cols, hellos)
    codes = cols[_KIND]
    code = codes[0]
    if codes.count(code) != n or code not in _KINDS_BY_CODE:  # else: one known kind
        if not _KINDS_BY_CODE.keys() >= set(codes):
            rank = _first(codes, lambda c: c not in _KINDS_BY_CODE)
            raise ProtocolError(f"unknown step kind code {codes[rank]}", rank=rank)
        code = _majority_kind(codes)
    kind = _KINDS_BY_CODE[code]
    seqs = cols[_SEQ]
    in_step = seqs.count(seq) == n and codes.count(code) == n
    reports: list[StepReport | None] = []
    for rank, (tokens, padded, ubatch, mode, unfinished, pause) in enumerate(
        zip(*cols[:_SEQ], strict=True)
    ):
        if not in_step and (seqs[rank] != seq or codes[rank] != code):
            got = _KINDS_BY_CODE[codes[rank]].value
            raise StepMismatch(rank, seq, kind.value, seqs[rank], got)
        report = StepReport(
            num_tokens=tokens,
            num_tokens_padded=padded,
            want_ubatch=bool(ubatch),
            cudagraph_mode=mode,
            has_unfinished=bool(unfinished),
            dp_rank=rank,
            epoch=DEVICE_EPOCH,
            seq=seq,
            kind=kind,
            want_pause=bool(pause),
        )
        validate_report(rank, report)
        reports.append(report)
    return decide(reports, hellos[0].num_ubatches, epoch=DEVICE_EPOCH, seq=seq, kind=kind)


def _first(column: Sequence[int], bad: Callable[[int], bool]) -> int:
    return next(rank for rank, value in enumerate(column) if bad(value))


def _check_config(cols: Sequence[Sequence[int]], hellos: Sequence[Hello]) -> None:
    """Every row must carry the group's fingerprint and num_ubatches (coordd's Reject texts)."""
    group = hellos[0]
    want_hash = fingerprint_hash(group.config_fingerprint)
    n = len(hellos)
    hashes, ubatches = cols[_FINGERPRINT], cols[_NUM_UBATCHES]
    if hashes.count(want_hash) == n and ubatches.count(group.num_ubatches) == n:
        return
    for rank, (hashed, got_n) in enumerate(zip(hashes, ubatches, strict=True)):
        if hashed != want_hash:
            got = _fingerprint_named(hashed, hellos)
            raise Rejected(
                "fingerprint",
                f"rank {rank} has config_fingerprint={got!r}, "
                f"the group (rank {group.dp_rank}) has {group.config_fingerprint!r}",
                expected=group.config_fingerprint,
                got=got,
            )
        if got_n != group.num_ubatches:
            raise Rejected(
                "num_ubatches",
                f"rank {rank} has num_ubatches={got_n!r}, "
                f"the group (rank {group.dp_rank}) has {group.num_ubatches!r}",
                expected=str(group.num_ubatches),
                got=str(got_n),
            )


def _fingerprint_named(hashed: int, hellos: Sequence[Hello]) -> str:
    for hello in hellos:
        if fingerprint_hash(hello.config_fingerprint) == hashed:
            return hello.config_fingerprint
    return f"<fingerprint hash {hashed:#010x}>"


def encode_hello_row(hello: Hello) -> bytes:
    """One rank's row of the handshake matrix (all zeros if the Hello does not fit)."""
    data = encode(hello)
    if len(data) > HELLO_BYTES - 2:
        return bytes(HELLO_BYTES)
    return len(data).to_bytes(2, "little") + data + bytes(HELLO_BYTES - 2 - len(data))


def decode_hellos(rows: Sequence[bytes]) -> list[Hello]:
    """The handshake matrix -> every rank's Hello; `ProtocolError` names a rank whose is bad."""
    hellos = []
    for rank, row in enumerate(rows):
        length = int.from_bytes(row[:2], "little")
        try:
            msg = decode_to_coordinator(row[2 : 2 + length]) if length else None
        except ProtocolError as exc:
            raise ProtocolError(f"bad Hello in the handshake: {exc.detail}", rank=rank) from None
        if type(msg) is not Hello:
            raise ProtocolError("no Hello in the handshake (too long, or not a Hello)", rank=rank)
        if msg.dp_rank != rank:
            raise ProtocolError(
                f"the Hello in row {rank} of the handshake claims dp_rank {msg.dp_rank}", rank=rank
            )
        hellos.append(msg)
    return hellos


def admit(hellos: Sequence[Hello]) -> Rejected | None:
    """Register the Hellos in rank order by coordd's own rules: the first rejection, or None."""
    coordinator = Coordinator(len(hellos), epoch=DEVICE_EPOCH)
    for rank, hello in enumerate(hellos):
        for send in coordinator.receive(f"device-rank-{rank}".encode(), hello, 0.0):
            if type(send.message) is Reject:
                return error_from_reject(send.message)
    return None


_FORMATS: dict[torch.dtype, Literal["q", "B"]] = {torch.int64: "q", torch.uint8: "B"}


class _Buffers:
    """The tensors of one `[world, width]` exchange, made once and reused round after round.

    A round writes only its own row into `host`, whose other rows stay zero: on the CPU `host`
    is the matrix the collective sums into (so the row is zeroed again after each read); on CUDA
    it is a pinned staging matrix copied to `matrix` on the device, and the sum comes back into
    the pinned `out`. A set is taken per round and given back once its result is read.
    """

    __slots__ = ("host", "matrix", "mine", "out", "raw", "zeros")

    def __init__(
        self, world: int, width: int, dtype: torch.dtype, rank: int, device: torch.device
    ) -> None:
        size = torch.empty((), dtype=dtype).element_size() * world * width
        self.raw: bytearray | None = None
        if device.type == "cpu":
            self.raw = bytearray(size)
            self.host = torch.frombuffer(self.raw, dtype=dtype).view(world, width)
            self.matrix = self.out = self.host
            view = memoryview(self.raw)
        else:
            self.host = torch.zeros((world, width), dtype=dtype, pin_memory=True)
            self.matrix = torch.empty((world, width), dtype=dtype, device=device)
            self.out = torch.empty((world, width), dtype=dtype, pin_memory=True)
            view = memoryview((ctypes.c_char * size).from_address(self.host.data_ptr()))
        self.zeros = bytes(size) if self.raw is not None else b""
        self.mine = view.cast("B").cast(_FORMATS[dtype])[rank * width : (rank + 1) * width]

    def write(self, row: Sequence[int] | bytes) -> None:
        """This rank's row, in place (`row` has exactly `width` values)."""
        self.mine[:] = row if isinstance(row, bytes) else array.array(self.mine.format, row)

    def clear(self) -> None:
        """On the CPU the sum landed in `host`: zero it, ready for the next round."""
        if self.raw is not None:
            self.raw[:] = self.zeros


class _SideStream:
    """Makes the client's side stream current, restored on exit: one stream lookup, where
    `torch.cuda.stream()` also resolves the device index on every entry and exit."""

    __slots__ = ("_fallback", "_prev", "index", "stream")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self.index = stream.device_index
        self._prev: torch.cuda.Stream | None = None
        self._fallback: contextlib.AbstractContextManager[object] | None = None

    def __enter__(self) -> None:
        prev = torch.cuda.current_stream()
        if prev.device_index == self.index:
            self._prev = prev
            torch.cuda.set_stream(self.stream)
        else:  # the engine has another device current: switch both, as the stock manager does
            self._fallback = torch.cuda.stream(self.stream)
            self._fallback.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._fallback is not None:
            fallback, self._fallback = self._fallback, None
            fallback.__exit__(*exc)
        else:
            torch.cuda.set_stream(self._prev)  # type: ignore[arg-type]
            self._prev = None


class _Exchange:
    """One all-reduce in flight: the work handle and the buffers it sums into."""

    __slots__ = ("buffers", "client", "free", "work")

    def __init__(self, client: DeviceCoordClient, buffers: _Buffers, free: list[_Buffers]) -> None:
        self.client = client
        self.buffers = buffers
        self.free = free
        side = client._side
        if side is None:
            self.work = dist.all_reduce(buffers.matrix, group=client.process_group, async_op=True)
            return
        with side:
            buffers.matrix.copy_(buffers.host, non_blocking=True)
            self.work = dist.all_reduce(buffers.matrix, group=client.process_group, async_op=True)

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def result(self, deadline: float, timeout: float) -> torch.Tensor:
        """The summed matrix on the host, the caller's to keep; `StepTimeout` (retryable) past
        `deadline`."""
        self._finish(deadline, timeout)
        return self.buffers.out

    def rows(self, deadline: float, timeout: float) -> list[list[int]]:
        """The summed matrix as lists; its buffers then serve a later round."""
        self._finish(deadline, timeout)
        buffers = self.buffers
        rows: list[list[int]] = buffers.out.tolist()
        buffers.clear()
        self.free.append(buffers)
        return rows

    def _finish(self, deadline: float, timeout: float) -> None:
        client = self.client
        side = client._side
        if side is None:
            self._wait(deadline, timeout)
            return
        with side:
            if client._poll_work:
                self._poll(deadline, timeout)
                self._join()
            else:
                self._wait(deadline, timeout)
            self.buffers.out.copy_(self.buffers.matrix)

    def _wait(self, deadline: float, timeout: float) -> None:
        remaining = max(deadline - time.monotonic(), 1e-3)
        try:
            self.work.wait(timeout=datetime.timedelta(seconds=remaining))
        except RuntimeError:
            if not self.work.is_completed():
                raise StepTimeout((), timeout) from None
            self._join()  # it failed, or completed just after the deadline

    def _poll(self, deadline: float, timeout: float) -> None:
        """NCCL's wait(timeout) sleeps in 1-10 ms steps; an event query costs microseconds."""
        spin_until = time.monotonic() + 0.002
        while not self.work.is_completed():
            now = time.monotonic()
            if now >= deadline:
                raise StepTimeout((), timeout)
            time.sleep(0 if now < spin_until else 0.0001)

    def _join(self) -> None:
        """The work is complete: make the stream wait on it, or raise the collective's error."""
        try:
            self.work.wait()
        except RuntimeError as exc:
            raise RankLost((), f"the device path's all-reduce failed: {exc}") from None


class DevicePendingStep:
    """A round this rank has reported for; `wait()` returns its decision or raises its error."""

    __slots__ = ("_client", "_exchange", "_outcome", "kind", "seq", "shared_seq")

    def __init__(
        self,
        client: DeviceCoordClient,
        seq: int,
        kind: StepKind,
        shared_seq: int,
        exchange: _Exchange,
    ) -> None:
        self._client = client
        self._exchange = exchange
        self._outcome: StepDecision | CoordError | None = None
        self.seq = seq
        self.kind = kind
        self.shared_seq = shared_seq

    def wait(self, timeout: float | None = None) -> StepDecision:
        """Block until the decision is known (at most `timeout`, default the client's)."""
        return self._client._wait(self, timeout)

    def done(self) -> bool:
        """True if `wait()` would return or raise without waiting on the collective."""
        return self._client._done(self)


class DeviceCoordClient(SessionView):
    """One DP rank's agreement over a torch.distributed process group the engine already has.

    Same surface as `CoordClient`: `connect`, `start` -> pending, `wait`, `coordinate`,
    `close`. `process_group=None` means the default group; the group's rank is the dp rank.
    Tensors live on `device`: CUDA for NCCL (default: the current CUDA device), else the CPU.
    On CUDA the exchange runs on a side stream, so it does not queue behind the engine's
    kernels, and the result is read with one device-to-host copy.
    """

    def __init__(
        self,
        *,
        config: ClientConfig | None = None,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        cuda_wait: str = "poll",
        **options: Any,
    ) -> None:
        """Settings as for `CoordClient` (keywords, `config=`, or both); only the group's and
        `wait_timeout` are read. `dp_rank` and `dp_size` default to the process group's."""
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "the device path needs an initialized torch.distributed process group "
                "(dist.init_process_group) or process_group="
            )
        rank = dist.get_rank(process_group)
        if rank < 0:
            raise ValueError("this process is not a member of process_group")
        dp_rank = options.pop("dp_rank", None)
        if dp_rank is None and config is not None:
            dp_rank = config.dp_rank
        if dp_rank is not None and dp_rank != rank:
            raise ValueError(f"dp_rank={dp_rank}, but this process is rank {rank} of the group")
        if cuda_wait not in ("poll", "work"):
            raise ValueError(f"cuda_wait must be 'poll' or 'work', got {cuda_wait!r}")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        if options.get("dp_size") is None:
            options.pop("dp_size", None)
            if config is None:
                options["dp_size"] = self.world_size
        self.config = ClientConfig.of(config, dp_rank=rank, **options)
        self.session = RankSession(self.config)
        backend = str(dist.get_backend(process_group))
        if device is None:
            on_cuda = backend == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else "cpu"
        self.device = torch.device(device)
        self._side = (
            _SideStream(torch.cuda.Stream(self.device)) if self.device.type == "cuda" else None
        )
        #: (width, dtype) -> the buffer sets no round holds now (see `_Buffers`).
        self._free: dict[tuple[int, torch.dtype], list[_Buffers]] = {}
        self._poll_work = backend == "nccl" and cuda_wait == "poll"
        self._fingerprint = fingerprint_hash(self.config.config_fingerprint)
        self._num_ubatches = self.config.num_ubatches
        self._hellos: list[Hello] = []
        self._shared_seq = 0
        self._failed_seq: int | None = None
        self._unresolved: collections.deque[DevicePendingStep] = collections.deque()
        self._handshake: _Exchange | None = None
        self._closed = False

    # -- public API ---------------------------------------------------------------------------

    def connect(self, timeout: float = 5.0) -> Welcome:
        """Exchange Hellos with every rank of the group (a collective: all ranks call it).

        Raises the `Rejected` coordd would give for the first rank (in rank order) whose Hello
        it would refuse, on every rank; `CoordinatorUnavailable` if not every rank joins within
        `timeout` (calling again keeps waiting for the same handshake).
        """
        if self._closed:
            raise CoordinatorUnavailable("the device-path client is closed")
        if self._handshake is None:
            row = encode_hello_row(self.session.hello_message)
            self._handshake = self._post(row, HELLO_BYTES, torch.uint8)
        try:
            matrix = self._handshake.result(time.monotonic() + timeout, timeout)
        except StepTimeout:
            raise CoordinatorUnavailable(
                f"not every rank of the process group joined the handshake within {timeout:g}s"
            ) from None
        except RankLost as exc:
            self._handshake = None
            raise CoordinatorUnavailable(exc.detail) from None
        self._handshake = None
        lengths = (matrix[:, 0].long() + matrix[:, 1].long() * 256).tolist()
        rows = [bytes(matrix[r, : 2 + n].tolist()) for r, n in enumerate(lengths)]
        hellos = decode_hellos(rows)
        rejected = admit(hellos)
        if rejected is not None:
            raise rejected
        for pending in self._unresolved:
            pending._outcome = CoordinatorUnavailable("superseded by connect()")
        self._unresolved.clear()
        next_seq = self._shared_seq if self._failed_seq is None else self._failed_seq + 1
        welcome = Welcome(epoch=DEVICE_EPOCH, next_seq=next_seq, dp_size=self.world_size)
        self.session.receive(welcome)
        self._hellos = hellos
        self._shared_seq = next_seq
        self._failed_seq = None
        return welcome

    def start(
        self, report: StepReport, kind: StepKind | str = StepKind.FORWARD
    ) -> DevicePendingStep:
        """Post this rank's report for the next round (one async all-reduce); returns at once."""
        if type(kind) is not StepKind:
            kind = StepKind(kind)
        check_fits(report)
        stamped = self.session.report(report, kind)
        row = encode_row(stamped, self._fingerprint, self._num_ubatches)
        exchange = self._post(row, NUM_FIELDS, torch.int64)
        pending = DevicePendingStep(self, stamped.seq, kind, self._shared_seq, exchange)
        self._shared_seq += 1
        self._unresolved.append(pending)
        return pending

    def coordinate(
        self,
        report: StepReport,
        kind: StepKind | str = StepKind.FORWARD,
        timeout: float | None = None,
    ) -> StepDecision:
        """start() and wait() in one call."""
        return self.start(report, kind).wait(timeout)

    def close(self) -> None:
        """Stop taking rounds; idempotent. The process group stays the engine's."""
        if self._closed:
            return
        self._closed = True
        if self.session.failed is None:
            self.session.fail(CoordinatorUnavailable("the device-path client is closed"))

    def __enter__(self) -> DeviceCoordClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _post(
        self, row: torch.Tensor | Sequence[int] | bytes, width: int, dtype: torch.dtype
    ) -> _Exchange:
        """A [world, width] matrix, zero but for `row` at this rank, summed across the group;
        its buffers are made once per width and reused (no tensor is made per round)."""
        free = self._free.get((width, dtype))
        if free is None:
            free = self._free[(width, dtype)] = []
        if free:
            buffers = free.pop()
        else:
            buffers = _Buffers(self.world_size, width, dtype, self.session.dp_rank, self.device)
        buffers.write(row.tolist() if isinstance(row, torch.Tensor) else row)
        return _Exchange(self, buffers, free)

    def _done(self, pending: DevicePendingStep) -> bool:
        if pending._outcome is not None or self.session.failed is not None:
            return True
        for earlier in self._unresolved:
            if earlier._outcome is None and not earlier._exchange.is_completed():
                return False
            if earlier is pending:
                break
        return True

    def _wait(self, pending: DevicePendingStep, timeout: float | None) -> StepDecision:
        timeout = self.wait_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        # Rounds resolve in order, so a failed round fails every later one, as on coordd.
        while pending._outcome is None and self._unresolved:
            self._resolve(self._unresolved[0], deadline, timeout)
            self._unresolved.popleft()
        outcome = pending._outcome
        if outcome is None:  # never started on this client, or superseded without a result
            raise CoordinatorUnavailable("this round is not pending on this client")
        if isinstance(outcome, CoordError):
            raise outcome
        return outcome

    def _resolve(self, pending: DevicePendingStep, deadline: float, timeout: float) -> None:
        if pending._outcome is not None:
            return
        if self.session.failed is not None:
            pending._outcome = self.session.failed
            return
        try:
            rows = pending._exchange.rows(deadline, timeout)
            pending._outcome = resolve_round(rows, seq=pending.shared_seq, hellos=self._hellos)
        except StepTimeout:
            raise  # the all-reduce is still in flight: waiting again may succeed
        except CoordError as error:
            pending._outcome = error
            self.session.fail(error)
            self._failed_seq = pending.shared_seq
