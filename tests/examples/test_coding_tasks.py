"""examples/coding_tasks: the generated repositories (each test fails, the reference fix makes it pass,
both run in the sandbox), the example session Claude Code resumes, and one attempt end to end through
Claude Code with the tiny model (slow)."""

from __future__ import annotations

import itertools
import json
import shlex
import socket
from pathlib import Path

import anyio
import pytest

import agentloop as al
from agentloop.harness import harness_binary
from agentloop.sandbox import Sandbox, SandboxConfig
from agentloop.sandbox.errors import SandboxUnavailableError
from agentloop.store.memory import MemoryStore
from agentloop.types import LLMCall, Reward
from examples._harness import run_rollouts
from examples.coding_tasks.agent import EXAMPLES, HARNESS, HARNESS_OPTIONS, SESSION_ID, agent, example_session
from examples.coding_tasks.tasks import KINDS, check_command, fix_command, make_tasks, statement, write_repo
from tests.examples.checks import check_exact_tokens


def claude_installed() -> bool:
    try:
        harness_binary("claude")
    except SandboxUnavailableError:
        return False
    return True


def test_tasks_are_deterministic_distinct_and_split() -> None:
    train, heldout = make_tasks()
    assert (len(train), len(heldout)) == (100, 50)
    assert (train, heldout) == make_tasks() and make_tasks(seed=1) != (train, heldout)
    bodies = [t["body"] for t in train + heldout]
    assert len(set(bodies)) == 150  # distinct functions: no held-out fix is a training fix
    assert {t["kind"] for t in heldout} == set(KINDS) and {t["kind"] for t in train} == set(KINDS)
    for t in train + heldout:
        assert t["fix"] == f"sed -i 's/{t['old']}/{t['new']}/' {t['name']}.py"
        assert t["prompt"].startswith(f"test_{t['name']}.py fails. Fix {t['name']}.py")
        assert t["assertion"] in t["prompt"] and f"Replace `{t['old']}` with `{t['new']}`." in t["prompt"]
    assert "Replace" not in make_tasks(hint=False)[0][0]["prompt"]
    with pytest.raises(ValueError, match="must occur once"):
        fix_command({"name": "f", "body": "def f(a):\n    return a - a\n", "old": "a", "new": "b"})
    with pytest.raises(ValueError, match="would need escaping"):
        fix_command({"name": "f", "body": "def f(a):\n    return a * 2\n", "old": "a * 2", "new": "a"})


async def test_each_repository_fails_before_and_passes_with_the_reference_fix(tmp_path: Path) -> None:
    """All 150 repositories in one sandbox: each test exits non-zero, the reference sed fixes it."""
    train, heldout = make_tasks()
    lines = []
    for task in train + heldout:
        write_repo(task, tmp_path / task["id"])
        test, tid = shlex.quote(task["test"]), task["id"]
        lines.append(
            f"cd /workspace/{tid} 2>/dev/null || cd {tid}; "  # bwrap's /workspace, else the fallback's folder
            f"if python3 {test} >/dev/null 2>&1; then echo PASSED_BEFORE {tid}; fi; "  # leaves a __pycache__
            f"{task['fix']}; {shlex.join(check_command(task))} >/dev/null 2>&1 && echo FIXED {tid}; cd - >/dev/null"
        )
    (tmp_path / "check.sh").write_text("\n".join(lines) + "\n")
    async with Sandbox.open(tmp_path, config=SandboxConfig()) as sb:
        with anyio.fail_after(300):
            result = await sb.run(["sh", "check.sh"], timeout_s=240)
    assert result.exit_code == 0, result.stderr[-2000:]
    assert "PASSED_BEFORE" not in result.stdout
    fixed = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("FIXED ")}
    assert fixed == {t["id"] for t in train + heldout}


def test_the_example_session_is_a_chain_of_solved_examples() -> None:
    files = example_session("/workspace", hint=True)
    ((path, text),) = files.items()
    assert path == f".claude/projects/-workspace/{SESSION_ID}.jsonl"
    lines = [json.loads(line) for line in text.splitlines()]
    assert len(lines) == 4 * len(EXAMPLES) and lines[0]["parentUuid"] is None
    assert all(b["parentUuid"] == a["uuid"] for a, b in itertools.pairwise(lines))
    calls = [
        c
        for x in lines
        if x["type"] == "assistant"
        for c in x["message"]["content"]
        if c["type"] == "tool_use"
    ]
    assert [c["input"]["command"] for c in calls] == [fix_command(ex) for ex in EXAMPLES]
    assert lines[0]["message"]["content"] == statement(EXAMPLES[0], hint=True)
    names = {t["name"] for t in make_tasks()[0] + make_tasks()[1]}
    assert not names & {ex["name"] for ex in EXAMPLES}  # the examples are not tasks
    assert ".claude/projects/-tmp-x-y/" in next(iter(example_session("/tmp/x.y")))
    assert "--resume" in HARNESS_OPTIONS[HARNESS]["args"] and "--bare" in HARNESS_OPTIONS[HARNESS]["args"]


@pytest.mark.slow
@pytest.mark.skipif(
    not claude_installed(), reason="no claude: make harnesses installs @anthropic-ai/claude-code"
)
async def test_one_attempt_through_claude_code_with_the_tiny_model(tiny_model_dir: Path) -> None:
    """The agent as training runs it: Claude Code on the attempt's proxy, the tiny random model behind
    it. Its calls are recorded with exact ids, every one with the example session's turns before the
    task, and the attempt ends with the test's verdict as its reward (0: a random model fixes nothing)."""
    from agentloop.engine.torch.engine import TorchEngine

    task = make_tasks()[1][0]
    engine, store = TorchEngine(str(tiny_model_dir), device="cpu"), MemoryStore()
    sampling = {"temperature": 0.0, "max_tokens": 12}
    with anyio.fail_after(420):
        summary = await run_rollouts(agent, [task], engine, store=store, concurrency=1, sampling=sampling)
    assert summary["statuses"] == {"succeeded": 1} and summary["rewards"] == [0.0]
    (rid,) = summary["rollout_ids"]
    spans = await store.query_spans(rid)
    calls = [s.payload for s in spans if isinstance(s.payload, LLMCall)]
    # --max-turns 2 bounds the session's turns, not its calls: Claude Code also retries a turn it cannot
    # parse (a random model's output) and makes side calls; 4 were seen here with greedy sampling
    assert 1 <= len(calls) <= 8 and all(c.prompt_ids and c.response_ids and not c.error for c in calls)
    assert all(
        0 < len(c.response_ids) <= 12 and len(c.response_logprobs or []) == len(c.response_ids) for c in calls
    )
    first = calls[0].messages
    assert [m["role"] for m in first[:2]] == ["system", "user"] and first[1]["content"] == statement(
        EXAMPLES[0], True
    )
    last = first[-1]["content"]  # the task after the examples (a string, or Anthropic-style text blocks)
    text = (
        last
        if isinstance(last, str)
        else " ".join(str(b.get("text", "")) for b in last if isinstance(b, dict))
    )
    assert task["prompt"] in text
    assert [s.payload.value for s in spans if isinstance(s.payload, Reward)] == [0.0]
    counts = await check_exact_tokens(store, [rid])
    assert counts["calls"] == len(calls)


@pytest.mark.slow
@pytest.mark.skipif(
    not claude_installed(), reason="no claude: make harnesses installs @anthropic-ai/claude-code"
)
def test_a_perfect_model_is_rewarded_and_the_prompt_is_short() -> None:
    """measure.py's scripted model runs the reference fix through Claude Code's Bash tool: the check
    passes, in two calls whose prompts stay under 1.6k tokens (Claude Code's own is ~12.5k)."""
    from examples.coding_tasks import measure

    (row,) = measure.main(["--options", HARNESS])
    assert row["check_passed"] and row["exit_code"] == 0 and row["calls"] == 2
    assert all(n < 1600 for n in row["prompt_tokens_per_call"]), row
    assert row["sampled_temperature"] == [0.6]  # Claude Code sends none: the trainer's resource decides


@pytest.mark.slow
@pytest.mark.skipif(
    not claude_installed(), reason="no claude: make harnesses installs @anthropic-ai/claude-code"
)
async def test_a_session_past_its_deadline_fails_the_attempt_instead_of_scoring_zero(tmp_path: Path) -> None:
    """A model that never answers (nothing listens on the port) and a 2 s deadline: Claude Code is killed
    at the deadline, and the attempt raises rather than returning 0.0, so an overloaded machine does not
    teach the model that its answers fail."""
    from examples.coding_tasks.agent import HarnessTimeoutError, fix_repo

    task = make_tasks()[1][0]
    silent = socket_that_never_answers()
    port = silent.getsockname()[1]
    dead = al.LLM(base_url=f"http://127.0.0.1:{port}/rollout/r/attempt/a/v1", model="m")
    try:
        with pytest.raises(HarnessTimeoutError, match="ran past its deadline of 2 s"):
            await fix_repo(task, dead, timeout_s=2.0)
    finally:
        silent.close()


def socket_that_never_answers() -> socket.socket:
    """A listening socket nobody accepts from: connections open, requests never get an answer."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    return s
