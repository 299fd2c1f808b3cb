"""The interface a sandbox backend implements: ``SandboxBackend`` makes ``Workspace``s.

agentloop ships two backends on one host (``BwrapBackend``, ``SubprocessBackend``). At scale, bring
your own: Docker, Kubernetes Jobs, Firecracker, a remote sandbox service. ``Sandbox.open`` validates
every argument before a backend sees it, so a backend gets:

- ``argv``: a non-empty list of str (a shell string already became ``["/bin/sh", "-c", s]``);
- ``env``: str to str, names checked: ``config.env`` and the call's ``env`` merged; the backend adds
  its own base (PATH, HOME, TMPDIR, WORKSPACE) under them and never passes the host's environment;
- ``timeout_s``: a finite positive float; ``stdin``: bytes or None;
- workspace paths: relative POSIX paths without ``..`` ('.' is the workspace itself).

A backend's duties: enforce ``config.limits`` (or document which it cannot), kill the whole run at
``timeout_s`` and report ``timed_out``, cut stdout/stderr at ``limits.output_bytes`` and say so, never
follow a link the sandboxed code made when it copies files out, and leave nothing behind in
``destroy`` (called once, also after errors). A limit it cannot enforce is said in its docs and
in ``RunResult.isolation``.

A Docker backend, sketched (``docker`` CLI; names are illustrative, not shipped)::

    class DockerBackend:
        name = "docker"

        def __init__(self, image: str = "python:3.12-slim") -> None:
            self.image = image

        async def create(self, source, config):
            limits = config.limits
            cid = (await anyio.run_process([
                "docker", "create", "--network", "none", "--read-only", "--cap-drop", "ALL",
                "--security-opt", "no-new-privileges", "--pids-limit", str(limits.processes),
                "--memory", f"{limits.memory_mb}m", "--cpus", "1",
                "--tmpfs", f"/tmp:size={limits.tmp_mb}m", "--tmpfs", f"/workspace:size={limits.disk_mb}m",
                self.image, "sleep", "infinity"])).stdout.decode().strip()
            await anyio.run_process(["docker", "start", cid])
            if source is not None:  # a directory: docker cp DIR/. CID:/workspace
                await anyio.run_process(["docker", "cp", f"{source}/.", f"{cid}:/workspace"])
            return DockerWorkspace(cid, config)

    class DockerWorkspace:
        isolation = "docker"
        workdir = "/workspace"

        async def run(self, argv, *, env, timeout_s, stdin, cwd):
            env_args = [a for k, v in env.items() for a in ("-e", f"{k}={v}")]
            # docker exec -i CID timeout -s KILL {timeout_s} ...; read stdout/stderr with caps
            # (anyio.open_process), count the bytes past the cap, fill a RunResult.
            ...

        async def write_file(self, path, data, mode=0o644): ...   # docker cp - (a tar on stdin)
        async def read_file(self, path, max_bytes): ...           # docker cp CID:/workspace/path -
        async def copy_in(self, src, dest): ...                   # docker cp src CID:/workspace/dest
        async def copy_out(self, src, dest): ...                  # docker cp CID:/workspace/src dest
        async def snapshot(self, dest, exclude=()): ...           # docker cp CID:/workspace - > dest
        async def destroy(self): ...                              # docker rm -f CID

The loopback proxy: a container reaches the rollout's proxy through a published port or the host
gateway, and ``config.loopback_ports`` names the ports to allow; a Kubernetes Job gets the proxy's
service URL in ``env`` and a NetworkPolicy that allows only it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from agentloop.sandbox._files import GitSnapshot, Source
from agentloop.sandbox.config import SandboxConfig
from agentloop.sandbox.result import RunResult

__all__ = ["GitSnapshot", "SandboxBackend", "Source", "Workspace"]


@runtime_checkable
class Workspace(Protocol):
    """One rollout's workspace, made by a backend; ``Sandbox`` wraps it and validates arguments."""

    @property
    def isolation(self) -> str:
        """What isolates commands: 'bwrap', 'none', or the backend's name (copied into RunResult)."""
        ...

    @property
    def workdir(self) -> str:
        """The workspace's path as commands see it (their working directory)."""
        ...

    async def run(
        self, argv: list[str], *, env: dict[str, str], timeout_s: float, stdin: bytes | None, cwd: str
    ) -> RunResult:
        """Run ``argv`` in ``cwd`` (relative to the workspace) and wait for it; a failing or killed
        command is a RunResult, not an exception."""
        ...

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Create or replace the file ``path``, making missing directories."""
        ...

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        """The contents of the regular file ``path``; a SandboxError when it is over ``max_bytes``."""
        ...

    async def copy_in(self, src: Path, dest: str) -> None:
        """Copy the host file or directory ``src`` into the workspace directory ``dest``."""
        ...

    async def copy_out(self, src: str, dest: Path) -> None:
        """Copy the workspace file or directory ``src`` to the host path ``dest``."""
        ...

    async def snapshot(self, dest: Path, exclude: tuple[str, ...] = ()) -> Path:
        """The workspace as a gzip tarball at the host path ``dest``, without the workspace paths in
        ``exclude`` (and what is under them); returns ``dest``."""
        ...

    async def destroy(self) -> None:
        """Remove the workspace and everything the backend made for it."""
        ...


@runtime_checkable
class SandboxBackend(Protocol):
    """Makes workspaces: from nothing, a template directory, a tarball or a ``GitSnapshot``."""

    @property
    def name(self) -> str:
        """A short name for logs."""
        ...

    async def create(self, source: Source, config: SandboxConfig) -> Workspace:
        """A new workspace filled from ``source`` under ``config``; raises SandboxUnavailableError
        when the backend cannot run here, and leaves nothing behind when it raises."""
        ...
