"""The sandbox's errors, under agentloop's one tree (``agentloop.errors.AgentLoopError``)::

    AgentLoopError
    └── SandboxError                 a sandbox could not be created, used or cleaned up
        ├── SandboxUnavailableError  the backend asked for cannot run on this machine (bwrap missing,
        │                            user namespaces off, no usable Python for the launcher)
        └── SandboxArgumentError     a bad argument: command, env, timeout, workspace path (also a ValueError)

A command that fails, times out or hits a limit is not an error: ``Sandbox.run`` returns a
``RunResult`` that says so. Config fields are validated by pydantic (``ValidationError`` names the field).
"""

from __future__ import annotations

from agentloop.errors import AgentLoopError

__all__ = ["SandboxArgumentError", "SandboxError", "SandboxUnavailableError"]


class SandboxError(AgentLoopError):
    """A sandbox could not be created, used or cleaned up; the message says what and how to fix it."""


class SandboxUnavailableError(SandboxError):
    """The backend asked for cannot run here; the message gives the reason and the fix."""


class SandboxArgumentError(SandboxError, ValueError):
    """An argument to a sandbox call is not valid; the message says what was expected and what came."""
