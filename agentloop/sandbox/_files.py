"""The host side of a workspace directory: fill it from a source, read and write files in it without
following links the sandbox made, measure it, archive it, remove it. Blocking; callers use threads.

Trap: the workspace is written by hostile code, and the host (maybe root) reads it. A symlink
``out -> /etc/shadow`` made inside must not be followed from outside, so single files are opened
one directory at a time with ``O_NOFOLLOW`` (no race), trees are copied with links kept as links
and FIFOs and devices skipped (opening a FIFO would block forever). Copying a tree while a command
runs in the same workspace still races with it: copy between runs.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from agentloop.sandbox.errors import SandboxArgumentError, SandboxError, SandboxUnavailableError

__all__ = ["GitSnapshot", "Owner", "Source"]


@dataclass(frozen=True)
class GitSnapshot:
    """The files tracked at ``rev`` of the local git repository ``repo`` (``git archive``: no
    history, no untracked files, no ``.git``)."""

    repo: Path
    rev: str = "HEAD"


# What a workspace starts from: nothing, a directory (copied), a tarball (.tar, .tar.gz, .tgz,
# .tar.bz2, .tar.xz; extracted with tarfile's "data" filter), or a git snapshot.
Source = Path | str | GitSnapshot | None


@dataclass(frozen=True)
class Owner:
    """Host uid/gid that workspace files must belong to (the sandbox's user), or None: ours."""

    uid: int | None = None
    gid: int | None = None

    def chown(self, fd_or_path: int | str | Path, *, dir_fd: int | None = None) -> None:
        if self.uid is None:
            return
        gid = self.gid if self.gid is not None else self.uid
        if isinstance(fd_or_path, int):
            os.fchown(fd_or_path, self.uid, gid)
        else:
            os.chown(fd_or_path, self.uid, gid, dir_fd=dir_fd, follow_symlinks=False)

    def chown_tree(self, root: Path) -> None:
        if self.uid is None:
            return
        self.chown(root)
        for top, dirs, files in os.walk(root):
            for name in dirs + files:
                self.chown(os.path.join(top, name))


def materialize(source: Source, dest: Path, *, max_bytes: int, git_timeout_s: float = 120.0) -> None:
    """Fill the empty directory ``dest`` from ``source``; raise if it would pass ``max_bytes``."""
    if source is None:
        return
    if isinstance(source, GitSnapshot):
        _from_git(source, dest, max_bytes, git_timeout_s)
    else:
        path = Path(source)
        if path.is_dir():
            shutil.copytree(path, dest, symlinks=True, dirs_exist_ok=True, copy_function=_copy_regular)
        elif path.is_file() and tarfile.is_tarfile(path):
            _extract(path, dest, max_bytes)
        else:
            kind = "a file that is not a tar archive" if path.exists() else "missing"
            raise SandboxArgumentError(
                f"a workspace source is a directory, a tarball or a GitSnapshot; {str(path)!r} is {kind}"
            )
    used = disk_usage(dest)
    if used > max_bytes:
        raise SandboxError(
            f"the workspace source takes {used / 2**20:.1f} MiB, over limits.disk_mb "
            f"({max_bytes / 2**20:.0f} MiB); raise limits.disk_mb or start from less"
        )


def _extract(archive: Path, dest: Path, max_bytes: int) -> None:
    with tarfile.open(archive) as tar:
        _extract_from(tar, dest, max_bytes, str(archive))


def _extract_from(tar: tarfile.TarFile, dest: Path, max_bytes: int, shown: str) -> None:
    """Extract what stays inside ``dest``: regular files, directories and links that point inside;
    FIFOs and devices are skipped; an archive over ``max_bytes`` (a tar bomb) stops first."""
    members = [m for m in tar.getmembers() if m.isfile() or m.isdir() or m.issym() or m.islnk()]
    size = sum(m.size for m in members if m.isfile())
    if size > max_bytes:
        raise SandboxError(
            f"{shown} holds {size / 2**20:.1f} MiB of files, over limits.disk_mb "
            f"({max_bytes / 2**20:.0f} MiB); raise limits.disk_mb"
        )
    for member in members:
        _check_member(member, shown)
    if hasattr(tarfile, "data_filter"):  # Python 3.11.4+: the standard filter checks again
        tar.extractall(dest, members=members, filter="data")
    else:
        for member in members:
            member.mode &= 0o755 if member.isdir() or member.mode & 0o100 else 0o644
            member.uid = member.gid = 0
            member.uname = member.gname = ""
        tar.extractall(dest, members=members)


def _check_member(member: tarfile.TarInfo, shown: str) -> None:
    name = PurePosixPath(member.name)
    inside = not name.is_absolute() and ".." not in name.parts
    if inside and member.issym():  # a relative target, resolved from the link's own directory
        target = PurePosixPath(os.path.normpath(name.parent / member.linkname))
        inside = not PurePosixPath(member.linkname).is_absolute() and not target.parts[:1] == ("..",)
    elif inside and member.islnk():  # a hard link names a member of the archive
        target = PurePosixPath(os.path.normpath(member.linkname))
        inside = not target.is_absolute() and not target.parts[:1] == ("..",)
    if not inside:
        what = (
            f"{member.name!r} -> {member.linkname!r}"
            if member.issym() or member.islnk()
            else repr(member.name)
        )
        raise SandboxArgumentError(f"{shown}: member {what} points outside the workspace; refused")


def _from_git(snap: GitSnapshot, dest: Path, max_bytes: int, timeout_s: float) -> None:
    git = shutil.which("git")
    if git is None:
        raise SandboxUnavailableError("a GitSnapshot workspace needs git on PATH; none found")
    repo = Path(snap.repo)
    if not repo.exists():
        raise SandboxArgumentError(f"GitSnapshot.repo {str(repo)!r} does not exist")
    with tempfile.TemporaryFile() as archive:
        # safe.directory: root snapshotting a user's checkout is fine (archive reads, runs no hooks)
        cmd = [git, "-c", f"safe.directory={repo.resolve()}", "-C", str(repo), "archive", "--format=tar"]
        done = subprocess.run(
            [*cmd, snap.rev], stdout=archive, stderr=subprocess.PIPE, timeout=timeout_s, check=False
        )
        if done.returncode != 0:
            raise SandboxArgumentError(
                f"git archive {snap.rev!r} in {str(repo)!r} failed: {done.stderr.decode(errors='replace').strip()}"
            )
        archive.seek(0)
        with tarfile.open(fileobj=archive) as tar:
            _extract_from(tar, dest, max_bytes, f"{repo}@{snap.rev}")


def _copy_regular(src: str, dst: str) -> None:
    """copytree's copy_function: regular files only (a FIFO, socket or device is skipped: opening a
    FIFO blocks), the source's last component not followed, the destination not followed either."""
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return  # a link swapped in meanwhile, or gone: not copied
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, info.st_mode & 0o777)
        with os.fdopen(os.dup(fd), "rb") as reader, os.fdopen(out, "wb") as writer:
            shutil.copyfileobj(reader, writer)
    finally:
        os.close(fd)


def relative(path: str | os.PathLike[str], workdir: str) -> str:
    """A workspace path as a clean relative POSIX path ('.' for the root); absolute paths must lie
    under ``workdir`` (what commands see); '..' and NUL are refused."""
    raw = os.fspath(path) if isinstance(path, str | os.PathLike) else path
    if not isinstance(raw, str):
        raise SandboxArgumentError(f"a workspace path is a str or Path, got {type(path).__name__}")
    if not raw or "\0" in raw:
        raise SandboxArgumentError(f"a workspace path must be non-empty without NUL, got {raw!r}")
    pure = PurePosixPath(raw)
    if pure.is_absolute():
        try:
            pure = pure.relative_to(workdir)
        except ValueError:
            raise SandboxArgumentError(
                f"workspace paths are relative, or absolute under {workdir}; got {raw!r}"
            ) from None
    if ".." in pure.parts:
        raise SandboxArgumentError(f"a workspace path may not contain '..', got {raw!r}")
    return str(pure)


def _open_dir(root: Path, parts: tuple[str, ...], *, create: bool, owner: Owner, shown: str) -> int:
    """An fd of root/parts, each step opened with O_NOFOLLOW; ``create`` makes missing directories."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts:
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    owner.chown(part, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                step = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno == errno.ENOTDIR and _is_link(part, fd):  # O_DIRECTORY wins over ELOOP
                    exc = OSError(errno.ELOOP, exc.strerror)
                raise _path_error(exc, shown) from None
            os.close(fd)
            fd = step
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _path_error(exc: OSError, shown: str) -> Exception:
    if exc.errno in (errno.ELOOP, errno.EMLINK):
        return SandboxArgumentError(
            f"{shown!r} goes through a symbolic link made in the workspace; the host does not follow those"
        )
    if exc.errno == errno.ENOTDIR:
        return SandboxArgumentError(f"{shown!r}: a part of the path is not a directory")
    if isinstance(exc, FileNotFoundError):
        return FileNotFoundError(errno.ENOENT, f"no such file in the workspace: {shown!r}")
    return exc


def write_file(root: Path, rel: str, data: bytes, mode: int, owner: Owner) -> None:
    parts = PurePosixPath(rel).parts
    if not parts or rel == ".":
        raise SandboxArgumentError("write_file needs a file path, got the workspace root")
    parent = _open_dir(root, parts[:-1], create=True, owner=owner, shown=rel)
    try:
        _write_at(parent, parts[-1], data, mode, owner, shown=rel)
    finally:
        os.close(parent)


def _write_at(parent: int, name: str, data: bytes, mode: int, owner: Owner, *, shown: str) -> None:
    try:
        fd = os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK, mode, dir_fd=parent
        )
    except OSError as exc:
        raise _path_error(exc, shown) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SandboxArgumentError(f"{shown!r} exists and is not a regular file")
        os.fchmod(fd, mode)
        owner.chown(fd)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def read_file(root: Path, rel: str, max_bytes: int) -> bytes:
    parts = PurePosixPath(rel).parts
    parent = _open_dir(root, parts[:-1], create=False, owner=Owner(), shown=rel)
    try:
        try:  # O_NONBLOCK: a FIFO planted under this name must not hang the host
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=parent)
        except OSError as exc:
            raise _path_error(exc, rel) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise SandboxArgumentError(f"{rel!r} is not a regular file")
            if info.st_size > max_bytes:
                raise SandboxError(f"{rel!r} is {info.st_size} bytes, over max_bytes={max_bytes}; pass more")
            with os.fdopen(os.dup(fd), "rb") as f:
                return f.read(max_bytes + 1)[:max_bytes]
        finally:
            os.close(fd)
    finally:
        os.close(parent)


def copy_in(root: Path, src: Path, rel: str, owner: Owner) -> None:
    """Copy the host file or directory ``src`` into the workspace directory ``rel`` (made if missing),
    under its own name. A directory is copied beside the workspace first, then renamed into place:
    nothing the sandbox planted at the destination is followed."""
    if not src.exists():
        raise SandboxArgumentError(f"copy_in: {str(src)!r} does not exist on the host")
    parts = PurePosixPath(rel).parts if rel != "." else ()
    parent = _open_dir(root, parts, create=True, owner=owner, shown=rel)
    try:
        if not src.is_dir():
            with open(src, "rb") as f:
                data = f.read()
            _write_at(parent, src.name, data, src.stat().st_mode & 0o777, owner, shown=f"{rel}/{src.name}")
            return
        staging = Path(tempfile.mkdtemp(prefix=".copy-in-", dir=root.parent))
        try:
            shutil.copytree(src, staging / "tree", symlinks=True, copy_function=_copy_regular)
            owner.chown_tree(staging / "tree")
            try:
                os.rename(staging / "tree", src.name, dst_dir_fd=parent)
            except OSError as exc:
                raise SandboxArgumentError(
                    f"copy_in: {f'{rel}/{src.name}'!r} exists in the workspace ({exc.strerror}); "
                    "copy to a new name"
                ) from None
        finally:
            remove_tree(staging)
    finally:
        os.close(parent)


def copy_out(root: Path, rel: str, dest: Path) -> None:
    """Copy the workspace file or directory ``rel`` to the host path ``dest`` (created; links kept
    as links, FIFOs and devices skipped)."""
    parts = PurePosixPath(rel).parts if rel != "." else ()
    if not parts:
        directory = _open_dir(root, (), create=False, owner=Owner(), shown=rel)
    else:
        parent = _open_dir(root, parts[:-1], create=False, owner=Owner(), shown=rel)
        try:
            try:
                info = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
            except OSError as exc:
                raise _path_error(exc, rel) from None
            if stat.S_ISREG(info.st_mode):
                dest.parent.mkdir(parents=True, exist_ok=True)
                _copy_regular(f"/proc/self/fd/{parent}/{parts[-1]}", os.fspath(dest))
                return
            if not stat.S_ISDIR(info.st_mode):
                raise SandboxArgumentError(f"copy_out: {rel!r} is neither a regular file nor a directory")
            directory = _open_dir(root, parts[-1:], create=False, owner=Owner(), shown=rel)
        finally:
            os.close(parent)
    try:
        shutil.copytree(
            f"/proc/self/fd/{directory}", dest, symlinks=True, dirs_exist_ok=True, copy_function=_copy_regular
        )
    finally:
        os.close(directory)


def disk_usage(root: Path) -> int:
    """Bytes of blocks in use under ``root`` (links not followed; a hard link counts each time)."""
    total = 0
    stack = [os.fspath(root)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:  # removed meanwhile, or made unreadable by the sandbox (its own loss)
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            total += info.st_blocks * 512
            if stat.S_ISDIR(info.st_mode):
                stack.append(entry.path)
    return total


def snapshot(root: Path, dest: Path, exclude: tuple[str, ...] = ()) -> Path:
    """The workspace as a gzip tarball at ``dest`` (links as links; FIFOs and devices skipped;
    ``exclude``: workspace-relative paths left out with everything under them)."""
    left_out = {f"./{path}" for path in exclude}

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if info.name in left_out:
            return None
        return info if info.isfile() or info.isdir() or info.issym() or info.islnk() else None

    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest, "w:gz") as tar:
        tar.add(root, arcname=".", filter=keep)
    return dest


def remove_tree(path: Path) -> None:
    """rm -rf that also removes what the sandbox made unreadable (chmod 0 on its own directories)."""
    if not path.exists():
        return
    os.chmod(path, 0o700)
    for top, dirs, _ in os.walk(path):  # top-down: each directory is opened up before the walk enters it
        for name in dirs:
            child = os.path.join(top, name)
            if not os.path.islink(child):
                os.chmod(child, 0o700)
    shutil.rmtree(path)
