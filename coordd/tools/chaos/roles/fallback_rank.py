"""A rank on a `FallbackClient` (role "fallback"): coordd's loss must not fail it.

The ranks form a gloo group (a file store in the scenario's directory) and run the honest
rank loop through a `FallbackClient`. A round is logged once its outcome is known, under the
path that answered it: its Begin (timed at its start) carries the report as that path stamped
it, so the checker holds every round, on coordd or on the device path (epoch 0), to the policy
over every rank's report. Each switch is a Note ("switch": round and path) the checker
compares across the ranks.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import msgspec

from coordd.proto.errors import CoordError
from coordd.proto.messages import StepKind, StepReport, Welcome
from coordd.testing.history import Begin, HistoryWriter, Note, report_dict
from coordd.tools.chaos.roles._common import client_config, now
from coordd.tools.chaos.roles.rank_loop import RankWorker
from coordd.tools.chaos.seeded_reports import kind_for, report_for
from coordd.tools.chaos.spec import WorkerSpec


class FallbackDriver:
    """`RankWorker`'s driver over a `FallbackClient`: seq is the group's round index."""

    def __init__(self, spec: WorkerSpec) -> None:
        import torch.distributed as dist

        from coordd.client.fallback import FallbackClient

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = os.path.join(os.path.dirname(spec.log_path), "gloo.store")
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=spec.dp_rank,
            world_size=spec.dp_size,
            timeout=datetime.timedelta(seconds=max(1.0, spec.deadline - now())),
        )
        self.client = FallbackClient(config=client_config(spec))

    @property
    def epoch(self) -> int | None:
        coordd = self.client.coordd
        return coordd.epoch if coordd is not None else 0

    @property
    def next_seq(self) -> int:
        return self.client.started

    def register(self, timeout: float) -> Welcome:
        return self.client.connect(timeout)

    def close(self) -> None:
        """Close the client, then the gloo group (left to exit, its threads abort the process)."""
        import torch.distributed as dist

        self.client.close()
        dist.destroy_process_group()


class FallbackWorker(RankWorker):
    def _round(self, driver: Any, seq: int) -> None:
        spec = self.spec
        kind = kind_for(spec.seed, seq)
        report = report_for(spec.seed, spec.dp_rank, seq)
        if spec.until_file:
            report = msgspec.structs.replace(report, want_pause=os.path.exists(spec.until_file))
        began = now()
        epoch, path_seq = self._path_round(driver)
        switches = len(driver.client.switches)
        pending = driver.client.start(report, kind)
        self._work()
        try:
            decision = pending.wait(spec.wait_timeout)
        except CoordError:
            self._logged(began, epoch, path_seq, kind, report)
            raise
        self._logged(began, decision.epoch, decision.seq, kind, report)
        self._end(decision.epoch, decision.seq, decision)
        for at, path, why, t in driver.client.switches[switches:]:
            self.log.write(Note(t=t, what="switch", detail=f"{at} {path}: {why}"[:200]))
        self._until_agreed(seq, decision)

    @staticmethod
    def _path_round(driver: FallbackDriver) -> tuple[int, int]:
        """The (epoch, seq) the round would have on the path it starts on."""
        client = driver.client
        if client.coordd is not None and client.path == "coordd":
            return client.coordd.epoch or 0, client.coordd.session.next_seq
        return 0, client.device.session.next_seq

    def _logged(
        self, began: float, epoch: int, seq: int, kind: StepKind, report: StepReport
    ) -> None:
        """The round's Begin, at its start, as the path that answered it stamped it."""
        sent = msgspec.structs.replace(
            report, dp_rank=self.spec.dp_rank, epoch=epoch, seq=seq, kind=kind
        )
        self.log.write(
            Begin(t=began, epoch=epoch, seq=seq, kind=kind.value, sent=[report_dict(sent)])
        )


def run_fallback_rank(spec: WorkerSpec, log: HistoryWriter) -> int:
    worker = FallbackWorker(spec, log)
    driver = FallbackDriver(spec)
    try:
        return worker.run(driver)  # type: ignore[arg-type]
    finally:
        driver.close()
