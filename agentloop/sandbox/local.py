"""The subprocess backend: the fallback where bubblewrap cannot run. Commands are plain processes on
this host, in the workspace directory, under the same rlimits, deadline, output caps and disk quota.

``isolation="none"``, and it means it: a command reads every file its user can read, reaches the
network (loopback services and the internet), sees and signals the user's other processes, and can
kill its own launcher to slip out of the tree kill (the process group is killed too; a process that
called setsid itself and whose launcher died survives). As root, commands run as ``config.uid``
(nobody), so they at least do not run as root. RLIMIT_NPROC counts all of that user's processes,
so the launcher raises it by the number the user runs already.
Use it for trusted commands, development, and machines where a container backend isolates instead.
"""

from __future__ import annotations

from pathlib import Path

from agentloop.sandbox._files import Source
from agentloop.sandbox._host import HostWorkspace
from agentloop.sandbox._supervise import Launch
from agentloop.sandbox.config import SandboxConfig

__all__ = ["SubprocessBackend"]


class SubprocessWorkspace(HostWorkspace):
    isolation = "none"

    def __init__(self, config: SandboxConfig, base: Path) -> None:
        super().__init__(config, base)
        self.workdir = str(self.root)

    def _prepare(self, source: Source) -> None:
        super()._prepare(source)
        tmp = self.base / "tmp"
        tmp.mkdir(mode=0o700)
        self.owner.chown(tmp)

    def launch(
        self, argv: list[str], env: dict[str, str], cwd: str, status_fd: int, relay: Path | None
    ) -> Launch:
        inside = str(self.root if cwd == "." else self.root / cwd)
        spec = self.spec(argv, inside, status_fd, nproc_user=True, parent_death=True)
        return Launch(
            argv=[self.python, "-I", "-S", "-B", str(self.base / "launcher.py"), spec],
            env=self.environment(env, str(self.base / "tmp")),
            cwd=str(self.root),
            user=self.owner.uid,
            kill="launcher",  # no pid namespace here: the launcher (a subreaper) kills its descendants
            isolation=self.isolation,
        )


class SubprocessBackend:
    """Workspaces on this host, commands as plain processes with rlimits: no isolation."""

    name = "subprocess"

    async def create(self, source: Source, config: SandboxConfig) -> SubprocessWorkspace:
        return await SubprocessWorkspace.make(source, config)
