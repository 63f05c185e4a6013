"""junk_groups' culprit: takes every group slot, asks for groups the deployment does not
expect, then floods as a member until coordd cuts it off."""

from __future__ import annotations

import os
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from coordd.client.sync import CoordClient
from coordd.proto.errors import CoordError, Rejected
from coordd.proto.messages import Heartbeat, Hello, StepReport, Welcome, encode
from coordd.testing.history import (
    Done,
    HistoryWriter,
    Inject,
    Note,
    Refused,
    Registered,
    error_info,
)
from coordd.tools.chaos.roles._common import (
    PROBE_TIMEOUT,
    client_config,
    now,
    read_answers,
    wait_for_trigger,
)
from coordd.tools.chaos.seeded_reports import kind_for
from coordd.tools.chaos.spec import WorkerSpec

#: The longest the squatter's member floods before it gives up on being cut off, far past
#: what coordd's per-member message window (MEMBER_SLACK) takes to cut it.
FLOOD_SECONDS = 8.0


def _ask(spec: WorkerSpec, log: HistoryWriter, group: str, what: str) -> CoordClient | None:
    """A real client's Hello for rank 0 of `group`, waiting for its own answer: a `Rejected`
    is logged as `Refused` (`what`), a Welcome as `Registered` where `what` is a question coordd
    must refuse (the checker's "admitted"), else as a "welcomed" note; the welcomed client is
    returned, held (its slot with it)."""
    client = CoordClient(config=client_config(spec, dp_rank=0, group=group))
    try:
        welcome = client.connect(timeout=min(PROBE_TIMEOUT, max(0.1, spec.deadline - now())))
    except Rejected as error:
        client.close()
        log.write(Refused(t=now(), error=error_info(error), what=what))
        return None
    except CoordError as error:
        client.close()
        log.write(Note(t=now(), what="no answer", detail=f"{what} {group}: {error}"))
        return None
    if what == "fill":
        log.write(Note(t=now(), what="welcomed", detail=group))
    else:
        log.write(Registered(t=now(), epoch=welcome.epoch, next_seq=welcome.next_seq))
    return client


def _raw_member(spec: WorkerSpec, group: str) -> tuple[zmq.Socket, zmq.Socket, object]:
    """A DEALER that says Hello for rank 0 of `group` and never reconnects (a cut is final),
    the monitor that sees its connection end, and coordd's answer (None: none in time)."""
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, f"squat-{os.getpid()}".encode())
    sock.setsockopt(zmq.RECONNECT_IVL, -1)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(spec.address)
    hello = Hello(
        dp_size=spec.dp_size,
        dp_rank=0,
        config_fingerprint=spec.fingerprint,
        incarnation=f"squatter-{os.getpid()}",
        group=group,
    )
    sock.send(encode(hello))
    answers = [a for a in read_answers(sock, PROBE_TIMEOUT) if not isinstance(a, Heartbeat)]
    return sock, monitor, answers[0] if answers else None


def _flood(sock: zmq.Socket, monitor: zmq.Socket, report: bytes, until: float) -> tuple[int, bool]:
    """Send `report` again and again (one report a round is a member's share) until the
    monitor sees the connection end, or `until`; what coordd sends back is read and dropped.
    How many went, and whether it was cut off."""
    sent = 0
    while now() < until:
        for _ in range(256):
            try:
                sock.send(report, zmq.NOBLOCK)
            except zmq.Again:
                time.sleep(0.001)
                break
            sent += 1
        while sock.poll(0, zmq.POLLIN):
            sock.recv(zmq.NOBLOCK)
        if monitor.poll(0, zmq.POLLIN):
            event = recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                return sent, True
    return sent, False


def run_squatter(spec: WorkerSpec, log: HistoryWriter) -> int:
    """junk_groups' culprit. Before the group starts, it takes every --max-groups slot with
    names coordd's patterns admit (`fill_groups`, rank 0 of each; the last over a raw DEALER)
    and asks for one more (refused group_limit): the group, named exactly, then registers at
    the limit. Once the group's rounds are live: Hellos for groups the deployment does not
    expect (`junk_names`, each refused group_unexpected), one more over the limit, then its
    raw member sends its report again and again until coordd cuts that connection off; the
    members it still holds must then answer pings (nothing else was cut)."""
    held: list[tuple[str, CoordClient]] = []
    sock = monitor = None
    try:
        for group in spec.fill_groups[:-1]:
            client = _ask(spec, log, group, "fill")
            if client is not None:
                held.append((group, client))
        sock, monitor, answer = _raw_member(spec, spec.fill_groups[-1])
        if isinstance(answer, Welcome):
            log.write(Note(t=now(), what="welcomed", detail=spec.fill_groups[-1]))
        else:
            detail = f"the flooding member's Hello for {spec.fill_groups[-1]} got {answer}"
            log.write(Note(t=now(), what="no member", detail=detail))
        over = list(spec.over_groups)
        _ask(spec, log, over.pop(0), "over the limit")
        filled = len(held) + isinstance(answer, Welcome)
        log.write(Note(t=now(), what="filled", detail="junk groups held", count=filled))
        wait_for_trigger(spec)
        detail = f"{len(spec.junk_names)} unexpected groups, then a member's flood"
        log.write(Inject(t=now(), fault=spec.fault, detail=detail))
        for name in spec.junk_names:
            _ask(spec, log, name, "unexpected group")
        for name in over:
            _ask(spec, log, name, "over the limit")
        log.write(Note(t=now(), what="asked", detail="unexpected", count=len(spec.junk_names)))
        log.write(Note(t=now(), what="asked", detail="over the limit", count=len(over) + 1))
        if isinstance(answer, Welcome):
            report = StepReport(
                num_tokens=1,
                num_tokens_padded=1,
                dp_rank=0,
                epoch=answer.epoch,
                seq=answer.next_seq,
                kind=kind_for(spec.seed, answer.next_seq),
            )
            began = now()
            sent, cut = _flood(
                sock, monitor, encode(report), min(spec.deadline, began + FLOOD_SECONDS)
            )
            detail = f"after {sent} copies of one report in {now() - began:.2f}s"
            log.write(Note(t=now(), what="cut" if cut else "not cut", detail=detail, count=sent))
        log.write(Note(t=now(), what="asked", detail="pings", count=len(held)))
        for group, client in held:
            try:
                client.ping(timeout=PROBE_TIMEOUT)
            except CoordError as error:
                log.write(Note(t=now(), what="no pong", detail=f"{group}: {error}"))
            else:
                log.write(Note(t=now(), what="pong", detail=group))
    finally:
        for _, client in held:
            client.close()
        if monitor is not None:
            monitor.close(linger=0)
        if sock is not None:
            sock.close(linger=0)
    log.write(Done(t=now(), next_seq=0, reason="squatter"))
    return 0
