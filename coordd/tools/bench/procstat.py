"""What a process costs, read from /proc: CPU time per thread (ns), context switches, memory.

The benchmark reads coordd's own accounting (and the ranks' own) instead of timing from outside,
so "CPU per round" counts every thread of the process, ZeroMQ's I/O thread included.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

_TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def _task_ids(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _thread_cpu_ns(pid: int, tid: str) -> int:
    """On-CPU time of one thread: schedstat (ns) where the kernel has it, else stat (ticks)."""
    sched = _read(f"/proc/{pid}/task/{tid}/schedstat")
    if sched:
        return int(sched.split()[0])
    stat = _read(f"/proc/{pid}/task/{tid}/stat")
    if not stat:
        return 0
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_NS  # utime, stime


def _status_fields(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


@dataclass
class ProcSample:
    """One reading of a process: CPU ns per thread name, context switches, memory."""

    cpu_ns: dict[str, int] = field(default_factory=dict)
    ctx_switches: int = 0
    rss_bytes: int = 0
    hwm_bytes: int = 0

    @property
    def total_cpu_ns(self) -> int:
        return sum(self.cpu_ns.values())


def sample(pid: int) -> ProcSample:
    """Read every thread of `pid` now (threads with one name, like ZeroMQ's, are summed)."""
    out = ProcSample()
    for tid in _task_ids(pid):
        name = _read(f"/proc/{pid}/task/{tid}/comm").strip() or tid
        if tid == str(pid):
            name = "main"
        out.cpu_ns[name] = out.cpu_ns.get(name, 0) + _thread_cpu_ns(pid, tid)
        status = _status_fields(_read(f"/proc/{pid}/task/{tid}/status"))
        out.ctx_switches += int(status.get("voluntary_ctxt_switches", "0") or 0)
        out.ctx_switches += int(status.get("nonvoluntary_ctxt_switches", "0") or 0)
    status = _status_fields(_read(f"/proc/{pid}/status"))
    out.rss_bytes = int(status.get("VmRSS", "0 kB").split()[0]) * 1024
    out.hwm_bytes = int(status.get("VmHWM", "0 kB").split()[0]) * 1024
    return out


def thread_kind(name: str) -> str:
    """Group thread names: main, zmq-io (ZeroMQ's I/O threads), zmq-other, other."""
    if name == "main":
        return name
    if name.startswith("ZMQbg/IO"):
        return "zmq-io"
    if name.startswith("ZMQbg"):
        return "zmq-other"
    return "other"


def cpu_delta_ns(before: ProcSample, after: ProcSample) -> dict[str, int]:
    """CPU ns spent per thread name between two samples (threads born in between count whole)."""
    return {
        name: ns - before.cpu_ns.get(name, 0)
        for name, ns in after.cpu_ns.items()
        if ns - before.cpu_ns.get(name, 0) > 0
    }
