"""The sandbox's errors, drawn in agentloop's one tree (``agentloop.errors``): ``SandboxError`` and below
it ``SandboxUnavailableError`` and ``SandboxArgumentError`` (also a ``ValueError``).

A command that fails, times out or hits a limit is not an error: ``Sandbox.run`` returns a
``RunResult`` that says so. Config fields are validated by pydantic (``ValidationError`` names the field).
"""

from __future__ import annotations

from agentloop.errors import SandboxArgumentError, SandboxError, SandboxUnavailableError

__all__ = ["SandboxArgumentError", "SandboxError", "SandboxUnavailableError"]
