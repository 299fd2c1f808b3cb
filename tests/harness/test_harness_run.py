"""al.harness.run: the real CLI in a real sandbox against a real proxy (a scripted engine stands in for
the model, so the session's path is known); and the specs' config and errors, without a harness."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import agentloop as al
from agentloop.harness import HARNESSES, harness_binary, harness_prefix
from agentloop.harness.specs import without_v1
from agentloop.sandbox import Limits, SandboxConfig, bwrap_problem
from agentloop.sandbox.errors import SandboxArgumentError, SandboxUnavailableError
from agentloop.store.memory import MemoryStore
from agentloop.types import LLMCall
from tests.proxy.conftest import attempt_url, new_attempt, running_proxy
from tests.proxy.conftest import tokenizer as tokenizer  # the fixture
from tests.proxy.engines import EchoEngine

LLM = al.LLM(base_url="http://127.0.0.1:8321/rollout/r1/attempt/a1/v1", model="tiny", api_key="k")
FIX = "sed -i 's/a - b/a + b/' bug.py && cat bug.py"
# each harness's shell tool, as it declares it (Codex offers exec_command, not apply_patch, to a model it
# has no metadata for)
SHELL_CALLS = {
    "codex": {"name": "exec_command", "arguments": {"cmd": FIX}},
    "claude": {"name": "Bash", "arguments": {"command": FIX}},
    "opencode": {"name": "bash", "arguments": {"command": FIX, "description": "fix add"}},
}
ANSWER = "Fixed: add returns a + b."


def scripted(tokenizer: Any, harness: str) -> Any:
    """The model's part: run the fix through the shell tool, then answer once the fixed file shows."""

    def reply(prompt_ids: list[int], sampling: Any) -> str:
        if "return a + b" in tokenizer.decode(prompt_ids[-400:]):
            return ANSWER
        return f"<tool_call>\n{json.dumps(SHELL_CALLS[harness])}\n</tool_call>"

    return reply


def installed(name: str) -> bool:
    try:
        harness_binary(name)
    except SandboxUnavailableError:
        return False
    return True


def test_the_specs_point_each_harness_at_the_attempt() -> None:
    codex = HARNESSES["codex"].files(LLM, 32768)[".codex/config.toml"]
    assert f'base_url = "{LLM.base_url}"' in codex and 'wire_api = "responses"' in codex
    assert (
        "model_context_window = 32768" in codex
        and HARNESSES["codex"].env(LLM, "/h")["AGENTLOOP_API_KEY"] == "k"
    )
    claude = HARNESSES["claude"].env(LLM, "/h")
    assert claude["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8321/rollout/r1/attempt/a1"
    assert claude["ANTHROPIC_SMALL_FAST_MODEL"] == "tiny" and claude["ANTHROPIC_API_KEY"] == "k"
    opencode = json.loads(HARNESSES["opencode"].files(LLM, 8192)[".config/opencode/opencode.json"])
    assert opencode["provider"]["agentloop"]["options"]["baseURL"] == LLM.base_url
    assert opencode["model"] == "agentloop/tiny"
    assert without_v1("http://h:1/v1/") == "http://h:1" and without_v1("http://h:1/x") == "http://h:1/x"
    assert HARNESSES["claude"].final_message('{"type": "result", "result": "done"}\n', None) == "done"
    assert HARNESSES["claude"].final_message("not json", None) is None


def test_extra_args_go_where_each_cli_takes_options() -> None:
    """Claude Code's variadic --tools would take a prompt after it: its extra options go last; Codex
    and opencode take the prompt as their last positional, so theirs go just before it."""
    extra = ["--tools", "Bash"]
    claude = HARNESSES["claude"].argv("fix it", LLM, "/h", "/w", extra)
    assert claude[-2:] == extra and claude[1:3] == ["-p", "fix it"]
    for name in ("codex", "opencode"):
        argv = HARNESSES[name].argv("fix it", LLM, "/h", "/w", extra)
        assert argv[-3:] == [*extra, "fix it"], name
        assert HARNESSES[name].argv("fix it", LLM, "/h", "/w") == [a for a in argv if a not in extra]


async def test_bad_input_is_refused_with_what_came(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(
        SandboxArgumentError, match=r"harness must be one of \['claude', 'codex', 'opencode'\]"
    ):
        await al.harness.run("aider", "fix it", LLM)
    with pytest.raises(SandboxArgumentError, match="task must be the prompt"):
        await al.harness.run("codex", 3, LLM)  # type: ignore[arg-type]
    with pytest.raises(SandboxArgumentError, match="prompt is empty"):
        await al.harness.run("codex", {"prompt": "  "}, LLM)
    with pytest.raises(SandboxArgumentError, match=r"llm must be an al\.LLM"):
        await al.harness.run("codex", "fix it", {"base_url": "x"})  # type: ignore[arg-type]
    with pytest.raises(SandboxArgumentError, match="args must be a sequence of str"):
        await al.harness.run("codex", "fix it", LLM, args="--tools Bash")
    with pytest.raises(SandboxArgumentError, match="args must be a sequence of str"):
        await al.harness.run("codex", "fix it", LLM, args=["--max-turns", 3])  # type: ignore[list-item]
    with pytest.raises(SandboxArgumentError, match="env must map variable names"):
        await al.harness.run("codex", "fix it", LLM, env={"A=B": "c"})
    with pytest.raises(SandboxArgumentError, match="home_files must map paths relative to HOME"):
        await al.harness.run("codex", "fix it", LLM, home_files={"/etc/passwd": "x"})
    monkeypatch.setenv("AGENTLOOP_HARNESS_PREFIX", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert harness_prefix() == tmp_path
    with pytest.raises(
        SandboxUnavailableError, match=r"harness 'codex' is not installed: run `make harnesses`"
    ):
        await al.harness.run("codex", "fix it", LLM)


@pytest.mark.slow
@pytest.mark.skipif(bwrap_problem() is not None, reason=f"bubblewrap cannot run here: {bwrap_problem()}")
@pytest.mark.parametrize("harness", sorted(HARNESSES))
async def test_each_harness_fixes_a_bug_in_a_bwrap_sandbox_and_every_call_is_recorded(
    harness: str, tokenizer: Any, tmp_path: Path
) -> None:
    """The harness runs the fix with its own shell tool and answers; the check (the test) passes in the
    same workspace; the host copy is untouched; every call is recorded with the engine's exact ids."""
    if not installed(harness):
        pytest.skip(f"{harness} is not installed: make harnesses installs {HARNESSES[harness].npm_package}")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "bug.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / "test_bug.py").write_text("from bug import add\nassert add(2, 3) == 5\n")
    engine, store = (
        EchoEngine(tokenizer, reply=scripted(tokenizer, harness), max_context=65536),
        MemoryStore(),
    )
    async with running_proxy(engine, store, default_max_tokens=1024) as proxy:
        att = await new_attempt(store)
        llm = al.LLM(base_url=attempt_url(proxy, att), model="tiny-coder")
        result = await al.harness.run(
            harness,
            "Fix add in bug.py so that test_bug.py passes.",
            llm,
            workspace=repo,
            check=["python3", "test_bug.py"],
            collect=["bug.py"],
            timeout_s=240,
        )
    assert result.run.isolation == "bwrap"
    assert result.run.exit_code == 0, result.run.stderr[-3000:]
    assert result.check is not None and result.check.exit_code == 0, result.run.stderr[-4000:]
    assert result.ok and result.files["bug.py"] == "def add(a, b):\n    return a + b\n"
    assert result.final_message is not None and ANSWER in result.final_message
    assert (repo / "bug.py").read_text() == "def add(a, b):\n    return a - b\n"  # the sandbox had a copy
    calls = [s.payload for s in await store.query_spans(att.rollout_id)]
    assert len(calls) >= 2 and all(isinstance(c, LLMCall) and c.model == "tiny-coder" for c in calls)
    for call, engine_call in zip(calls, engine.calls, strict=True):
        assert isinstance(call, LLMCall) and engine_call.output is not None
        assert call.prompt_ids == engine_call.prompt_ids and call.response_ids == engine_call.output.token_ids


@pytest.mark.slow
@pytest.mark.skipif(not installed("codex"), reason="no codex: make harnesses installs @openai/codex@0.169.0")
async def test_a_harness_that_cannot_reach_a_model_fails_in_the_result_not_raised(tmp_path: Path) -> None:
    """Nothing listens on the proxy port: the harness exits non-zero (or hits its deadline) and the result
    says so; the sandbox is gone afterwards."""
    dead = al.LLM(base_url="http://127.0.0.1:9/rollout/r/attempt/a/v1", model="m")
    result = await al.harness.run(
        "codex", "hello", dead, timeout_s=60, sandbox=SandboxConfig(limits=Limits(timeout_s=60))
    )
    assert not result.ok and (result.run.exit_code != 0 or result.run.timed_out)


@pytest.mark.skipif(bwrap_problem() is not None, reason=f"bubblewrap cannot run here: {bwrap_problem()}")
def test_a_sandbox_command_runs_on_the_trainers_uvloop() -> None:
    """The trainer runs agents on uvloop (agentloop.event_loop.run), whose subprocess_exec refuses the
    stdlib's user/group keywords the sandbox drops privileges with when it runs as root."""
    import asyncio

    from agentloop.event_loop import run
    from agentloop.sandbox import Sandbox

    async def main() -> tuple[str, Any]:
        async with Sandbox.open(None) as sb:
            return type(asyncio.get_running_loop()).__module__, await sb.run(
                ["sh", "-c", "echo ok"], timeout_s=60
            )

    loop, result = run(main)
    assert result.exit_code == 0 and result.stdout.strip() == "ok", (loop, result.stderr[-2000:])
