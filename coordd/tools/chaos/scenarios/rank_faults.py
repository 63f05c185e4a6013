"""Faults of a rank of the group: a report that breaks the protocol, a Hello that disagrees,
a process that dies, stops or straggles, a value out of range, a misused or abandoned client."""

from __future__ import annotations

import os
import signal
import time

from coordd.proto.messages import PROTOCOL_VERSION, StepKind
from coordd.testing.history import Inject, Note
from coordd.testing.scenario import Expect
from coordd.tools.chaos.scenario_run import Scenario, ScenarioRun
from coordd.tools.chaos.scenarios._steps import release_end
from coordd.tools.chaos.seeded_reports import kind_for
from coordd.tools.chaos.spec import Fault

# -- a rank that breaks the protocol (raw wire messages) ------------------------------------


class RawFault(Scenario):
    def __init__(self, fault: Fault, summary: str, expect: Expect) -> None:
        self.fault = fault
        self.summary = summary
        self.expect = expect

    def fault_seq(self, run: ScenarioRun) -> int:
        return run.inject_seq

    def run(self, run: ScenarioRun) -> None:
        run.inject_seq = self.fault_seq(run)
        run.culprit_name = f"rank{run.culprit}"
        run.start_ranks({run.culprit: "raw"}, fault_seq=run.inject_seq)


class WrongKind(RawFault):
    """vLLM's drafter-skip: one rank reports forward where the others run a drafter round. Half
    the seeds the rogue reports first (its report opens coordd's round), half last: either way
    the round's evidence (the majority kind) must name it."""

    def fault_seq(self, run: ScenarioRun) -> int:
        """The first drafter round from the seeded point on: the rogue reports it as forward."""
        for seq in range(run.inject_seq, run.end_seq - 3):
            if kind_for(run.seed, seq) is StepKind.DRAFT:
                return seq
        return run.inject_seq

    def run(self, run: ScenarioRun) -> None:
        run.inject_seq = self.fault_seq(run)
        run.culprit_name = f"rank{run.culprit}"
        first = run.seed % 2 == 0
        run.event(Note(t=time.monotonic(), what="rogue reports " + ("first" if first else "last")))
        run.start_ranks({run.culprit: "raw"}, fault_seq=run.inject_seq, rogue_first=first)


# -- a rank whose Hello disagrees with the group ----------------------------------------------


class JoinMismatch(Scenario):
    def __init__(self, fault: Fault, summary: str, field: str, reason: str) -> None:
        self.fault = fault
        self.summary = summary
        self.field = field
        self.expect = Expect(
            failure=True,
            errors=["StepTimeout"],
            culprit_view="refused",
            refusal=f"Rejected:{reason}",
        )

    def bad_value(self, run: ScenarioRun) -> str:
        if self.field == "dp_size":
            # Smaller (waits out the step timeout for the group to re-form, then is refused)
            # only where the culprit's rank fits it; larger is over --dp, refused at once.
            smaller = run.culprit < run.dp - 1 and run.rng.random() < 0.5
            if smaller:
                run.detection_slack = run.settings.step_timeout
            return str(run.dp - 1 if smaller else run.dp + run.rng.choice([1, 2]))
        if self.field == "protocol_version":
            return str(PROTOCOL_VERSION + run.rng.choice([1, -1]))
        return f"other-config-{run.rng.getrandbits(16):04x}"

    def run(self, run: ScenarioRun) -> None:
        c = run.culprit
        run.inject_seq = 0
        run.culprit_name = f"joiner{c}"
        joiner = run.start_observer(
            run.spec(
                run.culprit_name,
                "joiner",
                c,
                hello_field=self.field,
                hello_value=self.bad_value(run),
                go_file=os.path.join(run.dir, "join"),
            )
        )
        for rank in range(run.dp):
            if rank != c:
                run.start_worker(run.spec(f"rank{rank}", "rank", rank))
        since = time.monotonic()
        # the joiner says Hello once the others are in (so it is checked against the group),
        # and they begin their rounds once it has been turned away
        run.release(run.honest_names(), "join")
        run.wait_until(lambda: joiner.popen.poll() is not None, f"{run.culprit_name} to exit")
        run.release(run.honest_names())
        run.wait_detected(run.honest_names(), since)
        # the operator fixes the config: the rank comes back right, and the group recovers
        run.start_worker(run.spec(f"rank{c}", "rank", c))


class DuplicateRank(Scenario):
    fault = Fault.DUPLICATE_RANK
    summary = "a second process claims a rank the group has"
    expect = Expect(refusal="Rejected:rank_taken", culprit_view="refused")

    def run(self, run: ScenarioRun) -> None:
        run.culprit_name = f"impostor{run.culprit}"
        trigger = run.log_path(f"rank{run.culprit}")
        run.start_observer(
            run.spec(
                run.culprit_name,
                "impostor",
                run.culprit,
                trigger_log=trigger,
                trigger_seq=run.inject_seq,
            )
        )
        run.start_ranks()


# -- a rank process that dies, stops, or straggles -------------------------------------------


class RankKilled(Scenario):
    fault = Fault.RANK_KILLED
    summary = "SIGKILL a rank in the middle of a round; a fresh process replaces it"
    expect = Expect(failure=True, errors=["RankLost", "StepTimeout"], culprit_view="gone")

    def run(self, run: ScenarioRun) -> None:
        name = run.culprit_name = f"rank{run.culprit}"
        run.start_ranks(until_file=run.until_file)  # on until the fault is in (release_end)
        run.wait_seq(name, run.inject_seq)
        time.sleep(run.rng.uniform(0.0, 0.004))
        t = time.monotonic()
        run.event(
            Inject(t=t, fault=self.fault.value, rank=run.culprit, pid=run.processes[name].popen.pid)
        )
        run.signal_worker(name, signal.SIGKILL)
        run.wait_detected(run.honest_names(), t)
        spec = run.spec(f"rank{run.culprit}b", "rank", run.culprit, until_file=run.until_file)
        run.start_worker(spec)
        release_end(run)


class RankPaused(Scenario):
    fault = Fault.RANK_PAUSED
    summary = "SIGSTOP a rank past the heartbeat timeout, then SIGCONT"
    expect = Expect(
        failure=True,
        errors=["RankLost", "StepTimeout"],
        culprit_view="any",
        culprit_must_fail=True,
    )

    def run(self, run: ScenarioRun) -> None:
        name = run.culprit_name = f"rank{run.culprit}"
        run.start_ranks(until_file=run.until_file)  # on until the fault is in (release_end)
        run.wait_seq(name, run.inject_seq)
        time.sleep(run.rng.uniform(0.0, 0.004))
        t = time.monotonic()
        run.event(
            Inject(t=t, fault=self.fault.value, rank=run.culprit, pid=run.processes[name].popen.pid)
        )
        run.signal_worker(name, signal.SIGSTOP)
        run.wait_until(lambda: time.monotonic() - t > run.settings.heartbeat_timeout, "a while")
        run.wait_detected(run.honest_names(), t)
        time.sleep(run.rng.uniform(0.0, 0.5))
        run.signal_worker(name, signal.SIGCONT)
        run.event(Note(t=time.monotonic(), what="resumed", detail=name))
        release_end(run)


class Straggler(Scenario):
    fault = Fault.STRAGGLER
    summary = "one rank reports late (25-50% of the step timeout) in a few rounds"
    expect = Expect()

    def run(self, run: ScenarioRun) -> None:
        run.culprit_name = f"rank{run.culprit}"
        seqs = sorted(run.rng.sample(range(run.inject_seq, run.end_seq), 3))
        delay = run.rng.uniform(0.25, 0.5) * run.settings.step_timeout
        for rank in range(run.dp):
            extra: dict[str, object] = {}
            if rank == run.culprit:
                extra = dict(straggle_seqs=seqs, straggle_delay=delay)
            run.start_worker(run.spec(f"rank{rank}", "rank", rank, **extra))
        run.release([f"rank{r}" for r in range(run.dp)])


#: Out-of-range values the wire carries (int64) and the policy refuses, by field; each names
#: its own field (`validate_report` checks num_tokens first, then num_tokens_padded, then the
#: mode: a padded count below the rank's tokens names num_tokens_padded).
_BAD_VALUES = {
    "num_tokens": [2**31, 2**40, -1, -(2**31)],
    "num_tokens_padded": [2**31, 2**33, -1],
    "cudagraph_mode": [3, 7, -1, 2**31],
}


class InvalidValue(Scenario):
    fault = Fault.INVALID_VALUE
    summary = "a rank reports a value out of range (2**31 tokens, mode 3, ...) via the client"
    expect = Expect(failure=True, errors=["InvalidReport"])

    def run(self, run: ScenarioRun) -> None:
        c = run.culprit
        run.culprit_name = f"rank{c}"
        field = run.rng.choice(sorted(_BAD_VALUES))
        value = run.rng.choice(_BAD_VALUES[field])
        run.culprit_field = field
        for rank in range(run.dp):
            extra: dict[str, object] = {}
            if rank == c:
                extra = dict(fault_seq=run.inject_seq, bad_field=field, bad_value=value)
            run.start_worker(run.spec(f"rank{rank}", "rank", rank, **extra))
        run.release([f"rank{r}" for r in range(run.dp)])


class ClientMisuse(Scenario):
    fault = Fault.CLIENT_MISUSE
    summary = "a rank waits twice, starts while open, then is closed from another thread"
    expect = Expect(failure=True, errors=["RankLost", "StepTimeout"], culprit_view="any")

    def run(self, run: ScenarioRun) -> None:
        c = run.culprit
        run.culprit_name = f"rank{c}"
        first, second = run.rng.sample(range(run.inject_seq, run.inject_seq + 6), 2)
        close = max(first, second) + run.rng.randint(2, 5)
        order = ["second_wait", "start_twice"]
        run.rng.shuffle(order)
        misuse = {order[0]: first, order[1]: second, "close": close}
        run.inject_seq = close
        run.event(Note(t=time.monotonic(), what="misuse", detail=repr(misuse)))
        for rank in range(run.dp):
            # the others hold back where the misuse needs the round open (a start() twice;
            # the close, which must land mid-wait)
            extra: dict[str, object] = dict(hold_seqs=[misuse["start_twice"], close])
            if rank == c:
                extra = dict(misuse_seqs=misuse, close_delay=run.rng.uniform(0.005, 0.04))
            run.start_worker(run.spec(f"rank{rank}", "rank", rank, **extra))
        run.release([f"rank{r}" for r in range(run.dp)])


class AbandonedRound(Scenario):
    """The vLLM plugin's early start, when the step raises between the start and the sync: the
    culprit (the real client) starts its round and leaves without Goodbye before waiting for
    it. coordd must fail the group with `RankLost` naming it (never a decision built without
    it, never a clean leave), and the rank registers again and goes on."""

    fault = Fault.ABANDONED_ROUND
    summary = "a rank starts a round early, then leaves without Goodbye before its sync"
    expect = Expect(failure=True, errors=["RankLost"], culprit_view="any")

    def run(self, run: ScenarioRun) -> None:
        c = run.culprit
        run.culprit_name = f"rank{c}"
        for rank in range(run.dp):
            extra: dict[str, object] = dict(abandon_seq=run.inject_seq) if rank == c else {}
            run.start_worker(run.spec(f"rank{rank}", "rank", rank, **extra))
        run.release([f"rank{r}" for r in range(run.dp)])
