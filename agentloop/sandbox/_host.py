"""What the bubblewrap and subprocess backends share: a workspace that is a directory on this host,
the launcher they both start, the interpreter it runs under, and the user it runs as.

Layout of one sandbox (``base``: a private temporary directory, mode 0711 so the sandbox user can
reach what it is lent and list nothing)::

    base/workspace/      the workspace (owned by the sandbox user); HOME is inside it
    base/launcher.py     a copy of _launcher.py (readable by the sandbox user wherever agentloop lies)
    base/etc/            passwd, group, hosts made for bubblewrap (the host's are not lent)
    base/tmp/            TMPDIR of the subprocess backend
    base/relay-<n>/      one run's loopback relay sockets
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import stat
import sys
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Self

import anyio

from agentloop.sandbox import _files
from agentloop.sandbox._files import Owner, Source
from agentloop.sandbox._supervise import Launch, supervise
from agentloop.sandbox.config import SandboxConfig
from agentloop.sandbox.errors import SandboxUnavailableError
from agentloop.sandbox.result import RunResult

__all__ = ["HostWorkspace", "launcher_python", "run_as"]

LAUNCHER_SOURCE = Path(__file__).with_name("_launcher.py")
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


def run_as(config: SandboxConfig) -> int | None:
    """The host uid sandboxed processes run as: ``config.uid`` when we are root (root is exempt from
    RLIMIT_NPROC and must not run model-chosen commands), else None (our own)."""
    return config.uid if os.geteuid() == 0 else None


def _world_usable(path: Path) -> bool:
    """Every directory above ``path`` is searchable and ``path`` readable by any user."""
    try:
        if not os.stat(path).st_mode & stat.S_IROTH:
            return False
        return all(os.stat(parent).st_mode & stat.S_IXOTH for parent in path.parents)
    except OSError:
        return False


def closed_folder(path: Path, uid: int) -> Path | None:
    """The first folder on the way to ``path`` (``path`` too, when it is a folder) that user ``uid``, in its
    own group ``uid`` and no other (how the sandbox runs it), may not enter by the permission bits; None
    when the way is open. ACLs are not read."""
    way = [*reversed(path.parents), *([path] if path.is_dir() else [])]
    for folder in way:
        try:
            st = os.stat(folder)
        except OSError:
            return folder
        if st.st_uid == uid:
            bit = stat.S_IXUSR
        elif st.st_gid == uid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return folder
    return None


def check_lent_paths(config: SandboxConfig) -> None:
    """Refuse, naming the folder and the fix, a ``ro_binds`` path the sandbox's user cannot reach: under a
    private folder (a checkout in a 0700 home or ``mktemp -d``) bubblewrap fails with "Can't find source
    path ...: Permission denied", and the subprocess backend cannot run what lies there."""
    uid = run_as(config)
    if uid is None:  # the sandbox runs as this user, who reached these paths to name them
        return
    for path in config.ro_binds:
        closed = closed_folder(path, uid)
        if closed is not None:
            mode = stat.filemode(os.stat(closed).st_mode) if closed.exists() else "missing"
            raise SandboxUnavailableError(
                f"the sandbox runs commands as uid {uid}, which cannot enter {closed} ({mode}) on the way to "
                f"{path}, a path lent to it (ro_binds): open the way (chmod o+x {closed}) or keep what is "
                "lent (the harness CLIs, a virtualenv) outside private folders"
            )


def launcher_python(config: SandboxConfig) -> tuple[str, Path | None]:
    """(interpreter, the directory to lend read-only for it or None when /usr holds it).

    The launcher needs only the standard library, so any Python 3.8+ works: ``config.python``, else
    this process's interpreter (its installation lent read-only), else /usr's ``python3``. When the
    sandbox runs as another user, an interpreter under a private home (pyenv in /root) is skipped."""
    other_user = run_as(config) is not None
    candidates: list[tuple[Path, Path]] = []
    if config.python is not None:
        real = Path(os.path.realpath(config.python))
        candidates.append((real, real.parent.parent))
    else:
        candidates.append((Path(os.path.realpath(sys.executable)), Path(os.path.realpath(sys.base_prefix))))
        for name in ("/usr/bin/python3", "/usr/local/bin/python3"):
            candidates.append((Path(os.path.realpath(name)), Path("/usr")))
    for interpreter, prefix in candidates:
        if not os.access(interpreter, os.X_OK) or (other_user and not _world_usable(prefix / "lib")):
            continue
        if other_user and not _world_usable(interpreter):
            continue
        under_usr = prefix == Path("/usr") or Path("/usr") in prefix.parents
        return str(interpreter), None if under_usr else prefix
    tried = ", ".join(str(i) for i, _ in candidates)
    raise SandboxUnavailableError(
        f"no Python for the sandbox launcher (tried {tried}); "
        + ("it must be readable by uid " + str(run_as(config)) + "; " if other_user else "")
        + "install python3 under /usr or set SandboxConfig.python"
    )


class HostWorkspace(ABC):
    """A workspace directory on this host; subclasses say how one command is launched."""

    isolation: str
    workdir: str  # the workspace path that commands see

    def __init__(self, config: SandboxConfig, base: Path) -> None:
        self.config = config
        self.base = base
        self.root = base / "workspace"
        uid = run_as(config)
        self.owner = Owner(uid, uid)
        self.python, self.python_dir = launcher_python(config)
        self._runs = itertools.count()

    @classmethod
    async def make(cls, source: Source, config: SandboxConfig, **kwargs: Any) -> Self:
        """A new workspace filled from ``source``; nothing is left behind when that fails."""
        check_lent_paths(config)
        base = Path(tempfile.mkdtemp(prefix="agentloop-sandbox-"))
        try:
            os.chmod(base, 0o711)
            workspace = cls(config, base, **kwargs)
            await anyio.to_thread.run_sync(workspace._prepare, source)
        except BaseException:
            _files.remove_tree(base)
            raise
        return workspace

    def _prepare(self, source: Source) -> None:
        self.root.mkdir(mode=0o755)
        _files.materialize(source, self.root, max_bytes=self.config.limits.disk_mb << 20)
        (self.root / self.config.home).mkdir(parents=True, exist_ok=True)
        self.owner.chown_tree(self.root)
        shutil.copyfile(LAUNCHER_SOURCE, self.base / "launcher.py")
        os.chmod(self.base / "launcher.py", 0o644)

    def environment(self, env: dict[str, str], tmpdir: str) -> dict[str, str]:
        """The run's environment: a fixed base (never the host's), then config.env and ``env``."""
        path = ":".join([*self.config.path, SYSTEM_PATH])
        base = {
            "PATH": path,
            "HOME": f"{self.workdir}/{self.config.home}",
            "TMPDIR": tmpdir,
            "LANG": "C.UTF-8",
            "WORKSPACE": self.workdir,
        }
        return {**base, **self.config.env, **env}

    def spec(self, argv: list[str], cwd: str, status_fd: int, **extra: object) -> str:
        return json.dumps(
            {
                "argv": argv,
                "cwd": cwd,
                "rlimits": self.config.limits.rlimits(),
                "status_fd": status_fd,
                **extra,
            }
        )

    @abstractmethod
    def launch(
        self, argv: list[str], env: dict[str, str], cwd: str, status_fd: int, relay: Path | None
    ) -> Launch:
        """The host process that runs ``argv`` in ``cwd`` (relative to the workspace)."""

    def relay_dir(self) -> Path | None:
        """Where this run's loopback relay sockets go, or None when no relay is needed."""
        return None

    async def run(
        self, argv: list[str], *, env: dict[str, str], timeout_s: float, stdin: bytes | None, cwd: str
    ) -> RunResult:
        from agentloop.sandbox._relay import relay_ports

        relay = self.relay_dir()
        read_fd, write_fd = os.pipe()
        try:
            launch = self.launch(argv, env, cwd, write_fd, relay)
        except BaseException:
            os.close(read_fd)
            os.close(write_fd)
            raise
        try:
            ports = self.config.loopback_ports if relay is not None else ()
            async with relay_ports(relay or self.base, ports, self.owner.uid):
                return await supervise(
                    launch,
                    status=(read_fd, write_fd),
                    stdin=stdin,
                    timeout_s=timeout_s,
                    limits=self.config.limits,
                    workspace=self.root,
                )
        finally:
            if relay is not None:
                await anyio.to_thread.run_sync(_files.remove_tree, relay)

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        await anyio.to_thread.run_sync(_files.write_file, self.root, path, data, mode, self.owner)

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        return await anyio.to_thread.run_sync(_files.read_file, self.root, path, max_bytes)

    async def copy_in(self, src: Path, dest: str) -> None:
        await anyio.to_thread.run_sync(_files.copy_in, self.root, src, dest, self.owner)

    async def copy_out(self, src: str, dest: Path) -> None:
        await anyio.to_thread.run_sync(_files.copy_out, self.root, src, dest)

    async def snapshot(self, dest: Path, exclude: tuple[str, ...] = ()) -> Path:
        return await anyio.to_thread.run_sync(_files.snapshot, self.root, dest, exclude)

    async def destroy(self) -> None:
        await anyio.to_thread.run_sync(_files.remove_tree, self.base)
