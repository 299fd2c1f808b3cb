"""Bad input gets an error that says what was expected and what came, before anything runs."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from agentloop.errors import AgentLoopError
from agentloop.sandbox import (
    BwrapBackend,
    Limits,
    Sandbox,
    SandboxArgumentError,
    SandboxConfig,
    SandboxError,
    SandboxUnavailableError,
    loopback_port,
)
from agentloop.sandbox._host import closed_folder
from tests.sandbox.helpers import config, needs_bwrap


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"command": ""}, "a shell command must be non-empty"),
        ({"command": []}, "non-empty list of str"),
        ({"command": ["ls", 3]}, r"got \['ls', 3\]"),
        ({"command": b"ls"}, "got b'ls'"),
        ({"command": 7}, "got 7"),
        ({"command": "ls", "timeout_s": 0}, r"timeout_s must be in \(0, 86400\] seconds, got 0"),
        ({"command": "ls", "timeout_s": float("inf")}, "got inf"),
        ({"command": "ls", "timeout_s": "5"}, "timeout_s must be a number of seconds, got str"),
        ({"command": "ls", "timeout_s": True}, "got bool"),
        ({"command": "ls", "env": {"A": 1}}, "env must map str to str"),
        ({"command": "ls", "env": {"A=B": "x"}}, "has '=', NUL or is empty"),
        ({"command": "ls", "env": ["A"]}, "env must be a dict of str to str, got list"),
        ({"command": "ls", "stdin": 5}, "stdin must be bytes, str or None, got int"),
        ({"command": "ls", "cwd": "../.."}, "may not contain '..'"),
        ({"command": "ls", "cwd": "/etc"}, "workspace paths are relative, or absolute under"),
    ],
)
async def test_bad_run_arguments(kwargs: dict[str, object], message: str) -> None:
    async with Sandbox.open(config=config("subprocess")) as sb:
        command = kwargs.pop("command")
        with pytest.raises(SandboxArgumentError, match=message) as caught:
            await sb.run(command, **kwargs)  # type: ignore[arg-type]
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, AgentLoopError)


async def test_a_missing_working_directory_is_said() -> None:
    async with Sandbox.open(config=config("subprocess")) as sb:
        result = await sb.run("ls", cwd="no/such/dir")
    assert result.exit_code == 126 and "cannot enter" in result.stderr and "no/such/dir" in result.stderr


async def test_bad_file_arguments(tmp_path: Path) -> None:
    async with Sandbox.open(config=config("subprocess")) as sb:
        with pytest.raises(SandboxArgumentError, match=r"may not contain '..'"):
            await sb.read_file("a/../../etc/passwd")
        with pytest.raises(SandboxArgumentError, match=r"relative, or absolute under"):
            await sb.write_file("/etc/x", b"")
        with pytest.raises(SandboxArgumentError, match=r"data must be bytes or str, got int"):
            await sb.write_file("x", 5)  # type: ignore[arg-type]
        with pytest.raises(SandboxArgumentError, match=r"mode must be permission bits"):
            await sb.write_file("x", b"", mode=0o4755)
        with pytest.raises(SandboxArgumentError, match=r"needs a file path"):
            await sb.write_file(".", b"")
        with pytest.raises(FileNotFoundError, match=r"no such file in the workspace: 'missing'"):
            await sb.read_file("missing")
        with pytest.raises(SandboxArgumentError, match=r"does not exist on the host"):
            await sb.copy_in(tmp_path / "missing")
        with pytest.raises(SandboxArgumentError, match=r"a workspace path is a str or Path, got int"):
            await sb.read_file(3)  # type: ignore[arg-type]


async def test_bad_open_arguments(tmp_path: Path) -> None:
    with pytest.raises(SandboxArgumentError, match=r"source must be None, a directory or tarball path"):
        async with Sandbox.open(42):  # type: ignore[arg-type]
            pass
    with pytest.raises(SandboxArgumentError, match=r"config must be a SandboxConfig, got dict"):
        async with Sandbox.open(config={"backend": "bwrap"}):  # type: ignore[arg-type]
            pass
    with pytest.raises(SandboxArgumentError, match=r"backend must implement SandboxBackend"):
        async with Sandbox.open(backend="docker"):  # type: ignore[arg-type]
            pass
    (tmp_path / "plain.txt").write_text("not a tar")
    with pytest.raises(SandboxArgumentError, match=r"is a file that is not a tar archive"):
        async with Sandbox.open(tmp_path / "plain.txt", config=config("subprocess")):
            pass
    with pytest.raises(SandboxArgumentError, match=r"is missing"):
        async with Sandbox.open(tmp_path / "nope", config=config("subprocess")):
            pass


async def test_a_bwrap_that_cannot_run_is_refused_with_the_reason() -> None:
    folder = Path(tempfile.mkdtemp())  # not under pytest's 0700 tmp: as root, bwrap runs as nobody
    try:
        folder.chmod(0o755)
        fake = folder / "bwrap"
        fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
        fake.chmod(0o755)
        with pytest.raises(
            SandboxUnavailableError, match=r"uid map: Permission denied.*user namespaces are off"
        ):
            async with Sandbox.open(config=config("bwrap"), backend=BwrapBackend(str(fake))):
                pass
    finally:
        shutil.rmtree(folder)


def test_config_fields_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"ports must be 1..65535, got \[70000\]"):
        SandboxConfig(loopback_ports=(70000,))
    with pytest.raises(ValidationError, match=r"ports must be distinct"):
        SandboxConfig(loopback_ports=(80, 80))
    with pytest.raises(ValidationError, match=r"ro_binds holds absolute host paths, got 'rel'"):
        SandboxConfig(ro_binds=(Path("rel"),))
    with pytest.raises(ValidationError, match=r"does not exist on this host"):
        SandboxConfig(ro_binds=(tmp_path / "missing",))
    with pytest.raises(ValidationError, match=r"home is a relative path"):
        SandboxConfig(home="../x")
    with pytest.raises(ValidationError, match=r"backend"):
        SandboxConfig(backend="docker")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match=r"memory_mb"):
        Limits(memory_mb=0)
    with pytest.raises(ValidationError, match=r"extra"):
        Limits(memory=5)  # type: ignore[call-arg]
    with pytest.raises(SandboxUnavailableError, match=r"need 'no-such-node' on PATH"):
        SandboxConfig().with_node("no-such-node")


def test_loopback_port() -> None:
    assert loopback_port("http://127.0.0.1:8321/rollout/r/attempt/a/v1") == 8321
    assert loopback_port("http://localhost/v1") == 80
    for url in ("http://10.0.0.5:8000/v1", "ftp://127.0.0.1:21", "127.0.0.1:8000"):
        with pytest.raises(SandboxArgumentError, match=r"expected an http URL on 127.0.0.1 or localhost"):
            loopback_port(url)
    assert issubclass(SandboxUnavailableError, SandboxError) and issubclass(SandboxError, AgentLoopError)


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A temporary folder on a way any user may take (pytest's own tmp_path lies under a 0700 folder)."""
    path = Path(tempfile.mkdtemp())
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_closed_folder_names_the_first_folder_a_user_cannot_enter(open_tmp: Path) -> None:
    """By the permission bits the sandbox's user (its own uid and group, no other) meets on the way."""
    other = os.getuid() + 54321  # a user that owns nothing here
    private = open_tmp / "private"
    lent = private / "harness" / "bin"
    lent.mkdir(parents=True)
    private.chmod(0o700)
    try:
        assert closed_folder(lent, other) == private
        assert closed_folder(lent / "claude", other) == private  # a file's folders
        private.chmod(0o711)
        assert closed_folder(lent, other) is None
        (private / "harness").chmod(0o750)
        assert closed_folder(lent, other) == private / "harness"
        (private / "harness").chmod(0o751)
        lent.chmod(0o700)  # the lent folder itself is entered too
        assert closed_folder(lent, other) == lent
    finally:
        private.chmod(0o755)
        (private / "harness").chmod(0o755)
        lent.chmod(0o755)


@pytest.mark.skipif(
    os.geteuid() != 0, reason="as root the sandbox runs commands as its own uid; else as this user"
)
@pytest.mark.parametrize("backend", ["subprocess", pytest.param("bwrap", marks=needs_bwrap)])
async def test_a_lent_path_under_a_private_folder_is_refused_naming_it(open_tmp: Path, backend: str) -> None:
    """A checkout in a 0700 folder (mktemp -d, a private home) lends its harness CLIs to the sandbox's user,
    who cannot reach them: bwrap said only "Can't find source path ...: Permission denied"."""
    private = open_tmp / "home"
    lent = private / "checkout" / ".venv" / "harness"
    lent.mkdir(parents=True)
    private.chmod(0o700)
    try:
        with pytest.raises(
            SandboxUnavailableError, match=rf"cannot enter {private} \(drwx------\).*chmod o\+x"
        ):
            async with Sandbox.open(config=config(backend, ro_binds=(lent,))):
                pass
        private.chmod(0o711)
        async with Sandbox.open(config=config(backend, ro_binds=(lent,))) as sb:
            assert (await sb.run(["true"])).exit_code == 0
    finally:
        private.chmod(0o755)
