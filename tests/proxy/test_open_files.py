"""Agents that never close their clients under a low open-file limit: the proxy used to stop accepting
connections (``accept() out of system resource``) and clients timed out; now it raises the limit."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _waves(raise_limit: bool) -> list[dict[str, object]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AGENTLOOP_LOG_LEVEL": "ERROR"}
    args = ["256", "3", "70", "raise" if raise_limit else "keep"]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.proxy.open_files_agents", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 3, proc.stderr[-2000:]
    return lines


@pytest.mark.slow  # end to end, > 10 s: .ci/run runs it, make test does not
@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1024, reason="hard limit below 1024")
def test_unclosed_clients_do_not_stall_the_proxy() -> None:
    waves = _waves(raise_limit=True)
    assert [w["failed"] for w in waves] == [0, 0, 0]
    assert all(int(w["soft"]) > 256 for w in waves)  # type: ignore[call-overload]
    # the control: at 256 files the same agents run the proxy out of sockets in a later wave
    control = _waves(raise_limit=False)
    assert control[0]["failed"] == 0 and sum(int(w["failed"]) for w in control) > 0  # type: ignore[call-overload]
