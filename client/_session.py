"""The rank's side of the protocol, sans-IO: what to send, and what a received message means.

Both clients (blocking and asyncio), the device path and the raw test peer are shells over
this, so they cannot disagree about epochs, sequence numbers, which round an answer resolves,
or which failures end the group. No sockets and no clocks here: a shell feeds in the frames
it read and the disconnects it saw, and asks for each round's outcome.

The rules, the same for every shell:
- A group failure (a `StepFailed` for this epoch, coordd's `Goodbye`, a dropped connection
  while registered) fails every round not yet answered, and every later `start` and wait,
  with that one typed error until `connect()` registers again.
- An answer that came before the failure is still its round's: a shell reads every queued
  frame before it reports a disconnect, and `outcome` gives a round's own answer first.
- `connect()` opens a new registration: rounds of the old one that are still unanswered get
  `CoordinatorUnavailable("superseded by connect()")`, and their uncollected answers are
  dropped. Until the `Welcome`, a disconnect means nothing here (the shell sends the same
  `Hello` again over a new connection, in the same registration: `coordd.client._registration`);
  a refused or unanswered `Hello` fails the session with its error.
- Every answer is checked against the round this rank asked (`InvalidAnswer` says what did not
  fit): its epoch and seq; a decision against the report this rank sent
  (`coordd.proto.policy.decision_misfit`: its kind, `num_tokens_across_dp` of length dp with
  this rank's own count, counts in range, `cudagraph_mode` no higher than this rank's, this rank
  not in `dead_ranks`, the idle, unfinished, micro-batch and pause flags consistent with its
  own); a gather's site, its dp rows of the length this rank sent, this rank's own row as
  sent (`gather_misfit`). A misfit, or a decision for a round this rank has not reported yet,
  fails the group with that `InvalidAnswer` (coordd is at fault): none of it is used. An
  answer for no round this rank asked (an older epoch's, a round already answered, one of a
  past registration) is dropped and counted (`dropped_answers`), never kept.
"""

# Whole though over 500 lines: the session's rules (registration, seqs, answers, fail-stop)
# all read and write one state; split, each part would reach into the others'.

from __future__ import annotations

import operator
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import msgspec

from coordd.client._config import ClientConfig, default_wait_timeout
from coordd.proto.errors import (
    UNAVAILABLE_HINTS,
    CoordError,
    CoordinatorUnavailable,
    InvalidAnswer,
    InvalidReport,
    ProtocolError,
    Rejected,
)
from coordd.proto.messages import (
    INT64_MAX,
    INT64_MIN,
    MAX_GATHER_VALUES,
    MAX_MESSAGE_BYTES,
    FailReason,
    FromCoordinator,
    GatherReport,
    GatherResult,
    Goodbye,
    Heartbeat,
    Hello,
    Reject,
    StepDecision,
    StepFailed,
    StepKind,
    StepReport,
    Welcome,
    error_from_failure,
    error_from_reject,
)
from coordd.proto.policy import check_carriable, decision_misfit, gather_misfit

_replace = msgspec.structs.replace
_decode_from_coordinator = msgspec.msgpack.Decoder(FromCoordinator).decode
#: Read once: an enum member read through its class is a lookup on every round.
_GATHER = StepKind.GATHER

#: A round's outcome as a wait finds it: its decision or gathered rows, or its error.
Outcome = StepDecision | GatherResult | CoordError
#: Longest call-site label a `GatherReport` carries.
MAX_SITE_CHARS = 256
#: Rounds one registration keeps asked (reported, not yet answered): at twice this many, all but
#: the newest MAX_ASKED are forgotten (their answers then count as unsolicited). A shell has one
#: open at a time; this bounds a session driven without collecting its answers (the lean
#: benchmark's ranks, the device path) at a cost per report of one len().
MAX_ASKED = 64
_TRIM_ASKED_AT = 2 * MAX_ASKED
#: The highest `cudagraph_mode` (NONE=0, PIECEWISE=1, FULL=2).
MAX_CUDAGRAPH_MODE = 2
#: What a round asked for: the report this rank sent (a decision is checked against it).
Asked = StepReport | GatherReport


@dataclass(frozen=True)
class Registered:
    welcome: Welcome


@dataclass(frozen=True)
class RegistrationFailed:
    error: Rejected


@dataclass(slots=True)
class Resolved:
    """One round's own answer: a decision, or an error for this rank's report alone (a plain
    slots class, made once per round: it builds faster than a frozen one)."""

    seq: int
    outcome: Outcome


@dataclass(frozen=True)
class GroupFailed:
    """Every unanswered and later round fails with `error` until the rank registers again."""

    error: CoordError


@dataclass(frozen=True)
class Pong:
    nonce: int


Event = Registered | RegistrationFailed | Resolved | GroupFailed | Pong

SUPERSEDED = "superseded by connect()"


class RoundStillOpen(RuntimeError):
    """`start()` (or `start_gather()`) while this client's previous round is unanswered.

    Rounds are not pipelined: coordd runs one round at a time per group, and a rank's report
    for the next round that reaches coordd before another rank's report for this one fails the
    group with `StepMismatch`. A programming error in the engine's loop, not a coordd failure
    (so not a `CoordError`): wait() for the previous round first."""

    def __init__(self, rank: int, seq: int) -> None:
        self.rank = rank
        self.seq = seq
        super().__init__(
            f"rank {rank}: start() while round seq={seq} is still unanswered: wait() for it "
            "first (coordd runs one round at a time; rounds are not pipelined)"
        )


def new_incarnation() -> str:
    return f"{os.getpid()}-{secrets.token_hex(4)}"


class RankSession:
    """One rank's registration, sequence counter, answered rounds and fail-stop state."""

    def __init__(self, config: ClientConfig | None = None, **options: Any) -> None:
        config = ClientConfig.of(config, **options)
        self.config = config
        self.dp_rank = config.dp_rank
        self.dp_size = config.dp_size
        self.hello_message = Hello(
            dp_size=config.dp_size,
            dp_rank=config.dp_rank,
            config_fingerprint=config.config_fingerprint,
            incarnation=config.incarnation or new_incarnation(),
            group=config.group,
            num_ubatches=config.num_ubatches,
        )
        self.epoch: int | None = None
        self.next_seq = 0
        self.failed: CoordError | None = None
        self.registering = False
        #: The latest registration's `Welcome` (None before the first).
        self.welcome: Welcome | None = None
        #: How many times `connect()` began; a round belongs to the registration it started in.
        self.registration = 0
        #: Each answered round's first uncollected answer, and (rarely: a duplicate report's
        #: error) the ones after it.
        self._answers: dict[int, Outcome] = {}
        self._later: dict[int, list[Outcome]] = {}
        #: The rounds of this registration reported and not yet answered, by seq; and how many
        #: more reports than one a seq had (a test peer's duplicates, each answered).
        self._asked: dict[int, Asked] = {}
        self._asked_again: dict[int, int] = {}
        #: Answers dropped because no round this rank asked was waiting for them.
        self.dropped_answers = 0
        self._identity: bytes | None = None

    @property
    def identity(self) -> bytes:
        """The ZeroMQ routing id of this client's connection: 128 random bits, not derived from
        the rank or the incarnation, never shown by coordd (with ROUTER_HANDOVER off, coordd
        drops a second connection that presents it while this one lives; see coordd.io._identity).
        Made once per session: a client keeps its one DEALER across connect()."""
        if self._identity is None:
            self._identity = secrets.token_urlsafe(16).encode("ascii")
        return self._identity

    def new_identity(self) -> bytes:
        """A fresh routing id, for a new connection after the old one dropped."""
        self._identity = None
        return self.identity

    # -- what to send ---------------------------------------------------------------------------

    def hello(self) -> Hello:
        """Begin a registration (see the module's rules); returns the `Hello` to send."""
        self.registering = True
        self.registration += 1
        self._answers.clear()
        self._later.clear()
        self._asked.clear()
        self._asked_again.clear()
        return self.hello_message

    def report(self, report: StepReport, kind: StepKind, waited_us: int = -1) -> StepReport:
        """Stamp `report` with this rank's envelope and take the next seq; raises
        `InvalidReport` (naming this rank, the field, its value and the range; nothing sent,
        no seq taken) for what the wire cannot carry (`check_carriable`: a float, a value past
        int64, a flag that is not a bool). A value the wire carries but the policy refuses
        (2**31 tokens) is sent: coordd (or the device path) fails the round for every rank
        with the same `InvalidReport` naming this one, so no rank waits for it in vain.
        `waited_us`: how long this rank's wait for its previous round blocked (-1: none)."""
        if kind is _GATHER:
            raise InvalidReport(
                self.dp_rank, "kind", kind.value, "forward, draft or state (gather: start_gather)"
            )
        if self.failed is not None:
            raise self.failed
        epoch = self.epoch
        if epoch is None:
            raise ProtocolError("not registered: call connect() first", rank=self.dp_rank)
        # `check_carriable` on the fields the stamp keeps, before it: its common case (exact
        # ints in int64, bools) written out, a call less on every report; anything else goes
        # to the rule itself (tests/unit/test_answer_checks.py pins the two together)
        tokens, padded, mode = report.num_tokens, report.num_tokens_padded, report.cudagraph_mode
        if not (
            type(tokens) is int
            and type(padded) is int
            and type(mode) is int
            and INT64_MIN <= tokens <= INT64_MAX
            and INT64_MIN <= padded <= INT64_MAX
            and INT64_MIN <= mode <= INT64_MAX
            and type(report.want_ubatch) is bool
            and type(report.has_unfinished) is bool
            and type(report.want_pause) is bool
        ):
            check_carriable(self.dp_rank, report)
        seq = self.next_seq
        stamped = _replace(
            report, dp_rank=self.dp_rank, epoch=epoch, seq=seq, kind=kind, waited_us=waited_us
        )
        self.next_seq = seq + 1
        asked = self._asked
        asked[seq] = stamped
        if len(asked) >= _TRIM_ASKED_AT:
            self._forget_oldest()
        return stamped

    def gather(self, site: str, values: Sequence[int], waited_us: int = -1) -> GatherReport:
        """This rank's `GatherReport` for the next seq, stamped, and take the seq; raises
        `InvalidReport` (taking nothing) for what the wire cannot carry. `waited_us`: as
        `report`'s."""
        # `gather_report`, `stamp` and `sent` written out (the same checks in the same order,
        # the same errors): the vLLM plugin's every sync comes this way
        if self.failed is not None:
            raise self.failed
        try:
            ints = list(map(operator.index, values))
        except TypeError as exc:
            raise InvalidReport(self.dp_rank, "values", values, f"integers ({exc})") from None
        if len(ints) > MAX_GATHER_VALUES:
            raise InvalidReport(
                self.dp_rank, "values", len(ints), f"at most {MAX_GATHER_VALUES} values"
            )
        if ints and (min(ints) < INT64_MIN or max(ints) > INT64_MAX):
            raise InvalidReport(self.dp_rank, "values", ints, "int64 values")
        if len(site) > MAX_SITE_CHARS:
            raise InvalidReport(self.dp_rank, "site", site, f"at most {MAX_SITE_CHARS} characters")
        epoch = self.epoch
        if epoch is None:
            raise ProtocolError("not registered: call connect() first", rank=self.dp_rank)
        seq = self.next_seq
        stamped = GatherReport(
            site=site,
            values=ints,
            dp_rank=self.dp_rank,
            epoch=epoch,
            seq=seq,
            waited_us=waited_us if waited_us >= 0 else -1,
        )
        self.next_seq = seq + 1
        asked = self._asked
        if seq in asked:  # a seq sent twice (a test peer's): answered twice
            self.sent(stamped)
        else:
            asked[seq] = stamped
            if len(asked) >= _TRIM_ASKED_AT:
                self._forget_oldest()
        return stamped

    def sent(self, report: StepReport | GatherReport) -> None:
        """`report` went to coordd: its answer is expected (`report` and `gather` call this; a
        test peer that sends what `stamp` made calls it itself). A seq sent twice is answered
        twice."""
        seq = report.seq
        asked = self._asked
        if seq in asked:
            self._asked_again[seq] = self._asked_again.get(seq, 0) + 1
            return
        asked[seq] = report
        if len(asked) >= _TRIM_ASKED_AT:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        """Keep the newest MAX_ASKED asks (insertion order: the newest are last)."""
        asked = self._asked
        for seq in list(asked)[:-MAX_ASKED]:
            del asked[seq]
            self._asked_again.pop(seq, None)

    def gather_report(self, site: str, values: Sequence[int]) -> GatherReport:
        """An unstamped `GatherReport`: `values` as plain ints (anything with `__index__`:
        numpy or 0-d torch integers), checked against the wire's limits."""
        if self.failed is not None:
            raise self.failed
        try:
            ints = list(map(operator.index, values))
        except TypeError as exc:
            raise InvalidReport(self.dp_rank, "values", values, f"integers ({exc})") from None
        if len(ints) > MAX_GATHER_VALUES:
            raise InvalidReport(
                self.dp_rank, "values", len(ints), f"at most {MAX_GATHER_VALUES} values"
            )
        if ints and (min(ints) < INT64_MIN or max(ints) > INT64_MAX):
            raise InvalidReport(self.dp_rank, "values", ints, "int64 values")
        if len(site) > MAX_SITE_CHARS:
            raise InvalidReport(self.dp_rank, "site", site, f"at most {MAX_SITE_CHARS} characters")
        return GatherReport(site=site, values=ints)

    @overload
    def stamp(
        self,
        report: StepReport,
        kind: StepKind,
        *,
        seq: int | None = None,
        dp_rank: int | None = None,
    ) -> StepReport: ...

    @overload
    def stamp(
        self,
        report: GatherReport,
        kind: StepKind,
        *,
        seq: int | None = None,
        dp_rank: int | None = None,
    ) -> GatherReport: ...

    def stamp(
        self,
        report: StepReport | GatherReport,
        kind: StepKind,
        *,
        seq: int | None = None,
        dp_rank: int | None = None,
    ) -> StepReport | GatherReport:
        """`report` in this rank's envelope for the next seq, which is not taken; `seq` and
        `dp_rank` replace what a proper rank would put (a test peer's faults). A
        `GatherReport` is a gather round's whatever `kind` says (it has no kind field)."""
        if self.failed is not None:
            raise self.failed
        if self.epoch is None:
            raise ProtocolError("not registered: call connect() first", rank=self.dp_rank)
        dp_rank = self.dp_rank if dp_rank is None else dp_rank
        seq = self.next_seq if seq is None else seq
        if type(report) is GatherReport:
            return msgspec.structs.replace(report, dp_rank=dp_rank, epoch=self.epoch, seq=seq)
        return msgspec.structs.replace(
            report, dp_rank=dp_rank, epoch=self.epoch, seq=seq, kind=kind
        )

    # -- what came ------------------------------------------------------------------------------

    def receive_frame(self, frame: bytes) -> Event | None:
        """`receive` for raw bytes; a frame that does not decode is dropped."""
        # decode_from_coordinator's checks without its two Python frames: every round's
        # answer comes this way
        if len(frame) > MAX_MESSAGE_BYTES:
            return None
        try:
            msg = _decode_from_coordinator(frame)
        except msgspec.DecodeError:
            return None
        if type(msg) is StepDecision:  # `receive`'s first case
            seq = msg.seq
            if msg.epoch == self.epoch and not self.registering and not self._asked_again:
                # `_decided` for a decision that answers a report asked, written out: every
                # round's answer comes this way in the asyncio client
                asked = self._asked.get(seq)
                if type(asked) is StepReport:
                    del self._asked[seq]
                    error = decision_misfit(msg, asked, self.dp_rank, self.dp_size)
                    if error is not None:
                        return self._unfit(error)
                    answers = self._answers
                    if seq not in answers:
                        answers[seq] = msg
                    else:
                        self._later.setdefault(seq, []).append(msg)
                    return Resolved(seq, msg)
            return self._decided(msg)
        if type(msg) is GatherResult:
            return self._decided(msg)
        return self.receive(msg)

    def take_frame(self, frame: bytes, seq: int) -> StepDecision | GatherResult | Event | None:
        """`receive_frame`, for a shell that waits for round `seq` and has found `outcome`
        empty for it: that round's own answer comes back, as `outcome` would have given it,
        without being kept (the common case, made cheap); anything else is received as
        `receive_frame` does and its event comes back."""
        if len(frame) > MAX_MESSAGE_BYTES:
            return None
        try:
            msg = _decode_from_coordinator(frame)
        except msgspec.DecodeError:
            return None
        if type(msg) is StepDecision or type(msg) is GatherResult:
            if msg.seq == seq and seq not in self._answers:
                if msg.epoch == self.epoch and not self.registering and not self._asked_again:
                    # `_judged` for an answer of the kind of the report asked, written out:
                    # every round's answer comes this way (a step's decision, a gather's rows)
                    asked = self._asked.get(seq)
                    if type(msg) is StepDecision:
                        if type(asked) is StepReport:
                            del self._asked[seq]
                            error = decision_misfit(msg, asked, self.dp_rank, self.dp_size)
                            return msg if error is None else self._unfit(error)
                    elif type(asked) is GatherReport:  # and `msg` a GatherResult
                        del self._asked[seq]
                        error = gather_misfit(
                            msg,  # type: ignore[arg-type]
                            asked,
                            self.dp_rank,
                            self.dp_size,
                        )
                        return msg if error is None else self._unfit(error)
                judged = self._judged(msg)  # the awaited answer comes back, not kept
                return msg if judged is True else judged
            return self._decided(msg)
        return self.receive(msg)

    def receive(self, msg: FromCoordinator) -> Event | None:
        """What `msg` means for this rank; None for stale messages of an older epoch."""
        if type(msg) is StepDecision or type(msg) is GatherResult:
            return self._decided(msg)
        if type(msg) is StepFailed:
            return self._on_failed(msg)
        if type(msg) is Welcome:
            self.welcome = msg
            self.epoch = msg.epoch
            self.next_seq = msg.next_seq
            self.failed = None
            self.registering = False
            return Registered(msg)
        if type(msg) is Reject:
            error = error_from_reject(msg)
            self.registering = False
            self.failed = error
            return RegistrationFailed(error)
        if type(msg) is Heartbeat:
            return Pong(msg.nonce)
        if type(msg) is Goodbye:
            hint = UNAVAILABLE_HINTS["goodbye"]
            return self.fail(CoordinatorUnavailable(f"coordd said goodbye: {msg.text}", hint=hint))
        return None

    def connection_lost(self) -> GroupFailed | None:
        """The connection to coordd dropped (read what it queued first): the group's failure
        while registered and not yet failed, else nothing."""
        if self.registering or self.epoch is None or self.failed is not None:
            return None
        where = f" at {self.config.address}" if self.config.address else ""
        return self.fail(CoordinatorUnavailable(f"connection to coordd{where} dropped"))

    def registration_failed(self, error: CoordError) -> GroupFailed:
        """No `Welcome` came (the shell gave up waiting): fail with `error` until connect()."""
        self.registering = False
        return self.fail(error)

    def fail(self, error: CoordError) -> GroupFailed:
        self.failed = error
        return GroupFailed(error)

    # -- what a wait finds ----------------------------------------------------------------------

    def outcome(self, seq: int, registration: int) -> Outcome | None:
        """Take round `seq`'s outcome: its own answer, else the group's failure, else None
        while it is still open. A round started before the latest connect() is superseded."""
        if registration != self.registration:
            return CoordinatorUnavailable(SUPERSEDED)
        first = self._answers.pop(seq, None)
        if first is None:
            return self.failed
        if self._later:
            later = self._later.get(seq)
            if later:
                self._answers[seq] = later.pop(0)
                if not later:
                    del self._later[seq]
        return first

    def settled(self, seq: int, registration: int) -> bool:
        """True if `outcome` would not be None (without taking it)."""
        return registration != self.registration or seq in self._answers or self.failed is not None

    def _answer(self, seq: int, outcome: Outcome) -> Resolved:
        answers = self._answers
        if seq not in answers:
            answers[seq] = outcome
        else:
            self._later.setdefault(seq, []).append(outcome)
        return Resolved(seq, outcome)

    # -- checking an answer against its round -----------------------------------------------

    def _decided(self, msg: StepDecision | GatherResult) -> Event | None:
        """A decision or gathered rows: kept as its round's answer if it fits the round asked."""
        judged = self._judged(msg)
        if judged is True:
            return self._answer(msg.seq, msg)
        return judged

    def _judged(self, msg: StepDecision | GatherResult) -> Literal[True] | Event | None:
        """True if `msg` fits the round asked (it is not kept here); else the group's failure
        it causes, or None for an answer to no round this rank asked."""
        seq = msg.seq
        if msg.epoch != self.epoch or self.registering:
            self.dropped_answers += 1  # an older epoch's (or, registering, the old one's)
            return None
        asked = self._take_ask(seq)
        if asked is None:
            if seq >= self.next_seq:  # coordd decided a round this rank has not reported
                return self._unfit(
                    InvalidAnswer(
                        seq,
                        "seq",
                        seq,
                        f"a round this rank reported (its last is seq={self.next_seq - 1})",
                    )
                )
            self.dropped_answers += 1  # answered already, or never asked in this registration
            return None
        # one answer of each kind fits a round of that kind (`decision_misfit`, `gather_misfit`)
        error: InvalidAnswer | None
        if type(msg) is StepDecision:
            if type(asked) is StepReport:
                error = decision_misfit(msg, asked, self.dp_rank, self.dp_size)
            else:
                assert isinstance(asked, GatherReport)
                error = InvalidAnswer(
                    seq, "kind", msg.kind.value, f"a gather of site {asked.site!r}"
                )
        elif isinstance(asked, GatherReport):
            assert isinstance(msg, GatherResult)
            error = gather_misfit(msg, asked, self.dp_rank, self.dp_size)
        else:
            error = InvalidAnswer(seq, "kind", "gather", asked.kind.value)
        if error is None:
            return True
        return self._unfit(error)

    def _take_ask(self, seq: int) -> Asked | None:
        asked = self._asked.pop(seq, None)
        if asked is not None and self._asked_again:
            self._ask_again(seq, asked)
        return asked

    def _ask_again(self, seq: int, asked: Asked) -> None:
        """One of a seq's reports is answered: keep it asked while more of them went."""
        again = self._asked_again
        left = again.get(seq, 0)
        if left:
            self._asked[seq] = asked
            if left == 1:
                del again[seq]
            else:
                again[seq] = left - 1

    def _unfit(self, error: InvalidAnswer) -> GroupFailed | None:
        """An answer that does not fit its round fails the group, naming coordd."""
        if self.failed is not None:  # the first failure stays the one reported
            self.dropped_answers += 1
            return None
        return self.fail(error)

    def _on_failed(self, msg: StepFailed) -> Event | None:
        error = error_from_failure(msg)
        if msg.reason is FailReason.PROTOCOL:  # one report's own error
            if msg.epoch != self.epoch or self._take_ask(msg.seq) is None:
                self.dropped_answers += 1
                return None
            return self._answer(msg.seq, error)
        if msg.reason is FailReason.UNAVAILABLE or msg.epoch == self.epoch:
            return self.fail(error)
        return None


class SessionView:
    """What every client of a rank answers from its config and session alone (the blocking,
    asyncio and device-path clients alike), so they cannot drift apart on what it means."""

    config: ClientConfig
    session: RankSession

    @property
    def wait_timeout(self) -> float:
        """A wait's default: the config's, else one that outlives coordd's step timeout as
        its latest Welcome said it (`default_wait_timeout`)."""
        given = self.config.wait_timeout
        if given is not None:
            return given
        welcome = self.session.welcome
        step_timeout = welcome.step_timeout if welcome is not None else 0.0
        return default_wait_timeout(step_timeout, self.config.heartbeat_timeout)

    @property
    def dp_rank(self) -> int:
        return self.session.dp_rank

    @property
    def epoch(self) -> int | None:
        """The epoch of the current registration; None before the first Welcome."""
        return self.session.epoch

    @property
    def dropped_answers(self) -> int:
        """Answers from coordd dropped because no round of this rank's was waiting for them
        (an older epoch's, a round already answered, one of a past registration)."""
        return self.session.dropped_answers
