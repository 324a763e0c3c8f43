"""Process logging for `slmrank serve`: a level, and a format for people (text) or for log
collectors (json: one object per line, the fields a collector indexes at the top level).

    text  2026-12-01T03:40:50.123Z INFO slmrank.server: model loaded in 2.1 s: SERVING
    json  {"ts": "2026-12-01T03:40:50.123Z", "level": "info", "logger": "slmrank.server",
           "msg": "model loaded in 2.1 s: SERVING"}

Records go to stderr; the start-up announcements (the bound address, how to send a request) go
to stdout, in the same format. `extra={...}` fields of a record (the access log's method, code,
latency_ms, peer, ...) become JSON fields, or `key=value` pairs after a text message.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

from ..model import progress

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
ANNOUNCE = "slmrank"  # the logger of the start-up announcements (stdout)
ACCESS = "slmrank.access"  # one record per finished RPC, when the access log is on
PROGRESS = "slmrank.progress"  # artifact build and graph capture progress (service/model/progress.py)
# LogRecord attributes that are not a record's own `extra` fields
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


def _timestamp(record: logging.LogRecord) -> str:
    seconds = int(record.created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int(record.msecs):03d}Z"


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname} {record.name}: {record.getMessage()}"
        extras = _extras(record)
        if extras:
            line += " " + " ".join(f"{k}={v}" for k, v in extras.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": _timestamp(record), "level": record.levelname.lower(), "logger": record.name,
                               "msg": record.getMessage()}
        out.update(_extras(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_logging(level: str = "info", fmt: str = "text", stderr: TextIO | None = None,
                      stdout: TextIO | None = None) -> None:
    """Replaces the handlers of the root logger (stderr) and of the announcements (stdout)."""
    if level not in LEVELS:
        raise ValueError(f"log level: {level!r} is not one of {', '.join(LEVELS)}")
    if fmt not in ("text", "json"):
        raise ValueError(f"log format: {fmt!r} is not one of text, json")
    formatter: logging.Formatter = JsonFormatter() if fmt == "json" else TextFormatter()
    root = logging.getLogger()
    _replace_handler(root, logging.StreamHandler(stderr or sys.stderr), formatter)
    root.setLevel(LEVELS[level])
    announce = logging.getLogger(ANNOUNCE + ".announce")
    _replace_handler(announce, logging.StreamHandler(stdout or sys.stdout), formatter)
    announce.propagate = False
    announce.setLevel(logging.INFO)
    # long work (artifact build, graph capture) reports as records of this format, not bare lines
    progress_log = logging.getLogger(PROGRESS)
    progress.set_sink(lambda msg, fields: progress_log.info(msg, extra=fields))


def current_settings() -> tuple[str, str]:
    """(level, format) as configure_logging last set them ("info", "text" when it was not called):
    for child processes (the server's fronts) to log as the parent does."""
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, "_slmrank", False)]
    if not ours:
        return "info", "text"
    level = next((name for name, value in LEVELS.items() if value == root.level), "info")
    return level, "json" if isinstance(ours[-1].formatter, JsonFormatter) else "text"


def _replace_handler(logger: logging.Logger, handler: logging.Handler, formatter: logging.Formatter) -> None:
    """Ours replaces ours (called again: no duplicate lines); others' handlers (pytest's) stay."""
    for old in [h for h in logger.handlers if getattr(h, "_slmrank", False)]:
        logger.removeHandler(old)
    handler.setFormatter(formatter)
    handler._slmrank = True  # type: ignore[attr-defined]
    logger.addHandler(handler)


def announce(line: str) -> None:
    """A start-up line for the operator (stdout): the address, how to send a request."""
    logging.getLogger(ANNOUNCE + ".announce").info(line)
