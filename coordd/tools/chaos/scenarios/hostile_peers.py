"""Peers outside the group (garbage, forged reports, a taken routing id, id claims, junk
groups) and a man in the middle forging answers: refused at the door, the group never fails."""

from __future__ import annotations

import os

from coordd.core._daemon_defaults import DEFAULT_GROUPS
from coordd.core._group_names import GroupRules
from coordd.testing.history import Note
from coordd.testing.scenario import Expect
from coordd.tools.chaos.scenario_run import Scenario, ScenarioRun
from coordd.tools.chaos.scenarios._steps import run_on_until_done
from coordd.tools.chaos.spec import Fault


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
    """Membership is earned, against coordd run as deployed (its default --groups,
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
