"""The clients check every answer against the round they asked (issue 21, items 9 and 10).

A small fake coordd (a real ROUTER, in a thread of the test) welcomes each Hello and answers
each report with crafted messages: a decision that does not fit its round fails the group with
`InvalidAnswer` naming coordd, for both clients; an answer for no round asked is dropped and
counted, never kept.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from coordd.client.sync import CoordClient
from coordd.proto.errors import CoordinatorUnavailable, InvalidAnswer, ProtocolError
from coordd.proto.messages import (
    FromCoordinator,
    GatherReport,
    GatherResult,
    Goodbye,
    Hello,
    StepDecision,
    StepKind,
    StepReport,
    Welcome,
    decode_to_coordinator,
    encode,
)
from coordd.proto.policy import decide
from tests.integration.clients import CLIENT_KINDS, AnyClient, ClientMaker, client_maker

pytestmark = pytest.mark.timeout(60)

EPOCH = 7
DP = 2
REPORT = StepReport(num_tokens=3, num_tokens_padded=4, has_unfinished=True)
#: Crafted answers to one report: what the fake sends back for it.
Answer = Callable[[StepReport | GatherReport], list[FromCoordinator]]


def proper(report: StepReport | GatherReport) -> list[FromCoordinator]:
    """What a real coordd answers (every rank reporting the same)."""
    if isinstance(report, GatherReport):
        rows = [list(report.values) for _ in range(DP)]
        return [GatherResult(epoch=EPOCH, seq=report.seq, site=report.site, rows=rows)]
    return [decide([report] * DP, epoch=EPOCH, seq=report.seq, kind=report.kind)]


class FakeCoordd:
    """A ROUTER that welcomes every Hello (epoch 7, dp 2) and answers each report with what
    `answer` makes of it; it serves until `stop()`."""

    def __init__(self, context: zmq.Context, address: str) -> None:
        self.address = address
        self.answer: Answer = proper
        self.reports: list[StepReport | GatherReport] = []
        #: the Goodbyes received (a client's close() while registered says one)
        self.goodbyes = threading.Semaphore(0)
        self._sock = context.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # a ROUTER drops past its high-water mark
        self._sock.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sock = self._sock
        while not self._stop.is_set():
            if not sock.poll(20):
                continue
            peer, frame = sock.recv_multipart()
            msg = decode_to_coordinator(frame)
            if isinstance(msg, Hello):
                sock.send_multipart([peer, encode(Welcome(epoch=EPOCH, next_seq=0, dp_size=DP))])
            elif isinstance(msg, Goodbye):
                self.goodbyes.release()
            elif isinstance(msg, StepReport | GatherReport):
                self.reports.append(msg)
                for out in self.answer(msg):
                    sock.send_multipart([peer, encode(out)])
        sock.close(linger=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        assert not self._thread.is_alive(), "the fake coordd did not stop within 10 s"


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeCoordd]:
    context = zmq.Context()
    served = FakeCoordd(context, f"ipc://{tmp_path}/fake.sock")
    yield served
    served.stop()
    context.term()


@pytest.fixture(params=CLIENT_KINDS)
def make_client(request: pytest.FixtureRequest) -> Iterator[ClientMaker]:
    yield from client_maker(request.param)


def client_of(make_client: ClientMaker, fake: FakeCoordd) -> AnyClient:
    client = make_client(fake.address, dp_rank=0, dp_size=DP, config_fingerprint="fp")
    client.connect(timeout=10)
    return client


def dropped(client: AnyClient) -> int:
    inner: Any = getattr(client, "inner", client)
    return int(inner.dropped_answers)


def altered(**changes: object) -> Answer:
    def answer(report: StepReport | GatherReport) -> list[FromCoordinator]:
        return [msgspec.structs.replace(m, **changes) for m in proper(report)]

    return answer


MISFITS = [
    ("num_tokens_across_dp", {"num_tokens_across_dp": [4]}),
    ("num_tokens_across_dp", {"num_tokens_across_dp": [4, 4, 4]}),
    ("kind", {"kind": StepKind.DRAFT}),
    ("cudagraph_mode", {"cudagraph_mode": 9}),
    ("dead_ranks", {"dead_ranks": [7]}),
    # issue 28, defect 7: answers that contradict this rank's own report (3 tokens, padded 4,
    # unfinished requests), each of which wait() returned before
    ("num_tokens_across_dp[0]", {"num_tokens_across_dp": [0, 4]}),  # its own count 0
    ("num_tokens_across_dp", {"num_tokens_across_dp": [4, -16]}),
    ("num_tokens_across_dp", {"num_tokens_across_dp": [4, 2**40]}),
    ("dead_ranks", {"dead_ranks": [0]}),  # itself, though it reported
    ("all_idle", {"all_idle": True}),  # while it has work
    ("any_unfinished", {"any_unfinished": False}),  # while it has unfinished requests
]


@pytest.mark.parametrize(
    ("field", "changes"), MISFITS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(MISFITS)]
)
def test_a_decision_that_does_not_fit_its_round_is_refused_naming_coordd(
    make_client: ClientMaker, fake: FakeCoordd, field: str, changes: dict[str, object]
) -> None:
    client = client_of(make_client, fake)
    assert client.coordinate(REPORT, timeout=10).seq == 0, "a proper answer passes"
    fake.answer = altered(**changes)
    with pytest.raises(InvalidAnswer) as info:
        client.coordinate(REPORT, timeout=10)
    error = info.value
    assert isinstance(error, ProtocolError)
    assert (error.seq, error.field, error.at_fault) == (1, field, "coordd")
    with pytest.raises(InvalidAnswer):  # the group failed with it: nothing more is asked
        client.coordinate(REPORT, timeout=10)
    assert len(fake.reports) == 2


def test_an_answer_for_a_round_not_yet_reported_is_refused(
    make_client: ClientMaker, fake: FakeCoordd
) -> None:
    """coordd answers seq 0, and seq 1 at once, before this rank reported seq 1."""
    client = client_of(make_client, fake)
    fake.answer = lambda report: [*proper(report), *proper(msgspec.structs.replace(report, seq=1))]
    assert client.coordinate(REPORT, timeout=10).seq == 0
    inner: Any = getattr(client, "inner", client)
    deadline = time.monotonic() + 10
    while inner.session.failed is None and not inner.connection.socket.poll(50, zmq.POLLIN):
        assert time.monotonic() < deadline, "the early answer did not come within 10 s"
    with pytest.raises(InvalidAnswer) as info:  # read at start(), before the report goes
        client.coordinate(REPORT, timeout=10)
    assert (info.value.seq, info.value.field) == (1, "seq")


def test_unsolicited_answers_are_dropped_and_counted(
    make_client: ClientMaker, fake: FakeCoordd
) -> None:
    """After the round's answer, 5000 more for it and for seqs of an older epoch: dropped,
    counted, none kept, and the next round is answered as usual."""
    client = client_of(make_client, fake)

    def flood(report: StepReport | GatherReport) -> list[FromCoordinator]:
        first = proper(report)[0]
        assert isinstance(first, StepDecision)
        again = [first] * 2500
        older = [msgspec.structs.replace(first, epoch=EPOCH - 1, seq=s) for s in range(2500)]
        return [first, *again, *older]

    fake.answer = flood
    assert client.coordinate(REPORT, timeout=10).seq == 0
    fake.answer = proper
    assert client.coordinate(REPORT, timeout=10).seq == 1, "read past the flood"
    assert dropped(client) == 5000
    inner: Any = getattr(client, "inner", client)
    assert inner.session._answers == {} and inner.session._later == {}


def test_a_round_superseded_by_connect_is_done(make_client: ClientMaker, fake: FakeCoordd) -> None:
    """An engine that polls done() sees a round of the old registration done once connect()
    registered again (its wait raises 'superseded'), though coordd never answered it."""
    client = client_of(make_client, fake)
    fake.answer = lambda report: []
    pending = client.start(REPORT)
    assert not pending.done()
    client.connect(timeout=10)
    assert pending.done()
    with pytest.raises(CoordinatorUnavailable, match="superseded"):
        pending.wait(timeout=10)


GATHER_MISFITS = [
    ("rows[0]", lambda rows: [[9, 9], rows[1]]),  # this rank's own row altered
    ("rows", lambda rows: rows[:1]),  # a row missing
    ("rows", lambda rows: [*rows, [1, 2]]),  # an extra row
    ("rows[1]", lambda rows: [rows[0], [1]]),  # another rank's row of another length
]


@pytest.mark.parametrize(("field", "rows_of"), GATHER_MISFITS)
def test_gathered_rows_that_do_not_fit_are_refused(
    fake: FakeCoordd, field: str, rows_of: Callable[[list[list[int]]], list[list[int]]]
) -> None:
    with CoordClient(fake.address, dp_rank=0, dp_size=DP, config_fingerprint="fp") as client:
        client.connect(timeout=10)
        assert client.gather("site", [1, 2], timeout=10) == [[1, 2], [1, 2]]

        def answer(report: StepReport | GatherReport) -> list[FromCoordinator]:
            result = proper(report)[0]
            assert isinstance(result, GatherResult)
            return [msgspec.structs.replace(result, rows=rows_of(result.rows))]

        fake.answer = answer
        with pytest.raises(InvalidAnswer) as info:
            client.gather("site", [1, 2], timeout=10)
        assert (info.value.seq, info.value.field) == (1, field)
        fake.answer = altered(site="another")
        client.connect(timeout=10)
        with pytest.raises(InvalidAnswer, match="site"):
            client.gather("site", [1, 2], timeout=10)


def test_close_says_goodbye_when_registered_and_not_before(
    make_client: ClientMaker, fake: FakeCoordd
) -> None:
    """Issue 28, planted bug: the asyncio client's Goodbye on close inverted (sent only when
    not registered) passed every test; only the blocking client's clean stop was tested. A
    registered client of either kind says Goodbye on close(); one that never registered does
    not (coordd would have no rank to stop)."""
    client = client_of(make_client, fake)
    assert client.coordinate(REPORT, timeout=10).seq == 0
    client.close()
    assert fake.goodbyes.acquire(timeout=10), "no Goodbye from a registered client's close()"
    never = make_client(fake.address, dp_rank=1, dp_size=DP, config_fingerprint="fp")
    never.close()
    assert not fake.goodbyes.acquire(timeout=0.5), "a Goodbye from a client never registered"
