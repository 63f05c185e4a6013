"""Count one rank's work per round, as the box's load cannot move it (issue 37).

Runs a real `coordd serve` and `--dp` rank processes that each run the same rounds (the
bench's report tables, `coordd.tools.bench.workload`), and reports for rank 0 alone:

- instructions per round: rank 0 under `valgrind --tool=cachegrind --cache-sim=no`, run twice
  (`--base` and `--rounds` rounds, everything else the same); the difference of the two totals
  over the difference of the rounds (start-up, connect and close cancel out);
- bytecodes and calls per round by function: rank 0 natively under `sys.settrace` with
  `f_trace_opcodes`, over the rounds after `--warmup`.

    python -m coordd.tools.round_counts --client sync --dp 2
    python -m coordd.tools.round_counts --client aio --others-delay-us 5000 --tree /tmp/base
    python -m coordd.tools.round_counts --gather 7 --what instructions

`--gather N` runs gather rounds (`start_gather(site, N values)` then `wait()`, as the vLLM
plugin's sync does) instead of step rounds.

`--tree DIR` runs the ranks and coordd from another checkout (its `coordd` package on
PYTHONPATH): the same harness counts the code before and after a change. Only rank 0 is
measured; the other ranks and coordd run natively, so rank 0 is the slowest and its wait
mostly finds the decision queued or arriving.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

#: Longest any one process of a measurement may run (no hang, ever).
RUN_TIMEOUT = 900.0
#: Functions of this file: the loop that drives the rounds, counted apart from the client.
_HARNESS = os.path.abspath(__file__)


# -- the rank process ---------------------------------------------------------------------------


def _rank_main(args: argparse.Namespace) -> None:
    """One rank: connect, run `rounds` rounds, close; rank 0 may trace the rounds after
    `warmup` and write the counts to `trace_out`."""
    from coordd.client import ClientConfig
    from coordd.tools.bench.workload import report_table

    config = ClientConfig(
        address=args.address,
        dp_rank=args.rank,
        dp_size=args.dp,
        config_fingerprint="round-counts",
        wait_timeout=RUN_TIMEOUT,
    )
    reports = report_table(args.rank)
    if args.client == "sync":
        _rank_sync(args, config, reports)
    else:
        if args.loop == "uvloop":
            import uvloop

            uvloop.install()
        asyncio.run(_rank_aio(args, config, reports))


def _rank_sync(args: argparse.Namespace, config: Any, reports: list[Any]) -> None:
    from coordd.client import CoordClient

    client = CoordClient(config=config)
    client.connect(timeout=60)
    n = len(reports)
    tracer = _Tracer() if args.trace_out else None
    delay = args.others_delay_us / 1e6 if args.rank else 0.0
    values = [[args.rank * 1000 + i + j for j in range(args.gather)] for i in range(n)]
    for i in range(args.rounds):
        if tracer is not None and i == args.warmup:
            tracer.begin()
        if delay:
            time.sleep(delay)
        if args.gather:
            client.start_gather("round-counts", values[i % n]).wait()
        else:
            client.start(reports[i % n]).wait()
    if tracer is not None:
        tracer.end(args.trace_out, args.rounds - args.warmup)
    client.close()


async def _rank_aio(args: argparse.Namespace, config: Any, reports: list[Any]) -> None:
    from coordd.client import AsyncCoordClient

    client = AsyncCoordClient(config=config)
    await client.connect(timeout=60)
    n = len(reports)
    tracer = _Tracer() if args.trace_out else None
    delay = args.others_delay_us / 1e6 if args.rank else 0.0
    for i in range(args.rounds):
        if tracer is not None and i == args.warmup:
            tracer.begin()
        if delay:
            await asyncio.sleep(delay)
        await client.wait(client.start(reports[i % n]))
    if tracer is not None:
        tracer.end(args.trace_out, args.rounds - args.warmup)
    await client.close()


class _Tracer:
    """Opcode and call events by function (file's last two parts and qualified name)."""

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._names: dict[Any, str] = {}

    def _name(self, code: Any) -> str:
        name = self._names.get(code)
        if name is None:
            path = code.co_filename
            if os.path.abspath(path) == _HARNESS:
                where = "harness"
            else:
                parts = path.replace("\\", "/").split("/")
                where = "/".join(parts[-2:]).removesuffix(".py")
            name = self._names[code] = f"{where}:{getattr(code, 'co_qualname', code.co_name)}"
        return name

    def _trace(self, frame: Any, event: str, arg: object) -> Any:
        if event == "call":
            frame.f_trace_opcodes = True
            self.calls[self._name(frame.f_code)] += 1
        elif event == "opcode":
            self.ops[self._name(frame.f_code)] += 1
        return self._trace

    def begin(self) -> None:
        # the frames already running (the harness's loop, asyncio's) count from here on too
        frame: Any = sys._getframe(1)
        while frame is not None:
            frame.f_trace = self._trace
            frame.f_trace_opcodes = True
            frame = frame.f_back
        sys.settrace(self._trace)

    def end(self, path: str, rounds: int) -> None:
        sys.settrace(None)
        with open(path, "w") as out:
            json.dump({"rounds": rounds, "ops": self.ops, "calls": self.calls}, out)


# -- the measurement ----------------------------------------------------------------------------


def _env(tree: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    env.pop("PYTHONMALLOC", None)
    return env


def _run_group(
    args: argparse.Namespace, rounds: int, *, valgrind_out: str = "", trace_out: str = ""
) -> None:
    """coordd and `dp` ranks for `rounds` rounds; rank 0 under cachegrind or the tracer."""
    env = _env(args.tree)
    work = tempfile.mkdtemp(prefix="round-counts-")
    address = f"ipc://{work}/c.sock"
    log_path = f"{work}/coordd.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "coordd", "serve", "--dp", str(args.dp), "--bind", address,
             "--step-timeout", str(RUN_TIMEOUT)],
            env=env, stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
    ranks: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(f"{work}/c.sock"):
            if server.poll() is not None or time.monotonic() > deadline:
                with open(log_path) as log:
                    raise SystemExit(f"coordd did not start: {log.read()}")
            time.sleep(0.05)
        for rank in range(args.dp):
            cmd = [sys.executable, _HARNESS, "--as-rank", "--address", address,
                   "--rank", str(rank), "--dp", str(args.dp), "--rounds", str(rounds),
                   "--warmup", str(args.warmup), "--client", args.client,
                   "--loop", args.loop, "--others-delay-us", str(args.others_delay_us),
                   "--gather", str(args.gather)]  # fmt: skip
            if rank == 0 and trace_out:
                cmd += ["--trace-out", trace_out]
            if rank == 0 and valgrind_out:
                tool = (["--tool=callgrind", f"--callgrind-out-file={valgrind_out}"]
                        if args.callgrind else
                        ["--tool=cachegrind", "--cache-sim=no",
                         f"--cachegrind-out-file={valgrind_out}"])  # fmt: skip
                cmd = ["valgrind", *tool, "--log-file=/dev/null", *cmd]
            ranks.append(subprocess.Popen(cmd, env=env))
        deadline = time.monotonic() + RUN_TIMEOUT
        for proc in ranks:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if rc != 0:
                raise SystemExit(f"a rank exited with {rc}")
    finally:
        for proc in [*ranks, server]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def _instructions(path: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise SystemExit(f"no summary line in {path}")


def measure_instructions(args: argparse.Namespace) -> float:
    """Rank 0's instructions per round: two run lengths, the difference over the rounds;
    `--repeat` times, the median (the asyncio client's loop turns per round depend on when
    the answer comes, so its count varies from run to run; the blocking client's hardly)."""
    results = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="round-counts-cg-") as tmp:
            totals = []
            for rounds in (args.base, args.rounds):
                name = "callgrind" if args.callgrind else "cg"
                out = f"{args.callgrind or tmp}/{name}.{rounds}"
                _run_group(args, rounds, valgrind_out=out)
                totals.append(_instructions(out))
        per_round = (totals[1] - totals[0]) / (args.rounds - args.base)
        print(f"instructions: {totals[0]} ({args.base} rounds), {totals[1]} ({args.rounds} rounds)")
        print(f"instructions per round: {per_round:.0f}")
        results.append(per_round)
    median = statistics.median(results)
    if len(results) > 1:
        low, high = min(results), max(results)
        print(f"median instructions per round: {median:.0f} ({low:.0f}..{high:.0f})")
    return median


def measure_bytecodes(args: argparse.Namespace) -> dict[str, Any]:
    """Rank 0's bytecodes and calls per round by function, over the rounds after warmup."""
    with tempfile.TemporaryDirectory(prefix="round-counts-tr-") as tmp:
        out = f"{tmp}/trace.json"
        _run_group(args, args.trace_rounds, trace_out=out)
        with open(out) as f:
            counts = json.load(f)
    rounds = counts["rounds"]
    ops, calls = Counter(counts["ops"]), Counter(counts["calls"])
    client_ops = sum(v for k, v in ops.items() if not k.startswith("harness:"))
    client_calls = sum(v for k, v in calls.items() if not k.startswith("harness:"))
    print(f"bytecodes per round by function ({rounds} rounds traced; harness's loop apart):")
    for name, n in ops.most_common():
        if n / rounds >= args.min_ops:
            print(f"  {n / rounds:8.1f} ops {calls.get(name, 0) / rounds:6.2f} calls  {name}")
    turns = calls.get("asyncio/base_events:BaseEventLoop._run_once", 0)
    if turns:
        waits = calls.get("client/aio:AsyncCoordClient.wait", 0)
        print(
            f"asyncio loop turns per round: {turns / rounds:.2f}; wait() entries and resumes "
            f"per round: {waits / rounds:.2f} (2.00: every wait blocked; 1.00: none did)"
        )
    harness = sum(v for k, v in ops.items() if k.startswith("harness:"))
    print(
        f"total: {client_ops / rounds:.1f} bytecodes, {client_calls / rounds:.2f} calls per "
        f"round (the harness's loop: {harness / rounds:.1f})"
    )
    return {"rounds": rounds, "ops": ops, "calls": calls}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--client", choices=["sync", "aio"], default="sync")
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio",
                   help="the aio client's event loop")  # fmt: skip
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1200, help="the long cachegrind run")
    p.add_argument("--base", type=int, default=200, help="the short cachegrind run")
    p.add_argument("--others-delay-us", type=float, default=0.0,
                   help="the other ranks sleep this long before each report, so rank 0 reports "
                   "first and its every wait blocks: the asyncio client's loop turns per round "
                   "then no longer depend on when the answer comes (5000 does it)")  # fmt: skip
    p.add_argument("--gather", type=int, default=0, metavar="N",
                   help="N values a gather round (sync client), not step rounds")  # fmt: skip
    p.add_argument("--repeat", type=int, default=1, help="instruction runs (the median)")
    p.add_argument("--trace-rounds", type=int, default=1200)
    p.add_argument("--warmup", type=int, default=200, help="rounds before tracing")
    p.add_argument("--min-ops", type=float, default=1.0, help="hide functions below this")
    p.add_argument("--what", choices=["both", "instructions", "bytecodes"], default="both")
    p.add_argument("--tree", default=None, help="a checkout whose coordd to run")
    p.add_argument("--callgrind", default="", metavar="DIR",
                   help="run callgrind instead, keeping its two outputs in DIR "
                   "(callgrind_annotate: which C functions the instructions go to)")  # fmt: skip
    # the rank process's own arguments
    p.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--trace-out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.as_rank:
        _rank_main(args)
        return
    if args.gather and args.client != "sync":
        raise SystemExit("--gather counts the blocking client's gather rounds: --client sync")
    print(f"client={args.client} dp={args.dp} gather={args.gather} tree={args.tree or 'this one'}")
    if args.what in ("both", "bytecodes"):
        measure_bytecodes(args)
    if args.what in ("both", "instructions"):
        if shutil.which("valgrind") is None:
            raise SystemExit("valgrind is not installed: --what bytecodes only")
        measure_instructions(args)


if __name__ == "__main__":
    if "--as-rank" in sys.argv:  # run by path from another tree: find that tree's coordd
        sys.path[0:1] = []
    main()
