"""agentloop.agent_errors on real tracebacks: the user's frames kept, agentloop's and libraries' folded,
the innermost user frame named (issue 46: the console said ``8 x KeyError: 'answr'`` and no line)."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import pytest

from agentloop.agent_errors import fold_traceback, is_library_file, parse_frames, user_location


def _traceback_through_a_library(tmp_path: Path) -> str:
    """A KeyError raised in a user's file, called through json (the standard library) and this test."""
    user = tmp_path / "my_agent.py"
    user.write_text("def score(task):\n    return task['answr']\n")
    namespace: dict[str, object] = {}
    exec(compile(user.read_text(), str(user), "exec"), namespace)
    try:
        json.loads('{"a": 1}', object_hook=namespace["score"])  # type: ignore[arg-type]
    except KeyError as exc:
        return "".join(traceback.format_exception(exc))
    raise AssertionError("no KeyError")


def test_library_frames_fold_and_the_user_frame_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = _traceback_through_a_library(tmp_path)
    files = [f.file for f in parse_frames(text)]
    assert files[0] == __file__ and files[-1] == str(tmp_path / "my_agent.py")
    assert any("json" in f for f in files)  # the standard library's frames are there to fold
    folded = fold_traceback(text)
    assert "frames of json hidden]" in folded or "frame of json hidden]" in folded
    assert f'File "{tmp_path / "my_agent.py"}", line 2, in score' in folded
    assert "    return task['answr']" in folded  # the source line under the frame stays
    assert folded.splitlines()[0] == "Traceback (most recent call last):"
    assert folded.splitlines()[-1] == "KeyError: 'answr'"
    assert f"{os.sep}json{os.sep}" not in folded
    assert user_location(text) == f"{tmp_path / 'my_agent.py'}:2 in score"
    monkeypatch.chdir(tmp_path)  # under the working folder: a relative path
    assert user_location(text) == "my_agent.py:2 in score"


def test_which_files_are_the_library() -> None:
    import anyio

    import agentloop

    assert is_library_file(agentloop.__file__) and is_library_file(anyio.__file__)
    assert is_library_file(json.__file__) and is_library_file("<frozen importlib._bootstrap>")
    assert not is_library_file(__file__) and not is_library_file("/home/me/capitals/agent.py")
    assert user_location("Traceback (most recent call last):\nKeyError: 1\n") is None
    assert user_location(None) is None
    only_library = f'Traceback (most recent call last):\n  File "{agentloop.__file__}", line 1, in x\nE: 1\n'
    assert user_location(only_library) is None
    assert fold_traceback(only_library).splitlines()[1] == "  [1 frame of agentloop hidden]"
