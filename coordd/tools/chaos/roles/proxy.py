"""forged_answers' culprit: a man in the middle that forges the answers of one round."""

from __future__ import annotations

import contextlib
import os
import random

import msgspec
import zmq

from coordd.proto.errors import CoordError
from coordd.proto.messages import (
    Hello,
    StepDecision,
    StepKind,
    decode_from_coordinator,
    decode_to_coordinator,
    encode,
)
from coordd.testing.history import Done, HistoryWriter, Inject, Note
from coordd.tools.chaos.roles._common import now
from coordd.tools.chaos.spec import WorkerSpec


def _forged(decision: StepDecision, forge: str, dp_size: int, rng: random.Random) -> StepDecision:
    """`decision` with the one misfit `forge` names: an answer the rank must refuse."""
    replace = msgspec.structs.replace
    if forge == "seq":  # a round this rank has not reported yet
        return replace(decision, seq=decision.seq + rng.choice([1, 2]))
    if forge == "num_tokens_across_dp":
        across = list(decision.num_tokens_across_dp)
        return replace(decision, num_tokens_across_dp=rng.choice([across[:-1], [*across, 1]]))
    if forge == "dead_ranks":
        return replace(decision, dead_ranks=[rng.choice([dp_size, -1])])
    if forge == "cudagraph_mode":
        return replace(decision, cudagraph_mode=rng.choice([3, -1]))
    if forge == "kind":
        kinds = [
            k for k in (StepKind.FORWARD, StepKind.DRAFT, StepKind.STATE) if k != decision.kind
        ]
        return replace(decision, kind=rng.choice(kinds))
    raise ValueError(f"no such misfit: {forge}")


def _unsolicited(decision: StepDecision, extra: str) -> StepDecision:
    """An answer for no round the rank has open: `decision` again (its round is answered),
    or one of the epoch before."""
    if extra == "again":
        return decision
    if extra == "old_epoch":
        return msgspec.structs.replace(decision, epoch=decision.epoch - 1)
    raise ValueError(f"no such unsolicited answer: {extra}")


def run_proxy(spec: WorkerSpec, log: HistoryWriter) -> int:
    """forged_answers' culprit: a man in the middle between the ranks and the real coordd
    (`upstream`). It binds `address` (a ROUTER; the ranks are given it), opens one DEALER to
    coordd per rank connection, under that connection's routing id, and forwards every frame
    both ways as it is, but two: the victim's (`dp_rank`) decision of round `fault_seq` is
    replaced by a misfit (`forge`), and after `extra_rank`'s decision of that round comes one
    more that answers no round it has open (`extra`). It ends once `stop_file` exists.

    (A rank that reconnects under a new routing id would get a second DEALER while the first
    still holds its rank at coordd: nothing in this scenario drops a connection.)"""
    rng = random.Random(f"proxy:{spec.seed}")
    ctx: zmq.Context = zmq.Context.instance()
    front: zmq.Socket = ctx.socket(zmq.ROUTER)
    front.setsockopt(zmq.LINGER, 0)
    front.bind(spec.address)
    log.write(Note(t=now(), what="listening", detail=front.getsockopt_string(zmq.LAST_ENDPOINT)))
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    backs: dict[bytes, zmq.Socket] = {}
    owners: dict[zmq.Socket, bytes] = {}
    ranks: dict[bytes, int] = {}
    forged = added = False
    up = down = 0

    def back_for(identity: bytes) -> zmq.Socket:
        back = backs.get(identity)
        if back is None:
            back = backs[identity] = ctx.socket(zmq.DEALER)
            back.setsockopt(zmq.LINGER, 0)
            back.setsockopt(zmq.ROUTING_ID, identity)
            back.connect(spec.upstream)
            owners[back] = identity
            poller.register(back, zmq.POLLIN)
        return back

    def answers(identity: bytes, frames: list[bytes]) -> list[bytes]:
        """What goes to the rank behind `identity` for coordd's `frames`."""
        nonlocal forged, added
        rank = ranks.get(identity)
        if (forged and added) or rank not in (spec.dp_rank, spec.extra_rank):
            return frames
        try:
            message = decode_from_coordinator(frames[-1])
        except CoordError:
            return frames
        if not isinstance(message, StepDecision) or message.seq < spec.fault_seq:
            return frames
        if rank == spec.dp_rank and not forged:
            forged = True
            misfit = _forged(message, spec.forge, spec.dp_size, rng)
            detail = f"{spec.forge} of seq {message.seq} to rank {rank}: {misfit}"
            log.write(Inject(t=now(), fault=spec.fault, rank=rank, detail=detail))
            log.write(Note(t=now(), what="misfit", detail=spec.forge, count=message.seq))
            return [encode(misfit)]
        if rank == spec.extra_rank and not added:
            added = True
            extra = _unsolicited(message, spec.extra)
            detail = f"unsolicited ({spec.extra}) after seq {message.seq} to rank {rank}: {extra}"
            log.write(Inject(t=now(), fault=spec.fault, rank=rank, detail=detail))
            log.write(Note(t=now(), what="unsolicited", detail=spec.extra, count=rank))
            return [*frames, encode(extra)]
        return frames

    try:
        while now() < spec.deadline and not os.path.exists(spec.stop_file):
            for sock, _ in poller.poll(50):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if sock is front:
                        identity, payload = frames[0], frames[1:]
                        if identity not in ranks and payload:
                            with contextlib.suppress(CoordError):
                                hello = decode_to_coordinator(payload[-1])
                                if isinstance(hello, Hello):
                                    ranks[identity] = hello.dp_rank
                        back_for(identity).send_multipart(payload)
                        up += 1
                    else:
                        identity = owners[sock]
                        for frame in answers(identity, frames):
                            front.send_multipart([identity, frame])
                            down += 1
    finally:
        for back in backs.values():
            back.close(linger=0)
        front.close(linger=0)
    log.write(Note(t=now(), what="forwarded", detail="to coordd", count=up))
    log.write(Note(t=now(), what="forwarded", detail="to the ranks", count=down))
    log.write(Done(t=now(), next_seq=0, reason="proxy"))
    return 0
