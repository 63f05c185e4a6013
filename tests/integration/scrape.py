"""What integration tests ask of a coordd's HTTP side: a free port for `--metrics-port`, and
one sample of its /metrics."""

from __future__ import annotations

import socket
import urllib.request


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def metric_value(port: int, sample: str) -> float:
    """The value of `sample` (a metric name with its labels, as /metrics writes it: e.g.
    `coordd_connections_closed_total{reason="banned"}`) from the coordd serving on `port`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith(sample + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{sample} not in /metrics")
