"""LangChain's own ChatOpenAI, pointed at the proxy, works unchanged and every call keeps exact token ids.

The real Proxy over the real TorchEngine (tiny model, real SmolLM2 tokenizer); nothing in agentloop
is imported by the agent code: it only gets a base URL, as with any OpenAI-compatible server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI

from agentloop.adapter import merge_turns, triplets_for_rollouts
from agentloop.agent import rollout
from agentloop.engine.base import SamplingParams
from agentloop.proxy.server import Proxy
from agentloop.resources import LLM, Resources
from agentloop.runner import Runner
from agentloop.store.memory import MemoryStore
from agentloop.types import LLMCall, RolloutStatus
from tests.engine.conftest import make_engine
from tests.integrations.scripted import scripted_engine, tool_call_text
from tests.proxy.conftest import attempt_url, new_attempt, running_proxy

STORY = "Tell me a story."


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[Any]:
    eng = make_engine("torch", tiny_model_dir, max_context=1024, max_batch_size=4)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


@pytest.fixture
async def chat() -> AsyncIterator[Callable[..., ChatOpenAI]]:
    """Makes ChatOpenAI models (no retries) on their own HTTP clients, closed while the loop still runs."""
    clients: list[tuple[httpx.Client, httpx.AsyncClient]] = []

    def make(base_url: str, **kwargs: Any) -> ChatOpenAI:
        sync, async_ = httpx.Client(), httpx.AsyncClient()
        clients.append((sync, async_))
        kwargs = {"model": "tiny", "seed": 5, "temperature": 0.9, "max_tokens": 16, **kwargs}
        return ChatOpenAI(
            base_url=base_url, api_key="x", max_retries=0, timeout=30,  # type: ignore[arg-type]
            http_client=sync, http_async_client=async_, **kwargs,
        )  # fmt: skip

    yield make
    for sync, async_ in clients:
        sync.close()
        await async_.aclose()


async def llm_calls(store: MemoryStore, rollout_id: str) -> list[LLMCall]:
    return [s.payload for s in await store.query_spans(rollout_id) if isinstance(s.payload, LLMCall)]


async def assert_engine_tokens(engine: Any, call: LLMCall) -> None:
    """The span's response ids are what the engine gives for the span's prompt ids and sampling."""
    direct = await engine.generate(call.prompt_ids, SamplingParams(**call.sampling))
    assert call.response_ids == direct.token_ids
    # the proxied call and the direct one batch and reuse prefixes differently: each logit comes out of ~1150
    # fp32 products summed along the tiny model's path (2 layers x (4 x 64 + T + 2 x 64 + 128) + 64 in the
    # head), typical error sqrt(1150) * eps * |logit|, |logit| <= 20, / T = 0.9; a log-prob moves by twice that
    lp_atol = 2 * 1150**0.5 * 1.19e-7 * 20 / 0.9
    assert call.response_logprobs == pytest.approx(direct.logprobs, abs=lp_atol)


def text_of(engine: Any, call: LLMCall) -> str:
    ids = call.response_ids[:-1] if call.finish_reason == "stop" else call.response_ids  # drop <|im_end|>
    return str(engine.tokenizer.decode(ids))


async def test_invoke_and_ainvoke_record_exact_tokens(engine: Any, chat: Any) -> None:
    store = MemoryStore()
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        model = chat(attempt_url(proxy, att))
        with anyio.fail_after(60):
            amsg = await model.ainvoke([HumanMessage(STORY)])
            smsg = await anyio.to_thread.run_sync(model.invoke, [HumanMessage(STORY)])
            calls = await llm_calls(store, att.rollout_id)
            for call in calls:
                await assert_engine_tokens(engine, call)
    tok = engine.tokenizer
    expected_prompt = list(
        tok.apply_chat_template(
            [{"role": "user", "content": STORY}], add_generation_prompt=True, return_dict=False
        )
    )
    assert len(calls) == 2
    for msg, call in zip((amsg, smsg), calls, strict=True):
        assert isinstance(msg, AIMessage) and msg.content and msg.content == text_of(engine, call)
        assert call.prompt_ids == expected_prompt
        assert call.messages == [{"role": "user", "content": STORY}] and call.tools is None
        assert call.sampling["seed"] == 5 and call.sampling["temperature"] == 0.9
        assert call.sampling["max_tokens"] == 16 and len(call.response_ids) <= 16
        assert call.model == "tiny" and call.weights_version == engine.weights_version
        assert msg.response_metadata["finish_reason"] == call.finish_reason
        assert msg.usage_metadata is not None
        assert msg.usage_metadata["input_tokens"] == len(call.prompt_ids)
        assert msg.usage_metadata["output_tokens"] == len(call.response_ids)
    assert amsg.content == smsg.content and calls[0].response_ids == calls[1].response_ids  # same seed


async def test_stream_and_astream_join_to_the_non_streamed_text(engine: Any, chat: Any) -> None:
    store = MemoryStore()
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        model = chat(attempt_url(proxy, att), stream_usage=True)
        with anyio.fail_after(60):
            full = await model.ainvoke(STORY)
            achunks = [c async for c in model.astream(STORY)]
            schunks = await anyio.to_thread.run_sync(lambda: list(model.stream(STORY)))
    calls = await llm_calls(store, att.rollout_id)
    assert len(calls) == 3 and len(achunks) > 2 and len(schunks) > 2
    for chunks in (achunks, schunks):
        assert all(isinstance(c, AIMessageChunk) for c in chunks)
        assert "".join(str(c.content) for c in chunks) == full.content
        joined = chunks[0]
        for c in chunks[1:]:
            joined = joined + c
        assert joined.usage_metadata is not None
        assert joined.usage_metadata["output_tokens"] == len(calls[0].response_ids)
        assert joined.response_metadata["finish_reason"] == calls[0].finish_reason
    assert calls[1].response_ids == calls[2].response_ids == calls[0].response_ids
    assert calls[1].prompt_ids == calls[2].prompt_ids == calls[0].prompt_ids


async def test_bind_tools_sends_the_tools_and_the_span_records_them(engine: Any, chat: Any) -> None:
    store = MemoryStore()
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        bound = chat(attempt_url(proxy, att)).bind_tools([multiply])
        with anyio.fail_after(60):
            msg = await bound.ainvoke("What is 6 times 7?")
            await chat(attempt_url(proxy, att)).ainvoke("What is 6 times 7?")
            calls = await llm_calls(store, att.rollout_id)
            await assert_engine_tokens(engine, calls[0])
    assert isinstance(
        msg, AIMessage
    )  # a random tiny model rarely writes a tool call; the request is what counts
    with_tools, without = calls
    assert with_tools.tools == [convert_to_openai_tool(multiply)]
    assert without.tools is None
    prompt = engine.tokenizer.decode(with_tools.prompt_ids)
    assert '"name": "multiply"' in prompt and "Multiply two integers." in prompt  # rendered for the model
    assert "multiply" not in engine.tokenizer.decode(without.prompt_ids)
    assert msg.content == text_of(engine, with_tools) or msg.tool_calls


async def test_a_scripted_tool_call_round_trips_and_the_ledger_holds(engine: Any, chat: Any) -> None:
    """ChatOpenAI maps the proxy's tool call to AIMessage.tool_calls and sends it back in the next
    request in a form the ledger recognises: turn 2's prompt starts with turn 1's exact ids."""
    scripted = scripted_engine(engine.tokenizer, [tool_call_text("multiply", {"a": 6, "b": 7}), "It is 42."])
    store = MemoryStore()
    async with running_proxy(scripted, store) as proxy:
        att = await new_attempt(store)
        bound = chat(attempt_url(proxy, att), max_tokens=64).bind_tools([multiply])
        messages: list[Any] = [HumanMessage("What is 6 times 7?")]
        with anyio.fail_after(60):
            first = await bound.ainvoke(messages)
            assert isinstance(first, AIMessage)
            assert [(c["name"], c["args"]) for c in first.tool_calls] == [("multiply", {"a": 6, "b": 7})]
            messages += [first, ToolMessage(str(multiply.invoke(first.tool_calls[0]["args"])),
                                            tool_call_id=first.tool_calls[0]["id"])]  # fmt: skip
            second = await bound.ainvoke(messages)
    assert second.content == "It is 42."
    one, two = await llm_calls(store, att.rollout_id)
    assert one.finish_reason == "tool_calls" and two.ledger_break is None
    head = one.prompt_ids + one.response_ids
    assert two.prompt_ids[: len(head)] == head
    assert "42" in engine.tokenizer.decode(two.prompt_ids[len(head) :])


async def test_inside_a_rollout_the_agent_needs_only_the_base_url(
    engine: Any, chat: Callable[..., ChatOpenAI]
) -> None:
    """A production-style agent (ChatOpenAI built from the rollout's LLM) run by the Runner: two turns,
    one trajectory whose ids are exactly the recorded calls'."""
    seen: list[tuple[AIMessage, AIMessage]] = []

    @rollout
    async def agent(task: dict[str, Any], llm: LLM) -> float:
        # as an agent would build it, on HTTP clients the fixture closes (langchain's default clients
        # are process-wide and would outlive this test's event loop)
        model = chat(llm.base_url, model=llm.model, seed=task["seed"], max_tokens=12, temperature=1.0)
        history: list[Any] = [HumanMessage(task["question"])]
        first = await model.ainvoke(history)
        history += [first, HumanMessage("And then?")]
        second = await model.ainvoke(history)
        seen.append((first, second))  # type: ignore[arg-type]
        return 1.0

    store = MemoryStore()
    async with Proxy(engine, store) as proxy:
        await store.add_resources(Resources(items={"llm": proxy.as_resource("tiny")}))
        ids = [(await store.enqueue_rollout({"question": STORY, "seed": s})).rollout_id for s in (1, 2)]
        with anyio.fail_after(120):
            await Runner(agent, store, concurrency=2, poll_interval=0.01).run(max_rollouts=len(ids))
    assert [(await store.get_rollout(i)).status for i in ids] == [RolloutStatus.SUCCEEDED] * 2
    assert len(seen) == 2
    result = await triplets_for_rollouts(store, ids)
    for rid in ids:
        one, two = await llm_calls(store, rid)
        assert two.ledger_break is None
        head = one.prompt_ids + one.response_ids
        assert two.prompt_ids[: len(head)] == head  # LangChain sent turn 1 back as the model wrote it
        merged = merge_turns([t for t in result.triplets if t.metadata["rollout_id"] == rid])
        assert len(merged) == 1 and merged[0].reward == 1.0
        assert merged[0].prompt_ids == one.prompt_ids
        assert merged[0].response_ids == one.response_ids + two.prompt_ids[len(head) :] + two.response_ids
