"""Log lines for people (text) or for log pipelines (JSON), and the request they belong to.

``kvfabric --log-format json`` (or the daemon's ``log_format: json``) writes one JSON object
per line on stderr: ``time`` (UTC, ISO 8601, milliseconds), ``level``, ``logger``,
``message``, then ``request_id``, ``op``, ``namespace`` and ``tenant`` when the line was
logged while the daemon handled a request that has them, then any other field a call passed
with ``extra=`` (those win over the request's), and ``exception`` / ``stack`` as text.

The request's fields live in a context variable that the daemon sets where it takes a
request (:func:`request_context`: the control server, the HTTP API) and fills in as it learns
more (:func:`add_context`: the namespace once decoded). No handler passes them along by hand,
and they follow the request onto worker threads: ``asyncio`` tasks and Starlette's thread pool
copy the context, the control server's executor calls run in a copy too. The mapping itself
is shared by those copies, so what a worker thread adds is on the request's last line.

Light on purpose (the standard library only): the command line imports it for every command.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CONTEXT_FIELDS = ("request_id", "op", "namespace", "tenant")

_context: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "kvfabric_log_context", default=None
)
# What every LogRecord has: the rest of a record's attributes came from `extra=`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",  # 3.12+
}


@contextmanager
def request_context(**fields: Any) -> Iterator[dict[str, Any]]:
    """Log lines inside the block carry ``fields`` (None values left out); a fresh mapping
    per request, so concurrent requests never see each other's fields."""
    context = {key: value for key, value in fields.items() if value is not None}
    token = _context.set(context)
    try:
        yield context
    finally:
        _context.reset(token)


def add_context(**fields: Any) -> None:
    """Add ``fields`` (None values left out) to the current request's; nothing outside one."""
    context = _context.get()
    if context is not None:
        context.update((key, value) for key, value in fields.items() if value is not None)


def current_context() -> dict[str, Any]:
    """A copy of the current request's fields (empty outside a request)."""
    return dict(_context.get() or {})


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(_context.get() or {})
        line.update((k, v) for k, v in vars(record).items() if k not in _STANDARD)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        # default=str: an `extra=` value JSON has no type for (a Path, an enum) still logs
        return json.dumps(line, default=str, ensure_ascii=False)


def formatter(log_format: str, text_format: str = TEXT_FORMAT) -> logging.Formatter:
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {log_format!r}")
    return JsonFormatter() if log_format == "json" else logging.Formatter(text_format)


def configure(
    level: int, log_format: str = "text", *, text_format: str = TEXT_FORMAT, force: bool = True
) -> None:
    """The root logger writes ``level`` and above to stderr in ``log_format``, replacing any
    earlier configuration (``force=False``: only if there is none, as ``logging.basicConfig``).
    In JSON, warnings go through logging too: every line the process itself writes to stderr
    is then one object."""
    if not force and logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format, text_format))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.captureWarnings(log_format == "json")
