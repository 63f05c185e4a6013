"""coordd's log lines: plain text for a terminal, one JSON object per line for a log pipeline.

An event (a failed round, a lost or refused rank) is logged with `event()`: a short name and
its fields (group, epoch, seq, kind, ranks, reason, ...). The text format puts the fields in
the line as `key=value`; the JSON format gives each field its own key, so a log pipeline can
select every fault of one group or rank without parsing prose.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

LOG_FORMATS = ("text", "json")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _value(value: object) -> str:
    if isinstance(value, str):
        return json.dumps(value) if (not value or " " in value or '"' in value) else value
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


def event(logger: logging.Logger, level: int, name: str, **fields: Any) -> None:
    """Log event `name` with `fields`; the message text carries them as key=value too."""
    if not logger.isEnabledFor(level):
        return
    text = " ".join(f"{key}={_value(value)}" for key, value in fields.items())
    logger.log(level, "%s %s", name, text, extra={"event": name, "fields": fields})


def fault_fields(
    *, group: str, epoch: int, seq: int, kind: str, ranks: list[int] | tuple[int, ...]
) -> dict[str, Any]:
    """The fields every fault line carries, in this order."""
    return {"group": group, "epoch": epoch, "seq": seq, "kind": kind, "ranks": list(ranks)}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, then the event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out["message"] = getattr(record, "event", record.getMessage())
            for key, value in fields.items():
                out.setdefault(key, value)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str, fmt: str = "text") -> None:
    """Log to stderr at `level` in format `fmt` ("text" or "json")."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
