"""While attackers keep handshakes in flight, does an honest rank get in?

    python -m coordd.tools.load.honest_admission --transport ipc --attackers 16 --tries 10
    python -m coordd.tools.load.honest_admission --transport tcp --attackers 16 --tries 10

A fresh `coordd serve` at its defaults (tcp: with CURVE), `--attackers` processes of one
attack, then `--tries` honest `connect(timeout=10)`s one after another, each from a fresh
process (a rank's own source, as an engine's is). The attack over ipc: raw ZMTP handshakes,
20 in flight per process, each dropped and reopened after 50 ms (`claims --count 0`). Over
tcp+CURVE: a leaked client key, 20 handshakes in flight per process from 200 loopback
addresses (`handshakes --count 200`); the rank has a key of its own. Prints one line per
try and a summary; the exit status is 1 unless every try got in within its timeout.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from coordd.io._curve import write_keypair
from coordd.testing.process import CoorddProcess, die_with_parent
from coordd.tools.load.processes import start_load

#: One honest rank in a fresh process: prints "ok SECONDS" or "failed SECONDS ERROR".
_CONNECT = r"""
import sys, time
from coordd.client import CoordClient
t0 = time.monotonic()
try:
    with CoordClient(sys.argv[1], dp_rank=0, dp_size=1) as rank:
        rank.connect(timeout=float(sys.argv[2]))
    print(f"ok {time.monotonic() - t0:.2f}")
except Exception as exc:
    print(f"failed {time.monotonic() - t0:.2f} {type(exc).__name__}")
"""
#: Seconds the attack runs before the first try (its handshakes fill the gate by then).
WARMUP = 4.0
#: Seconds between tries.
PAUSE = 0.5


def run(transport: str, attackers: int, tries: int, timeout: float = 10.0) -> list[str]:
    """The tries' lines ("ok 0.01", "failed 10.00 CoordinatorUnavailable"), in order."""
    with tempfile.TemporaryDirectory(prefix="coordd-admission-") as tmp:
        honest_env = dict(os.environ)
        attack_env = dict(os.environ)
        if transport == "ipc":
            coordd = CoorddProcess(1, f"ipc://{tmp}/c.sock", ["--log-level", "error"])
            attack = ("claims", "--count", "0", "--peers", "20")
        else:
            for name in ("coordd", "leaked", "rank"):
                write_keypair(tmp, name)
            curve = [
                "--curve-secret-key",
                f"{tmp}/coordd.key_secret",
                "--curve-client-keys",
                f"{tmp}/leaked.key,{tmp}/rank.key",
            ]
            coordd = CoorddProcess(1, "tcp://127.0.0.1:0", ["--log-level", "error", *curve])
            attack = ("handshakes", "--peers", "20", "--count", "200")
            server_key = f"{tmp}/coordd.key"
            attack_env.update(
                COORDD_CURVE_SERVER_KEY=server_key,
                COORDD_CURVE_CLIENT_KEY=f"{tmp}/leaked.key_secret",
            )
            honest_env.update(
                COORDD_CURVE_SERVER_KEY=server_key,
                COORDD_CURVE_CLIENT_KEY=f"{tmp}/rank.key_secret",
            )
        seconds = WARMUP + tries * (timeout + PAUSE + 2) + 5
        with coordd:
            kind, *args = attack
            loads = [
                start_load(kind, coordd.address, *args, "--seconds", str(seconds), env=attack_env)
                for _ in range(attackers)
            ]
            try:
                time.sleep(WARMUP)
                lines = []
                for n in range(tries):
                    stopped = [load.args for load in loads if load.poll() is not None]
                    if stopped:
                        raise RuntimeError(f"an attacker stopped early: {stopped[0]!r}")
                    line = _try(coordd.address, timeout, honest_env)
                    print(f"try {n + 1}: {line}", flush=True)
                    lines.append(line)
                    time.sleep(PAUSE)
            finally:
                for load in loads:
                    load.kill()
                    load.wait()
            alive = coordd.proc is not None and coordd.proc.poll() is None
        if not alive:
            raise RuntimeError("coordd died under the attack")
        return lines


def _try(address: str, timeout: float, env: dict[str, str]) -> str:
    try:
        out = subprocess.run(
            [sys.executable, "-c", _CONNECT, address, str(timeout)],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout + 30,
            preexec_fn=die_with_parent(),
        )
    except subprocess.TimeoutExpired:
        return f"failed {timeout + 30:.2f} the rank's process hung"
    return out.stdout.strip() or f"failed - exit {out.returncode}: {out.stderr.strip()[-200:]}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m coordd.tools.load.honest_admission", description=__doc__
    )
    p.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    p.add_argument("--attackers", type=int, default=16)
    p.add_argument("--tries", type=int, default=10)
    p.add_argument("--timeout", type=float, default=10.0, help="each connect()'s, in seconds")
    args = p.parse_args(argv)
    lines = run(args.transport, args.attackers, args.tries, args.timeout)
    ok = [line for line in lines if line.startswith("ok")]
    times = ", ".join(line.split()[1] for line in lines)
    print(
        f"{args.transport}, {args.attackers} attackers: honest connect {len(ok)}/{len(lines)} "
        f"within {args.timeout:g} s (seconds: {times})",
        flush=True,
    )
    return 0 if len(ok) == len(lines) else 1


if __name__ == "__main__":
    sys.exit(main())
