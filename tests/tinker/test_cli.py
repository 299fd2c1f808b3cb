"""`agentloop tinker`: registered, and without a key it says how to give one (one line, exit 2) before
any model loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentloop.cli import main


def test_without_a_key_it_says_how_to_give_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for env in ("AGENTLOOP_TINKER_API_KEY", "TINKER_API_KEY"):
        monkeypatch.delenv(env, raising=False)
    assert main(["tinker", "--port", "0", "--model", "no-such-model-folder/"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs an API key" in err[0] and "TINKER_API_KEY" in err[0], err


def test_key_file_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    assert main(["tinker", "--api-key-file", str(empty), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is empty" in err[0], err


def test_port_is_checked(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TINKER_API_KEY", "tml-x")
    assert main(["tinker", "--port", "70000"]) == 2
    assert "--port must be in [0, 65535]" in capsys.readouterr().err
