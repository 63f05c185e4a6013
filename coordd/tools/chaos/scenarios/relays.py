"""A relay going away: killed, paused past the heartbeat timeout, or cut off from the root.

The group runs through relays: a root coordd, two relays (`coordd serve --relay-to`), each
serving half of the ranks over ipc. The fault hits one relay; the other relay's ranks must get
one typed error naming the lost relay's ranks (its lowest rank is the scenario's culprit), and
the lost relay's own ranks any typed error (their relay, or its root, is gone). Then the relay
comes back (a fresh process on the same address, or resumed, or its link restored), the ranks
register again and the group runs on.
"""

from __future__ import annotations

import os
import signal
import time

from coordd.testing.history import Inject, Note
from coordd.testing.scenario import Expect
from coordd.tools.chaos import netns
from coordd.tools.chaos.scenario_run import ChaosCoordd, Scenario, ScenarioRun
from coordd.tools.chaos.scenarios._steps import prepare_cut, release_end
from coordd.tools.chaos.spec import Fault

_EXPECT = Expect(
    failure=True,
    errors=["RankLost", "StepTimeout"],
    culprit_view="any",
)


def _layout(dp: int) -> list[range]:
    """Two relays: the lower half of the ranks and the upper half."""
    half = (dp + 1) // 2
    return [range(0, half), range(half, dp)]


class _RelayScenario(Scenario):
    expect = _EXPECT

    def prepare(self, run: ScenarioRun) -> None:
        run.coordd_args = [*run.coordd_args, "--relay-root"]  # the chaos run's coordd is the root

    def start_relay(
        self, run: ScenarioRun, index: int, prefix: list[str] | None = None
    ) -> ChaosCoordd:
        ranks = _layout(run.dp)[index]
        relay = ChaosCoordd(
            run.dp,
            f"ipc://{run.dir}/relay{index}.sock",
            run.settings,
            os.path.join(run.dir, f"relay{index}.log"),
            [
                "--relay-to",
                run.resources["root"],
                "--relay-ranks",
                f"{ranks[0]}-{ranks[-1]}",
                "--relay-name",
                f"node{index}",
                *(["--insecure"] if run.resources["root"].startswith("tcp://") else []),
            ],
        )
        if prefix:
            relay.argv = [*prefix, *relay.argv]
        relay.start(timeout=max(5.0, run.deadline - time.monotonic()))
        run.resources.setdefault("relays", {})[index] = relay
        run.event(
            Note(t=time.monotonic(), what="relay started", detail=f"node{index}", pid=relay.pid)
        )
        return relay

    def start_group(
        self, run: ScenarioRun, prefix_for: int = -1, prefix: list[str] | None = None
    ) -> int:
        """The relays and the ranks (each at its node's relay); the faulty relay's index."""
        run.resources["root"] = run.address
        layout = _layout(run.dp)
        faulty = 0 if run.culprit in layout[0] else 1
        run.culprit = layout[faulty][0]
        run.culprit_name = f"rank{run.culprit}"
        run.also_culprits = [f"rank{r}" for r in layout[faulty]]
        for index in range(2):
            self.start_relay(run, index, prefix if index == prefix_for else None)
        for index, ranks in enumerate(layout):
            address = run.resources["relays"][index].address
            for rank in ranks:
                spec = run.spec(
                    f"rank{rank}", "rank", rank, until_file=run.until_file, address=address
                )
                run.start_worker(spec)
        run.release([f"rank{r}" for r in range(run.dp)])
        return faulty

    def honest(self, run: ScenarioRun) -> list[str]:
        return [f"rank{r}" for r in range(run.dp) if f"rank{r}" not in run.also_culprits]

    def inject(self, run: ScenarioRun, faulty: int, detail: str) -> float:
        run.wait_seq(f"rank{run.culprit}", run.inject_seq)
        time.sleep(run.rng.uniform(0.0, 0.004))
        t = time.monotonic()
        relay = run.resources["relays"][faulty]
        run.event(
            Inject(t=t, fault=self.fault.value, rank=run.culprit, pid=relay.pid, detail=detail)
        )
        return t

    def cleanup(self, run: ScenarioRun) -> None:
        for relay in run.resources.get("relays", {}).values():
            relay.stop()


class RelayKilled(_RelayScenario):
    fault = Fault.RELAY_KILLED
    summary = "SIGKILL a relay mid-run; a fresh relay takes its address"

    def run(self, run: ScenarioRun) -> None:
        faulty = self.start_group(run)
        t = self.inject(run, faulty, f"relay node{faulty} SIGKILL")
        relay = run.resources["relays"][faulty]
        relay.signal(signal.SIGKILL)
        assert relay.proc is not None
        relay.proc.wait(timeout=10)
        relay.stop()
        run.wait_detected(self.honest(run), t)
        self.start_relay(run, faulty)
        release_end(run)


class RelayPaused(_RelayScenario):
    fault = Fault.RELAY_PAUSED
    summary = "SIGSTOP a relay past the heartbeat timeout, then SIGCONT"

    def run(self, run: ScenarioRun) -> None:
        faulty = self.start_group(run)
        t = self.inject(run, faulty, f"relay node{faulty} SIGSTOP")
        relay = run.resources["relays"][faulty]
        relay.signal(signal.SIGSTOP)
        run.wait_until(lambda: time.monotonic() - t > run.settings.heartbeat_timeout, "a while")
        run.wait_detected(self.honest(run), t)
        time.sleep(run.rng.uniform(0.0, 0.5))
        relay.signal(signal.SIGCONT)
        run.event(Note(t=time.monotonic(), what="resumed", detail=f"relay node{faulty}"))
        release_end(run)

    def cleanup(self, run: ScenarioRun) -> None:
        for relay in run.resources.get("relays", {}).values():
            if relay.proc is not None and relay.proc.poll() is None:
                relay.signal(signal.SIGCONT)
        super().cleanup(run)


class RelayCut(_RelayScenario):
    fault = Fault.RELAY_CUT
    transport = "tcp"
    summary = "over tcp, one relay's link to the root goes down (network namespace), then up"

    def prepare(self, run: ScenarioRun) -> None:
        super().prepare(run)
        prepare_cut(run, "a relay cut")

    def run(self, run: ScenarioRun) -> None:
        cut: netns.CutNamespace = run.resources["netns"]
        layout = _layout(run.dp)
        faulty = 0 if run.culprit in layout[0] else 1
        self.start_group(run, prefix_for=faulty, prefix=cut.prefix_argv())
        t = self.inject(run, faulty, f"relay node{faulty} link {cut.name} down")
        cut.cut()
        run.wait_until(lambda: time.monotonic() - t > run.settings.heartbeat_timeout, "a while")
        run.wait_detected(self.honest(run), t)
        time.sleep(run.rng.uniform(0.0, 0.5))
        cut.restore()
        run.event(Note(t=time.monotonic(), what="link restored", detail=cut.name))
        release_end(run)

    def cleanup(self, run: ScenarioRun) -> None:
        super().cleanup(run)
        cut = run.resources.get("netns")
        if cut is not None:
            cut.remove()
