"""Processes that only try to join: a Hello that disagrees with the group, or a second
client for a rank the group already has."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from coordd.proto.errors import CoordError
from coordd.proto.messages import Welcome
from coordd.testing.history import Done, HistoryWriter, Inject, Refused, Registered, error_info
from coordd.testing.rawrank import RawRank
from coordd.tools.chaos.roles._common import client_config, now, wait_for_go, wait_for_trigger
from coordd.tools.chaos.roles.rank_loop import ClientDriver
from coordd.tools.chaos.spec import WorkerSpec


def run_joiner(spec: WorkerSpec, log: HistoryWriter) -> int:
    """A rank whose Hello disagrees with the group (dp_size, fingerprint or protocol version)."""
    field, value = spec.hello_field, spec.hello_value
    timeout = min(5.0, max(0.1, spec.deadline - now()))
    if field == "protocol_version":
        rank = RawRank(config=client_config(spec))
        hello = msgspec.structs.replace(rank.session.hello_message, protocol_version=int(value))
        wait_for_go(spec)
        return _try_join(log, spec, lambda: rank.register(timeout, hello), rank.close)
    overrides: dict[str, Any] = {"dp_size": int(value)} if field == "dp_size" else {}
    if field == "config_fingerprint":
        overrides["config_fingerprint"] = value
    driver = ClientDriver(spec, **overrides)
    wait_for_go(spec)
    return _try_join(log, spec, lambda: driver.register(timeout), driver.close)


def run_impostor(spec: WorkerSpec, log: HistoryWriter) -> int:
    """A second real client that claims a rank the group already has."""
    driver = ClientDriver(spec)  # connected before the trigger: the Hello goes out at once
    wait_for_trigger(spec)
    return _try_join(log, spec, lambda: driver.register(min(5.0, spec.wait_timeout)), driver.close)


def _try_join(
    log: HistoryWriter, spec: WorkerSpec, join: Callable[[], Welcome], close: Callable[[], None]
) -> int:
    log.write(Inject(t=now(), fault=spec.fault, rank=spec.dp_rank))
    try:
        welcome = join()
    except CoordError as error:
        log.write(Refused(t=now(), error=error_info(error), what="hello"))
    else:
        log.write(Registered(t=now(), epoch=welcome.epoch, next_seq=welcome.next_seq))
    finally:
        close()
    log.write(Done(t=now(), next_seq=0, reason="joiner"))
    return 0
