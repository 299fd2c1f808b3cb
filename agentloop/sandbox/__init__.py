"""Sandboxed workspaces for rollouts: a harness's shell commands (chosen by the model, so hostile)
run in a workspace of their own, under limits, cut off from the host.

::

    from agentloop.sandbox import Sandbox, SandboxConfig, loopback_port

    config = SandboxConfig(loopback_ports=(loopback_port(llm.base_url),)).with_node()
    async with Sandbox.open("task_repo/", config=config) as sb:   # or a tarball, GitSnapshot(repo, rev)
        result = await sb.run("npm test", env={"OPENAI_BASE_URL": llm.base_url}, timeout_s=60)
        result.exit_code, result.stdout, result.timed_out, result.truncated, result.usage
        patch = await sb.read_file("out.diff")
    # the workspace is gone here, also after an exception

Backends (``SandboxConfig.backend``; ``Sandbox.open(backend=...)`` takes your own):

- ``bwrap`` (bubblewrap): fresh user/mount/pid/net/ipc/uts namespaces; read-only /usr, a writable
  /workspace, private /tmp; nothing else of the host. See ``agentloop.sandbox.bwrap``.
- ``subprocess``: the same limits on plain processes, no isolation (``RunResult.isolation='none'``,
  logged once). What 'auto' falls back to where bubblewrap cannot run. See ``agentloop.sandbox.local``.
- your own (Docker, Kubernetes Jobs): implement ``SandboxBackend`` (``agentloop.sandbox.base``).

Limits (``Limits``): wall clock (the whole tree is killed), CPU seconds, address space, open files
and file size per process, processes per sandbox, workspace size, bytes of output kept.

Network, decided: ``network='none'`` (the default) gives the sandbox an empty network namespace,
and each of ``loopback_ports`` is bridged in: the command connects to ``127.0.0.1:PORT`` inside,
the launcher relays over a Unix socket to the host's ``127.0.0.1:PORT`` (the rollout's proxy).
Nothing else is reachable: no host service, no internet, no DNS. ``network='host'`` shares the
host's network instead: simpler, but the command then reaches every loopback service (the store,
Ray, the proxy's other rollouts' routes) and the internet. Use it only for trusted commands.
"""

from __future__ import annotations

from agentloop.sandbox._files import GitSnapshot, Source
from agentloop.sandbox.base import SandboxBackend, Workspace
from agentloop.sandbox.bwrap import BwrapBackend, bwrap_problem
from agentloop.sandbox.config import Limits, SandboxConfig, loopback_port
from agentloop.sandbox.errors import SandboxArgumentError, SandboxError, SandboxUnavailableError
from agentloop.sandbox.local import SubprocessBackend
from agentloop.sandbox.result import LimitHit, ResourceUsage, RunResult
from agentloop.sandbox.sandbox import Sandbox, select_backend

__all__ = [
    "BwrapBackend",
    "GitSnapshot",
    "LimitHit",
    "Limits",
    "ResourceUsage",
    "RunResult",
    "Sandbox",
    "SandboxArgumentError",
    "SandboxBackend",
    "SandboxConfig",
    "SandboxError",
    "SandboxUnavailableError",
    "Source",
    "SubprocessBackend",
    "Workspace",
    "bwrap_problem",
    "loopback_port",
    "select_backend",
]
