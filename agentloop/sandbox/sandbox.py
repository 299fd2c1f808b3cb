"""``Sandbox``: one rollout's workspace and the commands run in it. Validates every argument (what
was expected, what came), picks the backend, and always cleans up."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import anyio

from agentloop.logging import get_logger
from agentloop.sandbox._files import GitSnapshot, Source, relative
from agentloop.sandbox.base import SandboxBackend, Workspace
from agentloop.sandbox.bwrap import BwrapBackend, bwrap_problem
from agentloop.sandbox.config import SandboxConfig, check_env
from agentloop.sandbox.errors import SandboxArgumentError, SandboxUnavailableError
from agentloop.sandbox.local import SubprocessBackend
from agentloop.sandbox.result import RunResult

__all__ = ["Sandbox", "select_backend"]

log = get_logger("agentloop.sandbox")

MAX_TIMEOUT_S = 86_400.0
DEFAULT_READ_BYTES = 16 << 20


@functools.cache  # warn once per process and reason, not once per rollout
def _warn_no_isolation(reason: str) -> None:
    log.warning(
        "sandbox_without_isolation",
        reason=reason,
        detail="commands run as plain processes with rlimits only: they can read this user's files, "
        "reach the network and other processes (RunResult.isolation='none')",
    )


async def select_backend(config: SandboxConfig) -> SandboxBackend:
    """The backend ``config.backend`` names; 'auto' is bwrap where it works, else subprocess (warned
    once, loudly). 'bwrap' where it cannot run raises SandboxUnavailableError with the reason."""
    if config.backend == "subprocess":
        return SubprocessBackend()
    problem = await anyio.to_thread.run_sync(bwrap_problem, config)
    if problem is None:
        return BwrapBackend()
    if config.backend == "bwrap":
        raise SandboxUnavailableError(f"SandboxConfig.backend='bwrap' but {problem}")
    _warn_no_isolation(problem)
    return SubprocessBackend()


def _argv(command: object) -> list[str]:
    if isinstance(command, str):
        if not command.strip() or "\0" in command:
            raise SandboxArgumentError(f"a shell command must be non-empty without NUL, got {command!r}")
        return ["/bin/sh", "-c", command]
    if isinstance(command, Sequence) and not isinstance(command, bytes | bytearray):
        argv = list(command)
        if argv and all(isinstance(a, str) and "\0" not in a for a in argv) and argv[0]:
            return argv
    raise SandboxArgumentError(
        "command must be a shell string or a non-empty list of str (no NUL, first not empty), "
        f"got {command!r}"[:300]
    )


def _timeout(timeout_s: object, default: float) -> float:
    if timeout_s is None:
        return default
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
        raise SandboxArgumentError(f"timeout_s must be a number of seconds, got {type(timeout_s).__name__}")
    if not (math.isfinite(timeout_s) and 0 < timeout_s <= MAX_TIMEOUT_S):
        raise SandboxArgumentError(
            f"timeout_s must be in (0, {MAX_TIMEOUT_S:.0f}] seconds, got {timeout_s!r}"
        )
    return float(timeout_s)


def _stdin(stdin: object) -> bytes | None:
    if stdin is None or isinstance(stdin, bytes):
        return stdin
    if isinstance(stdin, bytearray | memoryview):
        return bytes(stdin)
    if isinstance(stdin, str):
        return stdin.encode()
    raise SandboxArgumentError(f"stdin must be bytes, str or None, got {type(stdin).__name__}")


class Sandbox:
    """One rollout's workspace. Make it with :meth:`open`; every method is a coroutine that never
    blocks the event loop (processes are awaited, file work runs in threads).

    Paths are workspace paths: relative (``"src/main.py"``), or absolute under :attr:`workdir`.
    """

    def __init__(self, workspace: Workspace, config: SandboxConfig) -> None:
        self._workspace = workspace
        self.config = config
        self._closed = False

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        source: Source = None,
        *,
        config: SandboxConfig | None = None,
        backend: SandboxBackend | None = None,
    ) -> AsyncIterator[Sandbox]:
        """A new workspace from ``source`` (None: empty; a directory: copied; a tarball; a
        ``GitSnapshot``), removed when the block ends, also on an exception or a cancellation.

        ``backend`` overrides ``config.backend`` (a container backend of your own)."""
        config = SandboxConfig() if config is None else config
        if not isinstance(config, SandboxConfig):
            raise SandboxArgumentError(f"config must be a SandboxConfig, got {type(config).__name__}")
        if source is not None and not isinstance(source, str | os.PathLike | GitSnapshot):
            raise SandboxArgumentError(
                f"source must be None, a directory or tarball path, or a GitSnapshot; got {type(source).__name__}"
            )
        if backend is None:
            backend = await select_backend(config)
        elif not isinstance(backend, SandboxBackend):
            raise SandboxArgumentError(
                f"backend must implement SandboxBackend (name, async create), got {type(backend).__name__}"
            )
        workspace = await backend.create(
            Path(source) if isinstance(source, str | os.PathLike) else source, config
        )
        sandbox = cls(workspace, config)
        log.debug("sandbox_opened", backend=backend.name, isolation=workspace.isolation)
        try:
            yield sandbox
        finally:
            sandbox._closed = True
            with anyio.CancelScope(shield=True):
                await workspace.destroy()

    @property
    def isolation(self) -> str:
        """'bwrap', 'none' (subprocess backend) or a container backend's name."""
        return self._workspace.isolation

    @property
    def workdir(self) -> str:
        """The workspace as commands see it: /workspace under bwrap, the host directory otherwise."""
        return self._workspace.workdir

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxArgumentError("this Sandbox is closed (its block ended); open a new one")

    def _path(self, path: object) -> str:
        return relative(path, self.workdir)  # type: ignore[arg-type]

    async def run(
        self,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        stdin: bytes | str | None = None,
        cwd: str = ".",
    ) -> RunResult:
        """Run ``command`` (a shell string for /bin/sh -c, or an argv list) in the workspace and wait.

        ``env`` adds to the sandbox's environment (the host's is never passed); ``timeout_s`` defaults
        to ``config.limits.timeout_s``; at it the whole process tree is killed and the result says
        ``timed_out``. A non-zero exit, a kill or a cut output is in the result, not raised."""
        self._check_open()
        argv = _argv(command)
        merged = {**self.config.env, **check_env(dict(env) if isinstance(env, Mapping) else env or {})}
        return await self._workspace.run(
            argv,
            env=merged,
            timeout_s=_timeout(timeout_s, self.config.limits.timeout_s),
            stdin=_stdin(stdin),
            cwd=self._path(cwd),
        )

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        """Create or replace a workspace file (missing directories are made)."""
        self._check_open()
        if not isinstance(data, bytes | str):
            raise SandboxArgumentError(f"data must be bytes or str, got {type(data).__name__}")
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
            raise SandboxArgumentError(f"mode must be permission bits 0o000..0o777, got {mode!r}")
        await self._workspace.write_file(
            self._path(path), data.encode() if isinstance(data, str) else data, mode
        )

    async def read_file(self, path: str, *, max_bytes: int = DEFAULT_READ_BYTES) -> bytes:
        """A workspace file's bytes (links the sandbox made are not followed)."""
        self._check_open()
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise SandboxArgumentError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        return await self._workspace.read_file(self._path(path), max_bytes)

    async def copy_in(self, src: str | os.PathLike[str], dest: str = ".") -> None:
        """Copy a host file or directory into the workspace directory ``dest``, under its own name."""
        self._check_open()
        await self._workspace.copy_in(Path(src), self._path(dest))

    async def copy_out(self, src: str, dest: str | os.PathLike[str]) -> None:
        """Copy a workspace file or directory to the host path ``dest``."""
        self._check_open()
        await self._workspace.copy_out(self._path(src), Path(dest))

    async def snapshot(self, dest: str | os.PathLike[str], *, include_home: bool = False) -> Path:
        """The workspace as a .tar.gz at the host path ``dest`` (collect it before the block ends).
        HOME (``config.home``) is left out unless ``include_home``: it holds the harness's config
        (the proxy key among it) and caches, not the task's work."""
        self._check_open()
        exclude = () if include_home else (self._path(self.config.home),)
        return await self._workspace.snapshot(Path(dest), exclude)
