"""`agentloop serve --workers N`: the per-attempt routes served by worker processes, which stop with it."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import pytest

from agentloop.store.sqlite import SQLiteStore

pytestmark = pytest.mark.e2e  # `agentloop serve` and its worker in subprocesses


async def _attempt(db: Path) -> tuple[str, str]:
    store = SQLiteStore(db)
    try:
        await store.enqueue_rollout({"q": 1})
        attempted = await store.dequeue_rollout("test")
        assert attempted is not None
        return attempted.rollout_id, attempted.attempt.attempt_id
    finally:
        await store.close()


async def _calls(db: Path, rollout_id: str) -> int:
    store = SQLiteStore(db)
    try:
        return len(await store.query_spans(rollout_id))
    finally:
        await store.close()


def test_serve_with_a_worker_records_the_rollouts_calls(tmp_path: Path, tiny_model_dir: Path) -> None:
    db = tmp_path / "serve.db"
    cmd = [sys.executable, "-m", "agentloop.cli", "serve", "--model", str(tiny_model_dir), "--port", "0",
           "--store", str(db), "--workers", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        banner: list[str] = []
        while len(banner) < 20 and (not banner or banner[-1] not in ("Ctrl-C to stop.\n", "")):
            banner.append(proc.stdout.readline())
        assert banner[-1] == "Ctrl-C to stop.\n", banner
        found = re.search(r"worker 0 template: +(\S+)", "".join(banner))
        assert found, banner
        template = found.group(1)
        rid, aid = anyio.run(_attempt, db)
        url = template.replace("{rollout_id}", rid).replace("{attempt_id}", aid)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        with httpx.Client(timeout=60) as http:
            assert http.post(f"{url}/chat/completions", json=body).status_code == 200
            assert http.post(f"{url}/chat/completions", content=b"{oops").status_code == 400
        assert anyio.run(_calls, db, rid) == 1  # recorded by the worker in serve's store
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    port = int(re.search(r":(\d+)/", template).group(1))  # type: ignore[union-attr]
    with httpx.Client(timeout=5) as http, pytest.raises(httpx.ConnectError):  # the worker stopped too
        http.get(f"http://127.0.0.1:{port}/v1/models")


def test_serve_refuses_a_negative_worker_count(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "agentloop.cli", "serve", "--workers", "-1", "--model", str(tmp_path / "none")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "--workers must be >= 0, got -1" in out.stderr
