"""What a sandbox may use: ``Limits`` (per run and per workspace) and ``SandboxConfig`` (backend,
network, what the host lends read-only, environment). One pydantic model each; fields say why.

The defaults fit a coding harness on a laptop: two minutes a command, 2 GiB of address space per
process, 256 processes, 1 GiB of workspace. Raise them per sandbox, never turn them off: model
output is hostile input (DESIGN.md, "Security defaults").
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agentloop.sandbox.errors import SandboxArgumentError, SandboxUnavailableError

__all__ = ["Limits", "SandboxConfig", "loopback_port"]

MiB = 1 << 20


class Limits(BaseModel):
    """Resource limits. Process limits are rlimits, so they hold per process (``memory_mb``,
    ``cpu_s``, ``file_mb``) or per sandbox (``processes``); the wall clock, the disk quota and the
    output caps are enforced by the host and hold for the whole run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    timeout_s: float = Field(
        default=120.0,
        gt=0,
        le=86_400,
        description="wall-clock deadline of one run: the whole process tree dies",
    )
    cpu_s: int = Field(
        default=60, ge=1, description="CPU seconds per process (RLIMIT_CPU): SIGXCPU there, SIGKILL 1 s later"
    )
    memory_mb: int = Field(
        default=2048,
        ge=32,
        description="address space per process (RLIMIT_AS), MiB; allocations past it fail "
        "(node runs in 1 GiB; a JVM reserves more than it uses: raise it for one)",
    )
    processes: int = Field(
        default=256,
        ge=4,
        description="processes + threads in the sandbox (RLIMIT_NPROC): a fork bomb stops here",
    )
    file_mb: int = Field(
        default=256, ge=1, description="largest file one process may write (RLIMIT_FSIZE), MiB"
    )
    open_files: int = Field(
        default=1024, ge=16, description="open file descriptors per process (RLIMIT_NOFILE)"
    )
    disk_mb: int = Field(
        default=1024,
        ge=1,
        description="workspace quota, MiB: measured every disk_poll_s during a run and after it; "
        "a run past it is killed (limit_hit='disk')",
    )
    disk_poll_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="seconds between workspace measurements during a run (a walk of the tree)",
    )
    tmp_mb: int = Field(
        default=256, ge=1, description="size of the private /tmp and /dev/shm (tmpfs in RAM; bwrap only), MiB"
    )
    output_bytes: int = Field(
        default=1 * MiB,
        ge=1,
        description="bytes of stdout and of stderr kept per run; the rest is counted, dropped",
    )

    def rlimits(self) -> dict[str, tuple[int, int]]:
        """The launcher's rlimits (resource.RLIMIT_<name>: (soft, hard)); core dumps are off."""
        return {
            "CPU": (self.cpu_s, self.cpu_s + 1),
            "AS": (self.memory_mb * MiB, self.memory_mb * MiB),
            "NPROC": (self.processes, self.processes),
            "FSIZE": (self.file_mb * MiB, self.file_mb * MiB),
            "NOFILE": (self.open_files, self.open_files),
            "CORE": (0, 0),
        }


class SandboxConfig(BaseModel):
    """How a sandbox is built. ``network='none'`` with ``loopback_ports`` is the safe way to let a
    harness reach its rollout's proxy (see ``agentloop.sandbox``'s docstring for the trade-off)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Literal["auto", "bwrap", "subprocess"] = Field(
        default="auto",
        description="auto: bwrap when it works here, else subprocess (logged once, isolation='none')",
    )
    limits: Limits = Field(default_factory=lambda: Limits(), description="resource limits of every run")
    network: Literal["none", "host"] = Field(
        default="none",
        description="none: a fresh network namespace (only loopback_ports lead out); host: the host's "
        "network, every host service and the internet included",
    )
    loopback_ports: tuple[int, ...] = Field(
        default=(),
        description="host 127.0.0.1 TCP ports reachable at the same 127.0.0.1:port inside (the proxy)",
    )
    ro_binds: tuple[Path, ...] = Field(
        default=(),
        description="host paths lent read-only at the same path inside (a node or tool install dir)",
    )
    path: tuple[str, ...] = Field(
        default=(), description="directories put before /usr/local/bin:/usr/bin:/bin in PATH"
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="environment of every run (the host's is never inherited)"
    )
    home: str = Field(default=".home", description="HOME, relative to the workspace (created, writable)")
    python: Path | None = Field(
        default=None,
        description="interpreter for the launcher (stdlib only, 3.8+); default: this one or /usr's",
    )
    uid: int = Field(
        default=65534,
        ge=1,
        lt=2**32 - 1,
        description="host uid (and gid) sandboxes run as when agentloop runs as root: the kernel does not "
        "apply RLIMIT_NPROC to root, and root must not run model-chosen commands (default: nobody)",
    )

    @field_validator("loopback_ports")
    @classmethod
    def _ports(cls, ports: tuple[int, ...]) -> tuple[int, ...]:
        bad = [p for p in ports if not 1 <= p <= 65535]
        if bad:
            raise ValueError(f"ports must be 1..65535, got {bad}")
        if len(set(ports)) != len(ports):
            raise ValueError(f"ports must be distinct, got {list(ports)}")
        return ports

    @field_validator("ro_binds")
    @classmethod
    def _binds(cls, paths: tuple[Path, ...]) -> tuple[Path, ...]:
        for path in paths:
            if not path.is_absolute():
                raise ValueError(f"ro_binds holds absolute host paths, got {str(path)!r}")
            if not path.exists():
                raise ValueError(f"ro_binds path {str(path)!r} does not exist on this host")
        return paths

    @field_validator("env")
    @classmethod
    def _env(cls, env: dict[str, str]) -> dict[str, str]:
        check_env(env)
        return env

    @field_validator("home")
    @classmethod
    def _home(cls, home: str) -> str:
        if not home or home.startswith("/") or ".." in Path(home).parts or "\0" in home:
            raise ValueError(f"home is a relative path inside the workspace without '..', got {home!r}")
        return home

    def with_node(self, binary: str = "node") -> SandboxConfig:
        """This config plus what node-based CLIs (Claude Code, Codex, opencode) need: the node install
        (``binary``'s prefix, its global ``lib/node_modules`` included) lent read-only and its ``bin``
        first in PATH. Under /usr it is lent already; nvm, volta or a tarball install elsewhere is added.
        HOME (``home``, writable) takes npm's cache and the CLIs' config."""
        found = shutil.which(binary)
        if found is None:
            raise SandboxUnavailableError(
                f"node-based CLIs need {binary!r} on PATH; none found (install node, or pass its full path)"
            )
        bin_dir = Path(os.path.realpath(found)).parent
        prefix = bin_dir.parent
        binds = self.ro_binds
        if not (prefix == Path("/usr") or Path("/usr") in prefix.parents) and prefix not in binds:
            binds = (*binds, prefix)
        path = self.path if str(bin_dir) in self.path else (str(bin_dir), *self.path)
        return self.model_copy(update={"ro_binds": binds, "path": path})


def check_env(env: object) -> dict[str, str]:
    """``env`` as a dict of str to str with POSIX names, or a SandboxArgumentError that says what came."""
    if not isinstance(env, dict):
        raise SandboxArgumentError(f"env must be a dict of str to str, got {type(env).__name__}")
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise SandboxArgumentError(
                f"env must map str to str, got {key!r}: {type(value).__name__} ({type(key).__name__} key)"
            )
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise SandboxArgumentError(f"env name {key!r} (or its value) has '=', NUL or is empty")
    return env


def loopback_port(url: str) -> int:
    """The port of a loopback http(s) URL (a rollout's proxy base URL): what ``loopback_ports`` takes.

    >>> loopback_port("http://127.0.0.1:8321/rollout/r1/attempt/a1/v1")
    8321
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or parts.hostname not in ("127.0.0.1", "localhost"):
        raise SandboxArgumentError(
            f"expected an http URL on 127.0.0.1 or localhost (the proxy binds loopback), got {url!r}"
        )
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return port
