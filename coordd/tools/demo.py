"""`coordd demo --dp N`: a real coordd and N engine-like rank processes, with a live view.

Each rank (coordd/tools/demo_rank.py) runs a vLLM-shaped step loop over the vLLM adapter: draw a
batch, start the forward round, sleep the previous step's GPU time while the round is in
flight, finish it, then run the drafter's round. The view shows steps/s, the round latency
(drafter rounds, which nothing overlaps), the exposed wait of the forward rounds (what the
overlap leaves visible), and the share of padded tokens. At the end the demo checks that every
rank got the same decision in every round, equal to the policy applied to all reports.

The view uses rich on a terminal (the `demo` extra: pip install 'coordd[demo]') and prints plain
lines otherwise, or without rich.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import msgspec

from coordd.proto.policy import decide
from coordd.testing.process import CoorddProcess
from coordd.tools.demo_rank import Finished, Progress, RankMessage, demo_config, run_rank


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dp", type=int, default=4, help="engine ranks (processes)")
    p.add_argument(
        "--seconds", type=float, default=None, help="run this long (default 5 unless --rounds)"
    )
    p.add_argument("--rounds", type=int, default=None, help="run this many steps")
    p.add_argument(
        "--step-ms",
        type=float,
        default=2.0,
        help="simulated GPU time scale: a step takes step_ms * (0.6 + tokens/1024) ms",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bind",
        default=None,
        help="default: ipc in a temporary directory; tcp://HOST:PORT needs --insecure or the "
        "CURVE options (as coordd serve)",
    )
    p.add_argument(
        "--insecure", action="store_true", help="allow a tcp --bind without CURVE (as serve)"
    )
    p.add_argument(
        "--curve-secret-key",
        default=None,
        help="coordd's NAME.key_secret, as serve; the ranks read $COORDD_CURVE_SERVER_KEY and "
        "$COORDD_CURVE_CLIENT_KEY",
    )
    p.add_argument(
        "--curve-client-keys",
        default=None,
        help="comma list of admitted client key files (NAME.key), as serve",
    )
    p.add_argument("--plain", action="store_true", help="plain lines even on a terminal")


#: The most rank processes the demo starts.
MAX_DEMO_DP = 256


def check_args(args: argparse.Namespace) -> list[str]:
    """Refuse out-of-range options with one line naming the option (SystemExit, code 1);
    returns the options coordd serve gets for the bind (security)."""
    from coordd.core._options import OptionError, count, seconds
    from coordd.io._curve import SecurityConfigError, check_security_options
    from coordd.io._listen import BindError, check_bind

    try:
        if type(args.dp) is not int or not 2 <= args.dp <= MAX_DEMO_DP:
            raise OptionError(
                f"--dp must be >= 2 (at dp=1 nothing is agreed) and <= {MAX_DEMO_DP} (each "
                f"rank is a process), got {args.dp}"
            )
        if args.seconds is not None:
            seconds("--seconds", args.seconds, low=0.1)
        if args.rounds is not None:
            count("--rounds", args.rounds, low=1, high=10_000_000)
        seconds("--step-ms", args.step_ms, low=0.0, high=10_000.0)
        if args.bind is not None:
            check_bind(args.bind)
        clients = [k for k in (args.curve_client_keys or "").split(",") if k.strip()]
        bind = args.bind or "ipc://demo"
        check_security_options(bind, args.curve_secret_key, clients, args.insecure)
    except (OptionError, BindError, SecurityConfigError) as exc:
        raise SystemExit(f"coordd demo: {exc}") from None
    extra = ["--insecure"] if args.insecure else []
    if args.curve_secret_key:
        extra += ["--curve-secret-key", args.curve_secret_key]
        extra += ["--curve-client-keys", ",".join(clients)]
    return extra


# -- what the view shows ------------------------------------------------------------------------


#: The "recent" column's window, seconds.
RECENT_S = 2.0


@dataclass
class Stats:
    """Aggregated progress of all ranks: whole run, and a window of recent samples."""

    dp: int
    started: float = 0.0  # the first progress report: the ranks' start-up is not counted
    steps: dict[int, int] = field(default_factory=dict)
    history: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=64))
    exposed: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    #: (when it came, sample) for the last RECENT_S seconds: the "recent" column. (A window
    #: of 4000 samples held the whole of a 5 s demo: "recent" always equalled "whole run".)
    recent_exposed_at: deque[tuple[float, float]] = field(default_factory=deque)
    recent_latency_at: deque[tuple[float, float]] = field(default_factory=deque)
    tokens_run: int = 0
    tokens_real: int = 0
    ubatched: int = 0
    votes: int = 0
    voters: int = 0

    def add(self, p: Progress) -> None:
        if not self.started:
            self.started = time.monotonic()
        self.steps[p.rank] = p.steps
        self.exposed += p.exposed
        self.latency += p.latency
        now = time.monotonic()
        for recent, samples in (
            (self.recent_exposed_at, p.exposed),
            (self.recent_latency_at, p.latency),
        ):
            recent.extend((now, x) for x in samples)
            while recent and now - recent[0][0] > RECENT_S:
                recent.popleft()
        self.tokens_run += p.tokens_run
        self.tokens_real += p.tokens_real
        if p.rank == 0:
            self.ubatched += p.ubatched
        self.votes += p.votes
        self.history.append((time.monotonic(), self.group_steps))

    @property
    def recent_exposed(self) -> list[float]:
        return [x for _, x in self.recent_exposed_at]

    @property
    def recent_latency(self) -> list[float]:
        return [x for _, x in self.recent_latency_at]

    @property
    def group_steps(self) -> int:
        return min(self.steps.values()) if len(self.steps) == self.dp else 0

    def steps_per_s(self) -> float:
        now = time.monotonic()
        window = [(t, s) for t, s in self.history if now - t <= 1.5]
        if len(window) < 2 or window[-1][0] <= window[0][0]:
            return 0.0
        return (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])

    def padded_share(self) -> float:
        return 1 - self.tokens_real / self.tokens_run if self.tokens_run else 0.0

    def ubatched_share(self) -> float:
        steps = self.steps.get(0, 0)
        return self.ubatched / steps if steps else 0.0

    def vote_share(self) -> float:
        """How often a rank voted to micro-batch (the group needs every vote, and a split
        whose last micro-batch is not empty)."""
        steps = sum(self.steps.values())
        return self.votes / steps if steps else 0.0


def pct(samples: Any, q: float) -> float:
    """The q-quantile in microseconds (0 without samples)."""
    xs = sorted(samples)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e6 if xs else 0.0


def plain_line(s: Stats) -> str:
    return (
        f"t={time.monotonic() - s.started if s.started else 0.0:5.1f}s steps={s.group_steps:6d} "
        f"steps/s={s.steps_per_s():7.1f} "
        f"round p50={pct(s.recent_latency, 0.5):6.0f}us p99={pct(s.recent_latency, 0.99):6.0f}us "
        f"exposed p50={pct(s.recent_exposed, 0.5):5.0f}us "
        f"p99={pct(s.recent_exposed, 0.99):6.0f}us "
        f"padded={100 * s.padded_share():4.1f}% ubatch={100 * s.ubatched_share():4.1f}%"
    )


class PlainView:
    """One line a second: for logs, pipes and CI."""

    def __init__(self, title: str) -> None:
        print(title, flush=True)
        self._next = time.monotonic() + 1.0

    def update(self, s: Stats) -> None:
        if time.monotonic() >= self._next and s.group_steps:
            print("  " + plain_line(s), flush=True)
            self._next = time.monotonic() + 1.0

    def close(self) -> None:
        pass


class RichView:
    """A live table on a terminal."""

    def __init__(self, title: str) -> None:
        from rich.console import Console
        from rich.live import Live

        self.title = title
        self.console = Console()
        self.live = Live(console=self.console, refresh_per_second=8, transient=False)
        self.live.start()

    def update(self, s: Stats) -> None:
        from rich.table import Table

        title, _, caption = self.title.partition(" | ")
        table = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
        table.add_column("")
        table.add_column(f"last {RECENT_S:g} s", justify="right")
        table.add_column("whole run", justify="right")
        elapsed = time.monotonic() - s.started if s.started else 0.0
        whole = s.group_steps / elapsed if elapsed > 0 else 0.0
        table.add_row("steps", "", f"{s.group_steps}")
        table.add_row("steps/s", f"{s.steps_per_s():.0f}", f"{whole:.0f}")
        for name, recent, every in (
            ("round latency (drafter rounds)", s.recent_latency, s.latency),
            ("exposed wait (forward rounds)", s.recent_exposed, s.exposed),
        ):
            for q in (0.5, 0.99):
                table.add_row(
                    f"{name} p{int(q * 100)}",
                    f"{pct(recent, q):.0f} us",
                    f"{pct(every, q):.0f} us",
                )
        table.add_row("padded tokens (graph buckets + DP)", "", f"{100 * s.padded_share():.1f}%")
        table.add_row("micro-batching votes (per rank)", "", f"{100 * s.vote_share():.1f}%")
        table.add_row("micro-batched steps (group)", "", f"{100 * s.ubatched_share():.1f}%")
        self.live.update(table)

    def close(self) -> None:
        self.live.stop()


def make_view(title: str, plain: bool) -> PlainView | RichView:
    if plain or not sys.stdout.isatty():
        return PlainView(title)
    try:
        return RichView(title)
    except ImportError:
        print(
            "coordd demo: the live table needs rich (pip install 'coordd[demo]'); plain lines",
            file=sys.stderr,
        )
        return PlainView(title)


# -- the run -------------------------------------------------------------------------------------


def verify(finished: list[Finished], num_ubatches: int) -> tuple[int, list[str]]:
    """Every rank got the same decision for every round, equal to the policy: (rounds, problems)."""
    problems = [f"rank {f.rank}: {f.error}" for f in finished if f.error]
    lengths = {len(f.records) for f in finished}
    if len(lengths) != 1:
        problems.append(f"ranks logged different numbers of rounds: {sorted(lengths)}")
        return 0, problems
    for i in range(lengths.pop()):
        round_records = [f.records[i] for f in finished]
        first = round_records[0].decision
        if any(r.decision != first for r in round_records):
            problems.append(f"seq {first.seq}: ranks got different decisions")
            continue
        expected = decide(
            [r.report for r in round_records],
            num_ubatches,
            epoch=first.epoch,
            seq=first.seq,
            kind=first.kind,
        )
        if first != expected:
            problems.append(f"seq {first.seq}: decision differs from the policy")
    return len(finished[0].records), problems


def run(args: argparse.Namespace) -> int:
    security = check_args(args)
    seconds = args.seconds if args.seconds is not None or args.rounds is not None else 5.0
    limit = (seconds or 0) + (args.rounds or 0) * 0.05 + 60  # a hard stop: never hang
    decoder = msgspec.msgpack.Decoder(RankMessage)
    with tempfile.TemporaryDirectory(prefix="coordd-demo-") as tmp:
        bind = args.bind or f"ipc://{tmp}/coordd.sock"
        coordd = CoorddProcess(args.dp, bind, ["--log-level", "error", *security])
        try:
            coordd.start()
        except (RuntimeError, TimeoutError) as exc:
            raise SystemExit(
                f"coordd demo: coordd did not start ({exc}); see its error above"
            ) from None
        try:
            ctx = mp.get_context("spawn")
            pipes = [ctx.Pipe(duplex=False) for _ in range(args.dp)]
            procs = [
                ctx.Process(
                    target=run_rank,
                    args=(
                        coordd.address,
                        r,
                        args.dp,
                        args.rounds,
                        seconds,
                        args.step_ms,
                        args.seed,
                        pipes[r][1],
                    ),
                    daemon=True,
                )
                for r in range(args.dp)
            ]
            bound = f"{args.rounds} steps" if args.rounds else f"{seconds:g} s"
            title = (
                f"coordd demo: dp={args.dp} engine-like ranks, {bound} | "
                f"GPU time scale {args.step_ms:g} ms; coordd on {coordd.address}"
            )
            stats = Stats(args.dp)
            finished: dict[int, Finished] = {}
            view = make_view(title, args.plain)
            interrupted = False
            try:
                for p in procs:
                    p.start()
                for _, sender in pipes:
                    sender.close()  # the children hold theirs: a rank that dies reads as EOF
                open_pipes: dict[Connection, int] = {pipes[r][0]: r for r in range(args.dp)}
                hard_stop = time.monotonic() + limit
                while open_pipes and time.monotonic() < hard_stop:
                    for conn in wait(list(open_pipes), timeout=0.1):
                        assert isinstance(conn, Connection)
                        try:
                            message = decoder.decode(conn.recv_bytes())
                        except EOFError:
                            rank = open_pipes.pop(conn)
                            finished.setdefault(rank, Finished(rank, 0, [], "exited early"))
                            continue
                        if isinstance(message, Progress):
                            stats.add(message)
                        else:
                            finished[message.rank] = message
                            open_pipes.pop(conn, None)
                    view.update(stats)
            except KeyboardInterrupt:
                interrupted = True
            finally:
                view.close()
                for p in procs:
                    if interrupted and p.is_alive():
                        p.kill()
                    p.join(timeout=5)
                    if p.is_alive():
                        p.kill()
                        p.join(timeout=5)
        finally:
            coordd.stop()
    if interrupted:
        print("coordd demo: interrupted; every rank and coordd stopped", file=sys.stderr)
        return 130
    for r in range(args.dp):
        finished.setdefault(r, Finished(r, 0, [], f"no result within {limit:g}s"))
    ordered = [finished[r] for r in range(args.dp)]
    rounds, problems = verify(ordered, demo_config(args.dp).num_ubatches)
    return report(args, stats, ordered, rounds, problems)


def report(
    args: argparse.Namespace, s: Stats, finished: list[Finished], rounds: int, problems: list[str]
) -> int:
    elapsed = time.monotonic() - s.started if s.started else 0.0
    steps = finished[0].steps
    ok = not problems
    print(
        f"coordd demo: dp={args.dp}, {steps} steps ({rounds} rounds: forward + drafter) "
        f"in {elapsed:.1f} s"
    )
    print(
        f"  every rank got the same decision in all {rounds} rounds, equal to the policy: "
        f"{'yes' if ok else 'NO'}"
    )
    for problem in problems[:10]:
        print(f"    {problem}")
    print(
        f"  round latency (drafter rounds, nothing overlapped): p50 {pct(s.latency, 0.5):6.0f} us"
        f"   p99 {pct(s.latency, 0.99):6.0f} us"
    )
    print(
        f"  exposed wait (forward rounds, overlapped with the GPU): p50 "
        f"{pct(s.exposed, 0.5):6.0f} us   p99 {pct(s.exposed, 0.99):6.0f} us"
    )
    print(
        f"  padded tokens (CUDA-graph buckets + DP padding): {100 * s.padded_share():.1f}% of "
        f"the tokens run"
    )
    print(
        f"  micro-batching: a rank voted yes in {100 * s.vote_share():.1f}% of its steps, "
        f"the group micro-batched {100 * s.ubatched_share():.1f}% of the steps"
    )
    print("  " + takeaway(s))
    return 0 if ok else 1


def takeaway(s: Stats) -> str:
    """The closing line: what the two latencies mean side by side."""
    latency, exposed = pct(s.latency, 0.5), pct(s.exposed, 0.5)
    if not latency:
        return "what it means: no round was timed"
    return (
        f"what it means: a rank sends its report as soon as its batch is known and reads the "
        f"decision after the step's GPU work, so it waited {exposed:.0f} us (p50) for a round "
        f"that takes {latency:.0f} us ({100 * exposed / latency:.0f}%): the exchange overlaps "
        "the step instead of stalling it"
    )
