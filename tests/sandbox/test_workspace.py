"""Workspaces: made from a directory, a tarball or a git snapshot; files in and out without following
links the sandbox made; a snapshot to collect; always removed, also after an exception."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from agentloop.sandbox import GitSnapshot, Sandbox, SandboxArgumentError, SandboxError
from tests.sandbox.helpers import FAST, config, needs_bwrap

BACKENDS = [pytest.param("bwrap", marks=needs_bwrap), "subprocess"]


def _template(tmp_path: Path) -> Path:
    template = tmp_path / "template"
    (template / "src").mkdir(parents=True)
    (template / "src" / "main.py").write_text("print('hi')\n")
    (template / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (template / "run.sh").chmod(0o755)
    os.symlink("src/main.py", template / "link")
    os.mkfifo(template / "fifo")  # skipped, not opened (opening would block)
    return template


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_template_directory_is_copied_and_writable(tmp_path: Path, backend: str) -> None:
    template = _template(tmp_path)
    async with Sandbox.open(template, config=config(backend)) as sb:
        result = await sb.run("./run.sh && cat link && echo more >> src/main.py && ls -a")
        changed = await sb.read_file("src/main.py")
    assert result.ok, result
    assert result.stdout.splitlines()[:2] == ["ran", "print('hi')"]
    assert "fifo" not in result.stdout.split()
    assert changed == b"print('hi')\nmore\n"
    assert (template / "src" / "main.py").read_text() == "print('hi')\n", "the template is untouched"


async def test_a_tarball_is_extracted_and_a_bomb_refused(tmp_path: Path) -> None:
    archive = tmp_path / "repo.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(_template(tmp_path) / "src", arcname="src")
    async with Sandbox.open(archive, config=config("subprocess")) as sb:
        assert await sb.read_file("src/main.py") == b"print('hi')\n"

    bomb = tmp_path / "bomb.tar"
    with tarfile.open(bomb, "w") as tar:
        info = tarfile.TarInfo("big")
        info.size = 80 << 20  # over FAST.disk_mb; zeros compress to nothing in a real bomb
        tar.addfile(info, io.BytesIO(bytes(info.size)))
    with pytest.raises(SandboxError, match=r"80.0 MiB of files, over limits.disk_mb \(64 MiB\)"):
        async with Sandbox.open(bomb, config=config("subprocess")):
            pass

    for name, kind, link in [
        ("../escaped", tarfile.REGTYPE, ""),
        ("/abs", tarfile.REGTYPE, ""),
        ("up", tarfile.SYMTYPE, "../../etc"),
        ("abs", tarfile.SYMTYPE, "/etc/passwd"),
        ("d/deep", tarfile.SYMTYPE, "../../x"),
        ("hard", tarfile.LNKTYPE, "../outside"),
    ]:
        evil = tmp_path / "evil.tar"
        with tarfile.open(evil, "w") as tar:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, link
            tar.addfile(info, io.BytesIO(b""))
        with pytest.raises(SandboxArgumentError, match="points outside the workspace; refused"):
            async with Sandbox.open(evil, config=config("subprocess")):
                pass
    assert not (tmp_path / "escaped").exists()

    fine = tmp_path / "fine.tar"  # links that stay inside are kept
    with tarfile.open(fine, "w") as tar:
        for name, kind, link in [("d/lib", tarfile.SYMTYPE, "../lib"), ("lib", tarfile.REGTYPE, "")]:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, link
            tar.addfile(info, io.BytesIO(b""))
    async with Sandbox.open(fine, config=config("subprocess")) as sb:
        assert (await sb.run("readlink d/lib")).stdout == "../lib\n"


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
async def test_a_git_snapshot_holds_the_tracked_files_at_a_revision(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)

    git("init", "-q")
    (repo / "a.txt").write_text("v1")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "v1")
    (repo / "a.txt").write_text("v2 uncommitted")
    (repo / "untracked.txt").write_text("no")
    async with Sandbox.open(GitSnapshot(repo), config=config("subprocess")) as sb:
        result = await sb.run("ls -A")
        assert await sb.read_file("a.txt") == b"v1"
    assert result.stdout.split() == [".home", "a.txt"]
    with pytest.raises(SandboxArgumentError, match="git archive 'nope'"):
        async with Sandbox.open(GitSnapshot(repo, "nope"), config=config("subprocess")):
            pass


@pytest.mark.parametrize("backend", BACKENDS)
async def test_links_made_in_the_sandbox_are_not_followed_from_the_host(tmp_path: Path, backend: str) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    target = tmp_path / "host-dir"
    target.mkdir()
    async with Sandbox.open(config=config(backend)) as sb:
        await sb.run(f"ln -s {secret} leak && ln -s {target} dir && mkdir out && ln -s {secret} out/leak")
        await sb.run("mkfifo pipe && echo key > .home/config")
        with pytest.raises(SandboxArgumentError, match="symbolic link"):
            await sb.read_file("leak")
        with pytest.raises(SandboxArgumentError, match="symbolic link"):
            await sb.write_file("dir/planted", b"x")
        with pytest.raises(SandboxArgumentError, match="symbolic link"):
            await sb.write_file("leak", b"overwritten")
        with pytest.raises(SandboxArgumentError, match="not a regular file"):
            await sb.read_file("pipe")  # does not hang
        await sb.copy_out("out", tmp_path / "collected")
        snap = await sb.snapshot(tmp_path / "ws.tar.gz")
        with_home = await sb.snapshot(tmp_path / "home.tar.gz", include_home=True)
    assert secret.read_text() == "hunter2" and list(target.iterdir()) == []
    assert os.readlink(tmp_path / "collected" / "leak") == str(secret), "copied as a link, not followed"
    with tarfile.open(snap) as tar:
        names = {m.name: m for m in tar.getmembers()}
    assert names["./leak"].issym() and "./pipe" not in names
    assert "./out/leak" in names and not any(name.startswith("./.home") for name in names)
    with tarfile.open(with_home) as tar:
        assert "./.home/config" in tar.getnames()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_files_go_in_and_come_out(tmp_path: Path, backend: str) -> None:
    template = _template(tmp_path)
    async with Sandbox.open(config=config(backend)) as sb:
        await sb.write_file("notes/a.txt", "héllo")
        await sb.copy_in(template / "src", "vendor")
        await sb.copy_in(template / "run.sh")
        result = await sb.run(
            "cat notes/a.txt && ./run.sh && cat vendor/src/main.py && echo new > vendor/src/new"
        )
        await sb.copy_out("vendor", tmp_path / "out")
        await sb.copy_out(f"{sb.workdir}/notes/a.txt", tmp_path / "a.txt")
        with pytest.raises(SandboxArgumentError, match="exists in the workspace"):
            await sb.copy_in(template / "src", "vendor")
        with pytest.raises(SandboxError, match="over max_bytes=2"):
            await sb.read_file("notes/a.txt", max_bytes=2)
    assert result.ok, result
    assert result.stdout == "héllo" + "ran\nprint('hi')\n"
    assert (tmp_path / "out" / "src" / "new").read_text() == "new\n"
    assert (tmp_path / "a.txt").read_text() == "héllo"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_workspace_is_removed_after_an_exception(backend: str) -> None:
    with pytest.raises(RuntimeError, match="agent failed"):
        async with Sandbox.open(config=config(backend)) as sb:
            base = sb._workspace.base  # type: ignore[attr-defined]
            await sb.run("echo x > file; chmod 000 . ")  # the sandbox locks its own workspace
            assert base.exists()
            raise RuntimeError("agent failed")
    assert not base.exists()
    with pytest.raises(SandboxArgumentError, match="closed"):
        await sb.run("true")


async def test_a_source_over_the_quota_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    template = tmp_path / "big"
    template.mkdir()
    (template / "blob").write_bytes(os.urandom(2 << 20))
    before = set(Path("/tmp").glob("agentloop-sandbox-*"))
    limits = FAST.model_copy(update={"disk_mb": 1})
    with pytest.raises(SandboxError, match=r"over limits.disk_mb \(1 MiB\); raise limits.disk_mb"):
        async with Sandbox.open(template, config=config("subprocess", limits=limits)):
            pass
    assert set(Path("/tmp").glob("agentloop-sandbox-*")) <= before
