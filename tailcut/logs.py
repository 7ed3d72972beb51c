"""Structured logs with a fixed vocabulary: ``log_event(logger, "request_finished", rid=..., ms=...)``.

Text mode prints ``event k=v ...``; JSON mode prints one object per line. Prompts, outputs and keys
are never logged.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={"fields": fields})


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None) or {}
        tail = " ".join(f"{key}={value}" for key, value in fields.items())
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{stamp} {record.levelname[0]} {record.name} {record.getMessage()}"
        if tail:
            line = f"{line} {tail}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        body.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            body["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(body, default=str).decode()


def formatter(log_format: str = "text") -> logging.Formatter:
    """How tailcut's processes write a log line (``TAILCUT_LOG_FORMAT``: text or json)."""
    return _JsonFormatter() if log_format == "json" else _TextFormatter()


def configure(log_format: str = "text", level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format))
    root = logging.getLogger("tailcut")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
