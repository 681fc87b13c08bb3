"""JSON log lines on stderr for every service: ts, level, logger, msg, service, and
session_id / trace_id whenever known.

session_id comes from a record's `extra={"session_id": ...}` or else from the `SESSION_ID`
context variable, which a service binds for the task serving a session (and the tasks it
starts: the edge's SessionCore, the worker's Session handler, the scheduler's Acquire);
trace_id comes from the current OpenTelemetry span when one is active and valid.
`OMNI_LOG_FORMAT=text` keeps plain text lines for humans.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from contextvars import ContextVar, Token
from datetime import UTC, datetime
from typing import Any, TextIO

try:
    from opentelemetry import trace as _otel_trace
except ImportError:  # tracing not installed: no trace ids
    _otel_trace = None  # type: ignore[assignment]

#: The session the current task works for (None: none). One process runs one service.
SESSION_ID: ContextVar[str | None] = ContextVar("omni_session_id", default=None)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from `extra`.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}
_SKIP = _RECORD_FIELDS | {"session_id", "trace_id"}


def bind_session(session_id: str | None) -> Token[str | None]:
    """Log lines of the current task (and tasks it creates later) carry `session_id`."""
    return SESSION_ID.set(session_id or None)


def current_trace_id() -> str | None:
    """The active span's trace id as 32 hex digits, or None without a valid span."""
    if _otel_trace is None:
        return None
    context = _otel_trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return format(context.trace_id, "032x")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, naming `service` (edge, worker, scheduler)."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "service": self.service,
        }
        session_id = getattr(record, "session_id", None) or SESSION_ID.get()
        if session_id:
            entry["session_id"] = session_id
        trace_id = getattr(record, "trace_id", None) or current_trace_id()
        if trace_id:
            entry["trace_id"] = trace_id
        for key, value in vars(record).items():
            if key not in _SKIP and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def configure(service: str, level: int | str = logging.INFO, stream: TextIO | None = None) -> None:
    """Root logging to stderr: JSON lines naming `service`, or plain text when
    OMNI_LOG_FORMAT=text."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if os.environ.get("OMNI_LOG_FORMAT", "json").strip().lower() == "text":
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    else:
        handler.setFormatter(JsonFormatter(service))
    logging.basicConfig(level=level, handlers=[handler])
