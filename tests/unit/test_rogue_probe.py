"""The rogue's probe judges coordd by the answers to its own questions.

Before: the probe took the first answer that came, within 5.2 s each. Under load (2 cores, a
fresh clone) answers still coming to the stranger's forged reports, or a dropped one, made
stranger_noise fail "coordd did not answer a heartbeat / did not refuse a report / did not
refuse a Hello" while coordd's log showed it had refused both. Here a fake coordd (a ROUTER in
a thread) answers late and out of order, and drops one answer: the probe must still see each.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import zmq

from coordd.proto.errors import ProtocolError, Rejected
from coordd.proto.messages import (
    Heartbeat,
    Hello,
    StepKind,
    StepReport,
    decode_to_coordinator,
    encode,
    failure_message,
    reject_message,
)
from coordd.testing.history import HistoryWriter, Note, Refused, read_history
from coordd.testing.rogue import RoguePeer


class _LaggingCoordd(threading.Thread):
    """Answers every question, but first sends a stale answer (to a report sent earlier) and
    drops the first answer to the probe's stranger report (as coordd's answer rate may)."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.stop = threading.Event()
        self.reports_seen = 0

    def stale(self, peer: bytes) -> None:
        error = ProtocolError("report from a peer that has not registered", rank=0)
        failed = failure_message(error, epoch=0, seq=3, kind=StepKind.FORWARD)
        self.sock.send_multipart([peer, encode(failed)])

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            peer, frame = self.sock.recv_multipart()
            message = decode_to_coordinator(frame)
            self.stale(peer)
            if isinstance(message, Heartbeat):
                self.sock.send_multipart([peer, encode(message)])
            elif isinstance(message, StepReport):
                self.reports_seen += 1
                if self.reports_seen == 1:
                    continue  # dropped: the probe must ask again
                error = ProtocolError("report from a peer that has not registered", rank=0)
                failed = failure_message(
                    error, epoch=message.epoch, seq=message.seq, kind=message.kind
                )
                self.sock.send_multipart([peer, encode(failed)])
            elif isinstance(message, Hello):
                detail = "dp_rank 5 is outside 0..1"
                rejected = Rejected("rank_range", detail, expected="0..1", got="5")
                self.sock.send_multipart([peer, encode(reject_message(rejected))])


@pytest.mark.timeout(60)
def test_the_probe_waits_for_its_own_answers_and_asks_again(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/c.sock"
    coordd = _LaggingCoordd(address)
    coordd.start()
    path = tmp_path / "rogue.jsonl"
    try:
        log = HistoryWriter(str(path), role="garbage", rank=-1, name="rogue")
        with RoguePeer(address, 2) as rogue:
            assert rogue.connected(10.0)
            rogue.probe(log, timeout=30.0)
        log.close()
    finally:
        coordd.stop.set()
        coordd.join(10)
        coordd.sock.close()
    _, records = read_history(str(path))
    notes = [r.what for r in records if isinstance(r, Note)]
    refused = {r.what: r.error for r in records if isinstance(r, Refused)}
    assert "pong" in notes, notes
    assert refused["stranger report"].type == "ProtocolError"
    assert refused["hello"].reason == "rank_range"
    assert coordd.reports_seen >= 2  # the dropped answer was asked for again
