"""takeover_attempt's culprit: speaks for a live rank without holding it."""

from __future__ import annotations

import msgspec
import zmq

from coordd.proto.errors import CoordError
from coordd.proto.messages import (
    Goodbye,
    Heartbeat,
    StepFailed,
    StepReport,
    encode,
    error_from_failure,
)
from coordd.testing.history import (
    Done,
    HistoryWriter,
    Inject,
    Note,
    Refused,
    Registered,
    error_info,
    tail_records,
    wait_for_round,
)
from coordd.testing.rawrank import RawRank
from coordd.tools.chaos.roles._common import client_config, live_round, now, read_answers
from coordd.tools.chaos.seeded_reports import kind_for, other_report, report_for
from coordd.tools.chaos.spec import WorkerSpec


def run_taker(spec: WorkerSpec, log: HistoryWriter) -> int:
    """takeover_attempt's culprit: speaks for a live rank (`dp_rank`, the victim) without
    holding it: over a new connection presenting the victim's routing id (leaked: the victim
    logs it), it sends forged reports, a heartbeat and a Goodbye, and must receive nothing;
    then a Hello for the rank (refused rank_taken) and a report claiming it from a connection
    that never registered (refused). The victim's rounds must not notice."""
    victim = spec.dp_rank
    wait_for_round(spec.victim_log, spec.trigger_seq, spec.deadline)
    identity = ""
    for r in tail_records(spec.victim_log, 0)[0]:
        if isinstance(r, Note) and r.what == "identity":
            identity = r.detail
    _, live = live_round(spec.victim_log, 0, (0, 0))
    if not identity:
        log.write(Note(t=now(), what="no identity in the victim's log"))
        return 0
    log.write(Inject(t=now(), fault=spec.fault, rank=victim, detail="the victim's routing id"))
    ctx: zmq.Context = zmq.Context.instance()
    sock: zmq.Socket = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, bytes.fromhex(identity))
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(spec.address)
    sent = 0
    got: list[object] = []
    try:
        sock.poll(1000, zmq.POLLOUT)
        epoch, seq = live
        for i in range(6):
            forged = other_report(report_for(spec.seed, victim, seq + 1 + i % 2))
            frames = [
                msgspec.structs.replace(
                    forged,
                    num_tokens=forged.num_tokens + 4999,
                    num_tokens_padded=forged.num_tokens_padded + 4999,
                    dp_rank=victim,
                    epoch=epoch,
                    seq=seq + 1 + i % 2,
                    kind=kind_for(spec.seed, seq + 1 + i % 2),
                ),
                Heartbeat(nonce=i),
            ]
            if i == 5:
                frames.append(Goodbye(text="forged"))
            for message in frames:
                try:
                    sock.send(encode(message), zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    pass
            got += read_answers(sock, 0.05)
        got += read_answers(sock, 0.3)
    finally:
        sock.close()
    for answer in got:
        log.write(Note(t=now(), what="violation", detail=f"the victim's id received {answer}"))
    log.write(Note(t=now(), what="id taken: nothing received", count=sent))
    # a Hello for the held rank, as a real client would say it
    rank = RawRank(config=client_config(spec))
    try:
        welcome = rank.register(min(5.0, spec.wait_timeout))
    except CoordError as error:
        log.write(Refused(t=now(), error=error_info(error), what="hello"))
    else:
        log.write(Registered(t=now(), epoch=welcome.epoch, next_seq=welcome.next_seq))
    finally:
        rank.close()
    # a report claiming the held rank from a connection that never registered
    _, live = live_round(spec.victim_log, 0, live)
    claim = ctx.socket(zmq.DEALER)
    claim.setsockopt(zmq.LINGER, 0)
    claim.connect(spec.address)
    try:
        claim.poll(1000, zmq.POLLOUT)
        report = StepReport(
            num_tokens=1, num_tokens_padded=1, dp_rank=victim, epoch=live[0], seq=live[1] + 1
        )
        claim.send(encode(report), zmq.NOBLOCK)
        for answer in read_answers(claim, spec.wait_timeout):
            if isinstance(answer, StepFailed):
                info = error_info(error_from_failure(answer))
                log.write(Refused(t=now(), error=info, what="claimed report"))
            else:
                detail = f"a report claiming rank {victim} got {answer}"
                log.write(Note(t=now(), what="violation", detail=detail))
            break
    finally:
        claim.close()
    log.write(Done(t=now(), next_seq=0, reason="taker"))
    return 0
