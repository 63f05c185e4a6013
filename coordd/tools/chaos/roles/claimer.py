"""id_claims' culprit: the routing-id attack, then a Hello from a zero-led routing id."""

from __future__ import annotations

import random
import time

import zmq

from coordd.client._session import RankSession
from coordd.core._daemon_defaults import DEFAULT_HANDSHAKE_RATE, HANDSHAKE_TIMEOUT
from coordd.io._gate import REFUSAL_DELAY, SOURCE_SHARE
from coordd.proto.messages import Heartbeat, Reject, Welcome, encode, error_from_reject
from coordd.testing.history import (
    Done,
    HistoryWriter,
    Inject,
    Note,
    Refused,
    Registered,
    error_info,
)
from coordd.tools.chaos.roles._common import client_config, now, read_answers, wait_for_trigger
from coordd.tools.chaos.spec import WorkerSpec
from coordd.tools.load.claims import attack

#: The group the claimer's zero-led Hello asks for (as rank 0, coordd's dp_size): one of its
#: own, so that nothing but the routing id stands between it and a Welcome (a registered name
#: is exempt from the stranger grace).
CLAIMER_GROUP = "id-claims"


def run_claimer(spec: WorkerSpec, log: HistoryWriter) -> int:
    """id_claims' culprit: once the group's rounds are live, the routing-id attack for
    `claim_seconds` (`spec.claims` names held, id-less handshakes `spec.in_flight` at a time),
    with what it achieved logged; then a Hello from a routing id that starts with a zero byte
    (`\\x00` + 4 bytes from the seed), whose Reject (expected: routing_id) is logged as
    `Refused` and a Welcome as `Registered` (the checker's violation)."""
    rng = random.Random(f"claimer:{spec.seed}")
    wait_for_trigger(spec)
    detail = (
        f"{spec.claims} names held, id-less handshakes {spec.in_flight} at a time "
        f"for {spec.claim_seconds:g} s"
    )
    log.write(Inject(t=now(), fault=spec.fault, detail=detail))
    result = attack(spec.address, spec.claims, spec.claim_seconds, spec.in_flight)
    log.write(Note(t=now(), what="admitted", detail="id-less", count=result.idless_admitted))
    log.write(Note(t=now(), what="refused", detail="id-less", count=result.idless_refused))
    log.write(Note(t=now(), what="held", detail="names, most at once", count=result.held_max))
    log.write(Note(t=now(), what="admitted", detail="names", count=result.claims_admitted))
    log.write(Note(t=now(), what="closed", detail="names", count=result.claims_closed))
    log.write(Note(t=now(), what="attack", detail=result.summary()))
    # the attack spent this source's share of the handshake rate: a moment for a handshake's
    # worth to come back (else the gate stalls the Hello's handshake until coordd's
    # HANDSHAKE_IVL, ~5 s, and the scenario takes that much longer)
    time.sleep(1.25 / (DEFAULT_HANDSHAKE_RATE * SOURCE_SHARE))
    identity = b"\x00" + rng.randbytes(4)
    hello = RankSession(config=client_config(spec, dp_rank=0, group=CLAIMER_GROUP)).hello_message
    log.write(Note(t=now(), what="zero-led hello", detail=identity.hex()))
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(spec.address)
    try:
        sock.send(encode(hello))  # queued until the handshake (the gate may hold it a while)
        sent = now()
        # long enough for one stalled handshake as well
        timeout = spec.wait_timeout + HANDSHAKE_TIMEOUT + REFUSAL_DELAY
        answers = [a for a in read_answers(sock, timeout) if not isinstance(a, Heartbeat)]
        took = now() - sent
    finally:
        sock.close()
    if not answers:
        log.write(Note(t=now(), what="no answer", detail="zero-led hello"))
    else:
        answer = answers[0]
        detail = f"{type(answer).__name__} after {took * 1000:.0f} ms"
        log.write(Note(t=now(), what="answered", detail=detail))
        if isinstance(answer, Reject):
            info = error_info(error_from_reject(answer))
            log.write(Refused(t=now(), error=info, what="hello"))
        elif isinstance(answer, Welcome):
            log.write(Registered(t=now(), epoch=answer.epoch, next_seq=answer.next_seq))
        else:
            log.write(Note(t=now(), what="violation", detail=f"a Hello got {answer}"))
    log.write(Done(t=now(), next_seq=0, reason="claimer"))
    return 0
