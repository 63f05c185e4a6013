"""Every load against a fresh coordd, with the honest rounds' p50 and coordd's peaks."""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Sequence

from coordd.testing.process import CoorddProcess
from coordd.tools.load.gauge import ProcessGauge
from coordd.tools.load.honest_rounds import HonestRounds, p50_ms
from coordd.tools.load.processes import start_load

#: The loads `measure` runs, with their arguments (each bounded in count and time).
MEASURED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("garbage", ("--peers", "50", "--messages", "20000", "--repeat", "2")),
    ("fast", ("--seconds", "4")),
    ("multipart", ("--parts", "2000000")),
    ("unread", ("--peers", "20", "--messages", "10000", "--seconds", "1")),
    ("connections", ("--count", "1000", "--seconds", "4")),
    ("http", ("--count", "1000", "--seconds", "4")),
    ("claims", ("--count", "900", "--peers", "20", "--seconds", "4")),
    ("member", ("--seconds", "4", "--dp", "4")),
)


def measure(
    dp: int = 4,
    quiet_rounds: int = 300,
    limit: float = 60.0,
    only: Sequence[str] = (),
    extra: Sequence[str] = (),
    runs: int = 1,
) -> int:
    """For each load of MEASURED (or those named in `only`), `runs` times, against a fresh
    coordd (ipc, metrics on): honest-round p50 at `dp` quiet and during the load, coordd's
    peak RSS and descriptors, whether it lived.
    `extra` are more coordd options. Prints one line per run, and with `runs` > 1 a line per
    load of the ratio's and the peak's spread (a burst's peak varies from run to run on busy
    cores); returns 1 if coordd died under any."""
    import tempfile

    died = 0
    print(
        f"{'load':<12} {'quiet p50':>10} {'load p50':>9} {'ratio':>6} {'rounds':>7} "
        f"{'peak RSS':>9} {'peak FDs':>8}  coordd"
    )
    spread: dict[str, list[tuple[float, float]]] = {}
    for kind, load_args in [m for m in MEASURED for _ in range(runs)]:
        if only and kind not in only:
            continue
        with tempfile.TemporaryDirectory(prefix="coordd-load-") as tmp:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = int(probe.getsockname()[1])
            proc = CoorddProcess(
                dp,
                f"ipc://{tmp}/c.sock",
                ["--log-level", "error", "--metrics-port", str(port), *extra],
            ).start()
            try:
                with HonestRounds(proc.address, dp) as ranks, ProcessGauge(proc.pid) as gauge:
                    ranks.run(20)
                    quiet = p50_ms(ranks.run(quiet_rounds))
                    target = f"127.0.0.1:{port}" if kind == "http" else proc.address
                    load = start_load(kind, target, *load_args)
                    during: list[float] = []
                    end = time.monotonic() + limit
                    error = ""
                    while load.poll() is None and time.monotonic() < end:
                        try:
                            during.extend(ranks.run(1))
                        except Exception as exc:
                            error = type(exc).__name__
                            break
                    if load.poll() is None:
                        load.kill()
                    load.wait()
                    alive = gauge.alive
                died += not alive
                busy = p50_ms(during)
                state = "alive" if alive else "DIED"
                print(
                    f"{kind:<12} {quiet:>8.2f}ms {busy:>7.2f}ms {busy / quiet:>6.1f} "
                    f"{len(during):>7} {gauge.peak_rss_mb:>7.0f}MB {gauge.peak_fds:>8}  "
                    f"{state}{' ' + error if error else ''}",
                    flush=True,
                )
                spread.setdefault(kind, []).append((busy / quiet, gauge.peak_rss_mb))
            finally:
                proc.stop()
    for kind, seen in spread.items() if runs > 1 else ():
        ratios = sorted(r for r, _ in seen)
        peaks = sorted(p for _, p in seen)
        print(
            f"{kind:<12} {len(seen)} runs: ratio {ratios[0]:.1f}-{ratios[-1]:.1f} (median "
            f"{statistics.median(ratios):.1f}), peak RSS {peaks[0]:.0f}-{peaks[-1]:.0f} MB "
            f"(median {statistics.median(peaks):.0f})",
            flush=True,
        )
    return 1 if died else 0
