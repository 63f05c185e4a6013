"""coordd lost under ranks on a `FallbackClient` (role "fallback"): nothing may fail.

The group must absorb each of these: every round decided (on coordd or on the device path)
equal to the policy over every rank's report, the same for every rank, no error, and every
rank switching paths at the same rounds (the checker compares their "switch" notes).
"""

from __future__ import annotations

import signal
import time

from coordd.testing.dying_coordd import DyingCoordd
from coordd.testing.history import Inject, Note
from coordd.testing.scenario import Expect
from coordd.tools.chaos.scenario_run import Scenario, ScenarioRun
from coordd.tools.chaos.scenarios._steps import release_end
from coordd.tools.chaos.spec import Fault


class _Fallback(Scenario):
    expect = Expect()

    def start(self, run: ScenarioRun, address: str = "") -> None:
        run.culprit, run.culprit_name = -1, "coordd"
        if address:
            run.address = address
        roles = dict.fromkeys(range(run.dp), "fallback")
        run.start_ranks(roles, until_file=run.until_file)
        run.wait_seq("rank0", run.inject_seq)

    def switched(self, run: ScenarioRun, count: int) -> None:
        """Until every rank has logged `count` switches."""
        ranks = [run.processes[f"rank{r}"] for r in range(run.dp)]

        def done() -> bool:
            for p in ranks:
                p.poll_log()
            return all(
                p.popen.poll() is not None
                or sum(isinstance(r, Note) and r.what == "switch" for r in p.records) >= count
                for p in ranks
            )

        run.wait_until(done, f"every rank to switch paths {count}x")

    def kill(self, run: ScenarioRun) -> str:
        """SIGKILL coordd (a round is open most of the time); its address."""
        assert run.coordd is not None
        coordd, run.coordd = run.coordd, None
        run.event(Inject(t=time.monotonic(), fault=self.fault.value, detail="coordd SIGKILL"))
        coordd.signal(signal.SIGKILL)
        coordd.stop()
        return coordd.address

    def out_and_back(self, run: ScenarioRun, switches: int) -> None:
        """Kill coordd, and once every rank has left it (its `switches`-th switch), start a
        new one on the same address."""
        address = self.kill(run)
        self.switched(run, switches)
        run.start_coordd(address)


class CoorddLostFallback(_Fallback):
    fault = Fault.COORDD_LOST_FALLBACK
    summary = "SIGKILL coordd with a round open: the group goes on on the device path"

    def run(self, run: ScenarioRun) -> None:
        self.start(run)
        self.kill(run)
        self.switched(run, 1)
        release_end(run)


class CoorddBackFallback(_Fallback):
    fault = Fault.COORDD_BACK_FALLBACK
    summary = "SIGKILL and restart coordd, or SIGSTOP and resume it: out and back at one round"

    def run(self, run: ScenarioRun) -> None:
        self.start(run)
        if run.rng.random() < 0.5:
            self.out_and_back(run, 1)
        else:
            assert run.coordd is not None
            run.event(Inject(t=time.monotonic(), fault=self.fault.value, detail="coordd SIGSTOP"))
            run.coordd.signal(signal.SIGSTOP)
            self.switched(run, 1)
            run.coordd.signal(signal.SIGCONT)
        self.switched(run, 2)
        release_end(run)


class CoorddFlapping(_Fallback):
    fault = Fault.COORDD_FLAPPING
    summary = "kill and restart coordd twice: the group follows at a bounded pace, in step"

    def run(self, run: ScenarioRun) -> None:
        self.start(run)
        for flap in range(2):
            self.out_and_back(run, 2 * flap + 1)
            self.switched(run, 2 * flap + 2)
        release_end(run)


class CoorddPartialAnswer(_Fallback):
    fault = Fault.COORDD_PARTIAL_ANSWER
    summary = "coordd answers a round to some ranks only, then exits: the others catch up"

    def run(self, run: ScenarioRun) -> None:
        answered = sorted(run.rng.sample(range(run.dp), run.rng.randint(1, run.dp - 1)))
        fake = DyingCoordd(
            run.dp, f"ipc://{run.dir}/fake.sock", die_at=run.inject_seq, answer_to=answered
        )
        run.resources["fake"] = fake
        fake.start()
        detail = f"a coordd that answers round {run.inject_seq} to ranks {answered}, then exits"
        run.event(Inject(t=time.monotonic(), fault=self.fault.value, detail=detail))
        self.start(run, fake.address)
        self.switched(run, 1)
        release_end(run)

    def cleanup(self, run: ScenarioRun) -> None:
        fake = run.resources.get("fake")
        if fake is not None:
            fake.stop()
