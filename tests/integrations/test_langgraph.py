"""ChatModel and ReactAgentLoop against the real proxy, store and runner (scripted model choices)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from openai.types.chat import ChatCompletionMessage
from pydantic import BaseModel, Field

from agentloop.adapter import merge_turns, triplets_for_rollouts
from agentloop.agent import rollout
from agentloop.errors import RolloutContextError
from agentloop.proxy.server import Proxy
from agentloop.resources import LLM, Resources
from agentloop.runner import Runner
from agentloop.store.memory import MemoryStore
from agentloop.types import LLMCall, RolloutStatus
from integrations.langgraph import ChatModel, ReactAgentLoop, message_from_openai, small_react_graph
from tests.integrations.scripted import scripted_engine, tool_call_text
from tests.loop_watch import watch_event_loop


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


class Weather(BaseModel):
    """Get the weather of a city."""

    city: str = Field(description="The city name.")


def production_graph(model: Any) -> Any:
    """A graph as one writes it for production: any chat model, bind_tools, a ToolNode."""
    bound = model.bind_tools([multiply])

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await bound.ainvoke(state["messages"])]}

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_node("tools", ToolNode([multiply]))
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", tools_condition, {"tools": "tools", END: END})
    g.add_edge("tools", "agent")
    return g.compile()


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


async def run_rollouts(agent: Any, engine: Any, tasks: list[Any]) -> tuple[MemoryStore, list[str]]:
    store = MemoryStore()
    async with Proxy(engine, store) as proxy:
        await store.add_resources(Resources(items={"llm": proxy.as_resource("m", {"max_tokens": 256})}))
        ids = [(await store.enqueue_rollout(t)).rollout_id for t in tasks]
        with anyio.fail_after(60):
            await Runner(agent, store, concurrency=2, poll_interval=0.01).run(max_rollouts=len(tasks))
    return store, ids


# ---------------------------------------------------------------- ChatModel units


def test_bind_tools_converts_langchain_pydantic_and_functions() -> None:
    def lookup(key: str) -> str:
        """Look a key up.

        Args:
            key: what to look up.
        """
        return key

    model = ChatModel(llm=LLM(base_url="http://127.0.0.1:9/v1", model="m"))
    bound = model.bind_tools([multiply, Weather, lookup], tool_choice="multiply")
    tools = bound.kwargs["tools"]  # type: ignore[attr-defined]
    assert [t["function"]["name"] for t in tools] == ["multiply", "Weather", "lookup"]
    assert tools[0]["function"]["parameters"]["required"] == ["a", "b"]
    assert tools[1]["function"]["parameters"]["properties"]["city"]["description"] == "The city name."
    assert bound.kwargs["tool_choice"] == {"type": "function", "function": {"name": "multiply"}}  # type: ignore[attr-defined]
    assert model.bind_tools([multiply], tool_choice="any").kwargs["tool_choice"] == "required"  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="list of tools"):
        model.bind_tools(multiply)  # type: ignore[arg-type]


def test_unparsable_arguments_become_invalid_tool_calls() -> None:
    raw = ChatCompletionMessage.model_validate(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "multiply", "arguments": '{"a": 2, "b": 3}'},
                },
                {"id": "c2", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 2,'}},
                {"id": "c3", "type": "function", "function": {"name": "multiply", "arguments": "[1, 2]"}},
            ],
        }
    )
    msg = message_from_openai(raw)
    assert msg.tool_calls == [{"name": "multiply", "args": {"a": 2, "b": 3}, "id": "c1", "type": "tool_call"}]
    assert [(c["id"], c["args"]) for c in msg.invalid_tool_calls] == [("c2", '{"a": 2,'), ("c3", "[1, 2]")]
    assert all(c["error"] for c in msg.invalid_tool_calls) and msg.content == ""


def test_chat_model_outside_a_rollout_needs_an_llm() -> None:
    with pytest.raises(RolloutContextError, match="inside a rollout"):
        ChatModel()


# ---------------------------------------------------------------- through the proxy


async def test_sync_and_async_calls_map_tool_calls(tok: Any) -> None:
    engine, store = scripted_engine(tok, [tool_call_text("multiply", {"a": 6, "b": 7})]), MemoryStore()
    async with Proxy(engine, store) as proxy:
        await store.enqueue_rollout({"q": 1})
        att = await store.dequeue_rollout("w")
        assert att is not None
        url = proxy.as_resource().get_base_url(att.rollout_id, att.attempt.attempt_id)
        model = ChatModel(llm=LLM(base_url=url, model="m"), return_token_ids=True).bind_tools([multiply])
        with anyio.fail_after(30):
            amsg = await model.ainvoke([HumanMessage("6*7?")])
            smsg = await anyio.to_thread.run_sync(model.invoke, [HumanMessage("6*7?")])
    for msg in (amsg, smsg):
        assert isinstance(msg, AIMessage) and msg.content == ""
        assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("multiply", {"a": 6, "b": 7})]
        assert msg.usage_metadata is not None and msg.response_metadata["finish_reason"] == "tool_calls"
    calls = [s.payload for s in await store.query_spans(att.rollout_id) if isinstance(s.payload, LLMCall)]
    assert amsg.response_metadata["token_ids"] == calls[0].response_ids
    assert calls[0].tools is not None and calls[0].tools[0]["function"]["name"] == "multiply"


async def test_production_graph_runs_unchanged_and_keeps_tokens(tok: Any) -> None:
    script = [tool_call_text("multiply", {"a": 6, "b": 7}), "It is 42."]
    results: list[Any] = []

    @rollout
    async def agent(task: dict[str, Any], llm: LLM) -> float:
        graph = production_graph(ChatModel())  # bound to this attempt's LLM by the rollout context
        state = await graph.ainvoke({"messages": [("user", task["question"])]})
        results.append(state)
        return float("42" in state["messages"][-1].content)

    store, ids = await run_rollouts(agent, scripted_engine(tok, script), [{"question": "6*7?"}])
    assert (await store.get_rollout(ids[0])).status is RolloutStatus.SUCCEEDED
    messages = results[0]["messages"]
    assert isinstance(messages[2], ToolMessage) and messages[2].content == "42"
    calls = [s.payload for s in await store.query_spans(ids[0]) if isinstance(s.payload, LLMCall)]
    assert len(calls) == 2 and calls[1].ledger_break is None
    merged = merge_turns((await triplets_for_rollouts(store, ids)).triplets)
    assert len(merged) == 1 and merged[0].reward == 1.0
    n0, n1 = len(calls[0].response_ids), len(calls[1].response_ids)
    obs = calls[1].prompt_ids[len(calls[0].prompt_ids) + n0 :]
    assert merged[0].response_ids == calls[0].response_ids + obs + calls[1].response_ids
    assert merged[0].response_mask == [1] * n0 + [0] * len(obs) + [1] * n1
    assert "42" in tok.decode(obs)


class Multiplier(ReactAgentLoop):
    tools = (multiply,)
    system_prompt = "You multiply numbers with the multiply tool."
    max_steps = 6

    def reward(self, task: Any, final_state: Any) -> float:
        return float(task["answer"] in final_state["messages"][-1].content)


async def test_react_agent_loop_is_an_agent(tok: Any) -> None:
    script = [tool_call_text("multiply", {"a": 3, "b": 5}), "The product is 15."]
    store, ids = await run_rollouts(
        Multiplier(), scripted_engine(tok, script), [{"question": "3*5?", "answer": "15"}]
    )
    assert (await store.get_rollout(ids[0])).status is RolloutStatus.SUCCEEDED
    result = await triplets_for_rollouts(store, ids)
    assert [t.reward for t in result.triplets] == [1.0, 1.0]
    calls = [s.payload for s in await store.query_spans(ids[0]) if isinstance(s.payload, LLMCall)]
    assert calls[0].messages[0] == {"role": "system", "content": Multiplier.system_prompt}


async def test_react_agent_loop_stops_at_max_steps(tok: Any) -> None:
    class Looper(Multiplier):
        max_steps = 4

        async def reward(self, task: Any, final_state: Any) -> float:
            return -1.0 if isinstance(final_state["messages"][-1], ToolMessage | AIMessage) else 0.0

    store, ids = await run_rollouts(
        Looper(), scripted_engine(tok, [tool_call_text("multiply", {"a": 1, "b": 1})]), ["go"]
    )
    assert (await store.get_rollout(ids[0])).status is RolloutStatus.SUCCEEDED
    spans = await store.query_spans(ids[0])
    assert sum(s.kind == "llm_call" for s in spans) == 2  # agent, tools, agent, tools: 4 steps
    assert spans[-1].payload.value == -1.0  # type: ignore[union-attr]


async def test_small_react_graph_fallback(tok: Any) -> None:
    class Small(Multiplier):
        def build_graph(self, llm: ChatModel) -> Any:
            return small_react_graph(llm, self.tools, self.system_prompt)

    script = [tool_call_text("multiply", {"a": 2, "b": 9}), "18"]
    store, ids = await run_rollouts(
        Small(), scripted_engine(tok, script), [{"question": "2*9?", "answer": "18"}]
    )
    spans = await store.query_spans(ids[0])
    calls = [s.payload for s in spans if isinstance(s.payload, LLMCall)]
    assert len(calls) == 2 and calls[1].ledger_break is None and calls[0].messages[0]["role"] == "system"
    assert spans[-1].payload.value == 1.0  # type: ignore[union-attr]


async def test_a_sync_reward_runs_off_the_event_loop(tok: Any) -> None:
    """A slow sync reward (re-running model SQL, say) does not stall the loop the other agents share."""
    import threading
    import time

    loop_thread = threading.get_ident()
    seen: list[int] = []

    class SlowReward(Multiplier):
        def reward(self, task: Any, final_state: Any) -> float:
            seen.append(threading.get_ident())
            time.sleep(0.5)  # holds its thread, not the event loop
            return 1.0

    async with watch_event_loop(interval_s=0.01) as gaps:
        script = [tool_call_text("multiply", {"a": 3, "b": 5}), "The product is 15."]
        task = [{"question": "3*5?", "answer": "15"}]
        store, ids = await run_rollouts(SlowReward(), scripted_engine(tok, script), task)
    assert len(gaps) >= 20  # the loop kept ticking through the 0.5 s reward (a stalled loop ticks ~0 then)
    assert (await store.get_rollout(ids[0])).status is RolloutStatus.SUCCEEDED
    assert seen and seen[0] != loop_thread
