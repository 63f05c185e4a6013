"""A rank that speaks the wire format by hand: the real client refuses to misbehave, this one can.

It is the real blocking client (`CoordClient`: its `RankSession`, `RankConnection` and poll
loop) with the sending opened up: it sends whatever `StepReport` or `Hello` it is given (a
skipped or repeated seq, the wrong kind, another rank's id, a foreign protocol version), and
judges what coordd makes of it exactly as a real rank does.
"""

from __future__ import annotations

from typing import overload

from coordd.client.sync import CoordClient
from coordd.proto.errors import CoordinatorUnavailable, ProtocolError
from coordd.proto.messages import (
    GatherReport,
    GatherResult,
    Hello,
    StepDecision,
    StepKind,
    StepReport,
    Welcome,
    encode,
)


class RawRank(CoordClient):
    """One rank whose reports are stamped by hand: `stamp` and `send` any message, `advance`
    when its round is reported, `wait` for what coordd makes of a seq. Takes `CoordClient`'s
    settings (keywords or `config=`)."""

    @property
    def next_seq(self) -> int:
        return self.session.next_seq

    def register(self, timeout: float, hello: Hello | None = None) -> Welcome:
        """Send `hello` (default: this rank's proper one); raises `Rejected` or unavailable."""
        return self._register(timeout, hello)

    @overload
    def stamp(
        self, report: StepReport, kind: StepKind, *, seq: int | None = None, dp_rank: int = -1
    ) -> StepReport: ...

    @overload
    def stamp(
        self, report: GatherReport, kind: StepKind, *, seq: int | None = None, dp_rank: int = -1
    ) -> GatherReport: ...

    def stamp(
        self,
        report: StepReport | GatherReport,
        kind: StepKind,
        *,
        seq: int | None = None,
        dp_rank: int = -1,
    ) -> StepReport | GatherReport:
        """`report` in this rank's envelope; `seq`/`dp_rank` override what a real rank would put
        (a `GatherReport` is a gather round's, whatever `kind` says)."""
        rank = None if dp_rank < 0 else dp_rank
        if type(report) is GatherReport:
            return self.session.stamp(report, kind, seq=seq, dp_rank=rank)
        return self.session.stamp(report, kind, seq=seq, dp_rank=rank)

    def send(self, message: StepReport | GatherReport) -> None:
        """Send `message` as it is; its answer is then expected (`RankSession.sent`)."""
        self.session.sent(message)
        if not self.connection.send(encode(message)):
            raise self.session.fail(
                CoordinatorUnavailable(f"cannot send to coordd at {self.address}: no connection")
            ).error

    def advance(self) -> None:
        """This rank's round is reported: the next one gets the next seq."""
        self.session.next_seq += 1

    def wait(self, seq: int, timeout: float) -> StepDecision:
        """The next outcome for `seq`: its decision, or the error it (or the group) ended with."""
        return self._wait(seq, self.session.registration, timeout)

    def wait_gather(self, seq: int, timeout: float) -> GatherResult:
        """As `wait`, for a gather round: its rows, or the error it (or the group) ended with.
        Send a gather round's report with `send(stamp(GatherReport(...), StepKind.GATHER))`."""
        outcome = self._wait_outcome(seq, self.session.registration, timeout)
        if type(outcome) is not GatherResult:
            raise ProtocolError(f"coordd answered the gather round seq={seq} with a {outcome!r}")
        return outcome
