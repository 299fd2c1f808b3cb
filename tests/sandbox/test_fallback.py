"""Where bubblewrap is missing, backend='auto' falls back to plain processes: it says so once, loudly,
marks every result isolation='none', and still applies the limits."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from agentloop.sandbox import Sandbox, SandboxConfig, SandboxUnavailableError
from agentloop.sandbox.sandbox import _warn_no_isolation
from tests.sandbox.helpers import FAST, PYTHON


async def test_auto_without_bwrap_warns_once_and_still_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # shutil.which finds no bwrap (commands get their own PATH)
    _warn_no_isolation.cache_clear()
    limits = FAST.model_copy(update={"memory_mb": 256, "output_bytes": 1000})
    with capture_logs() as logs:
        async with Sandbox.open(config=SandboxConfig(limits=limits)) as sb:
            hog = await sb.run([PYTHON, "-c", "x = bytearray(1 << 30)"])
            loop = await sb.run("while :; do :; done", timeout_s=0.5)
            loud = await sb.run("head -c 1500 /dev/zero")
        async with Sandbox.open(config=SandboxConfig(limits=limits)):
            pass
    warnings = [e for e in logs if e["event"] == "sandbox_without_isolation"]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"
    assert (
        "bubblewrap is not installed" in warnings[0]["reason"]
        and "apt-get install bubblewrap" in warnings[0]["reason"]
    )
    assert sb.isolation == "none" and hog.isolation == "none"
    assert "MemoryError" in hog.stderr
    assert loop.timed_out and loop.limit_hit == "timeout"
    assert loud.stdout_truncated and loud.stdout.startswith(
        "\0" * 1000 + "\n[agentloop.sandbox: stdout truncated"
    )


async def test_bwrap_asked_for_but_missing_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailableError, match="backend='bwrap' but bubblewrap is not installed"):
        async with Sandbox.open(config=SandboxConfig(backend="bwrap")):
            pass
