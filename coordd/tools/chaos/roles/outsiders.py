"""Peers outside the group that send what no rank would: garbage frames (garbage_frames),
forged reports for the live rounds (stranger_noise)."""

from __future__ import annotations

import random
import time

import msgspec
import zmq

from coordd.proto.messages import (
    Goodbye,
    Heartbeat,
    StepFailed,
    StepReport,
    encode,
    error_from_failure,
)
from coordd.testing.history import HistoryWriter, Inject, Note, Refused, error_info, wait_for_round
from coordd.testing.rogue import APP_LEVEL
from coordd.tools.chaos.roles._common import (
    PROBE_TIMEOUT,
    live_round,
    now,
    read_answers,
    rogue_peer,
)
from coordd.tools.chaos.seeded_reports import kind_for, report_for
from coordd.tools.chaos.spec import WorkerSpec


def run_rogue(spec: WorkerSpec, log: HistoryWriter) -> int:
    """The garbage scenario's culprit: a flood of bad frames once the group runs, then a probe."""
    with rogue_peer(spec) as rogue:
        if not rogue.connected(timeout=5.0):
            log.write(Note(t=now(), what="rogue could not connect"))
            return 0
        wait_for_round(spec.trigger_log, spec.trigger_seq, spec.deadline)
        log.write(Inject(t=now(), fault=spec.fault, detail=f"{spec.frames} frames"))
        sent = rogue.flood(spec.frames)
        for category, count in sorted(sent.items()):
            log.write(Note(t=now(), what="sent", detail=category, count=count))
        rogue.probe(log, PROBE_TIMEOUT, spec.fingerprint)
    return 0


def run_stranger(spec: WorkerSpec, log: HistoryWriter) -> int:
    """stranger_noise's culprit: a peer that never registers sends forged reports for the live
    rounds (right epoch and seq, any rank's id, other values) amid garbage frames, then checks
    coordd still answers (the rogue's probe), then bursts forged reports as fast as it can on
    a second connection (coordd may cut it off). The group's rounds must not notice."""
    rng = random.Random(f"stranger:{spec.seed}")
    with rogue_peer(spec) as rogue:
        if not rogue.connected(timeout=5.0):
            log.write(Note(t=now(), what="stranger could not connect"))
            return 0
        wait_for_round(spec.trigger_log, spec.trigger_seq, spec.deadline)
        log.write(Inject(t=now(), fault=spec.fault, detail="forged reports amid garbage"))
        offset, live = live_round(spec.trigger_log, 0, (0, 0))
        forged = answered = 0
        refused: set[str] = set()

        def collect(timeout: float = 0.0) -> None:
            nonlocal answered
            for answer in read_answers(rogue.sock, timeout):
                if isinstance(answer, StepFailed):
                    answered += 1
                    error = error_from_failure(answer)
                    if type(error).__name__ not in refused:
                        refused.add(type(error).__name__)
                        info = error_info(error)
                        log.write(Refused(t=now(), error=info, what="forged report"))
                elif not isinstance(answer, Heartbeat):
                    log.write(Note(t=now(), what="violation", detail=f"a stranger got {answer}"))

        for i in range(60):
            offset, live = live_round(spec.trigger_log, offset, live)
            if i % 2 == 0:
                epoch, seq = live[0], live[1] + rng.choice([0, 0, 1])
                report = report_for(spec.seed, 99, seq, salt=f"forged{i}")
                rogue.sock.send(
                    encode(
                        msgspec.structs.replace(
                            report,
                            num_tokens=report.num_tokens + 7919,
                            num_tokens_padded=report.num_tokens_padded + 7919,
                            dp_rank=rng.randrange(spec.dp_size),
                            epoch=epoch,
                            seq=seq,
                            kind=kind_for(spec.seed, seq),
                        )
                    ),
                    zmq.NOBLOCK,
                )
                forged += 1
            elif i % 6 == 1:
                rogue.sock.send(encode(Goodbye(text="forged")), zmq.NOBLOCK)
            else:
                rogue.send(rng.choice(APP_LEVEL))
            collect()
            time.sleep(rng.uniform(0.001, 0.004))
        collect(0.3)
        log.write(Note(t=now(), what="sent", detail="forged", count=forged))
        log.write(Note(t=now(), what="answered", detail="forged", count=answered))
        for category, count in sorted(rogue.sent.items()):
            log.write(Note(t=now(), what="sent", detail=category, count=count))
        rogue.probe(log, PROBE_TIMEOUT, spec.fingerprint)
        burst = _burst(spec, live)
        log.write(Note(t=now(), what="burst", detail="forged reports, one connection", count=burst))
    return 0


def _burst(spec: WorkerSpec, live: tuple[int, int]) -> int:
    """`spec.frames` forged reports as fast as a fresh DEALER takes them (a fast stranger)."""
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, spec.frames + 10)
    sock.connect(spec.address)
    sent = 0
    try:
        if not sock.poll(2000, zmq.POLLOUT):
            return 0
        frame = encode(
            StepReport(num_tokens=1, num_tokens_padded=1, dp_rank=0, epoch=live[0], seq=live[1])
        )
        for _ in range(spec.frames):
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                break
            sent += 1
        time.sleep(0.05)
    finally:
        sock.close()
    return sent
