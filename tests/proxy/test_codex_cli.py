"""The real Codex CLI (npm ``@openai/codex@0.169.0``, ``make test-slow`` installs it under
``.venv/harness``) runs one ``codex exec`` session against a rollout attempt's proxy URL: the scripted
model runs a shell command, edits a file with Codex's free-form ``apply_patch`` tool, thinks and answers;
Codex executes both tools, the session completes, and every call is recorded with exact token ids that
extend the call before. Skipped when no codex binary is found (``CODEX_BIN`` names one)."""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentloop.store.memory import MemoryStore
from agentloop.types import LLMCall
from tests.proxy.conftest import attempt_url, new_attempt, running_proxy
from tests.proxy.engines import EchoEngine

ROOT = Path(__file__).resolve().parents[2]
PINNED = ROOT / ".venv" / "harness" / "node_modules" / ".bin" / "codex"
REPLIES = [
    'I will look first.\n<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls -a"}}\n</tool_call>',
    '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n*** Add File: hello.txt\\n'
    '+hello world\\n*** End Patch\\n"}}\n</tool_call>',
    "<think>The file is there.</think>\n\nDone: created hello.txt.",
]


def codex_binary() -> str | None:
    found = os.environ.get("CODEX_BIN") or (str(PINNED) if PINNED.exists() else shutil.which("codex"))
    return found if found and shutil.which(found) else None


@pytest.mark.slow
@pytest.mark.skipif(
    codex_binary() is None, reason="no codex binary: make test-slow installs @openai/codex@0.169.0"
)
async def test_a_codex_exec_session_completes_and_is_recorded_with_exact_ids(
    tokenizer: Any, tmp_path: Path
) -> None:
    codex = codex_binary()
    assert codex is not None
    replies = iter(REPLIES)
    # Codex's first prompt (instructions + tools) is ~9k tokens of SmolLM2's tokenizer: the scripted engine
    # takes a context a real model for Codex needs (32k)
    engine, store = EchoEngine(tokenizer, reply=lambda p, s: next(replies), max_context=32768), MemoryStore()
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    async with running_proxy(engine, store, default_max_tokens=1024) as proxy:
        att = await new_attempt(store)
        (home / "config.toml").write_text(
            'model = "gpt-5.5"\nmodel_provider = "agentloop"\n\n[model_providers.agentloop]\nname = "agentloop"\n'
            f'base_url = "{attempt_url(proxy, att)}"\nwire_api = "responses"\n'
        )
        env = {**os.environ, "CODEX_HOME": str(home), "NO_COLOR": "1"}
        command = [codex, "exec", "--skip-git-repo-check", "--sandbox", "danger-full-access", "-C", str(work),
                   "List the files here, then create hello.txt saying hello world."]  # fmt: skip
        with anyio.fail_after(240):
            done = await anyio.run_process(command, input=b"", env=env, check=False)
    out = done.stdout.decode() + done.stderr.decode()
    assert done.returncode == 0, out[-3000:]
    assert (work / "hello.txt").read_text() == "hello world\n"
    assert (
        "Done: created hello.txt." in done.stdout.decode() and "The file is there" not in done.stdout.decode()
    )
    calls = [s.payload for s in await store.query_spans(att.rollout_id)]
    assert len(calls) == len(REPLIES) and all(isinstance(c, LLMCall) for c in calls)
    for call, engine_call in zip(calls, engine.calls, strict=True):
        assert isinstance(call, LLMCall) and engine_call.output is not None
        assert call.model == "gpt-5.5" and call.prompt_ids == engine_call.prompt_ids
        assert (
            call.response_ids == engine_call.output.token_ids
            and call.response_logprobs == engine_call.output.logprobs
        )
    for before, after in itertools.pairwise(calls):
        assert isinstance(before, LLMCall) and isinstance(after, LLMCall) and after.ledger_break is None
        head = before.prompt_ids + before.response_ids  # Codex sent back exactly what the model wrote
        assert after.prompt_ids[: len(head)] == head
    second = calls[1]
    assert isinstance(second, LLMCall) and second.messages[-1]["role"] == "tool"  # exec_command's output
