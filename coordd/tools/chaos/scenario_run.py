"""One chaos scenario's run: a real coordd, real rank processes, one injected fault, then
the checker.

A scenario (`Scenario`: prepare, run, cleanup) builds its fault from `ScenarioRun`'s blocks.
Each run lives in its own directory (coordd's log, one JSON-lines history per process, the
runner's own events and `scenario.json`), so a failing one can be read afterwards. Every wait has
a deadline: a process still running at the scenario's budget is killed and counted as a hang.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from coordd.testing.checker import ScenarioResult, check_scenario
from coordd.testing.history import (
    Begin,
    End,
    HistoryWriter,
    Inject,
    Note,
    Record,
    Registered,
    tail_records,
)
from coordd.testing.process import CoorddProcess, die_with_parent
from coordd.testing.scenario import Expect, ScenarioInfo
from coordd.tools.chaos.spec import Fault, Settings, WorkerSpec


def _insecure_tcp_flag(bind: str) -> list[str]:
    """Plain tcp (no CURVE keys) where coordd asks for it to be said out loud."""
    import argparse

    from coordd.cli import add_server_options

    parser = argparse.ArgumentParser(add_help=False)
    add_server_options(parser)
    known = "--insecure" in parser._option_string_actions
    return ["--insecure"] if known and bind.startswith("tcp://") else []


class GaveUp(Exception):
    """A step of the scenario did not happen by its deadline (the checker says what broke)."""


class ChaosCoordd(CoorddProcess):
    """A real `coordd serve`, run through `coordd.tools.chaos.serve` so its log lands in a file."""

    starter_outlives_child = True  # a scenario's thread ends only after its processes

    def __init__(
        self, dp: int, bind: str, settings: Settings, log_path: str, extra: Iterable[str] = ()
    ) -> None:
        super().__init__(
            dp,
            bind,
            [
                *_insecure_tcp_flag(bind),
                "--step-timeout",
                str(settings.step_timeout),
                "--heartbeat-interval",
                str(settings.heartbeat_interval),
                "--heartbeat-timeout",
                str(settings.heartbeat_timeout),
                "--log-level",
                "debug",
                *extra,
            ],
        )
        assert self.argv[1:4] == ["-m", "coordd", "serve"]
        self.argv = [sys.executable, "-m", "coordd.tools.chaos.serve", log_path, *self.argv[3:]]


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: str
    offset: int = 0
    records: list[Record] = field(default_factory=list)

    def poll_log(self) -> list[Record]:
        new, self.offset = tail_records(self.log_path, self.offset)
        self.records.extend(new)
        return new


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


class ScenarioRun:
    """One fault kind, one seed: the processes, the injection, and the record of it all."""

    def __init__(self, scenario: Scenario, seed: int, settings: Settings, directory: str) -> None:
        self.scenario = scenario
        self.seed = seed
        self.settings = settings
        self.dir = directory
        self.rng = random.Random(f"scenario:{scenario.fault.value}:{seed}")
        self.dp = self.rng.randint(settings.min_dp, settings.max_dp)
        self.culprit = self.rng.randrange(self.dp)
        self.inject_seq = self.rng.randint(3, max(3, settings.rounds // 2))
        # enough rounds after the fault that the group is still running when a process the
        # runner starts, or the runner itself, gets to it on a loaded machine
        self.end_seq = max(settings.rounds, self.inject_seq + 40)
        self.transport = scenario.transport or settings.transport
        self.started = time.monotonic()
        self.deadline = self.started + settings.budget
        self.processes: dict[str, Process] = {}
        self.coordd: ChaosCoordd | None = None
        self.coordd_log = os.path.join(directory, "coordd.log")
        #: `WorkerSpec.until_file`: the ranks run on until the runner creates it
        self.until_file = os.path.join(directory, "until")
        self.address = ""
        self.bind_host = "127.0.0.1"
        self.culprit_name = ""
        self.culprit_field = ""
        #: `ScenarioInfo.also_culprits`: ranks behind a relay that is the fault.
        self.also_culprits: list[str] = []
        self.harness_kills: set[str] = set()
        #: Seconds a scenario's fault may take past the usual detection bound, by design.
        self.detection_slack = 0.0
        self.deadline_kills: set[str] = set()
        self.resources: dict[str, Any] = {}
        #: More `coordd serve` flags, from the scenario's `prepare` (junk_groups: --max-groups)
        self.coordd_args: list[str] = []
        os.makedirs(directory, exist_ok=True)
        self.events = HistoryWriter(
            os.path.join(directory, "runner.jsonl"), role="runner", rank=-1, name="runner"
        )

    # -- the scenario's building blocks -------------------------------------------------------

    def event(self, record: Inject | Note) -> None:
        self.events.write(record)

    def start_coordd(self, bind: str | None = None) -> ChaosCoordd:
        if bind is None:
            bind = (
                f"ipc://{self.dir}/c.sock"
                if self.transport == "ipc"
                else f"tcp://{self.bind_host}:*"
            )
        coordd = ChaosCoordd(self.dp, bind, self.settings, self.coordd_log, self.coordd_args)
        coordd.start(timeout=max(5.0, self.deadline - time.monotonic()))
        self.coordd = coordd
        self.address = coordd.address
        return coordd

    def spec(self, name: str, role: str, rank: int, **extra: object) -> WorkerSpec:
        s = self.settings
        fields: dict[str, object] = dict(
            role=role,
            name=name,
            address=self.address,
            dp_size=self.dp,
            dp_rank=rank,
            seed=self.seed,
            end_seq=self.end_seq,
            log_path=self.log_path(name),
            go_file=os.path.join(self.dir, "go"),
            deadline=self.deadline,
            step_timeout=s.step_timeout,
            heartbeat_interval=s.heartbeat_interval,
            heartbeat_timeout=s.heartbeat_timeout,
            wait_timeout=s.wait_timeout,
            fault=self.scenario.fault.value,
        )
        fields.update(extra)
        return WorkerSpec(**fields)  # type: ignore[arg-type]

    def start_worker(self, spec: WorkerSpec, prefix: Iterable[str] = ()) -> Process:
        spec_path = os.path.join(self.dir, f"{spec.name}.spec.json")
        with open(spec_path, "wb") as f:
            f.write(msgspec.json.encode(spec))
        with open(os.path.join(self.dir, f"{spec.name}.stderr"), "wb") as err:
            popen = subprocess.Popen(
                [*prefix, sys.executable, "-m", "coordd.tools.chaos.worker", spec_path],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
                # a run killed from outside takes its ranks along (the scenario's thread
                # ends only after them)
                preexec_fn=die_with_parent(any_thread=True),
            )
        process = Process(spec.name, popen, spec.log_path)
        self.processes[spec.name] = process
        self.event(Note(t=time.monotonic(), what="started", detail=spec.name, pid=popen.pid))
        return process

    def log_path(self, name: str) -> str:
        return os.path.join(self.dir, f"{name}.jsonl")

    def start_observer(self, spec: WorkerSpec) -> Process:
        """Start a process that injects on a trigger, and wait until it is up (its log exists):
        a process still starting when the group is done would find no group to disturb."""
        process = self.start_worker(spec)
        self.wait_until(
            lambda: os.path.exists(spec.log_path) or process.popen.poll() is not None,
            f"{spec.name} to start",
        )
        return process

    def start_ranks(self, roles: dict[int, str] | None = None, **extra: object) -> None:
        """Start the group's rank processes and let them go once every one has registered."""
        for rank in range(self.dp):
            role = (roles or {}).get(rank, "rank")
            self.start_worker(self.spec(f"rank{rank}", role, rank, **extra))
        self.release([f"rank{r}" for r in range(self.dp)])

    def release(self, names: Iterable[str], go_file: str = "go") -> None:
        """Open a startup barrier once the processes `names` have registered (or ended)."""
        self.wait_registered(names)
        with open(os.path.join(self.dir, go_file), "w"):
            pass
        self.event(Note(t=time.monotonic(), what="released", detail=go_file))

    def signal_worker(self, name: str, sig: signal.Signals) -> None:
        process = self.processes[name]
        if process.popen.poll() is None:
            os.kill(process.popen.pid, sig)
        if sig == signal.SIGKILL:
            self.harness_kills.add(name)

    def wait_until(self, condition: Callable[[], bool], what: str, step: float = 0.005) -> None:
        """Poll `condition` until true; at the scenario's deadline give the scenario up."""
        while time.monotonic() < self.deadline:
            if condition():
                return
            time.sleep(step)
        raise GaveUp(f"gave up waiting for {what} at the scenario's deadline")

    def wait_seq(self, name: str, seq: int) -> None:
        """Until process `name` has begun round `seq` (or ended)."""
        process = self.processes[name]

        def reached() -> bool:
            process.poll_log()
            return process.popen.poll() is not None or any(
                isinstance(r, Begin) and r.seq >= seq for r in process.records
            )

        self.wait_until(reached, f"{name} to begin seq {seq}")

    def wait_registered(self, names: Iterable[str]) -> None:
        procs = [self.processes[n] for n in names]

        def registered() -> bool:
            for p in procs:
                p.poll_log()
            return all(
                p.popen.poll() is not None or any(isinstance(r, Registered) for r in p.records)
                for p in procs
            )

        self.wait_until(registered, "the ranks to register")

    def wait_detected(self, names: Iterable[str], since: float) -> None:
        """Until every process in `names` has logged a typed error after `since` (or ended)."""
        procs = [self.processes[n] for n in names]

        def detected() -> bool:
            for p in procs:
                p.poll_log()
            return all(
                p.popen.poll() is not None
                or any(
                    isinstance(r, End) and r.error is not None and r.t >= since for r in p.records
                )
                for p in procs
            )

        self.wait_until(detected, "every rank to see the failure")

    def honest_names(self) -> list[str]:
        return [f"rank{r}" for r in range(self.dp) if r != self.culprit]

    def restart_coordd(self, sig: signal.Signals) -> None:
        """Kill coordd with `sig` and start a fresh one (a new epoch) on the same address."""
        assert self.coordd is not None
        old = self.coordd
        address = old.address
        self.event(
            Inject(
                t=time.monotonic(),
                fault=self.scenario.fault.value,
                detail=f"coordd {sig.name}",
                pid=old.pid,
            )
        )
        old.signal(sig)
        assert old.proc is not None
        try:
            old.proc.wait(timeout=10)
        finally:
            old.stop()
        self.event(Note(t=time.monotonic(), what="coordd exited", count=old.proc.returncode or 0))
        time.sleep(self.rng.uniform(0.0, 0.3))
        self.start_coordd(address)
        self.event(Note(t=time.monotonic(), what="coordd restarted", detail=address))

    # -- running it ---------------------------------------------------------------------------

    def execute(self) -> ScenarioResult:
        skipped = ""
        try:
            try:
                self.scenario.prepare(self)
            except Skip as why:
                skipped = str(why)
            else:
                if self.coordd is None:
                    self.start_coordd()
                self.scenario.run(self)
                self._wait_all()
        except GaveUp as exc:
            self.event(Note(t=time.monotonic(), what="gave up", detail=str(exc)))
        except Exception as exc:  # a harness failure is a failed scenario, never a hang
            self.event(Note(t=time.monotonic(), what="harness error", detail=repr(exc)))
        finally:
            self._end_everything()
            self.scenario.cleanup(self)
            self.events.close()
            self._write_info(skipped)
        return check_scenario(self.dir)

    def _wait_all(self) -> None:
        hard_deadline = self.deadline + 3.0
        for process in self.processes.values():
            remaining = hard_deadline - time.monotonic()
            try:
                process.popen.wait(timeout=max(0.0, remaining))
            except subprocess.TimeoutExpired:
                self.event(
                    Note(
                        t=time.monotonic(),
                        what="killed at deadline",
                        detail=process.name,
                        pid=process.popen.pid,
                    )
                )
                process.popen.kill()
                process.popen.wait(timeout=10)
                self.deadline_kills.add(process.name)

    def _stderr_tail(self, name: str) -> str:
        try:
            with open(os.path.join(self.dir, f"{name}.stderr"), errors="replace") as f:
                lines = [line.strip() for line in f if line.strip()]
        except OSError:
            return ""
        return lines[-1] if lines else ""

    def _end_everything(self) -> None:
        """End every process still running (the scenario gave up: each counts as a hang)."""
        for process in self.processes.values():
            if process.popen.poll() is None:
                with contextlib.suppress(OSError):
                    os.kill(process.popen.pid, signal.SIGCONT)
                process.popen.kill()
                process.popen.wait(timeout=10)
                self.deadline_kills.add(process.name)
                self.event(
                    Note(
                        t=time.monotonic(),
                        what="killed at deadline",
                        detail=process.name,
                        pid=process.popen.pid,
                    )
                )
            code = process.popen.returncode
            self.event(
                Note(
                    t=time.monotonic(),
                    what="exited",
                    detail=process.name,
                    count=code,
                    pid=process.popen.pid,
                )
            )
            if code != 0 and process.name not in self.harness_kills | self.deadline_kills:
                tail = self._stderr_tail(process.name)
                self.event(
                    Note(
                        t=time.monotonic(),
                        what="crashed",
                        pid=process.popen.pid,
                        detail=f"{process.name} exited with {code}: {tail}",
                    )
                )
        if self.coordd is not None and self.coordd.proc is not None:
            alive = self.coordd.proc.poll() is None
            code = self.coordd.stop()
            self.event(
                Note(
                    t=time.monotonic(),
                    what="coordd stopped" if alive else "coordd died",
                    count=code or 0,
                )
            )

    def _write_info(self, skipped: str) -> None:
        info = ScenarioInfo(
            fault=self.scenario.fault.value,
            seed=self.seed,
            dp=self.dp,
            transport=self.transport,
            culprit=self.culprit,
            culprit_name=self.culprit_name,
            inject_seq=self.inject_seq,
            end_seq=self.end_seq,
            expect=self.scenario.expect,
            wait_timeout=self.settings.wait_timeout,
            detection_bound=self.settings.detection_bound + self.detection_slack,
            harness_kills=sorted(self.harness_kills),
            culprit_field=self.culprit_field,
            skipped=skipped,
            also_culprits=self.also_culprits,
        )
        with open(os.path.join(self.dir, "scenario.json"), "wb") as f:
            f.write(msgspec.json.encode(info))
