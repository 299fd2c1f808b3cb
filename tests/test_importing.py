"""agentloop.importing.import_object: every accepted form, every error, and the call sites that use it."""

from __future__ import annotations

import os.path
import pickle
import sys
import uuid
from pathlib import Path

import pytest

from agentloop.agent import FunctionAgent, rollout
from agentloop.cli import UsageError
from agentloop.commands.runner import load_object
from agentloop.errors import ImportObjectError, ToolDefinitionError
from agentloop.importing import import_object
from agentloop.tools import ToolRegistry
from tests.tools.fixtures import Counter, add

FORMS = r"\(package.module:name, package.module.name or path/to/file.py:name\)"


@pytest.fixture(autouse=True)
def _restore_sys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # import_object may put folders in front


def _module_file(folder: Path, body: str) -> Path:
    """A module with a fresh name (never in sys.modules yet) in ``folder``."""
    path = folder / f"mod_{uuid.uuid4().hex[:12]}.py"
    path.write_text(body)
    return path


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("os.path:join", os.path.join),
        ("os.path.join", os.path.join),  # no colon: the longest importable prefix is the module
        ("tests.tools.fixtures:Counter", Counter),
        ("tests.tools.fixtures:Counter.execute", Counter.execute),
        ("tests.tools.fixtures.Counter.execute", Counter.execute),  # a.b.C.attr: module a.b, then C.attr
        ("tests.tools.fixtures.add", add),
    ],
)
def test_module_forms(spec: str, expected: object) -> None:
    assert import_object(spec) is expected


def test_file_forms_relative_to_base_and_with_siblings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sibling = _module_file(tmp_path, "VALUE = 41\n")
    path = _module_file(tmp_path, f"from {sibling.stem} import VALUE\n\nclass Box:\n    answer = VALUE + 1\n")
    assert import_object(f"{path}:Box.answer") == 42  # absolute path, attribute chain
    assert import_object(f"{path.name}:Box.answer", base=tmp_path) == 42  # relative to base
    monkeypatch.chdir(tmp_path)
    assert import_object(f"{path.name}:Box") is import_object(f"{path}:Box")  # relative to the working folder


def test_search_cwd_and_base_put_folders_on_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    in_cwd, in_base = tmp_path / "cwd", tmp_path / "base"
    in_cwd.mkdir(), in_base.mkdir()
    a, b = _module_file(in_cwd, "X = 'cwd'\n"), _module_file(in_base, "X = 'base'\n")
    monkeypatch.chdir(in_cwd)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    with pytest.raises(ImportObjectError, match=f"no module named '{a.stem}' on the Python path"):
        import_object(f"{a.stem}:X")  # a library call leaves sys.path alone
    assert import_object(f"{a.stem}:X", search_cwd=True) == "cwd"
    assert import_object(f"{b.stem}.X", base=in_base) == "base"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", rf"thing must look like module:object {FORMS}, got 'no_colon'"),
        ("pkg.mod:", rf"thing must look like module:object {FORMS}, got 'pkg.mod:'"),
        (":name", rf"thing must look like module:object {FORMS}, got ':name'"),
        ("pkg..name", rf"thing must look like module:object {FORMS}, got 'pkg..name'"),
        ("agent.py", rf"thing 'agent.py' names a file but not the object in it; write agent.py:name {FORMS}"),
        ("no_such_module_xyz:f", "thing 'no_such_module_xyz:f': no module named 'no_such_module_xyz' on the"),
        ("no_such_module_xyz.sub.f", "no module named 'no_such_module_xyz' on the Python path"),
        ("json:nope", "thing 'json:nope': module 'json' has no attribute 'nope'"),
        ("json.nope.deeper", "thing 'json.nope.deeper': module 'json' has no attribute 'nope.deeper'"),
        ("missing_file.py:f", "thing 'missing_file.py:f': file '.*missing_file.py' does not exist"),
    ],
)
def test_errors_say_what_was_expected_and_what_came(spec: str, message: str) -> None:
    with pytest.raises(ImportObjectError, match=message):
        import_object(spec, "thing")


def test_an_error_inside_the_module_is_named_with_its_file_and_line(tmp_path: Path) -> None:
    path = _module_file(tmp_path, "import json\n\nraise RuntimeError('no API key set')\n")
    with pytest.raises(ImportObjectError) as info:
        import_object(f"{path}:agent", "agent")
    assert str(info.value) == (
        f"agent '{path}:agent': importing '{path.stem}' failed: RuntimeError: no API key set ({path}, line 3)"
    )
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(ImportObjectError, match="must be a string"):
        import_object(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the call sites accept the same forms


def test_the_cli_takes_every_form_and_reports_usage_errors(tmp_path: Path) -> None:
    path = _module_file(tmp_path, "def agent(task, llm):\n    return 1.0\n")
    assert load_object("tests.tools.fixtures.add") is add  # --agent pkg.mod.name (a colon was needed before)
    assert load_object(f"{path}:agent").__name__ == "agent"
    with pytest.raises(UsageError, match="--agent must look like module:object"):
        load_object("no_colon")


def test_a_tool_registry_takes_a_file_path(tmp_path: Path) -> None:
    tool_file = _module_file(
        tmp_path, "def shout(text: str) -> str:\n    '''Shout.'''\n    return text.upper()\n"
    )
    yaml_file = tmp_path / "tools.yaml"
    yaml_file.write_text(f"- class: {tool_file}:shout\n- class: tests.tools.fixtures:Counter\n")
    assert ToolRegistry.from_yaml(yaml_file).names == ["shout", "counter"]
    yaml_file.write_text("- class: tests.tools.fixtures:nope\n")
    with pytest.raises(ToolDefinitionError, match=r"tools\[0\]: class 'tests.tools.fixtures:nope': module"):
        ToolRegistry.from_yaml(yaml_file)


@rollout
def module_level_agent(task: dict, llm: object) -> float:
    return 1.0


def test_an_agent_pickles_by_reference_through_import_object() -> None:
    reduced = module_level_agent.__reduce__()
    assert reduced[1] == (__name__, "module_level_agent")
    assert pickle.loads(pickle.dumps(module_level_agent)) is module_level_agent
    assert FunctionAgent(lambda task, llm: 0.0).__reduce__()[0] is FunctionAgent  # not importable: by value
