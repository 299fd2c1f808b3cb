"""`agentloop serve --max-context N` (issue 43): the model's own context by default, a limit above the
model's refused in one line before any weights load, and a prompt over the context answered with a 400
``context_length_exceeded``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.e2e  # every test runs `agentloop serve` in a subprocess


def _serve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "agentloop.cli", "serve", "--port", "0", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_max_context_above_the_models_limit_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = _serve("--model", str(tiny_model_dir), "--max-context", "4096", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"agentloop serve: error: --max-context 4096 is above the model's limit of 2048 tokens ({tiny_model_dir}: "
        "max_position_embeddings); pass at most 2048, or leave the flag out for the model's full context"
    ]
    out = _serve("--model", str(tiny_model_dir), "--max-context", "1", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "agentloop serve: error: --max-context must be >= 2 tokens, got 1"
    ]
    assert not (tmp_path / "agentloop-serve.db").exists()  # refused before anything started


@pytest.mark.slow  # a serve subprocess per case: ~15 s each on 2 cores
@pytest.mark.parametrize("flag", [[], ["--max-context", "1000"]])
def test_serve_context_and_a_prompt_over_it(tmp_path: Path, tiny_model_dir: Path, flag: list[str]) -> None:
    cmd = [sys.executable, "-m", "agentloop.cli", "serve", "--model", str(tiny_model_dir), "--port", "0",
           "--store", str(tmp_path / "serve.db"), *flag]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=dict(os.environ), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    context = int(flag[1]) if flag else 2048  # the tiny model's max_position_embeddings
    try:
        assert proc.stdout is not None
        banner: list[str] = []
        while len(banner) < 20 and (not banner or banner[-1] not in ("Ctrl-C to stop.\n", "")):
            banner.append(proc.stdout.readline())
        assert banner[-1] == "Ctrl-C to stop.\n", banner
        found = re.search(r"OpenAI base URL \(apps\):\s+(\S+)", "".join(banner))
        assert found, banner
        base = found.group(1)
        with httpx.Client(timeout=60) as http:
            (card,) = http.get(f"{base}/models").json()["data"]
            assert card["max_model_len"] == context
            words = {"role": "user", "content": "word " * context}  # over the context once templated
            r = http.post(f"{base}/chat/completions", json={"model": card["id"], "messages": [words]})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            ok = {"role": "user", "content": "Hi"}
            r = http.post(
                f"{base}/chat/completions", json={"model": card["id"], "messages": [ok], "max_tokens": 4}
            )
            assert r.status_code == 200, r.text
    finally:  # (how serve stops is test_serve_keys'; here only what it answered matters)
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
