"""What every chaos process saw, one JSON line per event, so the checker can judge the whole run.

A rank writes a `Begin` line (with the exact reports it sends) before it sends, and an `End`
line (the decision, or the typed error with its type name and culprits) once the round is over,
so a rank that never hears back leaves a `Begin` without an `End`: a hang. Times are
`time.monotonic()`, one clock for every process on the machine. Reports and decisions are kept
as plain dicts (readable in the file) and turned back into wire Structs for the checker.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any, Union

import msgspec

from coordd.proto.errors import CoordError
from coordd.proto.messages import StepDecision, StepKind, StepReport


class ErrorInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A typed error as a rank saw it: enough to compare two ranks' views of one failure."""

    type: str
    reason: str
    culprits: list[int]
    text: str
    fields: dict[str, Any] = {}

    def signature(self) -> tuple[object, ...]:
        """What must be equal when two ranks got "the same" failure (free text left out)."""
        keep = ("expected_seq", "expected_kind", "got_seq", "got_kind", "seq", "field")
        return (
            self.type,
            self.reason,
            tuple(self.culprits),
            tuple((k, self.fields[k]) for k in keep if k in self.fields),
        )


def error_info(error: CoordError) -> ErrorInfo:
    ranks = getattr(error, "ranks", None)
    if ranks is None:
        rank = getattr(error, "rank", None)
        ranks = () if rank is None else (rank,)
    fields = {k: v for k, v in vars(error).items() if isinstance(v, (int, float, str, bool))}
    return ErrorInfo(
        type=type(error).__name__,
        reason=str(error.reason),
        culprits=sorted(ranks),
        text=str(error),
        fields=fields,
    )


class Registered(msgspec.Struct, tag="registered", frozen=True, kw_only=True):
    t: float
    epoch: int
    next_seq: int


class Refused(msgspec.Struct, tag="refused", frozen=True, kw_only=True):
    """coordd turned this process away (a Reject, or an error for a stray message)."""

    t: float
    error: ErrorInfo
    what: str = ""


class Begin(msgspec.Struct, tag="begin", frozen=True, kw_only=True):
    t: float
    epoch: int
    seq: int
    kind: str
    sent: list[dict[str, Any]]


class End(msgspec.Struct, tag="end", frozen=True, kw_only=True):
    t: float
    epoch: int
    seq: int
    decision: dict[str, Any] | None = None
    error: ErrorInfo | None = None
    #: The rank gave up waiting on its own (coordd never answered): a hang.
    no_answer: bool = False


class Inject(msgspec.Struct, tag="inject", frozen=True, kw_only=True):
    """The moment a fault was injected (by a misbehaving process, or by the runner)."""

    t: float
    fault: str
    detail: str = ""
    rank: int = -1
    pid: int = 0


class Note(msgspec.Struct, tag="note", frozen=True, kw_only=True):
    """Anything else worth keeping: a frame sent by the rogue, a process exit, a resume."""

    t: float
    what: str
    detail: str = ""
    count: int = 0
    pid: int = 0


class Done(msgspec.Struct, tag="done", frozen=True, kw_only=True):
    t: float
    next_seq: int
    reason: str = "end"


Record = Union[Registered, Refused, Begin, End, Inject, Note, Done]


class Header(msgspec.Struct, tag="header", frozen=True, kw_only=True):
    """The first line of a process's log: who it is."""

    t: float
    role: str
    rank: int
    pid: int
    name: str


_encoder = msgspec.json.Encoder()
_decoder: msgspec.json.Decoder[Union[Header, Record]] = msgspec.json.Decoder(Union[Header, Record])


class HistoryWriter:
    """Append records to a JSON-lines file, each line written and flushed whole."""

    def __init__(self, path: str, *, role: str, rank: int, name: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.write(Header(t=time.monotonic(), role=role, rank=rank, pid=os.getpid(), name=name))

    def write(self, record: Header | Record) -> None:
        os.write(self._fd, _encoder.encode(record) + b"\n")

    def close(self) -> None:
        os.close(self._fd)


def read_history(path: str) -> tuple[Header | None, list[Record]]:
    """Read a log; a torn last line (the process was killed mid-write) is left out."""
    header: Header | None = None
    records: list[Record] = []
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                item = _decoder.decode(line)
            except msgspec.DecodeError:
                continue
            if isinstance(item, Header):
                header = item
            else:
                records.append(item)
    return header, records


def tail_records(path: str, offset: int) -> tuple[list[Record], int]:
    """Records appended since `offset` (whole lines only), and the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    out: list[Record] = []
    for line in data[:end].splitlines():
        item = _decoder.decode(line)
        if not isinstance(item, Header):
            out.append(item)
    return out, offset + end


def wait_for_round(path: str, seq: int, deadline: float) -> bool:
    """Poll the log at `path` until it shows round `seq` begun (or its process done)."""
    offset = 0
    while time.monotonic() < deadline:
        records, offset = tail_records(path, offset)
        if any((isinstance(r, Begin) and r.seq >= seq) or isinstance(r, Done) for r in records):
            return True
        time.sleep(0.002)
    return False


def report_dict(report: StepReport) -> dict[str, Any]:
    return msgspec.to_builtins(msgspec.structs.asdict(report))


def decision_dict(decision: StepDecision) -> dict[str, Any]:
    return msgspec.to_builtins(msgspec.structs.asdict(decision))


def report_of(d: dict[str, Any]) -> StepReport:
    return StepReport(**{**d, "kind": StepKind(d["kind"])})


def decision_of(d: dict[str, Any]) -> StepDecision:
    return StepDecision(**{**d, "kind": StepKind(d["kind"])})


def iter_logs(directory: str) -> Iterator[str]:
    for name in sorted(os.listdir(directory)):
        if name.endswith(".jsonl"):
            yield os.path.join(directory, name)
