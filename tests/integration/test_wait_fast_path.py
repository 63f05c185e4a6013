"""The blocking client's wait, written out for its common case (issue 37), against `_pump`.

`_wait_outcome` takes a wait's first slice itself (RCVTIMEO already at a slice, pyzmq's own
socket) instead of calling `_pump`. Each answer a fake coordd can give (a fitting decision,
every misfit, a round's own error, the group's failure, coordd's Goodbye, a Pong between) is
awaited both ways, the first slice through the written-out path and through `_pump`: the
outcome, the error and what the session keeps must be the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from coordd.client.sync import _POLL_SLICE_MS, CoordClient
from coordd.proto.errors import CoordError
from coordd.proto.messages import (
    FailReason,
    FromCoordinator,
    GatherReport,
    Goodbye,
    Heartbeat,
    StepFailed,
    StepReport,
)
from tests.integration.test_answer_checks import (
    DP,
    EPOCH,
    MISFITS,
    REPORT,
    FakeCoordd,
    altered,
    proper,
)

pytestmark = pytest.mark.timeout(60)


def failed(reason: FailReason) -> object:
    def answer(report: StepReport | GatherReport) -> list[FromCoordinator]:
        assert isinstance(report, StepReport)
        return [
            StepFailed(
                epoch=EPOCH,
                seq=report.seq,
                kind=report.kind,
                reason=reason,
                culprits=[1],
                text="planted",
                detail="planted",
            )
        ]

    return answer


def pong_first(report: StepReport | GatherReport) -> list[FromCoordinator]:
    return [Heartbeat(nonce=5), *proper(report)]


def goodbye(report: StepReport | GatherReport) -> list[FromCoordinator]:
    return [Goodbye(text="coordd is shutting down")]


ANSWERS = [("proper", proper), ("pong-first", pong_first), ("goodbye", goodbye)]
ANSWERS += [(f"failed-{r.value}", failed(r)) for r in FailReason]
ANSWERS += [(f"misfit-{i}-{f}", altered(**c)) for i, (f, c) in enumerate(MISFITS)]


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeCoordd]:
    context = zmq.Context()
    served = FakeCoordd(context, f"ipc://{tmp_path}/fake.sock")
    yield served
    served.stop()
    context.term()


def _second_round(fake: FakeCoordd, answer: object, written_out: bool) -> tuple[object, ...]:
    client = CoordClient(fake.address, dp_rank=0, dp_size=DP, config_fingerprint="fp")
    try:
        client.connect(timeout=10)
        fake.answer = proper
        assert client.coordinate(REPORT, timeout=10).seq == 0
        fake.answer = answer  # type: ignore[assignment]
        pending = client.start(REPORT)
        # the written-out slice needs RCVTIMEO at a slice; any other value sends it to _pump
        if written_out:
            assert client._rcvtimeo == _POLL_SLICE_MS
            assert type(client.connection.socket) is zmq.Socket
        else:
            client.connection.socket.setsockopt(zmq.RCVTIMEO, 20)
            client._rcvtimeo = 20
        try:
            outcome: object = pending.wait(10)
        except CoordError as error:
            outcome = (type(error).__name__, str(error))
        session = client.session
        kept = (session.failed is not None, session._answers, session.dropped_answers, client._pong)
        return outcome if not isinstance(outcome, msgspec.Struct) else repr(outcome), kept
    finally:
        client.close()


@pytest.mark.parametrize(("name", "answer"), ANSWERS, ids=[n for n, _ in ANSWERS])
def test_the_written_out_slice_gives_what_pump_gives(
    fake: FakeCoordd, name: str, answer: object
) -> None:
    assert _second_round(fake, answer, True) == _second_round(fake, answer, False)
