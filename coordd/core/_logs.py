"""coordd's log lines: plain text for a terminal, one JSON object per line for a log pipeline.

An event (a failed round, a lost or refused rank) is logged with `event()`: a short name and
its fields (group, epoch, seq, kind, ranks, reason, ...). The text format puts the fields in
the line as `key=value`; the JSON format gives each field its own key, so a log pipeline can
select every fault of one group or rank without parsing prose. Where the lines go, and in which
format, is the command's to set up (`coordd.cli._logging`); a decision in the core returns a
`LogEvent` for the shell to log. The core imports no `logging`: a logger is whatever the
shell passes (`Logger`), and a level is the standard library's number (`WARNING`, `INFO`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from coordd.core._bounds import Throttle

#: `logging`'s levels, by number (the shell's logger takes them as they are).
INFO = 20
WARNING = 30


class Logger(Protocol):
    """What of a `logging.Logger` the lines here use."""

    def isEnabledFor(self, level: int) -> bool: ...

    def log(
        self, level: int, msg: object, *args: object, extra: Mapping[str, object] | None = ...
    ) -> None: ...


def _plain(text: str) -> bool:
    """True if `text` can stand in a log line as it is: printable, no whitespace, no quote."""
    return (
        bool(text) and text.isprintable() and '"' not in text and not any(c.isspace() for c in text)
    )


def _value(value: object) -> str:
    """A field's value as the text format shows it: a string a peer may control (a group
    name, a fingerprint) is quoted and escaped (JSON string rules, ASCII only) unless it is
    plainly printable, so a newline or a terminal escape in it cannot forge or hide a line."""
    if isinstance(value, str):
        return value if _plain(value) else json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value(v) if isinstance(v, str) else str(v) for v in value) + "]"
    if isinstance(value, bytes):
        return json.dumps(value.decode("utf-8", "backslashreplace"))
    return str(value)


def one_line(text: str) -> str:
    """`text` with every control character (newline, carriage return, escape, ...) written
    as an escape, so it cannot start a line of its own; printable text is kept as it is."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def event(logger: Logger, level: int, name: str, **fields: Any) -> None:
    """Log event `name` with `fields`; the message text carries them as key=value too."""
    if not logger.isEnabledFor(level):
        return
    text = " ".join(f"{key}={_value(value)}" for key, value in fields.items())
    logger.log(level, "%s %s", name, text, extra={"event": name, "fields": fields})


@dataclass(frozen=True, slots=True)
class LogEvent:
    """A line a decision asks the shell to log (`emit`)."""

    level: int
    name: str
    fields: dict[str, Any]


def emit(logger: Logger, line: LogEvent) -> None:
    """Log `line` with `event`."""
    event(logger, line.level, line.name, **line.fields)


def fault_fields(
    *, group: str, epoch: int, seq: int, kind: str, ranks: list[int] | tuple[int, ...]
) -> dict[str, Any]:
    """The fields every fault line carries, in this order."""
    return {"group": group, "epoch": epoch, "seq": seq, "kind": kind, "ranks": list(ranks)}


class Aggregated:
    """One kind of warning that a peer can cause once per message (a bad frame, a report from
    a peer that never registered): the first is logged at once, the rest of each `interval`
    counted and logged as one summary line (`suppressed=N`) when the interval ends, so a flood
    of 20,000 costs a few lines, not 20,000.

    `schedule(delay, callback)` arranges the summary when no further message comes (coordd
    passes its event loop's `call_later`); without it, the summary waits for the next one."""

    def __init__(
        self,
        logger: Logger,
        name: str,
        *,
        interval: float = 10.0,
        level: int = WARNING,
        clock: Callable[[], float] = time.monotonic,
        schedule: Callable[[float, Callable[[], None]], object] | None = None,
    ) -> None:
        self.logger = logger
        self.name = name
        self.interval = interval
        self.level = level
        self.clock = clock
        self.schedule = schedule
        self.total = 0
        #: one key: a line per interval, the rest held back into the summary
        self._throttle = Throttle(interval, keys=1)
        self._last: dict[str, Any] = {}
        self._started = 0.0  # when the current interval's line was logged
        self._flush_pending = False

    def __call__(self, **fields: Any) -> None:
        """One occurrence, with its fields (logged, or counted into the next summary)."""
        self.total += 1
        now = self.clock()
        if not self._throttle.admit(None, now):
            self._last = fields
            if self.schedule is not None and not self._flush_pending:
                self._flush_pending = True
                self.schedule(max(0.0, self._started + self.interval - now), self._scheduled_flush)
            return
        self._flush(self._throttle.held(None))
        event(self.logger, self.level, self.name, **fields)
        self._started = now

    def _scheduled_flush(self) -> None:
        self._flush_pending = False
        self.flush()

    def flush(self) -> None:
        """Log the summary of what was counted since the last line, if anything was."""
        self._flush(self._throttle.held(None))

    def _flush(self, count: int) -> None:
        if not count:
            return
        fields = {**self._last, "suppressed": count}
        last = fields.pop("detail", None)  # a caller's own detail: kept, after the summary's
        more = f"{count} more like this within {self.interval:g}s (last one's fields shown)"
        event(
            self.logger, self.level, self.name, **fields, detail=f"{more}: {last}" if last else more
        )
