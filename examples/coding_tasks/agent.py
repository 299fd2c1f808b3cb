"""The coding agent: Claude Code (``al.harness.run``) fixes one tiny repository in a sandbox; the reward
is 1.0 when the repository's test passes afterwards, in the same sandbox, else 0.0.

SmolLM2 holds 8192 tokens. Claude Code's own system prompt and tool set make a first prompt of ~12.5k
tokens; ``HARNESS_OPTIONS["claude-trimmed"]`` replaces the system prompt (``--system-prompt``) with
``SYSTEM_PROMPT`` (what to do, and one worked call in the exact text the proxy parses) and offers only
the Bash tool (``--tools Bash``). ``measure.py`` gives each option's prompt tokens per call.
"""

from __future__ import annotations

import functools
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import agentloop as al
from examples.coding_tasks.tasks import check_command, fix_command, statement, write_repo

SYSTEM_PROMPT = (
    "You fix a failing test in a small Python repository: call the Bash tool once with one sed command "
    "that replaces the wrong text in the file, then reply Done."
)

# Worked examples, shown as earlier turns of a resumed Claude Code session (see example_session): not
# tasks of the data set (tasks.py names no function sum_two, upto, pints or hello), one per kind
EXAMPLES = (
    {"name": "sum_two", "body": "def sum_two(p, q):\n    return p - q\n", "old": "p - q", "new": "p + q",
     "assertion": "assert sum_two(2, 3) == 5"},
    {"name": "upto", "body": "def upto(j):\n    return list(range(1, j))\n", "old": "range(1, j)",
     "new": "range(1, j + 1)", "assertion": "assert upto(3) == [1, 2, 3]"},
    {"name": "pints", "body": "def pints(gallons):\n    return gallons * 6\n", "old": "6", "new": "8",
     "assertion": "assert pints(2) == 16"},
    {"name": "hello", "body": 'def hello(name):\n    return "Bye, " + name\n', "old": "Bye",
     "new": "Hello", "assertion": "assert hello('Ann') == 'Hello, Ann'"},
)  # fmt: skip
SESSION_ID = "c0d1e000-0000-4000-8000-00000000e7a1"  # the example session's id (--resume takes it)


def example_session(
    workdir: str, examples: tuple[dict[str, Any], ...] = EXAMPLES, hint: bool = False
) -> dict[str, str]:
    """A Claude Code session file in which each example is already solved: the task, the Bash call
    with its fix, the tool's result, ``Done.``. ``claude --resume SESSION_ID -p TASK`` then sends the
    examples as earlier turns before the task (what makes a small model copy the call's format)."""
    lines: list[dict[str, Any]] = []
    parent: str | None = None
    common = {"isSidechain": False, "userType": "external", "cwd": workdir, "sessionId": SESSION_ID,
              "version": "2.1.332", "timestamp": "2026-01-01T00:00:00.000Z"}  # fmt: skip

    def add(kind: str, message: dict[str, Any]) -> None:
        nonlocal parent
        uid = f"00000000-0000-4000-8000-{len(lines) + 1:012d}"
        lines.append({"parentUuid": parent, "type": kind, "message": message, "uuid": uid, **common})
        parent = uid

    for i, ex in enumerate(examples):
        tool_id = f"toolu_example{i}"
        add("user", {"role": "user", "content": statement(ex, hint)})
        call = {"type": "tool_use", "id": tool_id, "name": "Bash", "input": {"command": fix_command(ex)}}
        add("assistant", {"id": f"msg_example{i}a", "type": "message", "role": "assistant", "model": "smollm2",
                          "content": [call], "stop_reason": "tool_use", "stop_sequence": None})  # fmt: skip
        result = {"tool_use_id": tool_id, "type": "tool_result", "content": "(Bash completed with no output)",
                  "is_error": False}  # fmt: skip
        add("user", {"role": "user", "content": [result]})
        add("assistant", {"id": f"msg_example{i}b", "type": "message", "role": "assistant", "model": "smollm2",
                          "content": [{"type": "text", "text": "Done."}], "stop_reason": "end_turn",
                          "stop_sequence": None})  # fmt: skip
    slug = re.sub(r"[^A-Za-z0-9]", "-", workdir)
    return {f".claude/projects/{slug}/{SESSION_ID}.jsonl": "".join(json.dumps(x) + "\n" for x in lines)}


# The ways of running a harness that measure.py compares; the agent uses HARNESS (below).
HARNESS_OPTIONS: dict[str, dict[str, Any]] = {
    "codex": {"harness": "codex", "args": [], "env": {}},
    "opencode": {"harness": "opencode", "args": [], "env": {}},
    "claude": {"harness": "claude", "args": [], "env": {}},
    "claude-bash": {"harness": "claude", "args": ["--tools", "Bash"], "env": {}},
    "claude-trimmed": {
        "harness": "claude",
        "args": ["--system-prompt", SYSTEM_PROMPT, "--disable-slash-commands", "--tools", "Bash"],
        "env": {},
    },
    "claude-bare": {"harness": "claude", "args": ["--bare"], "env": {}},
    "claude-trimmed-bare": {
        "harness": "claude",
        "args": [
            "--bare",
            "--max-turns",
            "2",
            "--system-prompt",
            SYSTEM_PROMPT,
            "--disable-slash-commands",
            "--tools",
            "Bash",
        ],
        "env": {},
    },
    "claude-trimmed-bare-examples": {
        "harness": "claude",
        "args": [
            "--bare",
            "--max-turns",
            "2",
            "--system-prompt",
            SYSTEM_PROMPT,
            "--disable-slash-commands",
            "--tools",
            "Bash",
            "--resume",
            SESSION_ID,
        ],
        "env": {},
        "home_files": example_session,
    },
}
HARNESS = "claude-trimmed-bare-examples"


async def fix_repo(
    task: dict[str, Any], llm: al.LLM, *, option: str = HARNESS, timeout_s: float = 480.0
) -> float:
    """One attempt: the task's repository in a fresh sandbox, the harness on its statement, then the test."""
    spec = HARNESS_OPTIONS[option]
    with tempfile.TemporaryDirectory(prefix="coding-task-") as tmp:
        result = await al.harness.run(
            spec["harness"], task["prompt"], llm, workspace=write_repo(task, Path(tmp) / "repo"),
            check=check_command(task), timeout_s=timeout_s, args=spec["args"], env=spec["env"],
            home_files=_home_files(spec, task),
        )  # fmt: skip
    if result.run.timed_out:
        # not the model's failure: an overloaded machine or a slow engine. Failing the attempt keeps it out
        # of training (counted as rollout/failed) instead of teaching the model that its answer scored 0
        raise HarnessTimeoutError(
            f"{spec['harness']} ran past its deadline of {timeout_s:.0f} s on {task.get('name', 'a task')!r} "
            f"after {result.run.usage.wall_s:.0f} s: the engine is too slow for this timeout (an overloaded CPU?); "
            "raise timeout_s or lower the concurrency"
        )
    return 1.0 if result.check is not None and result.check.exit_code == 0 else 0.0


class HarnessTimeoutError(TimeoutError):
    """A harness session ran past its deadline: the attempt fails rather than scoring 0."""


def _home_files(spec: dict[str, Any], task: dict[str, Any]) -> Any:
    files = spec.get("home_files")
    if files is example_session:  # the examples are stated as the task is (with or without the hint)
        return functools.partial(example_session, hint=bool(task.get("hint")))
    return files


@al.rollout
async def agent(task: dict[str, Any], llm: al.LLM) -> float:
    return await fix_repo(task, llm)
