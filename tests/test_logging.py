"""configure_logging: human lines (colors on a TTY only), JSON when asked, level filtering, idempotence;
run_log: a run's log.txt with every event, the warnings and Ray's worker output kept off the console."""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from agentloop import logging as al_logging
from agentloop.logging import configure_logging, get_logger


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
    al_logging._configured = None


def test_human_lines_when_piped_and_json_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 46: piped output mixed JSON lines with everything else; now JSON is asked for."""
    out = io.StringIO()
    configure_logging("INFO", stream=out)  # not a TTY: still human lines, without colors
    get_logger("agentloop.test").warning("attempt_failed", where="agent.py:6 in score")
    line = out.getvalue()
    assert "attempt_failed" in line and "where='agent.py:6 in score'" in line and "\x1b[" not in line
    with pytest.raises(json.JSONDecodeError):
        json.loads(line)
    configure_logging("WARNING", stream=out)  # json=None: the format in force stays
    monkeypatch.setenv("AGENTLOOP_LOG_FORMAT", "json")
    configure_logging("WARNING", stream=out)
    get_logger("agentloop.test").warning("still_human")
    assert "still_human" in out.getvalue().splitlines()[-1] and not out.getvalue().startswith("{")
    al_logging._configured = None  # never configured: the environment decides
    out = io.StringIO()
    configure_logging("INFO", stream=out)
    get_logger("agentloop.test").info("attempt_finished", rollout_id="ro-1", reward=0.5)
    record = json.loads(out.getvalue().strip())
    assert record["event"] == "attempt_finished"
    assert record["logger"] == "agentloop.test" and record["level"] == "info"
    assert record["rollout_id"] == "ro-1" and record["reward"] == 0.5 and "timestamp" in record
    monkeypatch.setenv("AGENTLOOP_LOG_FORMAT", "xml")
    al_logging._configured = None
    with pytest.raises(ValueError, match="AGENTLOOP_LOG_FORMAT must be one of human, json, got 'xml'"):
        configure_logging("DEBUG", stream=out)


def test_console_renderer_on_a_tty() -> None:
    out = _TTY()
    configure_logging("INFO", stream=out)
    get_logger("agentloop.test").warning("runner_signal", signal="SIGTERM")
    line = out.getvalue()
    assert "runner_signal" in line and "signal" in line and "SIGTERM" in line
    assert "\x1b[" in line  # colors on a terminal
    with pytest.raises(json.JSONDecodeError):
        json.loads(line)


def test_level_filters_and_exceptions_are_rendered() -> None:
    out = io.StringIO()
    configure_logging("warning", json=True, stream=out)
    log = get_logger("agentloop.test")
    log.info("hidden")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    (record,) = [json.loads(line) for line in out.getvalue().splitlines()]
    assert record["event"] == "failed" and "ValueError: boom" in record["exception"]


def test_idempotent_and_env_level(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    configure_logging("INFO", json=True, stream=out)
    config = structlog.get_config()
    configure_logging("INFO", json=True, stream=out)
    assert structlog.get_config() == config  # the same configuration, not rebuilt
    monkeypatch.setenv("AGENTLOOP_LOG_LEVEL", "ERROR")
    configure_logging(json=True, stream=out)
    get_logger("x").warning("filtered")
    get_logger("x").error("shown")
    events = [json.loads(line)["event"] for line in out.getvalue().splitlines()]
    assert events == ["shown"]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"level must be one of .* got 'LOUD'"):
        configure_logging("LOUD")
    with pytest.raises(ValueError, match="logger name must be a non-empty string"):
        get_logger("")


def _fail_with_a_secret_local() -> None:
    api_key = "sk-live-7f3a9c"  # noqa: F841 (a local that a traceback with locals would print)
    raise ValueError("boom")


@pytest.mark.parametrize("stream", [_TTY, io.StringIO], ids=["console", "json"])
def test_tracebacks_never_show_local_variables(stream: type[io.StringIO]) -> None:
    out = stream()
    configure_logging("INFO", stream=out, json=stream is io.StringIO)
    try:
        _fail_with_a_secret_local()
    except ValueError:
        get_logger("agentloop.test").exception("failed")
    text = out.getvalue()
    assert "ValueError: boom" in text and "_fail_with_a_secret_local" in text  # the traceback is there
    assert "sk-live-7f3a9c" not in text and "api_key" not in text  # its locals are not


def test_rollout_level_hides_per_rollout_events_below_it() -> None:
    out = io.StringIO()
    configure_logging("INFO", json=True, stream=out, rollout_level="WARNING")
    log = get_logger("agentloop.runner")
    log.info("attempt_started", rollout_id="ro-1")
    log.debug("attempt_finished", rollout_id="ro-1", status="succeeded")
    log.warning("attempt_finished", rollout_id="ro-2", status="failed")
    log.info("runner_started", worker_id="w")
    log.debug("hidden_by_level")
    events = [(r["event"], r.get("rollout_id")) for r in map(json.loads, out.getvalue().splitlines())]
    assert events == [("attempt_finished", "ro-2"), ("runner_started", None)]
    with pytest.raises(ValueError, match="rollout_level must be one of"):
        configure_logging("INFO", rollout_level="LOUD")


def test_silence_drops_everything_until_configured_again() -> None:
    out = io.StringIO()
    configure_logging("INFO", json=True, stream=out)
    al_logging.silence()
    get_logger("x").critical("dropped")
    configure_logging("INFO", json=True, stream=out)  # the same arguments configure again after silence
    get_logger("x").info("shown")
    assert [json.loads(line)["event"] for line in out.getvalue().splitlines()] == ["shown"]


def test_a_logger_made_before_configuring_follows_the_configuration() -> None:
    """Module-level loggers are made at import, before any entry point configures logging."""
    early = get_logger("agentloop.early", component="x")
    first, second = io.StringIO(), io.StringIO()
    configure_logging("INFO", json=True, stream=first)
    early.info("one")
    configure_logging("WARNING", json=True, stream=second)
    early.info("hidden")
    early.warning("two")
    assert json.loads(first.getvalue())["event"] == "one"
    record = json.loads(second.getvalue())
    assert record["event"] == "two" and record["logger"] == "agentloop.early" and record["component"] == "x"


def test_a_run_log_keeps_what_the_console_does_not_show(tmp_path: Path) -> None:
    """The console shows warnings and up; log.txt gets every INFO event as JSON, per-rollout ones
    included, the Python warnings libraries raise and Ray's worker lines (write_run_log)."""
    out = io.StringIO()
    configure_logging("WARNING", stream=out, rollout_level="WARNING")
    log = get_logger("agentloop.test")
    assert al_logging.write_run_log("nowhere") is False  # no run log open
    saved = warnings.showwarning
    with al_logging.run_log(tmp_path / "run" / "log.txt") as path:
        log.info("writing run", run_dir="x")  # before the run's folder exists: kept for the file
        (tmp_path / "run").mkdir()
        log.info("attempt_started", rollout_id="ro-1")
        log.warning("attempt_failed", rollout_id="ro-1", error="KeyError: 'answr'")
        log.debug("too_fine")
        warnings.warn("No artists with labels found to put in legend.", UserWarning, stacklevel=1)
        assert al_logging.write_run_log("(TrainerWorker pid=7) Loading weights: 100%") is True
        with al_logging.run_log(tmp_path / "inner.txt"):  # a run inside a run: the outer file
            log.info("inner")
    log.info("after the run")  # the file is closed: neither there nor on the console
    assert not (tmp_path / "inner.txt").exists()
    console = out.getvalue()
    assert console.count("\n") == 1 and "attempt_failed" in console and "No artists" not in console
    text = path.read_text()
    events = [json.loads(line)["event"] for line in text.splitlines() if line.startswith("{")]
    assert events == ["writing run", "attempt_started", "attempt_failed", "inner"]
    assert "UserWarning: No artists with labels found to put in legend." in text
    assert "(TrainerWorker pid=7) Loading weights: 100%\n" in text
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert warnings.showwarning is saved  # put back


def test_log_lines_print_above_a_progress_bar() -> None:
    """On a terminal each log line goes through tqdm.write, which clears and redraws the bar."""
    from tqdm import tqdm

    out = _TTY()
    configure_logging("INFO", stream=out)
    with tqdm(total=3, file=out, desc="training") as bar:
        bar.update(1)
        get_logger("agentloop.test").info("step", step=1)
        bar.update(1)
    text = out.getvalue()
    assert "step" in text and text.count("training") >= 2  # redrawn after the line


def test_the_default_stream_is_stderr_as_it_is_when_a_line_is_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Configured while stderr was another stream (a test's capture, a redirect) that has since been
    closed, logging still writes: to stderr as it is now, not to the closed stream."""
    first = io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    configure_logging("INFO", json=True)
    get_logger("t").info("one")
    first.close()
    now = io.StringIO()
    monkeypatch.setattr("sys.stderr", now)
    get_logger("t").info("two")  # the old binding raised "I/O operation on closed file"
    assert [json.loads(line)["event"] for line in now.getvalue().splitlines()] == ["two"]
