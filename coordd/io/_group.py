"""`Group`: one named DP group as the shell holds it."""

from __future__ import annotations

from dataclasses import dataclass

from coordd.ops.observer import Observer
from coordd.proto.coordinator import Coordinator


@dataclass(eq=False, slots=True)
class Group:
    """One named DP group: its state machine, what is counted about it, and its open round's
    deadline as the server last scheduled it."""

    name: str
    coordinator: Coordinator
    observer: Observer
    deadline: float | None = None
    #: its rounds (decided and failed) when the current message-count window began
    window_rounds: int = 0
