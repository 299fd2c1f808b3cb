"""ToolAgent through the real proxy, store, runner and adapter (scripted model choices, and the tiny model)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentloop.adapter import merge_turns, triplets_for_rollouts
from agentloop.agent import emit_reward
from agentloop.engine.factory import load_engine
from agentloop.errors import ToolDefinitionError
from agentloop.proxy.server import Proxy
from agentloop.resources import Resources
from agentloop.runner import Runner
from agentloop.store.memory import MemoryStore
from agentloop.tools import function_tool
from agentloop.tools.agent import ToolAgent, task_messages, truncate_text
from agentloop.types import LLMCall, Log, Reward, RolloutStatus, ToolCall
from tests.integrations.scripted import scripted_engine, tool_call_text
from tests.loop_watch import watch_event_loop


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + b


@function_tool
def mul(a: int, b: int) -> tuple[str, float]:
    """Multiply two integers (and reward the use of this tool)."""
    return str(a * b), 0.25


@function_tool
def boom(x: int) -> str:
    """Always fails."""
    raise RuntimeError("kaboom")


def exact(task: dict[str, Any], answer: str | None) -> float:
    return float(answer is not None and answer.strip().endswith(task["answer"]))


async def run_agent(
    agent: Any, engine: Any, tasks: list[Any], concurrency: int = 2
) -> tuple[MemoryStore, list[str]]:
    """Store + proxy + runner: run every task once and return the store and rollout ids."""
    store = MemoryStore()
    async with Proxy(engine, store) as proxy:
        await store.add_resources(Resources(items={"llm": proxy.as_resource("m", {"max_tokens": 256})}))
        ids = [(await store.enqueue_rollout(t)).rollout_id for t in tasks]
        with anyio.fail_after(60):
            await Runner(agent, store, concurrency=concurrency, poll_interval=0.01).run(
                max_rollouts=len(tasks)
            )
    return store, ids


# ---------------------------------------------------------------- pure helpers


@pytest.mark.parametrize(
    ("side", "expected"),
    [
        ("right", "abcd... [truncated 6 chars] ..."),
        ("left", "... [truncated 6 chars] ...ghij"),
        ("middle", "ab... [truncated 6 chars] ...ij"),
    ],
)
def test_truncate_text_sides(side: Any, expected: str) -> None:
    assert truncate_text("abcdefghij", 4, side) == expected
    assert truncate_text("abc", 4, side) == "abc"
    assert truncate_text("abcdefghij", None, side) == "abcdefghij"


def test_truncate_rejects_unknown_side() -> None:
    with pytest.raises(ValueError, match="'left', 'right' or 'middle'"):
        truncate_text("abc", 1, "top")  # type: ignore[arg-type]


def test_task_forms() -> None:
    assert task_messages("hi") == [{"role": "user", "content": "hi"}]
    assert task_messages({"question": "q", "answer": "1"}, "sys") == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
    ]
    msgs = [{"role": "system", "content": "own"}, {"role": "user", "content": "p"}]
    assert task_messages({"messages": msgs}, "sys") == msgs
    assert task_messages({"prompt": "p"}) == [{"role": "user", "content": "p"}]
    with pytest.raises(ValueError, match="'question' / 'prompt'"):
        task_messages({"q": 1})
    with pytest.raises(ValueError, match="non-empty list of chat messages"):
        task_messages({"messages": []})


def test_constructor_validates() -> None:
    with pytest.raises(TypeError, match=r"\(task, answer\)"):
        ToolAgent([add], reward_fn=lambda task: 1.0)
    with pytest.raises(ValueError, match="max_turns must be an int >= 1"):
        ToolAgent([add], exact, max_turns=0)
    with pytest.raises(ValueError, match="max_tool_response_chars"):
        ToolAgent([add], exact, max_tool_response_chars=0)
    with pytest.raises(ValueError, match="'left', 'right' or 'middle'"):
        ToolAgent([add], exact, truncate_side="both")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tools must be a ToolRegistry"):
        ToolAgent("add", exact)  # type: ignore[arg-type]
    with pytest.raises(ToolDefinitionError, match="two tools are named 'add'"):
        ToolAgent([add, add], exact)


# ---------------------------------------------------------------- the tool path, scripted


async def test_parallel_tool_calls_rewards_spans_and_masks(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    script = [
        tool_call_text("add", {"a": 2, "b": 3}) + "\n" + tool_call_text("mul", {"a": 4, "b": 5}),
        "The answer is 5",
    ]
    engine = scripted_engine(tok, script)
    agent = ToolAgent([add, mul], exact, system_prompt="Use the tools.")
    store, ids = await run_agent(agent, engine, [{"question": "2+3?", "answer": "5"}])
    rollout = await store.get_rollout(ids[0])
    assert rollout.status is RolloutStatus.SUCCEEDED
    spans = await store.query_spans(ids[0])
    kinds = [s.kind for s in spans]
    assert kinds == ["llm_call", "tool_call", "tool_call", "reward", "llm_call", "log", "reward"]
    tools = [s.payload for s in spans if isinstance(s.payload, ToolCall)]
    assert [(t.name, t.arguments, t.result, t.error) for t in tools] == [
        ("add", {"a": 2, "b": 3}, "5", None),
        ("mul", {"a": 4, "b": 5}, "20", None),
    ]
    rewards = [(s.payload.name, s.payload.value) for s in spans if isinstance(s.payload, Reward)]
    assert rewards == [("tool:mul", 0.25), ("final", 1.0)]
    final_log = spans[5].payload
    assert isinstance(final_log, Log) and final_log.fields["stop_reason"] == "answer"
    assert final_log.fields["tool_calls"] == 2 and final_log.fields["answer"] == "The answer is 5"

    calls = [s.payload for s in spans if isinstance(s.payload, LLMCall)]
    assert calls[1].messages[-2]["content"] == "5" and calls[1].messages[-1]["content"] == "20"
    assert calls[1].ledger_break is None  # the second prompt extends the first: delta tokenization
    result = await triplets_for_rollouts(store, ids)
    assert [t.reward for t in result.triplets] == [1.25, 1.25]  # identical: final + tool reward
    assert [t.response_ids for t in result.triplets] == [c.response_ids for c in calls]
    merged = merge_turns(result.triplets)
    assert len(merged) == 1
    sample = merged[0]
    assert sample.prompt_ids == calls[0].prompt_ids
    n0 = len(calls[0].response_ids)
    observation = calls[1].prompt_ids[len(calls[0].prompt_ids) + n0 :]
    assert sample.response_ids == calls[0].response_ids + observation + calls[1].response_ids
    assert sample.response_mask == [1] * n0 + [0] * len(observation) + [1] * len(calls[1].response_ids)
    masked_text = tok.decode(observation)
    assert "5" in masked_text and "20" in masked_text and "<|im_start|>assistant" in masked_text
    assert tok.decode(calls[0].response_ids).startswith("<tool_call>")


async def test_tool_faults_reach_the_model_as_text(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    script = [
        tool_call_text("nope", {})
        + tool_call_text("add", {"a": "x"})
        + tool_call_text("boom", {"x": 1})
        + tool_call_text("echo", {"text": "y" * 120}),
        "done 0",
    ]

    @function_tool
    def echo(text: str) -> str:
        """Echo the text back."""
        return text

    agent = ToolAgent([add, boom, echo], exact, max_tool_response_chars=80, truncate_side="right")
    store, ids = await run_agent(agent, scripted_engine(tok, script), [{"prompt": "go", "answer": "0"}], 1)
    assert (await store.get_rollout(ids[0])).status is RolloutStatus.SUCCEEDED
    spans = await store.query_spans(ids[0])
    tools = [s.payload for s in spans if isinstance(s.payload, ToolCall)]
    assert [t.error for t in tools] == ["unknown_tool", "invalid_arguments", "tool_exception", None]
    assert "unknown tool 'nope'" in tools[0].result and tools[0].result.startswith("Error:")
    assert "kaboom" in tools[2].result
    assert tools[3].result == "y" * 80 + "... [truncated 40 chars] ..."
    second = [s.payload for s in spans if isinstance(s.payload, LLMCall)][1]
    assert [m["content"] for m in second.messages if m["role"] == "tool"] == [t.result for t in tools]
    assert [s.payload.value for s in spans if isinstance(s.payload, Reward)] == [1.0]


async def test_parallel_calls_run_concurrently(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    started = {"wait": anyio.Event(), "signal": anyio.Event()}

    @function_tool
    async def wait() -> str:
        """Waits until `signal` has run: finishes only when the two calls overlap."""
        started["wait"].set()
        with anyio.move_on_after(5):
            await started["signal"].wait()
            return "overlapped"
        return "sequential"

    @function_tool
    async def signal() -> str:
        """Signals `wait`."""
        await started["wait"].wait()
        started["signal"].set()
        return "sent"

    script = [tool_call_text("wait", {}) + tool_call_text("signal", {}), "ok"]
    agent = ToolAgent([wait, signal], lambda task, answer, messages: float(messages[-2]["content"] == "sent"))
    store, ids = await run_agent(agent, scripted_engine(tok, script), ["go"])
    tools = [s.payload for s in await store.query_spans(ids[0]) if isinstance(s.payload, ToolCall)]
    assert [t.result for t in tools] == ["overlapped", "sent"]


async def test_max_turns_ends_without_answer(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    seen: list[Any] = []

    async def reward(task: Any, answer: str | None, messages: list[dict[str, Any]]) -> float:
        seen.append(answer)
        return 0.0 if answer is None else 1.0

    agent = ToolAgent([add], reward, max_turns=3, parallel_tool_calls=False)
    store, ids = await run_agent(
        agent, scripted_engine(tok, [tool_call_text("add", {"a": 1, "b": 1})]), ["loop"]
    )
    spans = await store.query_spans(ids[0])
    assert sum(s.kind == "llm_call" for s in spans) == 3 and sum(s.kind == "tool_call" for s in spans) == 3
    assert seen == [None]
    log = next(s.payload for s in spans if isinstance(s.payload, Log))
    assert log.fields["stop_reason"] == "max_turns"


# ---------------------------------------------------------------- the real tiny model


async def test_tiny_model_end_to_end_tokens_exact(tiny_model_dir: Path) -> None:
    engine = load_engine(str(tiny_model_dir), device="cpu", max_context=1024)
    await engine.start()
    try:
        agent = ToolAgent(
            [add], exact, max_turns=2, sampling={"max_tokens": 12, "temperature": 1.0, "seed": 3}
        )
        store, ids = await run_agent(agent, engine, [{"question": "1+1?", "answer": "2"}] * 2)
    finally:
        await engine.stop()
    result = await triplets_for_rollouts(store, ids)
    for rid in ids:
        assert (await store.get_rollout(rid)).status is RolloutStatus.SUCCEEDED
    calls = [s.payload for rid in ids for s in await store.query_spans(rid) if isinstance(s.payload, LLMCall)]
    assert calls and len(result.triplets) == len(calls)
    for triplet, call in zip(result.triplets, calls, strict=True):
        assert triplet.prompt_ids == call.prompt_ids and triplet.response_ids == call.response_ids
        assert triplet.response_logprobs == call.response_logprobs and len(call.response_ids) <= 12
        assert json.dumps(call.tools or []).count('"add"') == 1
    for sample in merge_turns(result.triplets):
        assert sample.response_mask is not None and sum(sample.response_mask) >= 1


async def test_a_slow_sync_reward_runs_off_the_event_loop(tiny_model_dir: Path) -> None:
    """issue 16: a sync reward_fn (one that re-runs model output: code, SQL) ran on the event loop,
    stalling every other rollout, proxy request and heartbeat for as long as it took."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    def slow_reward(task: Any, answer: str | None) -> float:
        time.sleep(1.0)  # blocks its thread, holding no lock the loop needs
        emit_reward(0.25, name="inside")  # the attempt's context reaches the worker thread
        return 1.0

    async with watch_event_loop() as gaps:
        store, ids = await run_agent(
            ToolAgent([add], slow_reward), scripted_engine(tok, ["It is 2."]), ["a", "b"]
        )
    assert max(gaps) < 0.5, max(gaps)  # two 1 s rewards ran while the loop kept ticking
    for rid in ids:
        assert (await store.get_rollout(rid)).status is RolloutStatus.SUCCEEDED
        rewards = {
            s.payload.name: s.payload.value
            for s in await store.query_spans(rid)
            if isinstance(s.payload, Reward)
        }
        assert rewards == {"inside": 0.25, "final": 1.0}, rewards
