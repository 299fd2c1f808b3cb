"""structlog, configured in one function: human lines (colored on a terminal, plain when piped), or
JSON lines when asked (``json=True``, ``AGENTLOOP_LOG_FORMAT=json``, the CLI's ``--log-format json``).

Library code only calls :func:`get_logger`; entry points (the CLI, the trainer, ``Runner.run_sync``)
call :func:`configure_logging` once. Calling it again with the same arguments changes nothing.

A training run also keeps a log file (:func:`run_log`, ``<run folder>/log.txt``): every event at INFO
and up as a JSON line (DEBUG too with ``-v``), whatever the console shows, plus what the user need not
see on the console: Python warnings raised by libraries and the output of Ray's worker processes
(:func:`write_run_log`). On a terminal, log lines print above the progress bar, not through it.

Three rules hold in every configuration this module makes:

- Tracebacks are plain text. structlog's default console renderer formats exceptions with rich and
  ``show_locals=True``, which prints every local variable of every frame: API keys and prompts
  included. Here both renderers format exceptions the way Python itself does, without locals.
- Events about one rollout (they carry ``rollout_id``) have their own threshold, ``rollout_level``:
  a run of 1,000 rollouts logs 1,000 ``attempt_started`` lines at INFO, which drown out the few
  lines a person wants to read. The CLI shows them only with ``--verbose``.
- Colors only on a terminal: a piped console gets no escape sequences.
"""

from __future__ import annotations

import contextlib
import json as _json
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any, TextIO, cast

import structlog
from structlog._config import BoundLoggerLazyProxy  # what structlog.get_logger returns

_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR}
_LEVELS["WARN"] = logging.WARNING
_LEVELS["CRITICAL"] = logging.CRITICAL
_LEVELS["EXCEPTION"] = logging.ERROR  # the level name structlog gives log.exception(...)

# The arguments of the configuration in force (None: never configured by us). Module state, not a
# global of the program: it only remembers what structlog was told, to make repeat calls no-ops.
_configured: tuple[int, int, bool, int] | None = None
FORMATS = ("human", "json")  # the CLI's --log-format choices


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


def _json_from_env() -> bool:
    fmt = os.environ.get("AGENTLOOP_LOG_FORMAT", "human").strip().lower()
    if fmt not in FORMATS:
        raise ValueError(f"AGENTLOOP_LOG_FORMAT must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt == "json"


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


class _CurrentStderr:
    """``sys.stderr`` as it is when a line is written, not when logging was configured: a stream that
    was replaced since (a test's capture, a library's redirect) and then closed is never written to."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return _isatty(sys.stderr)


_STDERR = _CurrentStderr()


class _AboveProgressBars:
    """A terminal stream that writes whole lines through ``tqdm.write``: a log line then prints above a
    running progress bar instead of tearing it into two bars."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self._partial = ""

    def write(self, text: str) -> int:
        self._partial += text
        if "\n" in self._partial:
            lines, _, self._partial = self._partial.rpartition("\n")
            try:
                from tqdm import tqdm
            except ImportError:
                self.out.write(lines + "\n")
            else:
                tqdm.write(lines, file=self.out)
        return len(text)

    def flush(self) -> None:
        self.out.flush()

    def isatty(self) -> bool:
        return True


def _render_json(_: Any, __: str, event: MutableMapping[str, Any]) -> str:
    return _json.dumps(event, default=repr)


class _RunLogSink:
    """The final processor: writes each event to the run log file (when one is open) as a JSON line,
    then passes on to the console only the events the console's levels let through."""

    def __init__(self, console_level: int, rollout_level: int, renderer: Any) -> None:
        self.console_level = console_level
        self.rollout_level = rollout_level  # events with a rollout_id: this level and up on the console
        self.renderer = renderer

    def __call__(self, logger: Any, name: str, event: MutableMapping[str, Any]) -> Any:
        if _run_log.active:
            record = structlog.processors.format_exc_info(logger, name, dict(event))
            _run_log.write(_render_json(logger, name, record) + "\n", early=True)
        level = _LEVELS.get(str(event.get("level", "")).upper(), 0)
        if level < self.console_level or ("rollout_id" in event and level < self.rollout_level):
            raise structlog.DropEvent
        if isinstance(self.renderer, structlog.processors.JSONRenderer):
            event = structlog.processors.format_exc_info(logger, name, event)  # Python's own format
        elif "timestamp" in event:  # a person reads the console: the local time of day is enough
            event["timestamp"] = time.strftime("%H:%M:%S")
        return self.renderer(logger, name, event)

    def __eq__(self, other: object) -> bool:
        mine = (self.console_level, self.rollout_level, type(self.renderer))
        return isinstance(other, _RunLogSink) and mine == (
            other.console_level,
            other.rollout_level,
            type(other.renderer),
        )

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
    ``json``: True for JSON lines, False for human lines, None for the format in force (the demo's
    call keeps the CLI's ``--log-format``), else ``AGENTLOOP_LOG_FORMAT`` (``human``, the default, or
    ``json``). ``stream``: where lines go (default stderr); colored when
    it is a terminal. ``rollout_level``: the lowest level at which events about one rollout (those
    with a ``rollout_id``) print; None: ``level``. A run log (:func:`run_log`) gets INFO and up
    whatever ``level`` is (DEBUG too when ``level`` is DEBUG).
    """
    global _configured
    out = stream if stream is not None else cast("TextIO", _STDERR)
    lvl = _parse_level(level)
    per_rollout = lvl if rollout_level is None else max(lvl, _parse_level(rollout_level, "rollout_level"))
    if json is not None:
        as_json = json
    elif _configured is not None:  # the format in force: a command's --log-format outlives a library's call
        as_json = _configured[2]
    else:
        as_json = _json_from_env()
    key = (lvl, per_rollout, bool(as_json), id(out))
    if key == _configured:
        return
    tty = _isatty(out)
    renderer: Any
    if as_json:
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(
            colors=tty and "NO_COLOR" not in os.environ, exception_formatter=structlog.dev.plain_traceback
        )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            _RunLogSink(lvl, per_rollout, renderer),  # the run's log.txt, then the console's levels
        ],
        # a run's log.txt keeps INFO and up whatever the console shows (DEBUG with -v)
        wrapper_class=structlog.make_filtering_bound_logger(min(lvl, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(
            file=cast("TextIO", _AboveProgressBars(out)) if tty else out
        ),
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


class _RunLog:
    """The run log, shared by the structlog sink, the warnings hook and Ray's worker output (a thread
    of Ray's): one file, one lock. :func:`run_log` sets the path; the file is opened at the first
    write once its folder exists (a run creates its folder after the checks that may refuse it)."""

    _EARLY_MAX = 1 << 16  # chars kept while the folder does not exist yet (then written first)

    def __init__(self) -> None:
        self.path: Path | None = None
        self.file: TextIO | None = None
        self.early: list[str] = []
        self.lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self.path is not None

    def write(self, text: str, *, early: bool = False) -> bool:
        """Append ``text``; False when no run log is open or its folder does not exist yet (``early``:
        then keep it, up to ``_EARLY_MAX`` chars, for the file's start)."""
        with self.lock:
            if self.file is None and self.path is not None and self.path.parent.is_dir():
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                self.file = os.fdopen(fd, "a", encoding="utf-8")
                text, self.early = "".join(self.early) + text, []
            if self.file is None:
                if early and self.path is not None and sum(map(len, self.early)) < self._EARLY_MAX:
                    self.early.append(text)
                return False
            try:
                self.file.write(text)
                self.file.flush()  # a crash loses nothing
            except (OSError, ValueError):  # a full disk: the console still works
                return False
            return True

    def close(self) -> None:
        with self.lock:
            if self.file is not None:
                self.file.close()
            self.path, self.file, self.early = None, None, []


_run_log = _RunLog()


def write_run_log(text: str) -> bool:
    """Append ``text`` (a line ending added) to the run log; False when there is none to write to."""
    return _run_log.write(text if text.endswith("\n") else text + "\n")


@contextlib.contextmanager
def run_log(path: Path) -> Iterator[Path]:
    """While inside: log events also go to ``path`` (JSON lines, INFO and up), and Python warnings and
    :func:`write_run_log` text go there instead of the console. The file is created 0600 once its
    folder exists; a run inside a run (a demo's fit) keeps the outer file. Yields ``path``."""
    if _run_log.active:
        yield path
        return
    previous = warnings.showwarning

    def to_run_log(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if not write_run_log(warnings.formatwarning(message, category, filename, lineno, line)):
            previous(message, category, filename, lineno, file, line)  # no folder yet: the console

    with _run_log.lock:
        _run_log.path = Path(path)
    warnings.showwarning = to_run_log
    try:
        yield path
    finally:
        if warnings.showwarning is to_run_log:
            warnings.showwarning = previous
        _run_log.close()


def get_logger(name: str, **initial: Any) -> Any:
    """A structlog logger that tags every event with ``logger=name`` (plus any ``initial`` fields).

    Lazy: a module-level logger follows every later :func:`configure_logging` (``.bind()`` on
    structlog's proxy would freeze the configuration in force at import)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"logger name must be a non-empty string, got {name!r}")
    # structlog.get_logger(**initial) would be lazy too, but its own parameter is named ``logger``
    return BoundLoggerLazyProxy(None, initial_values={"logger": name, **initial}, logger_factory_args=())
