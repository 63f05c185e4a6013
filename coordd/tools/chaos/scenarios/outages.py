"""coordd itself going away (a restart) and the link to a rank going away (a cut)."""

from __future__ import annotations

import signal
import time

from coordd.testing.history import Inject, Note
from coordd.testing.scenario import Expect
from coordd.tools.chaos import netns
from coordd.tools.chaos.scenario_run import Scenario, ScenarioRun
from coordd.tools.chaos.scenarios._steps import prepare_cut, release_end
from coordd.tools.chaos.spec import Fault

# -- coordd itself ----------------------------------------------------------------------------


class CoorddRestart(Scenario):
    fault = Fault.COORDD_RESTART
    summary = "kill coordd (SIGKILL or SIGTERM) and start a new one on the same address"
    expect = Expect(
        failure=True,
        errors=["CoordinatorUnavailable"],
        names_culprit=False,
        split_allowed=True,
    )

    def run(self, run: ScenarioRun) -> None:
        observed = f"rank{run.culprit}"
        run.culprit = -1
        run.culprit_name = "coordd"
        run.start_ranks(until_file=run.until_file)  # on until coordd is back (release_end)
        run.wait_seq(observed, run.inject_seq)
        time.sleep(run.rng.uniform(0.0, 0.004))
        run.restart_coordd(run.rng.choice([signal.SIGKILL, signal.SIGTERM]))
        release_end(run)


class NetworkCut(Scenario):
    fault = Fault.NETWORK_CUT
    transport = "tcp"
    summary = "over tcp, one rank's link goes down (network namespace + veth), then back up"
    expect = Expect(
        failure=True,
        errors=["RankLost", "StepTimeout"],
        culprit_view="any",
        culprit_must_fail=True,
    )

    def prepare(self, run: ScenarioRun) -> None:
        prepare_cut(run, "network cut")

    def run(self, run: ScenarioRun) -> None:
        cut: netns.CutNamespace = run.resources["netns"]
        name = run.culprit_name = f"rank{run.culprit}"
        for rank in range(run.dp):
            prefix = cut.prefix_argv() if rank == run.culprit else []
            spec = run.spec(f"rank{rank}", "rank", rank, until_file=run.until_file)
            run.start_worker(spec, prefix)
        run.release([f"rank{r}" for r in range(run.dp)])
        run.wait_seq(name, run.inject_seq)
        t = time.monotonic()
        run.event(Inject(t=t, fault=self.fault.value, rank=run.culprit, detail=cut.name))
        cut.cut()
        run.wait_until(lambda: time.monotonic() - t > run.settings.heartbeat_timeout, "a while")
        run.wait_detected(run.honest_names(), t)
        time.sleep(run.rng.uniform(0.0, 0.5))
        cut.restore()
        run.event(Note(t=time.monotonic(), what="link restored", detail=cut.name))
        release_end(run)

    def cleanup(self, run: ScenarioRun) -> None:
        cut = run.resources.get("netns")
        if cut is not None:
            cut.remove()
