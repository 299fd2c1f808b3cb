"""Helpers for the sandbox tests: real bubblewrap, real processes, real sockets.

Tests that need bubblewrap carry ``needs_bwrap``: on a machine where it cannot run (not installed,
user namespaces off) they are skipped with the reason; ``make sandbox-deps`` installs it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentloop.sandbox import Limits, SandboxConfig, SandboxUnavailableError, bwrap_problem
from agentloop.sandbox._host import launcher_python

BWRAP_PROBLEM = bwrap_problem()
needs_bwrap = pytest.mark.skipif(
    BWRAP_PROBLEM is not None, reason=f"bubblewrap cannot sandbox here ({BWRAP_PROBLEM}); make sandbox-deps"
)

# Small limits keep every test to about a second.
FAST = Limits(timeout_s=10, memory_mb=512, processes=64, disk_mb=64, disk_poll_s=0.2, output_bytes=64 << 10)


def config(backend: str = "bwrap", **kwargs: object) -> SandboxConfig:
    limits = kwargs.pop("limits", FAST)
    return SandboxConfig(backend=backend, limits=limits, **kwargs)  # type: ignore[arg-type]


try:  # runs inside every sandbox: the launcher's own interpreter
    PYTHON, NO_LAUNCHER = launcher_python(SandboxConfig())[0], None
except SandboxUnavailableError as exc:  # conftest.py skips every sandbox test, saying why
    PYTHON, NO_LAUNCHER = "", str(exc)


def running_with(marker: str) -> list[int]:
    """Host pids whose command line holds ``marker`` (processes a test left behind, if any)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline and b"pytest" not in cmdline:
            found.append(int(name))
    return found
