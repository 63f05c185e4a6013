"""Steps more than one scenario takes: a network namespace to cut, let the group end once its
culprit is done."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from coordd.testing.history import Begin, Note
from coordd.tools.chaos import netns
from coordd.tools.chaos.scenario_run import Process, ScenarioRun, Skip


def run_on_until_done(run: ScenarioRun, culprit: Process, start: Callable[[], None]) -> None:
    """Start the group (`start`), which rounds on past its end until `culprit` has exited, then
    10 rounds more (the end seq written into `until_file`): the culprit acts while the group
    runs, and the group is seen going on."""
    start()
    run.wait_until(lambda: culprit.popen.poll() is not None, f"{culprit.name} to finish")
    release_end(run)


def release_end(run: ScenarioRun) -> None:
    """Let ranks started with `until_file` end: 10 rounds past the furthest one begun (at
    least `end_seq`), the seq they agree on through the rounds (see `roles.rank_loop`). The
    end is set only now so that a fault injected once a rank reached `inject_seq` lands while
    the group still runs, however slowly the runner got to it."""
    ranks = [p for name, p in run.processes.items() if name.startswith("rank")]
    for p in ranks:
        p.poll_log()
    seq = max((r.seq for p in ranks for r in p.records if isinstance(r, Begin)), default=0)
    end = max(run.end_seq, seq + 10)  # one end for all: a rank that stops early fails the rest
    with open(run.until_file + ".tmp", "w") as f:
        f.write(str(end))
    os.replace(run.until_file + ".tmp", run.until_file)
    run.event(Note(t=time.monotonic(), what="released", detail=f"until seq {end}"))


def prepare_cut(run: ScenarioRun, what: str) -> None:
    """A fresh network namespace whose link `what` cuts (`run.resources["netns"]`), coordd bound
    on its host side; `Skip` where namespaces cannot be made here."""
    reason = netns.unavailable()
    if reason is not None:
        raise Skip(f"{what} needs a network namespace: {reason}")
    netns.remove_stale()
    cut = netns.CutNamespace()
    run.resources["netns"] = cut
    cut.create()
    run.bind_host = cut.host_ip
