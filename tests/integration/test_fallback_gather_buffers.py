"""A gather round on the fallback's device path makes no tensor once warm: its row goes into
the device client's buffers for its width, reused round after round, and its rows and errors
(a rank at another site: StepMismatch naming it) are as before.

Two spawned ranks on a gloo group, each a `FallbackClient` whose coordd never answers (an ipc
path nothing listens on), so the group runs on the device path from `connect()`."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

WORLD = 2
SITE = "it.buffers"
#: Value counts of the gathers: one buffer set per width (and per round in flight).
COUNTS = (0, 1, 3, 7)


def _values(rank: int, index: int, count: int) -> list[int]:
    return [index * 1000 + rank * 100 + k - 50 for k in range(count)]


def _rank(rank: int, store: str, address: str, out: mp.Queue) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
            timeout=datetime.timedelta(seconds=60),
        )  # fmt: skip
        out.put((rank, _check(rank, address)))
    except BaseException as exc:
        out.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _check(rank: int, address: str) -> str:
    from coordd.client.fallback import FallbackClient

    config = dict(dp_rank=rank, dp_size=WORLD, wait_timeout=30, config_fingerprint="buffers")
    with FallbackClient(address, switch_timeout=30, **config) as client:
        return _gathers(rank, client)


def _gathers(rank: int, client: Any) -> str:
    import torch

    from coordd.client.fallback import DEVICE
    from coordd.proto.errors import StepMismatch

    client.connect(timeout=1.0)
    assert client.path == DEVICE, client.path

    def expect(index: int, count: int, rows: Any) -> None:
        want = [_values(r, index, count) for r in range(WORLD)]
        assert rows == want, (index, count, rows, want)

    index = 0
    for _ in range(2):  # warm-up: two rounds in flight per width, two buffer sets each
        for count in COUNTS:
            pending = [client.start_gather(SITE, _values(rank, index + k, count)) for k in (0, 1)]
            for k, p in enumerate(pending):
                expect(index + k, count, p.wait())
            index += 2

    made: list[str] = []

    def refusing(name: str, original: Any) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller == "coordd.client.own_path":  # the path vote's own matrix
                return original(*args, **kwargs)
            made.append(f"torch.{name} from {caller}")
            raise AssertionError(f"a gather made a tensor: torch.{name} from {caller}")

        return refuse

    for name in ("zeros", "tensor", "empty", "frombuffer", "as_tensor", "zeros_like"):
        setattr(torch, name, refusing(name, getattr(torch, name)))
    for i in range(200):
        count = COUNTS[i % len(COUNTS)]
        if i % 3:
            expect(index, count, client.gather(SITE, _values(rank, index, count)))
            index += 1
        else:
            pending = [client.start_gather(SITE, _values(rank, index + k, count)) for k in (0, 1)]
            for k, p in enumerate(pending):
                expect(index + k, count, p.wait())
            index += 2

    # A rank at another site is still named, and the gathers after it run as before.
    try:
        client.gather(SITE if rank == 0 else "it.other", [1, 2, 3])
        raise AssertionError("a gather at another site on rank 1 passed")
    except StepMismatch as error:
        assert error.rank == 1, error
        mine = "gather:it.buffers" if rank == 0 else "gather:it.other"
        assert mine in str(error) and "gather site " in str(error), error
    for count in COUNTS:
        expect(index, count, client.gather(SITE, _values(rank, index, count)))
        index += 1
    assert client.path == DEVICE and not made, (client.path, made)
    return "ok"


@pytest.mark.timeout(180)
def test_device_path_gathers_make_no_tensor_once_warm(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    address = f"ipc://{tmp_path}/nobody.sock"
    store = str(tmp_path / "store")
    procs = [
        ctx.Process(target=_rank, args=(rank, store, address, out), daemon=True)
        for rank in range(WORLD)
    ]
    for proc in procs:
        proc.start()
    try:
        got = dict(out.get(timeout=150) for _ in procs)
        assert got == {rank: "ok" for rank in range(WORLD)}
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
