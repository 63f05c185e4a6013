"""The one flat error hierarchy that both paths (coordd and device) raise.

Every error carries the data a caller needs to act on it (which rank, what was expected,
what came), so engine code never parses a message string. Each docstring says who is at fault;
`hint` says what to do next and is shown under the message in a traceback (a note).

A round's error travels to every rank as one `StepFailed`: each class below declares its
`reason` and the fields it fills (`wire_fields`) and reads back (`from_wire`), and
`coordd.proto.messages.WIRE_ERRORS` keys the classes by reason. `Rejected` travels as a
`Reject` instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from typing import Self


class WireFailure(Protocol):
    """The fields of a `coordd.proto.messages.StepFailed` that `from_wire` reads (named here,
    so that this module and the messages do not import each other)."""

    @property
    def culprits(self) -> Sequence[int]: ...
    @property
    def detail(self) -> str: ...
    @property
    def expected(self) -> str: ...
    @property
    def expected_kind(self) -> str: ...
    @property
    def expected_seq(self) -> int: ...
    @property
    def field(self) -> str: ...
    @property
    def got_kind(self) -> str: ...
    @property
    def got_seq(self) -> int: ...
    @property
    def timeout(self) -> float: ...
    @property
    def value(self) -> str: ...


#: After a failed round, the group stays failed (every later report gets the same error) until
#: the ranks reconnect; most hints end with this step.
_NEW_EPOCH = "call connect() on every rank to open a new epoch"


class CoordError(Exception):
    """Base of every coordd error: catch it to handle any failed registration or round."""

    #: The wire reason code (a `FailReason` value; `Rejected`: a `RejectReason` value).
    reason: str = "error"
    #: What to do next, in one sentence.
    hint: str = ""
    #: A `StepFailed` for this error must name a culprit rank (`from_wire` reads it).
    names_a_rank: ClassVar[bool] = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        if self.hint:
            self.add_note(f"hint: {self.hint}")

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and _fields(self) == _fields(other)

    def __hash__(self) -> int:
        return hash((type(self), str(self)))

    def wire_fields(self) -> dict[str, Any]:
        """The `StepFailed` fields that carry this error, besides epoch/seq/kind/reason/text."""
        raise TypeError(f"{type(self).__name__} does not travel in a StepFailed")

    @classmethod
    def from_wire(cls, msg: WireFailure) -> Self:
        """The error back from the `StepFailed` fields that `wire_fields` filled."""
        raise TypeError(f"{cls.__name__} does not travel in a StepFailed")


def _fields(error: CoordError) -> dict[str, object]:
    return {k: v for k, v in vars(error).items() if k not in ("__notes__", "hint")}


def _ranks(ranks: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted(set(ranks)))


#: What to do next for each `RejectReason` value.
REJECT_HINTS = {
    "version": "run the same coordd release on the ranks and the sidecar",
    "dp_size": (
        "check the rank's --data-parallel-size: at most coordd's --dp, and the group's size "
        "while any of its ranks stays connected"
    ),
    "rank_range": "check the rank's --data-parallel-rank: it must be in 0..dp_size-1",
    "rank_taken": (
        "another live process holds this dp_rank: stop it (coordd drops it once its "
        "connection closes) or fix this rank's --data-parallel-rank"
    ),
    "group": (
        "give every rank of one DP group the same group name (1-64 printable characters, no "
        "whitespace); one client belongs to one group: use another client for another group"
    ),
    "num_ubatches": (
        "give every rank the same micro-batching settings (vLLM: enable_dbo, ubatch_size)"
    ),
    "fingerprint": "deploy the same engine config to every rank (the config fingerprints differ)",
    "curve_key": (
        "coordd binds this CURVE key to other ranks (--curve-client-keys N=PATH, or a key file "
        "named rank<N>.key): give this rank its own key (COORDD_CURVE_CLIENT_KEY) or fix its "
        "--data-parallel-rank"
    ),
    "routing_id": (
        "set the connection's routing id (ZMQ_ROUTING_ID) to a random value that does not "
        "start with a zero byte (coordd's client uses 16 random bytes as URL-safe text)"
    ),
    "group_unexpected": (
        "coordd admits only the groups its deployment expects (--groups / COORDD_GROUPS: names "
        "or fnmatch patterns, by default vLLM's dp-tp*-pp*, enginecore and the client's "
        "default): add this group's name there, or fix the rank's group name"
    ),
    "not_root": (
        "the coordd at the relay's --relay-to address takes no relays: start that root with "
        "--relay-root (COORDD_RELAY_ROOT=1), or point --relay-to at the root"
    ),
    "group_limit": (
        "coordd serves at most --max-groups groups (COORDD_MAX_GROUPS): raise it, or find "
        "what registers so many group names (vLLM: one per TP/PP position, plus the engine cores)"
    ),
}


class Rejected(CoordError):
    """coordd (or the device path's handshake) refused this rank's `Hello`.

    At fault: this rank's settings, which disagree with coordd's or with the ranks already in.
    `reason` is a `RejectReason` value, `expected`/`got` the values; `hint` says which setting
    to check. Fix it and call connect() again.
    """

    def __init__(self, reason: str, detail: str, *, expected: str = "", got: str = "") -> None:
        self.reason = reason
        self.detail = detail
        self.expected = expected
        self.got = got
        self.hint = REJECT_HINTS.get(reason, "")
        super().__init__(f"registration rejected ({reason}): {detail}")


class StepMismatch(CoordError):
    """Rank `rank` reported another seq or kind than the round expects.

    At fault: that rank's engine loop, which skipped, repeated or reordered a sync (every rank
    must run the same syncs in the same order). Fix the rank's sync order, then call connect()
    on every rank to open a new epoch.
    """

    reason = "mismatch"
    hint = f"make every rank run the same syncs in the same order, then {_NEW_EPOCH}"
    names_a_rank = True

    def __init__(
        self, rank: int, expected_seq: int, expected_kind: str, got_seq: int, got_kind: str
    ) -> None:
        self.rank = rank
        self.expected_seq = expected_seq
        self.expected_kind = expected_kind
        self.got_seq = got_seq
        self.got_kind = got_kind
        super().__init__(
            f"rank {rank} reported seq={got_seq} kind={got_kind}, "
            f"the round expects seq={expected_seq} kind={expected_kind}"
        )

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.rank,)

    def wire_fields(self) -> dict[str, Any]:
        return dict(
            culprits=[self.rank],
            expected_seq=self.expected_seq,
            expected_kind=self.expected_kind,
            got_seq=self.got_seq,
            got_kind=self.got_kind,
        )

    @classmethod
    def from_wire(cls, msg: WireFailure) -> Self:
        return cls(msg.culprits[0], msg.expected_seq, msg.expected_kind, msg.got_seq, msg.got_kind)


class ConflictingReport(CoordError):
    """Rank `rank` sent two different reports for round `seq`.

    At fault: that rank's engine, which changed a report it had sent (a retry with new values,
    or one client shared by two threads). Send one report per rank per round, then call
    connect() on every rank to open a new epoch.
    """

    reason = "conflict"
    hint = f"send one report per rank per round (one client per rank), then {_NEW_EPOCH}"
    names_a_rank = True

    def __init__(self, rank: int, seq: int) -> None:
        self.rank = rank
        self.seq = seq
        super().__init__(f"rank {rank} sent two different reports for seq={seq}")

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.rank,)

    def wire_fields(self) -> dict[str, Any]:
        return dict(culprits=[self.rank], got_seq=self.seq)

    @classmethod
    def from_wire(cls, msg: WireFailure) -> Self:
        return cls(msg.culprits[0], msg.got_seq)


class InvalidReport(CoordError):
    """Rank `rank` reported `field`=`value`, outside the range `expected` states.

    At fault: that rank's engine code, which computed the value (the vLLM adapter raises this
    before sending when vLLM's arguments are out of range). Fix the value; if a round failed
    for it, call connect() on every rank to open a new epoch.
    """

    reason = "invalid"
    hint = f"fix the value the rank reports (see `expected`); after a failed round, {_NEW_EPOCH}"
    names_a_rank = True

    def __init__(self, rank: int, field: str, value: object, expected: str) -> None:
        self.rank = rank
        self.field = field
        self.value = value
        self.expected = expected
        super().__init__(f"rank {rank}: invalid {field}={value!r} (expected {expected})")

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.rank,)

    def wire_fields(self) -> dict[str, Any]:
        return dict(
            culprits=[self.rank], field=self.field, value=repr(self.value), expected=self.expected
        )

    @classmethod
    def from_wire(cls, msg: WireFailure) -> Self:
        return cls(msg.culprits[0], msg.field, _literal(msg.value), msg.expected)


def _literal(text: str) -> object:
    """Undo the repr() of an invalid report value (ints and bools only ever travel)."""
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        return text


class RankLost(CoordError):
    """Ranks `ranks` are gone: their connection closed, or they missed heartbeats for coordd's
    --heartbeat-timeout (`detail` says which, or that a rank left with Goodbye).

    At fault: those ranks (the process died or hung, or its network was cut), not the ranks
    that get this error. Restart them (their own logs say why they stopped), then call
    connect() on every rank to open a new epoch once they are back. With coordd
    --on-rank-loss neutralize the others go on without them instead.
    """

    reason = "lost"
    hint = f"restart the lost rank(s), then {_NEW_EPOCH} once they are back"

    def __init__(self, ranks: Iterable[int], detail: str = "") -> None:
        self.ranks = _ranks(ranks)
        self.detail = detail
        super().__init__(f"rank(s) {list(self.ranks)} lost" + (f": {detail}" if detail else ""))

    def wire_fields(self) -> dict[str, Any]:
        return dict(culprits=list(self.ranks), detail=self.detail)

    @classmethod
    def from_wire(cls, msg: WireFailure) -> Self:
        return cls(msg.culprits, msg.detail)


#: The hint of a `StepTimeout` that names no rank: the waiting client's own timeout ran out
#: (or, on the device path, a rank did not join the collective).
NO_RANK_TIMEOUT_HINT = (
    "this rank's wait ran out before coordd decided: coordd names the late ranks only after its "
    "--step-timeout, so give wait() a timeout longer than that (the default, wait(), does) or "
    "look in coordd's log and `coordd status` for them; on the device path, a rank did not "
    "join the round"
)


class StepTimeout(CoordError):
    """The round was not complete within `timeout` seconds (coordd's --step-timeout).

    At fault: `ranks`, which had not reported (a slow or stuck engine step; empty if coordd
    itself decided nothing in time). Find why they are late, or raise --step-timeout, then call
    connect() on every rank to open a new epoch.
    """

    reason = "timeout"
    hint = f"find why the named ranks are late or raise coordd's --step-timeout, then {_NEW_EPOCH}"

    def __init__(self, ranks: Iterable[int], timeout: float) -> None:
        self.ranks = _ranks(ranks)
        self.timeout = timeout
        if not self.ranks:
            self.hint = NO_RANK_TIMEOUT_HINT
        who = f"rank(s) {list(self.ranks)} did not report" if self.ranks else "no decision"
        super().__init__(f"{who} within {timeout:g}s")

    def wire_fields(self) -> dict[str, Any]:
        return dict(culprits=list(self.ranks), timeout=self.timeout)

    @classmethod
    def from_wire(cls, msg: WireFailure) -> Self:
        return cls(msg.culprits, msg.timeout)


#: `CoordinatorUnavailable` hints for causes that "check that coordd runs" does not fix.
UNAVAILABLE_HINTS = {
    "address": (
        "write the address as coordd's --bind is written: ipc:///path/to/coordd.sock or "
        "tcp://host:port (IPv6: tcp://[::1]:port)"
    ),
    "runtime_dir": (
        "make the runtime directory one of this user's own (not a symlink), or set "
        "COORDD_ADDRESS to the address coordd binds"
    ),
    "closed": "this client was closed: make a new one (a closed client does not reopen)",
    "superseded": "start the round again: connect() ended every round started before it",
    "goodbye": "coordd was stopped: start it again (or wait for its restart), then connect()",
}
#: The hints of the client's fixed details (`client.sync`'s "client closed",
#: `client.session.SUPERSEDED`; tests/unit/test_messages.py holds them to those constants).
_DETAIL_HINTS = {
    "client closed": UNAVAILABLE_HINTS["closed"],
    "superseded by connect()": UNAVAILABLE_HINTS["superseded"],
}


class CoordinatorUnavailable(CoordError):
    """coordd cannot be reached, shut down, or restarted (its new epoch ends the old rounds).

    At fault: coordd or the network between it and this rank, not the ranks. Check that coordd
    runs at the address the client uses (COORDD_ADDRESS) and is reachable, then call connect()
    again.
    """

    reason = "unavailable"
    hint = "check that coordd is running and reachable at the client's address, then connect()"

    def __init__(self, detail: str, *, hint: str = "") -> None:
        """`hint`: what to do about this cause, where the raiser knows better than the class's
        (a malformed address, a refused key: no point checking that coordd runs)."""
        self.detail = detail
        hint = hint or _DETAIL_HINTS.get(detail, "")
        if hint:
            self.hint = hint
        super().__init__(detail)

    def wire_fields(self) -> dict[str, Any]:
        return dict(culprits=[], detail=self.detail)

    @classmethod
    def from_wire(cls, msg: WireFailure) -> Self:
        return cls(msg.detail)


class ProtocolError(CoordError):
    """Bytes or messages that break the protocol: undecodable, unregistered, spoofed.

    At fault: the peer that sent them (rank `rank` if known): a different coordd release, a
    foreign or buggy client, or a damaged frame. Run the same coordd release everywhere; if
    they match, it is a bug in coordd or the client: report it with this message.
    """

    reason = "protocol"
    hint = "run the same coordd release on the ranks and the sidecar; if they match, report a bug"

    def __init__(self, detail: str, *, rank: int | None = None) -> None:
        self.detail = detail
        self.rank = rank
        super().__init__(detail if rank is None else f"rank {rank}: {detail}")

    def wire_fields(self) -> dict[str, Any]:
        return dict(culprits=[] if self.rank is None else [self.rank], detail=self.detail)

    @classmethod
    def from_wire(cls, msg: WireFailure) -> Self:
        return cls(msg.detail, rank=msg.culprits[0] if msg.culprits else None)


class InvalidAnswer(ProtocolError):
    """coordd answered round `seq` with `field`=`value`, which does not fit the round this rank
    asked (`expected` says what would): another seq, epoch, kind or site; a list of another
    length than dp; a value out of range; an answer for a round this rank had not reported.

    At fault: coordd (or whatever speaks to this rank as coordd), never the ranks: the answer
    was not built from this round's reports, so no part of it is used. The client checks it
    before handing it over; the group fails with this error until connect() (it never travels:
    a rank raises it). Run the same coordd release on the ranks and the sidecar; if they match,
    report a bug in coordd with this message.
    """

    hint = (
        "coordd sent an answer that does not fit the round: run the same coordd release on the "
        "ranks and the sidecar; if they match, report a coordd bug with this message"
    )
    #: Who is at fault: always coordd.
    at_fault = "coordd"

    def __init__(self, seq: int, field: str, value: object, expected: str) -> None:
        self.seq = seq
        self.field = field
        self.value = value
        self.expected = expected
        super().__init__(
            f"coordd answered round seq={seq} with {field}={value!r} (expected {expected})"
        )


__all__ = [
    "REJECT_HINTS",
    "ConflictingReport",
    "CoordError",
    "CoordinatorUnavailable",
    "InvalidAnswer",
    "InvalidReport",
    "ProtocolError",
    "RankLost",
    "Rejected",
    "StepMismatch",
    "StepTimeout",
]
