"""structlog set-up: JSON lines when stderr is not a terminal, readable lines when it is.

Every process of a service (supervisor, sync agent, I/O workers) calls
``configure_logging(store=..., server=..., component=...)``, so every line names
the store and server it is about. Warnings and errors are also kept in a small
in-process ring (``recent_warnings``) that the service publishes on its notice
board, where ``status`` and the dashboard show them.
"""

from __future__ import annotations

import collections
import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

#: The last warnings and errors of this process, newest last (published for the dashboard).
RECENT_WARNINGS: collections.deque[dict[str, Any]] = collections.deque(maxlen=20)
_WARNING_LEVELS = {"warning", "error", "critical"}


def _keep_warnings(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    if event.get("level") in _WARNING_LEVELS:  # add_log_level ran first (and maps exception to error)
        RECENT_WARNINGS.append({k: (v if isinstance(v, (str, int, float, bool)) or v is None else str(v))
                                for k, v in event.items()})
    return event


def recent_warnings() -> list[dict[str, Any]]:
    """Copies of this process's last warnings (level, event, timestamp and the bound fields)."""
    return list(RECENT_WARNINGS)


def configure_logging(level: int = logging.INFO, **bindings: str) -> None:
    """Configure structlog for a service process and bind ``bindings`` (store, server, ...) to every line."""
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer(colors=False) if sys.stderr.isatty() else structlog.processors.JSONRenderer())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _keep_warnings,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    if bindings:
        structlog.contextvars.bind_contextvars(**bindings)
