"""Load generators against a live coordd, and honest ranks that time their rounds meanwhile:
every load is bounded in count and time and stops by itself.

Run them from the command line (command.py has the usage):
`python -m coordd.tools.load KIND ADDRESS ...`, or all of them with figures:
`python -m coordd.tools.load measure --dp 4`.
`LOADS` names them; `start_load(kind, address, ...)` starts one as a child process
(processes.py); `HonestRounds` drives dp real clients through rounds and keeps each round's
latency (honest_rounds.py); `ProcessGauge` samples a process's RSS and descriptors (gauge.py).
The loads themselves: message_floods.py, connection_floods.py, claims.py; `measure`: measure.py.
"""

from __future__ import annotations

from coordd.tools.load.command import main
from coordd.tools.load.gauge import ProcessGauge
from coordd.tools.load.honest_rounds import HonestRounds
from coordd.tools.load.processes import LOADS, start_load, wait_load

__all__ = ["LOADS", "HonestRounds", "ProcessGauge", "main", "start_load", "wait_load"]
