"""What every chaos role shares: the clock, the client settings, the runner's barriers,
and reading coordd's answers off a raw socket."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import zmq

from coordd.client._config import ClientConfig
from coordd.proto.errors import CoordError
from coordd.proto.messages import decode_from_coordinator
from coordd.testing.history import Begin, tail_records, wait_for_round
from coordd.testing.rogue import RoguePeer
from coordd.tools.chaos.spec import WorkerSpec

now = time.monotonic
#: The rogue's probe (three questions) may take this long in all: on busy cores an answer can
#: come seconds late, and a coordd that does not answer still fails within the scenario's budget.
PROBE_TIMEOUT = 15.0


def client_config(spec: WorkerSpec, **overrides: Any) -> ClientConfig:
    """The settings every client of this worker (real or raw) is made with."""
    spec_config = ClientConfig(
        address=spec.address,
        dp_rank=spec.dp_rank,
        dp_size=spec.dp_size,
        config_fingerprint=spec.fingerprint,
        wait_timeout=spec.wait_timeout,
        heartbeat_interval=spec.heartbeat_interval,
        heartbeat_timeout=spec.heartbeat_timeout,
    )
    return ClientConfig.of(spec_config, **overrides)


def wait_for_go(spec: WorkerSpec) -> None:
    """The runner's startup barrier (see `WorkerSpec.go_file`)."""
    while spec.go_file and not os.path.exists(spec.go_file) and now() < spec.deadline:
        time.sleep(0.002)


def wait_for_trigger(spec: WorkerSpec) -> None:
    """Until the trigger process has begun round `trigger_seq` (or ended, or the deadline)."""
    if spec.trigger_log:
        wait_for_round(spec.trigger_log, spec.trigger_seq, spec.deadline)


def rogue_peer(spec: WorkerSpec) -> RoguePeer:
    """A peer outside the group, with the scenario's heartbeat settings."""
    return RoguePeer(
        spec.address,
        spec.dp_size,
        seed=spec.seed,
        heartbeat_interval=spec.heartbeat_interval,
        heartbeat_timeout=spec.heartbeat_timeout,
    )


def live_round(path: str, offset: int, last: tuple[int, int]) -> tuple[int, tuple[int, int]]:
    """The (epoch, seq) a rank's log shows it in last, read on from `offset`."""
    records, offset = tail_records(path, offset)
    for r in records:
        if isinstance(r, Begin):
            last = (r.epoch, r.seq)
    return offset, last


def read_answers(sock: zmq.Socket, timeout: float = 0.0) -> list[object]:
    """Whatever coordd sent `sock` (undecodable frames left out), waiting up to `timeout`."""
    out: list[object] = []
    while sock.poll(int(timeout * 1000), zmq.POLLIN):
        with contextlib.suppress(CoordError, zmq.Again):
            out.append(decode_from_coordinator(sock.recv(zmq.NOBLOCK)))
        timeout = 0.0
    return out
