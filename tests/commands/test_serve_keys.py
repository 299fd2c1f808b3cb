"""`agentloop serve` keys (issue 16): off loopback a key is required (one line, exit 2, before any
model loads); the key comes from --api-key-file or $AGENTLOOP_PROXY_API_KEY and is never printed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.e2e  # every test runs `agentloop serve` in a subprocess

KEY = "serve-key-3b1f9a"


def _serve(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "agentloop.cli", "serve", *args]
    keys = ("AGENTLOOP_PROXY_API_KEY", "AGENTLOOP_ADMIN_KEY")
    full_env = {k: v for k, v in os.environ.items() if k not in keys} | (env or {})
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=120)


def test_serve_off_loopback_without_a_key_is_one_line_error(tmp_path: Path) -> None:
    for host in ("0.0.0.0", "::"):
        out = _serve("--host", host, "--port", "0", "--model", str(tmp_path / "no-model"), cwd=tmp_path)
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip().splitlines() == [
            f"agentloop serve: error: --host {host} is not a loopback address, so a key is required: pass "
            "--api-key-file PATH or set $AGENTLOOP_PROXY_API_KEY (or serve on 127.0.0.1)"
        ]


def test_serve_key_file_errors_are_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    key = tmp_path / "app.key"
    key.write_text(KEY)
    cases = [
        (["--api-key-file", str(tmp_path / "missing.key")], "cannot read the key file"),
        (["--api-key-file", str(empty)], "is empty"),
        (["--api-key", "env:AL_TEST_NOT_SET"], "AL_TEST_NOT_SET"),
        (["--api-key-file", str(key), "--admin-key-file", str(empty)], "is empty"),
        (["--api-key-file", str(key), "--admin-key-file", str(key), "--admin-key", "env:X"], "not both"),
        # the admin key may not be an app key too (that app would be the admin)
        (["--api-key-file", str(key), "--api-key", "env:AL_K", "--admin-key-file", str(key)], "must differ"),
    ]
    for args, match in cases:
        out = _serve("--host", "0.0.0.0", "--port", "0", *args, cwd=tmp_path, env={"AL_K": "other-key"})
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert match in out.stderr


@pytest.mark.parametrize("source", ["env", "file"])
def test_serve_off_loopback_with_a_key_requires_it(tmp_path: Path, tiny_model_dir: Path, source: str) -> None:
    key_file = tmp_path / "proxy.key"
    key_file.write_text(KEY + "\n")
    args = ["--api-key-file", str(key_file)] if source == "file" else []
    env = {"AGENTLOOP_PROXY_API_KEY": KEY} if source == "env" else {}
    cmd = [sys.executable, "-m", "agentloop.cli", "serve", "--model", str(tiny_model_dir), "--host", "0.0.0.0",
           "--port", "0", "--store", str(tmp_path / "serve.db"), *args]  # fmt: skip
    assert KEY not in " ".join(cmd)  # nothing in `ps` shows it
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        banner: list[str] = []  # up to its last line, "Ctrl-C to stop."
        while len(banner) < 20 and (not banner or banner[-1] not in ("Ctrl-C to stop.\n", "")):
            banner.append(proc.stdout.readline())
        assert banner[-1] == "Ctrl-C to stop.\n", banner
        assert "key required" in banner[0] and KEY not in "".join(banner)
        found = re.search(r"http://([^:/]+):(\d+)/v1", "".join(banner))
        assert found and found.group(1) != "0.0.0.0", banner  # the address clients can call
        found = re.search(r":(\d+)/v1", found.group(0))
        assert found
        base = f"http://127.0.0.1:{found.group(1)}/v1"
        with httpx.Client(timeout=30) as http:
            assert http.get(f"{base}/models").status_code == 401
            assert http.get(f"{base}/models", headers={"authorization": "Bearer wrong"}).status_code == 401
            assert http.get(f"{base}/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert KEY not in err


def test_a_key_on_the_command_line_gets_a_note(tmp_path: Path) -> None:
    out = _serve("--api-key", KEY, "--model", str(tmp_path / "no-model"), "--port", "0", cwd=tmp_path)
    assert out.returncode == 2  # the model is missing; the key itself was accepted, with a note
    assert out.stderr.splitlines()[0] == (
        "agentloop serve: note: a key on the command line is visible to every user (ps); "
        "prefer --api-key-file or $AGENTLOOP_PROXY_API_KEY"
    )
    assert KEY not in out.stderr
