"""structlog, configured in one function: JSON lines when stderr is not a TTY, a console renderer otherwise.

Library code only calls :func:`get_logger`; entry points (the CLI, the trainer, ``Runner.run_sync``)
call :func:`configure_logging` once. Calling it again with the same arguments changes nothing.

Two rules hold in every configuration this module makes:

- Tracebacks are plain text. structlog's default console renderer formats exceptions with rich and
  ``show_locals=True``, which prints every local variable of every frame: API keys and prompts
  included. Here both renderers format exceptions the way Python itself does, without locals.
- Events about one rollout (they carry ``rollout_id``) have their own threshold, ``rollout_level``:
  a run of 1,000 rollouts logs 1,000 ``attempt_started`` lines at INFO, which drown out the few
  lines a person wants to read. The CLI shows them only with ``--verbose``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog
from structlog._config import BoundLoggerLazyProxy  # what structlog.get_logger returns

_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR}
_LEVELS["WARN"] = logging.WARNING
_LEVELS["CRITICAL"] = logging.CRITICAL
_LEVELS["EXCEPTION"] = logging.ERROR  # the level name structlog gives log.exception(...)

# The arguments of the configuration in force (None: never configured by us). Module state, not a
# global of the program: it only remembers what structlog was told, to make repeat calls no-ops.
_configured: tuple[int, int, bool, int] | None = None


def _parse_level(level: str | int | None, what: str = "level") -> int:
    if level is None:
        level = os.environ.get("AGENTLOOP_LOG_LEVEL", "INFO")
    if isinstance(level, bool):
        raise TypeError(f"{what} must be a level name or number, got bool {level!r}")
    if isinstance(level, int):
        return level
    if not isinstance(level, str) or level.upper() not in _LEVELS:
        raise ValueError(f"{what} must be one of {sorted(_LEVELS)} (or a number), got {level!r}")
    return _LEVELS[level.upper()]


class _RolloutFilter:
    """Drops events that name a rollout (``rollout_id``) below ``min_level``; runs after add_log_level."""

    def __init__(self, min_level: int) -> None:
        self.min_level = min_level

    def __call__(self, _: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if "rollout_id" in event and _LEVELS.get(str(event.get("level", "")).upper(), 0) < self.min_level:
            raise structlog.DropEvent
        return event

    def __eq__(self, other: object) -> bool:  # equal configs compare equal (the idempotence check)
        return isinstance(other, _RolloutFilter) and other.min_level == self.min_level

    __hash__ = None  # type: ignore[assignment]


def configure_logging(
    level: str | int | None = None,
    json: bool | None = None,
    stream: TextIO | None = None,
    *,
    rollout_level: str | int | None = None,
) -> None:
    """Configure structlog for agentloop (and everything else that uses structlog).

    ``level``: a level name or number; None reads ``AGENTLOOP_LOG_LEVEL`` (default INFO).
    ``json``: True for JSON lines, False for the console renderer, None to pick JSON unless the
    stream is a TTY. ``stream``: where lines go (default stderr). ``rollout_level``: the lowest
    level at which events about one rollout (those with a ``rollout_id``) print; None: ``level``.
    """
    global _configured
    out = stream if stream is not None else sys.stderr
    lvl = _parse_level(level)
    per_rollout = lvl if rollout_level is None else max(lvl, _parse_level(rollout_level, "rollout_level"))
    as_json = json if json is not None else not (hasattr(out, "isatty") and out.isatty())
    key = (lvl, per_rollout, bool(as_json), id(out))
    if key == _configured:
        return
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
    ]
    if per_rollout > lvl:
        processors.append(_RolloutFilter(per_rollout))
    processors += [
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if as_json:
        processors.append(structlog.processors.format_exc_info)  # Python's own format: no locals
        processors.append(structlog.processors.JSONRenderer())
    else:
        processors.append(structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    _configured = key


def _drop(_: Any, __: str, ___: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    raise structlog.DropEvent


def silence() -> None:
    """Drop every structlog event from now on (a command that is stopping on purpose has nothing to add)."""
    global _configured
    structlog.configure(processors=[_drop])
    _configured = None  # the next configure_logging call configures again


def get_logger(name: str, **initial: Any) -> Any:
    """A structlog logger that tags every event with ``logger=name`` (plus any ``initial`` fields).

    Lazy: a module-level logger follows every later :func:`configure_logging` (``.bind()`` on
    structlog's proxy would freeze the configuration in force at import)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"logger name must be a non-empty string, got {name!r}")
    # structlog.get_logger(**initial) would be lazy too, but its own parameter is named ``logger``
    return BoundLoggerLazyProxy(None, initial_values={"logger": name, **initial}, logger_factory_args=())
