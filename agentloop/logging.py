"""structlog, configured in one function: JSON lines when stderr is not a TTY, a console renderer otherwise.

Library code only calls :func:`get_logger`; entry points (the CLI, the trainer, ``Runner.run_sync``)
call :func:`configure_logging` once. Calling it again with the same arguments changes nothing.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO

import structlog

_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR}
_LEVELS["WARN"] = logging.WARNING
_LEVELS["CRITICAL"] = logging.CRITICAL

# The arguments of the configuration in force (None: never configured by us). Module state, not a
# global of the program: it only remembers what structlog was told, to make repeat calls no-ops.
_configured: tuple[int, bool, int] | None = None


def _parse_level(level: str | int | None) -> int:
    if level is None:
        level = os.environ.get("AGENTLOOP_LOG_LEVEL", "INFO")
    if isinstance(level, bool):
        raise TypeError(f"level must be a level name or number, got bool {level!r}")
    if isinstance(level, int):
        return level
    if not isinstance(level, str) or level.upper() not in _LEVELS:
        raise ValueError(f"level must be one of {sorted(_LEVELS)} (or a number), got {level!r}")
    return _LEVELS[level.upper()]


def configure_logging(
    level: str | int | None = None, json: bool | None = None, stream: TextIO | None = None
) -> None:
    """Configure structlog for agentloop (and everything else that uses structlog).

    ``level``: a level name or number; None reads ``AGENTLOOP_LOG_LEVEL`` (default INFO).
    ``json``: True for JSON lines, False for the console renderer, None to pick JSON unless the
    stream is a TTY. ``stream``: where lines go (default stderr).
    """
    global _configured
    out = stream if stream is not None else sys.stderr
    lvl = _parse_level(level)
    as_json = json if json is not None else not (hasattr(out, "isatty") and out.isatty())
    key = (lvl, bool(as_json), id(out))
    if key == _configured:
        return
    renderer: Any = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if as_json:
        processors.append(structlog.processors.format_exc_info)  # the console renderer formats them itself
    processors.append(renderer)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    _configured = key


def get_logger(name: str, **initial: Any) -> Any:
    """A structlog logger that tags every event with ``logger=name`` (plus any ``initial`` fields)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"logger name must be a non-empty string, got {name!r}")
    return structlog.get_logger().bind(logger=name, **initial)
