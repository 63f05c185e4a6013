"""The blocking client's wait, over a fake connection: what it reads before it reports a loss.

Over real sockets a frame and the close that follows it arrive in either order relative to a
wait's slice, so no test over them reaches the case that matters: the slice ends with nothing
queued, then coordd's last frame and the disconnect both arrive before the next look. The
fake here makes that order certain.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import pytest
import zmq

from coordd.client.sync import CoordClient
from coordd.proto.errors import CoordinatorUnavailable
from coordd.proto.messages import FromCoordinator, Goodbye, StepKind, StepReport, Welcome, encode
from coordd.proto.policy import decide

pytestmark = pytest.mark.timeout(30)

REPORT = StepReport(num_tokens=3, num_tokens_padded=4, has_unfinished=True)


class FakeDealer:
    """The first recv ends its slice with nothing queued; what `arrive` queues comes after."""

    closed = False

    def __init__(self) -> None:
        self.queue: deque[bytes] = deque()
        self.slices = 0

    def setsockopt(self, option: int, value: int) -> None:
        pass

    def getsockopt(self, option: int) -> int:
        if option == zmq.EVENTS:
            return int(zmq.POLLIN) if self.queue else 0
        raise AssertionError(f"unexpected getsockopt({option})")

    def recv(self, flags: int = 0) -> bytes:
        if self.queue and (flags & zmq.NOBLOCK or self.slices):
            return self.queue.popleft()
        self.slices += 1
        raise zmq.Again()


class FakeConnection:
    """A connection whose monitor reports the drop together with `last`, queued at that
    moment (coordd sent it, then closed)."""

    address = "ipc:///fake/coordd.sock"

    def __init__(self, last: FromCoordinator) -> None:
        self.socket = FakeDealer()
        self.last = last
        self.dropped = False
        self.closed_with: list[bytes | None] = []

    def disconnected(self) -> bool:
        if self.dropped:
            return False
        self.socket.queue.append(encode(self.last))
        self.dropped = True
        return True

    def close(self, final: bytes | None = None) -> None:
        self.closed_with.append(final)


def registered_client(tmp_path: Path) -> CoordClient:
    client = CoordClient(
        f"ipc://{tmp_path}/none.sock", dp_rank=0, dp_size=2, config_fingerprint="fp"
    )
    client.connection.close()  # the real one is never used
    session = client.session
    session.hello()
    session.receive(Welcome(epoch=3, next_seq=0, dp_size=2))
    return client


def test_a_decision_queued_with_the_close_is_the_rounds_answer(tmp_path: Path) -> None:
    """Issue 28, planted bug: the blocking client not reading what was queued before it
    reports the loss (a decision queued with the close lost as "connection dropped") passed
    every test. The wait returns the decision; the loss fails only what comes after."""
    client = registered_client(tmp_path)
    sent = client.session.report(REPORT, StepKind.FORWARD)
    decision = decide([sent, sent], epoch=3, seq=sent.seq)
    fake = FakeConnection(decision)
    client.connection = fake  # type: ignore[assignment]
    assert client._wait(sent.seq, client.session.registration, 5.0) == decision
    assert fake.socket.slices == 1 and not fake.socket.queue
    with pytest.raises(CoordinatorUnavailable, match="dropped"):
        client.session.report(REPORT, StepKind.FORWARD)
    client.close()


def test_a_goodbye_queued_with_the_close_is_what_the_wait_raises(tmp_path: Path) -> None:
    """coordd's Goodbye (it shut down) queued with the close: the wait says so, not "connection
    dropped", which sends an operator after the network."""
    client = registered_client(tmp_path)
    sent = client.session.report(REPORT, StepKind.FORWARD)
    client.connection = FakeConnection(Goodbye(text="coordd is shutting down"))  # type: ignore[assignment]
    with pytest.raises(CoordinatorUnavailable, match="said goodbye: coordd is shutting down"):
        client._wait(sent.seq, client.session.registration, 5.0)
    client.close()
