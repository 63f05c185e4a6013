"""vLLM's fault tolerance, the plugin's side, without vLLM: a rank's fault reaches the others as
coordd's typed error (what makes a vLLM engine UNHEALTHY under `--enable-fault-tolerance`), then
every rank rebuilds its gloo group with the same ranks, as vLLM's `retry` does
(`EngineCoreSentinel._reinit_dp_group`: a new ProcessGroup from
`stateless_init_torch_distributed_process_group`; the workers' `_DP` gets a new `cpu_group`), and
syncs again: the plugin registers the group again in a new epoch and the rounds are right.

The CPU engine cannot run vLLM's own `retry`: fault tolerance needs external load balancing
(`vllm serve` per rank) and an all2all backend with fault support, and the CPU all2all
manager's `clean_buffers()` raises NotImplementedError inside the worker's retry
(docs/vllm.md, "Fault tolerance")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from coordd.testing import CoorddProcess
from tests.integration.scrape import free_port, metric_value

RANK = r"""
import json, sys, time
import torch
import torch.distributed as dist
from coordd.proto.errors import CoordError
from coordd.vllm.enable import PluginSettings
from coordd.vllm.exchange import Exchange, ReduceOp
from coordd.vllm.groups import GroupIdentity

rank, address, store, fallback = sys.argv[1:5]
rank = int(rank)
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
group = dist.new_group([0, 1], backend="gloo")
ex = Exchange(PluginSettings(address, connect_timeout=10, sync_timeout=30,
                             fallback=fallback == "1"))
ident = GroupIdentity("dp-tp0-pp0", rank, 2, "fp")
out = {"rank": rank, "faults": [], "wrong": 0, "rounds": 0}


def sync(n):
    t = torch.zeros(4, 2, dtype=torch.int32)
    t[:, rank] = n * 10 + rank
    if not ex.sync_(t, ReduceOp.SUM, ident, True, group=group):
        dist.all_reduce(t, group=group)
    if t[0].tolist() != [n * 10, n * 10 + 1]:
        out["wrong"] += 1
    out["rounds"] += 1


for n in range(10):
    sync(n)
if rank == 1:
    time.sleep(4.0)  # past coordd's 2 s step timeout: this rank's fault
try:
    sync(10)
except CoordError as error:
    out["faults"].append(f"{type(error).__name__}: {error}")
# the retry: every rank rebuilds its group with the same ranks, then syncs again
dist.barrier(group=group)
group = dist.new_group([0, 1], backend="gloo")
for n in range(11, 31):
    try:
        sync(n)
    except CoordError as error:
        out["faults"].append(f"after the rebuild: {type(error).__name__}: {error}")
        break
link = ex._links[ident.name]
out["on_coordd"] = link.client is not None
out["epoch"] = link.client.epoch if link.client is not None else None
out["regroups"] = ex.regroups
print("RESULT " + json.dumps(out), flush=True)
ex.close()
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fallback", [True, False], ids=["fallback", "fail-stop"])
def test_a_group_rebuilt_after_a_fault_registers_again(tmp_path: Path, fallback: bool) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    port = free_port()
    args = ["--step-timeout", "2", "--metrics-port", str(port), "--log-level", "error"]
    with CoorddProcess(2, f"ipc://{tmp_path}/c.sock", args) as coordd:
        ranks = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(script),
                    str(r),
                    coordd.address,
                    str(tmp_path / "store"),
                    "1" if fallback else "0",
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        try:
            outs = [p.communicate(timeout=180) for p in ranks]
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        registrations = metric_value(port, 'coordd_registrations_total{group="dp-tp0-pp0"}')
    results: list[dict[str, Any]] = []
    for out, err in outs:
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert lines, err[-3000:]
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    for result in results:
        # the fault is coordd's typed error naming rank 1, at both ranks, and no switch
        assert len(result["faults"]) == 1, result
        assert result["faults"][0].startswith("StepTimeout") and "[1]" in result["faults"][0]
        assert result["wrong"] == 0 and result["rounds"] == 30, result
        assert result["regroups"] == 1 and result["on_coordd"], result
    assert results[0]["epoch"] == results[1]["epoch"]
    assert registrations == 4  # each rank twice: at the start and after the rebuild
