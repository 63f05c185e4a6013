"""coordd's own cost per round, counted rather than timed: a real `coordd serve --dp N` and N
lean ranks (the blocking client), run twice at two lengths; the difference over the difference
in rounds is the cost of one round, with start-up and shut-down cancelled out.

Two counts, each unmoved by the load of a shared machine:
- `--opcodes`: Python bytecodes and calls by function, in coordd's main thread (the event
  loop: everything the daemon's Python does), counted by `sys.settrace` with opcode events;
- `--instructions`: instructions of the whole coordd process (its main thread and libzmq's
  I/O thread), counted by `valgrind --tool=cachegrind --cache-sim=no`.

The counts do vary with how the ranks' messages fall into the daemon's wakeups (one drain may
take one message or eight), and a coordd slowed by the count batches more than a fast one:
the report says wakeups per round beside the opcode counts, and `--stagger-ms` spaces the
ranks' reports so that each has a wakeup of its own (the other end of the range).

    python -m coordd.tools.serve_counts --dp 8 --rounds 600 --base 100 --opcodes --instructions
    python -m coordd.tools.serve_counts --dp 2 --gather 7 --instructions

`--gather N`: the ranks run gather rounds of N values each (the vLLM plugin's sync) instead.

This is the daemon's side only: the ranks' own cost is counted elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coordd.testing.process import CoorddProcess, stop_process

#: Rounds every rank runs first in both runs (they cancel in the difference).
WARMUP = 20
#: Longest a rank waits to register (coordd under valgrind starts slowly) or for a round.
RANK_TIMEOUT = 300.0
#: Longest one whole run may take.
RUN_TIMEOUT = 1200.0
_MODULE = "coordd.tools.serve_counts"


# -- inside coordd ---------------------------------------------------------------------------


def _traced_serve(out: str, argv: list[str]) -> int:
    """Run `coordd <argv>` with every bytecode of the main thread counted by its function;
    the counts are written to `out` (JSON) when coordd returns."""
    ops: Counter[Any] = Counter()
    calls: Counter[Any] = Counter()

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            ops[frame.f_code] += 1
        return local

    def first(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        calls[frame.f_code] += 1
        return local

    from coordd.cli import main

    sys.settrace(first)
    try:
        code = main(argv)
    finally:
        sys.settrace(None)
        rows: dict[str, list[int]] = {}
        for co in set(ops) | set(calls):
            key = _name(co)
            row = rows.setdefault(key, [0, 0])
            row[0] += ops[co]
            row[1] += calls[co]
        Path(out).write_text(json.dumps(rows))
    return code


def _name(code: Any) -> str:
    """`package/module.py:Qual.name`, short enough to read in a table."""
    path = Path(code.co_filename)
    parts = path.parts
    for root in ("coordd", "asyncio", "zmq", "msgspec"):
        if root in parts:
            path = Path(*parts[len(parts) - 1 - parts[::-1].index(root) :])
            break
    else:
        path = Path(path.name)
    return f"{path}:{getattr(code, 'co_qualname', code.co_name)}"


# -- a rank ----------------------------------------------------------------------------------


def _rank(
    address: str, rank: int, dp: int, rounds: int, stagger: float = 0.0, gather: int = 0
) -> int:
    """One lean rank: register, then `rounds` blocking rounds of the bench's reports (or
    `gather` > 0: gathers of that many values), each sent `rank * stagger` seconds after the
    previous round's answer."""
    from coordd.client.sync import CoordClient
    from coordd.tools.bench.methods import bench_config
    from coordd.tools.bench.workload import report_table

    table = report_table(rank)
    config = bench_config(rank, dp)
    client = CoordClient(address, config=config)
    client.connect(timeout=RANK_TIMEOUT)
    try:
        delay = rank * stagger
        values = [[rank * 1000 + i + j for j in range(gather)] for i in range(len(table))]
        for i in range(rounds):
            if delay:
                time.sleep(delay)
            if gather:
                client.start_gather("serve-counts", values[i % len(table)]).wait()
            else:
                client.start(table[i % len(table)]).wait()
    finally:
        client.close()
    return 0


# -- the parent ------------------------------------------------------------------------------


def _run(
    dp: int,
    rounds: int,
    wrap: list[str],
    env: dict[str, str],
    workdir: str,
    stagger: float,
    gather: int = 0,
) -> None:
    """One run: coordd (under `wrap`) and `dp` ranks for WARMUP + `rounds` rounds."""
    bind = f"ipc://{workdir}/coordd.sock"
    proc = CoorddProcess(dp, bind, extra_args=["--log-level", "warning"], env=env)
    proc.argv = [*wrap, *proc.argv[3:]]  # in place of `python -m coordd`
    proc.start(timeout=RANK_TIMEOUT)
    try:
        rank_argv = [sys.executable, "-m", _MODULE, "_rank", proc.address]
        ranks = [
            subprocess.Popen(
                [*rank_argv, str(r), str(dp), str(WARMUP + rounds), str(stagger), str(gather)]
            )
            for r in range(dp)
        ]
        deadline = time.monotonic() + RUN_TIMEOUT
        failed = []
        for r, rank in enumerate(ranks):
            try:
                code = rank.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stop_process(rank)
                code = -1
            if code != 0:
                failed.append(r)
        if failed:
            raise RuntimeError(f"ranks {failed} failed (see their output above)")
    finally:
        exit_code = proc.stop(timeout=120.0)
    if exit_code not in (0, None):
        raise RuntimeError(f"coordd exited with {exit_code}")


def count_opcodes(
    dp: int, rounds: int, base: int, stagger: float = 0.0, gather: int = 0
) -> dict[str, tuple[float, float]]:
    """Bytecodes and calls per round by function (`rounds` less `base`, over the difference)."""
    runs = []
    for n in (base, rounds):
        with tempfile.TemporaryDirectory(prefix="coordd-counts-") as workdir:
            out = f"{workdir}/ops.json"
            wrap = [sys.executable, "-m", _MODULE, "_traced", out, "--"]
            _run(dp, n, wrap, dict(os.environ), workdir, stagger, gather)
            runs.append(json.loads(Path(out).read_text()))
    small, large = runs
    span = rounds - base
    per: dict[str, tuple[float, float]] = {}
    for key in set(small) | set(large):
        a, b = small.get(key, [0, 0]), large.get(key, [0, 0])
        per[key] = ((b[0] - a[0]) / span, (b[1] - a[1]) / span)
    return per


def count_instructions(
    dp: int,
    rounds: int,
    base: int,
    keep: str | None = None,
    stagger: float = 0.0,
    gather: int = 0,
) -> tuple[int, int, float]:
    """coordd's instructions (whole process) at both lengths, and per round; `keep`: a
    folder to copy cachegrind's two outputs to (`cg_diff` of them gives the round by
    function)."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise RuntimeError("valgrind is not installed (apt-get install valgrind)")
    totals = []
    for n in (base, rounds):
        with tempfile.TemporaryDirectory(prefix="coordd-counts-") as workdir:
            out = f"{workdir}/cachegrind.out"
            wrap = [valgrind, "--tool=cachegrind", "--cache-sim=no",
                    f"--cachegrind-out-file={out}", sys.executable, "-m", "coordd"]  # fmt: skip
            _run(dp, n, wrap, dict(os.environ), workdir, stagger, gather)
            totals.append(_summary(Path(out).read_text()))
            if keep is not None:
                Path(keep).mkdir(parents=True, exist_ok=True)
                shutil.copy(out, Path(keep) / f"cachegrind.{n}")
    return totals[0], totals[1], (totals[1] - totals[0]) / (rounds - base)


def _summary(text: str) -> int:
    for line in text.splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError("no summary line in cachegrind's output")


def _table(per: dict[str, tuple[float, float]], top: int) -> str:
    rows = sorted(per.items(), key=lambda kv: -kv[1][0])
    ours = [(k, v) for k, v in rows if k.startswith("coordd/")]
    lines = ["| function | bytecodes / round | calls / round |", "|---|---|---|"]
    lines += [f"| {k} | {v[0]:.0f} | {v[1]:.1f} |" for k, v in rows[:top]]
    total = sum(v[0] for _, v in rows)
    total_calls = sum(v[1] for _, v in rows)
    own = sum(v[0] for _, v in ours)
    own_calls = sum(v[1] for _, v in ours)
    lines.append(f"| total, coordd's own code | {own:.0f} | {own_calls:.1f} |")
    lines.append(f"| total, everything traced | {total:.0f} | {total_calls:.1f} |")
    wakeups = sum(v[1] for k, v in per.items() if k.endswith("CoordServer._on_frames"))
    lines.append(f"\nwakeups (`_on_frames` calls) per round: {wakeups:.2f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["_traced"]:
        return _traced_serve(args[1], args[3:])
    if args[:1] == ["_rank"]:
        gather = int(args[6]) if len(args) > 6 else 0
        return _rank(args[1], int(args[2]), int(args[3]), int(args[4]), float(args[5]), gather)
    p = argparse.ArgumentParser(prog="python -m coordd.tools.serve_counts", description=__doc__)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--rounds", type=int, default=600, help="rounds of the longer run")
    p.add_argument("--base", type=int, default=100, help="rounds of the shorter run")
    p.add_argument("--opcodes", action="store_true", help="bytecodes by function (settrace)")
    p.add_argument("--instructions", action="store_true", help="instructions (cachegrind)")
    p.add_argument("--top", type=int, default=30, help="functions shown")
    p.add_argument("--json", help="write the counts here as well")
    p.add_argument("--gather", type=int, default=0, metavar="N",
                   help="gather rounds of N values each instead of step rounds")  # fmt: skip
    p.add_argument("--keep", help="copy cachegrind's outputs to this folder")
    p.add_argument(
        "--stagger-ms",
        type=float,
        default=0.0,
        help="rank r sends each report r * this after the last answer: long enough, and each "
        "report has a wakeup of its own (the default, 0, lets a slowed coordd batch them)",
    )
    opts = p.parse_args(args)
    if opts.rounds <= opts.base:
        p.error("--rounds must exceed --base")
    if not (opts.opcodes or opts.instructions):
        opts.opcodes = True
    result: dict[str, Any] = {
        "dp": opts.dp,
        "rounds": opts.rounds,
        "base": opts.base,
        "gather": opts.gather,
    }
    if opts.instructions:
        small, large, per_round = count_instructions(
            opts.dp, opts.rounds, opts.base, opts.keep, opts.stagger_ms / 1000, opts.gather
        )
        result["instructions"] = {"base": small, "rounds": large, "per_round": per_round}
        print(
            f"coordd instructions (whole process, cachegrind): {small} at {opts.base} rounds, "
            f"{large} at {opts.rounds}: {per_round:.0f} per round, "
            f"{per_round / opts.dp:.0f} per rank per round (dp={opts.dp})",
            flush=True,
        )
    if opts.opcodes:
        per = count_opcodes(opts.dp, opts.rounds, opts.base, opts.stagger_ms / 1000, opts.gather)
        result["opcodes"] = per
        print(f"coordd main thread, per round at dp={opts.dp} (settrace opcode events):")
        print(_table(per, opts.top), flush=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
