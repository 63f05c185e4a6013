"""The fault kinds: for each, how it is injected into a running group and what must come of it.

Every scenario starts a real coordd and `dp` rank processes (2..4, from the seed), lets them run
rounds, injects its one fault at a seeded point and, where the group fails, lets it recover:
the ranks register again (a new epoch) and run on to the end, and a rank that is gone (killed,
or refused at the door) is replaced as a supervisor would. `Expect` is what the checker holds
the history to; the runner writes it into each scenario's `scenario.json`.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from coordd.core._daemon_defaults import DEFAULT_GROUPS
from coordd.core._registry import GroupRules
from coordd.proto.messages import PROTOCOL_VERSION, StepKind
from coordd.testing.history import Begin, Inject, Note
from coordd.testing.scenario import Expect
from coordd.tools.chaos import netns
from coordd.tools.chaos.spec import Fault
from coordd.tools.chaos.workload import kind_for

if TYPE_CHECKING:
    from coordd.tools.chaos.runner import Process, ScenarioRun


class Skip(Exception):
    """This scenario cannot run here; the message says why."""


class Scenario:
    fault: Fault
    expect: Expect
    transport: str | None = None
    summary = ""

    def prepare(self, run: ScenarioRun) -> None:
        """Before coordd starts; raise `Skip` if the scenario cannot run here."""

    def run(self, run: ScenarioRun) -> None:
        raise NotImplementedError

    def cleanup(self, run: ScenarioRun) -> None:
        """After every process has ended (also after a failure)."""


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


class GarbageFrames(Scenario):
    fault = Fault.GARBAGE_FRAMES
    summary = "a rogue peer sends garbage, truncated, oversized and misdirected frames"
    expect = Expect(culprit_view="refused", refusal="rogue")

    def run(self, run: ScenarioRun) -> None:
        run.culprit = -1
        run.culprit_name = "rogue"
        run.end_seq = 4 * run.settings.rounds  # the group runs on through the whole flood
        run.start_observer(
            run.spec(
                "rogue",
                "garbage",
                -1,
                frames=40,
                trigger_log=run.log_path("rank0"),
                trigger_seq=run.inject_seq,
            )
        )
        run.start_ranks()


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
        reason = netns.unavailable()
        if reason is not None:
            raise Skip(f"network cut needs a network namespace: {reason}")
        netns.remove_stale()
        cut = netns.CutNamespace()
        run.resources["netns"] = cut
        cut.create()
        run.bind_host = cut.host_ip

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


# -- values, misuse and hostile peers (issue 11, parts A-D) -----------------------------------


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


class StrangerNoise(Scenario):
    fault = Fault.STRANGER_NOISE
    summary = "a stranger forges reports for the live rounds amid garbage, then bursts"
    expect = Expect(culprit_view="refused", refusal="stranger")

    def run(self, run: ScenarioRun) -> None:
        run.culprit = -1
        run.culprit_name = "stranger"
        stranger = run.start_observer(
            run.spec(
                "stranger",
                "stranger",
                -1,
                frames=3000,
                trigger_log=run.log_path("rank0"),
                trigger_seq=run.inject_seq,
            )
        )
        run_on_until_done(run, stranger, lambda: run.start_ranks(until_file=run.until_file))


class TakeoverAttempt(Scenario):
    fault = Fault.TAKEOVER_ATTEMPT
    summary = "a peer presents a live rank's leaked routing id, says Hello for it, claims it"
    expect = Expect(culprit_view="refused", refusal="takeover")

    def run(self, run: ScenarioRun) -> None:
        victim = run.culprit
        run.culprit = -1
        run.culprit_name = "taker"
        victim_log = run.log_path(f"rank{victim}")
        taker = run.start_observer(
            run.spec(
                "taker",
                "taker",
                victim,
                victim_log=victim_log,
                trigger_log=victim_log,
                trigger_seq=run.inject_seq,
            )
        )

        def start() -> None:
            for rank in range(run.dp):
                extra: dict[str, object] = dict(until_file=run.until_file)
                if rank == victim:
                    extra["leak_identity"] = True
                run.start_worker(run.spec(f"rank{rank}", "rank", rank, **extra))
            run.release([f"rank{r}" for r in range(run.dp)])

        run_on_until_done(run, taker, start)


class IdClaims(Scenario):
    """The routing-id attack on libzmq (see coordd.io._gate), briefly, while the group runs: the
    claimer holds names libzmq could give (`\\x00` + 4 bytes) and makes id-less handshakes as
    fast as it can (`coordd.tools.load.claims.attack`), then says Hello from a zero-led routing
    id, which coordd must refuse (a registered name would be exempt from the stranger grace)."""

    fault = Fault.ID_CLAIMS
    summary = "a peer holds libzmq-style names amid id-less handshakes, then says Hello from one"
    expect = Expect(culprit_view="refused", refusal="id_claims")
    #: Small enough for CI (~1 s of attack), enough to show the gate's numbers in the notes.
    names, in_flight, seconds = 50, 10, 1.0

    def run(self, run: ScenarioRun) -> None:
        run.culprit = -1
        run.culprit_name = "claimer"
        claimer = run.start_observer(
            run.spec(
                "claimer",
                "claimer",
                0,
                claims=self.names,
                in_flight=self.in_flight,
                claim_seconds=self.seconds,
                trigger_log=run.log_path("rank0"),
                trigger_seq=run.inject_seq,
            )
        )
        run_on_until_done(run, claimer, lambda: run.start_ranks(until_file=run.until_file))


#: Group names no rule of coordd's default --groups admits (GroupRules: its exact names and
#: `dp-tp*-pp*`), near misses of them among others: each Hello for one is refused
#: group_unexpected.
_UNEXPECTED = [
    "junk",
    "Default",
    "dp-tp0",
    "dp_tp0_pp0",
    "dp-pp0-tp0",
    "enginecore2",
    "engine-core",
    "vllm",
]
assert not any(GroupRules().admits(name) for name in _UNEXPECTED)


class JunkGroups(Scenario):
    """Membership is earned (issue 21), against coordd run as deployed (its default --groups,
    --max-groups small enough to fill): the slots filled with names its patterns admit, the
    group, whose name is one --groups gives exactly, still registers; while it runs, Hellos for
    groups the deployment does not expect are refused group_unexpected, one more pattern name
    group_limit, and a member of a junk group that sends far more than one report a round has
    its connection cut off, and nothing else (its other members still answer pings)."""

    fault = Fault.JUNK_GROUPS
    summary = "junk Hellos refused, junk filling --max-groups, a junk member's flood cut off"
    expect = Expect(culprit_view="refused", refusal="junk_groups")
    max_groups = 3

    def prepare(self, run: ScenarioRun) -> None:
        run.coordd_args = [
            "--groups",
            ",".join(DEFAULT_GROUPS),
            "--max-groups",
            str(self.max_groups),
        ]

    def run(self, run: ScenarioRun) -> None:
        run.culprit = -1
        run.culprit_name = "squatter"
        pp = run.seed % 8 + 1  # names `dp-tp*-pp*` admits, none of them the group's
        names = [f"dp-tp{t}-pp{pp}" for t in range(1, self.max_groups + 3)]
        junk = [*run.rng.sample(_UNEXPECTED, 3), f"junk-{run.rng.getrandbits(16):04x}"]
        squatter = run.start_observer(
            run.spec(
                "squatter",
                "squatter",
                0,
                fill_groups=names[: self.max_groups],
                over_groups=names[self.max_groups :],
                junk_names=junk,
                trigger_log=run.log_path("rank0"),
                trigger_seq=run.inject_seq,
            )
        )

        def filled() -> bool:
            squatter.poll_log()
            done = squatter.popen.poll() is not None
            return done or any(isinstance(r, Note) and r.what == "filled" for r in squatter.records)

        # the group registers once the junk holds every slot: its exact name must get one
        run.wait_until(filled, "the squatter to fill the group slots")
        run_on_until_done(run, squatter, lambda: run.start_ranks(until_file=run.until_file))


#: The answers a client must refuse (the field its `InvalidAnswer` names), one per seed in
#: turn: a decision for a round not yet reported, num_tokens_across_dp of another length
#: than dp, dead_ranks out of 0..dp-1, cudagraph_mode out of 0..2, another kind.
_MISFITS = ["seq", "num_tokens_across_dp", "dead_ranks", "cudagraph_mode", "kind"]


class ForgedAnswers(Scenario):
    """Trust runs both ways: a proxy between the ranks and the real coordd forwards every
    frame as it is, but at `inject_seq` replaces one rank's decision with a misfit (one per
    seed, `_MISFITS`) and adds, after another rank's decision of that round, an answer for no
    round it has open (that decision again, or one of the epoch before). The first must raise
    a typed `InvalidAnswer` naming coordd and the field, never hand the value over, and the
    rank register again and go on; the second is dropped and counted, and is no error."""

    fault = Fault.FORGED_ANSWERS
    summary = "a proxy before coordd alters one rank's decision and adds an unsolicited one"
    expect = Expect(culprit_view="any", refusal="forged_answer")

    def run(self, run: ScenarioRun) -> None:
        victim = run.culprit
        run.culprit_name = f"rank{victim}"
        run.culprit_field = _MISFITS[run.seed % len(_MISFITS)]
        other = (victim + 1 + run.rng.randrange(run.dp - 1)) % run.dp
        bind = (
            f"ipc://{run.dir}/proxy.sock" if run.transport == "ipc" else f"tcp://{run.bind_host}:*"
        )
        stop = os.path.join(run.dir, "stop")
        proxy = run.start_observer(
            run.spec(
                "proxy",
                "proxy",
                victim,
                address=bind,
                upstream=run.address,
                fault_seq=run.inject_seq,
                forge=run.culprit_field,
                extra=("again", "old_epoch")[run.seed % 2],
                extra_rank=other,
                stop_file=stop,
            )
        )

        def listening() -> str:
            proxy.poll_log()
            for r in proxy.records:
                if isinstance(r, Note) and r.what == "listening":
                    return r.detail
            return ""

        run.wait_until(lambda: bool(listening()) or proxy.popen.poll() is not None, "the proxy")
        run.start_ranks(address=listening())
        ranks = [run.processes[f"rank{r}"] for r in range(run.dp)]
        try:
            run.wait_until(lambda: all(p.popen.poll() is not None for p in ranks), "the ranks")
        finally:
            with open(stop, "w"):
                pass


def run_on_until_done(run: ScenarioRun, culprit: Process, start: Callable[[], None]) -> None:
    """Start the group (`start`), which rounds on past its end until `culprit` has exited, then
    10 rounds more (the end seq written into `until_file`): the culprit acts while the group
    runs, and the group is seen going on."""
    start()
    run.wait_until(lambda: culprit.popen.poll() is not None, f"{culprit.name} to finish")
    release_end(run)


def release_end(run: ScenarioRun) -> None:
    """Let ranks started with `until_file` end: 10 rounds past the furthest one begun (at
    least `end_seq`), the seq they agree on through the rounds (see the worker). A fault
    injected once a rank reached `inject_seq` must land while the group runs: with a fixed
    end, ranks on 2 busy cores finished all their rounds before the runner's SIGSTOP, SIGKILL,
    link cut or coordd kill took effect (rank_paused: "no rank was running when the fault was
    injected"; network_cut: "the failure never reached" the others; rank_killed and
    coordd_restart had the same fixed end)."""
    ranks = [p for name, p in run.processes.items() if name.startswith("rank")]
    for p in ranks:
        p.poll_log()
    seq = max((r.seq for p in ranks for r in p.records if isinstance(r, Begin)), default=0)
    end = max(run.end_seq, seq + 10)  # one end for all: a rank that stops early fails the rest
    with open(run.until_file + ".tmp", "w") as f:
        f.write(str(end))
    os.replace(run.until_file + ".tmp", run.until_file)
    run.event(Note(t=time.monotonic(), what="released", detail=f"until seq {end}"))


_MISMATCH = Expect(failure=True, errors=["StepMismatch"])

SCENARIOS: dict[Fault, Scenario] = {
    s.fault: s
    for s in [
        RawFault(Fault.SKIPPED_SEQ, "a rank skips a sync (reports seq + 1)", _MISMATCH),
        RawFault(Fault.REPEATED_SEQ, "a rank re-sends an earlier seq with other data", _MISMATCH),
        WrongKind(
            Fault.WRONG_KIND,
            "a rank reports forward where the round is a drafter step (first or last)",
            Expect(failure=True, errors=["StepMismatch"], mirror_ok=True),
        ),
        RawFault(
            Fault.CONFLICTING_DUPLICATE,
            "a rank sends two different reports for one round",
            Expect(failure=True, errors=["ConflictingReport", "StepMismatch"]),
        ),
        JoinMismatch(
            Fault.DP_SIZE_MISMATCH, "a rank joins with another dp_size", "dp_size", "dp_size"
        ),
        JoinMismatch(
            Fault.FINGERPRINT_MISMATCH,
            "a rank joins with another config",
            "config_fingerprint",
            "fingerprint",
        ),
        JoinMismatch(
            Fault.VERSION_MISMATCH,
            "a rank speaks another protocol version",
            "protocol_version",
            "version",
        ),
        DuplicateRank(),
        RankKilled(),
        RankPaused(),
        Straggler(),
        CoorddRestart(),
        GarbageFrames(),
        RawFault(
            Fault.SPOOFED_RANK,
            "a rank registered as r reports as another rank",
            Expect(refusal="ProtocolError", culprit_view="same"),
        ),
        NetworkCut(),
        InvalidValue(),
        ClientMisuse(),
        StrangerNoise(),
        TakeoverAttempt(),
        IdClaims(),
        JunkGroups(),
        ForgedAnswers(),
        AbandonedRound(),
    ]
}
assert set(SCENARIOS) == set(Fault), "one scenario per fault kind"
