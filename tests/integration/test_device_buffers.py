"""The device path makes its tensors once: after the first rounds, a round (one at a time, or
several in flight) creates no tensor, and every decision is still the policy's.

One spawned rank on a gloo group of one (the test process keeps no process group)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

pytest.importorskip("torch")


def _rank(store: str, out: mp.Queue) -> None:
    try:
        out.put(_check(store))
    except BaseException as exc:
        out.put(f"{type(exc).__name__}: {exc}")


def _check(store: str) -> str:
    import torch
    import torch.distributed as dist

    from coordd.client.device import DeviceCoordClient
    from coordd.proto.messages import StepKind, StepReport
    from coordd.proto.policy import decide

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    client = DeviceCoordClient(config_fingerprint="buffers", wait_timeout=30)
    client.connect(timeout=30)
    kinds = [StepKind.FORWARD, StepKind.DRAFT, StepKind.STATE]

    def report(i: int) -> StepReport:
        return StepReport(num_tokens=i, num_tokens_padded=i + i % 3, want_ubatch=i % 2 == 0)

    seqs = iter(range(10**6))

    def check(i: int, got: object) -> None:
        want = decide([report(i)], epoch=0, seq=next(seqs), kind=kinds[i % 3])
        assert got == want, (i, got, want)

    for i in range(3):  # three rounds in flight: three sets of buffers
        pending = [client.start(report(i + k), kinds[(i + k) % 3]) for k in range(3)]
        for k, p in enumerate(pending):
            check(i + k, p.wait())

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a tensor was made in a round")

    for name in ("zeros", "tensor", "empty", "frombuffer", "as_tensor", "zeros_like"):
        setattr(torch, name, refuse)
    torch.Tensor.pin_memory = refuse  # type: ignore[method-assign]
    torch.Tensor.cpu = refuse  # type: ignore[method-assign]
    for i in range(60):
        if i % 20 < 10:
            check(i, client.coordinate(report(i), kinds[i % 3]))
        else:
            pending = [client.start(report(i), kinds[i % 3])]
            pending.append(client.start(report(i + 100), kinds[(i + 100) % 3]))
            check(i, pending[0].wait())
            check(i + 100, pending[1].wait())
    client.close()
    dist.destroy_process_group()
    return "ok"


@pytest.mark.timeout(120)
def test_no_tensor_is_made_per_round(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_rank, args=(str(tmp_path / "store"), out), daemon=True)
    proc.start()
    try:
        assert out.get(timeout=100) == "ok"
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
