"""Per-step timings of the V1 runner's DP sync, for stock vLLM and the plugin alike.

With COORDD_VLLM_TIMINGS=DIR in a worker's environment, each process appends one JSON line a
step to DIR/steps-<pid>.jsonl:

  mode    "stock" (the plugin off), "off" (the plugin, every round started at the sync) or
          "on" (the runner's round started before `_prepare_inputs`)
  step    seconds in `execute_model`
  sync    seconds the step's thread spent in `_determine_batch_execution_and_padding` at the
          sync (where vLLM's DP sync blocks): the step's wait in the sync
  start   seconds spent starting the round early (overlap on; 0 otherwise)
  window  seconds from the early start to the sync (0 without one)
  wait    seconds the plugin blocked for the round's answer at the sync (0 for stock vLLM)

A step that made no sync (a rank with nothing scheduled returns before it) has sync = 0 and
is written too: readers keep the steps with a sync. Each line is written when its step ends.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from coordd.vllm import early


class StepClock:
    """Times one process's steps and the sync in each (see the module's docstring)."""

    def __init__(self, directory: Path, mode: str) -> None:
        self.directory = directory
        self.mode = mode
        self._lock = threading.Lock()
        self._out: TextIO | None = None
        self._pid = 0
        self._step: dict[str, float] | None = None

    # -- what the wrappers and the exchange report ---------------------------------------------

    def begin_step(self) -> None:
        self._step = {"sync": 0.0, "start": 0.0, "window": 0.0, "wait": 0.0}

    def end_step(self, seconds: float) -> None:
        """Write the step's line at once (after its timing: the write is in no measured
        span), so a rank that is killed still leaves every step it finished."""
        step, self._step = self._step, None
        if step is None:
            return
        step["step"] = seconds
        line = json.dumps({"mode": self.mode, **{k: round(v, 7) for k, v in step.items()}})
        with self._lock:
            if self._out is None or self._pid != os.getpid():  # a forked child: its own file
                self._pid = os.getpid()
                self._out = (self.directory / f"steps-{self._pid}.jsonl").open("a")
            self._out.write(line + "\n")
            self._out.flush()

    def add(self, key: str, seconds: float) -> None:
        if self._step is not None:
            self._step[key] += seconds

    def on_sync(self, identity: Any, site: str, window: float, wait: float) -> None:
        """`Exchange.on_sync`: the runner's sync only (its site is
        coordinate_batch_across_dp called from the runner)."""
        if self._step is not None and site.startswith("coordinate_batch_across_dp@"):
            self._step["window"] += window
            self._step["wait"] += wait


def timed(clock: StepClock, original: Callable[..., Any], key: str) -> Callable[..., Any]:
    """`original` with its time added to the clock's `key` (the early start's run of the sync
    function counts as "start", not as the sync)."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = early.now()
        try:
            return original(*args, **kwargs)
        finally:
            clock.add("start" if early.starting() else key, early.now() - began)

    wrapper.coordd_patch = True  # type: ignore[attr-defined]
    return wrapper


def stepped(clock: StepClock, original: Callable[..., Any]) -> Callable[..., Any]:
    """`original` (execute_model) as one step of the clock."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        clock.begin_step()
        began = early.now()
        try:
            return original(*args, **kwargs)
        finally:
            clock.end_step(early.now() - began)

    wrapper.coordd_patch = True  # type: ignore[attr-defined]
    return wrapper


def make_clock(directory: str, mode: str) -> StepClock:
    """A clock writing under `directory`."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    return StepClock(path, mode)
