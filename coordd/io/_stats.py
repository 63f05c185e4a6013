"""The I/O shell's own counts, and the one place they are gathered for ops to read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from coordd.core._admission import Admission
from coordd.io._gate import HandshakeGate
from coordd.io._memory import MemoryWatch
from coordd.ops.view import ShellCounters


@dataclass
class ServerStats:
    """Counters the metrics endpoint and the benchmark read."""

    frames_in: int = 0
    bad_frames: int = 0
    frames_out: int = 0
    disconnects: int = 0
    #: parts of refused multipart messages, dropped without decoding
    parts_dropped: int = 0


def shell_counters(
    stats: ServerStats,
    admission: Admission,
    watch: MemoryWatch | None,
    gate: HandshakeGate | None,
    curve_refused: Callable[[], int] | None,
) -> ShellCounters:
    """The I/O shell's counts now, as ops reads them (`coordd.ops.view.ShellCounters`)."""
    return ShellCounters(
        frames_in=stats.frames_in,
        frames_out=stats.frames_out,
        bad_frames=stats.bad_frames,
        disconnects=stats.disconnects,
        connections_open=len(admission.open),
        closed_cap=admission.evicted,
        closed_flood=admission.cut_off,
        closed_banned=admission.refused,
        closed_silent=admission.expired,
        closed_messages_dropped=admission.dropped_shut,
        memory_shed=None if watch is None else watch.stats.shed_connections,
        memory_refused=None if gate is None else gate.refused,
        rate_refused=None if gate is None or gate.rate is None else gate.rate.refused,
        curve_refused=None if curve_refused is None else curve_refused(),
        closed_violation=admission.violations,
    )
