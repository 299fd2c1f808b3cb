"""``agentloop serve --train CONFIG.yaml`` and ``agentloop rollback``, as a user runs them: the server
in a subprocess, an app posting sessions and rewards over HTTP, the gate's evaluation from a JSONL and
a reward function beside the config, a promotion, then a rollback from the CLI.

Real components: the CLI in subprocesses, the tiny model (real tokenizer) served by a TorchEngine,
the real store, trainer and gate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ADMIN = "serve-train-admin-key"


@pytest.mark.slow  # end to end, > 10 s: .ci/run runs it, make test does not
def test_serve_trains_online_promotes_and_rolls_back(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "Say hi", "answer": "hi"}\n{"prompt": "Say yo"}\n')
    (tmp_path / "score.py").write_text("def score(task, text):\n    return 0.5\n")
    (tmp_path / "online.yaml").write_text(
        "online: {sessions_per_update: 2, settle_s: 0, eval_tasks: tasks.jsonl, eval_reward: score.py:score,"
        " eval_max_tokens: 4}\n"
        "data: {max_prompt_length: 64, max_response_length: 16}\n"
        "actor_rollout_ref: {actor: {optim: {lr: 1.0e-3}}}\n"
    )
    cmd = [sys.executable, "-m", "agentloop.cli", "serve", "--model", str(tiny_model_dir), "--port", "0"]
    cmd += ["--store", str(tmp_path / "serve.db"), "--train", str(tmp_path / "online.yaml")]
    cmd += ["--run-dir", str(tmp_path / "run")]
    env = {**os.environ, "AGENTLOOP_ADMIN_KEY": ADMIN}  # the admin routes (versions, rollback) need it
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        while len(lines) < 20 and (not lines or lines[-1] not in ("Ctrl-C to stop.\n", "")):
            lines.append(proc.stdout.readline())
        assert lines[-1] == "Ctrl-C to stop.\n", lines
        (base,) = [line.split()[-1] for line in lines if "OpenAI base URL" in line]
        url = base.removesuffix("/v1")
        assert any("online training:" in line and "tasks.jsonl" in line for line in lines), lines
        with httpx.Client(timeout=60) as http:
            assert http.get(f"{url}/v1/admin/versions").status_code == 401  # the app (no key) may not
            for sid, reward in (("a", 1.0), ("b", 0.0)):
                chat = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}
                r = http.post(f"{base}/chat/completions", json=chat, headers={"X-Session-Id": sid})
                assert r.status_code == 200, r.text
                assert http.post(f"{base}/sessions/{sid}/reward", json={"value": reward}).status_code == 200
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # the update, the gate (score 0.5 >= 0.5 - margin), promotion
                versions = http.get(
                    f"{url}/v1/admin/versions", headers={"Authorization": f"Bearer {ADMIN}"}
                ).json()
                if versions["current"] == 1:
                    break
                time.sleep(0.5)
            assert versions["current"] == 1, versions
            assert [v["score"] for v in versions["versions"]] == [0.5, 0.5]
        done = subprocess.run(
            [sys.executable, "-m", "agentloop.cli", "rollback", "--url", base, "--to", "0"],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout == "serving version 0 (was 1)\n"  # the banner's .../v1 URL is accepted
        bad = subprocess.run(
            [sys.executable, "-m", "agentloop.cli", "rollback", "--url", url, "--to", "9"],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert bad.returncode == 2 and "no promoted version 9" in bad.stderr
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    kinds = [
        json.loads(line)["kind"] for line in (tmp_path / "run" / "promotions.jsonl").read_text().splitlines()
    ]
    assert kinds == ["baseline", "promoted", "rollback"]
    assert (tmp_path / "run" / "versions" / "v1.safetensors").exists()
