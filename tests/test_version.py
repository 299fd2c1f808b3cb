"""``agentloop --version``: the installed command prints ``agentloop <version>``, the version of
agentloop/_version.py, which pyproject.toml's must equal."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from agentloop import __version__
from agentloop._version import __version__ as leaf_version

ROOT = Path(__file__).resolve().parents[1]


def test_one_version_everywhere() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert __version__ is leaf_version
    assert project["version"] == __version__, "pyproject.toml's version and agentloop/_version.py differ"


@pytest.mark.e2e
def test_the_command_prints_its_version() -> None:
    command = Path(sys.executable).with_name("agentloop")  # the console script beside this interpreter
    assert command.exists(), f"no {command}: install the package (pip install -e .) to get the command"
    for args in (["--version"], ["version"]):
        out = subprocess.run([str(command), *args], capture_output=True, text=True, timeout=120)
        assert (out.returncode, out.stdout, out.stderr) == (0, f"agentloop {__version__}\n", ""), args
