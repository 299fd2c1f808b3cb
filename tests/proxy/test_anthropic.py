"""The Anthropic Messages API on the proxy, through the official ``anthropic`` client: tool
conversations record the engine's exact token ids and extend the token ledger, per attempt and per
session, streamed or not; bad input gets a 4xx in Anthropic's error shape."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anthropic
import anyio
import httpx
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from pydantic import TypeAdapter

from agentloop.proxy.server import Proxy
from agentloop.store.memory import MemoryStore
from agentloop.types import LLMCall
from tests.proxy.conftest import attempt_url, new_attempt, running_proxy
from tests.proxy.engines import EchoEngine

TOOLS: Any = [{"name": "calc", "description": "evaluate arithmetic",
               "input_schema": {"type": "object", "properties": {"expr": {"type": "string"}}}}]  # fmt: skip
CALL_TEXT = 'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call>'


def scripted(replies: list[str]) -> Any:
    it = iter(replies)
    return lambda prompt_ids, sampling: next(it)


@pytest.fixture
async def claude() -> AsyncIterator[Callable[..., anthropic.AsyncAnthropic]]:
    """Makes AsyncAnthropic clients (no retries) and closes them while the event loop still runs."""
    clients: list[anthropic.AsyncAnthropic] = []

    def make(base_url: str, **kwargs: Any) -> anthropic.AsyncAnthropic:
        client = anthropic.AsyncAnthropic(base_url=base_url, api_key="x", max_retries=0, **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


async def _ask(client: anthropic.AsyncAnthropic, stream: bool, **kwargs: Any) -> Any:
    if not stream:
        return await client.messages.create(**kwargs)
    async with client.messages.stream(**kwargs) as events:
        return await events.get_final_message()


async def _recorded(proxy: Proxy, store: MemoryStore, where: str, rollout_id: str) -> list[LLMCall]:
    if where == "session":
        rec = proxy.sessions.get("app-7")
        assert rec is not None
        return list(rec.calls)
    return [s.payload for s in await store.query_spans(rollout_id)]  # type: ignore[misc]


@pytest.mark.parametrize("where", ["attempt", "session"])
@pytest.mark.parametrize("stream", [False, True])
async def test_two_turn_tool_conversation_records_exact_tokens(
    tokenizer: Any, claude: Any, stream: bool, where: str
) -> None:
    engine, store = EchoEngine(tokenizer, reply=scripted([CALL_TEXT, "It is 5."])), MemoryStore()
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        base = attempt_url(proxy, att) if where == "attempt" else proxy.session_base_url
        client = claude(base.removesuffix("/v1"), default_headers={"X-Session-Id": "app-7"})
        messages: list[Any] = [{"role": "user", "content": "What is 2+3?"}]
        ask = {"model": proxy.model_name, "max_tokens": 64, "system": "You add.", "tools": TOOLS}
        with anyio.fail_after(30):
            first = await _ask(client, stream, messages=messages, **ask)
            assert first.stop_reason == "tool_use"
            assert [b.type for b in first.content] == ["text", "tool_use"]
            assert first.content[0].text == "Let me compute."
            use = first.content[1]
            assert use.name == "calc" and use.input == {"expr": "2+3"} and use.id.startswith("toolu_")
            messages += [
                {"role": "assistant", "content": first.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]},
            ]
            second = await _ask(client, stream, messages=messages, **ask)
    assert second.stop_reason == "end_turn" and second.content[0].text == "It is 5."
    calls = await _recorded(proxy, store, where, att.rollout_id)
    assert len(calls) == 2
    for call, engine_call, answer in zip(calls, engine.calls, (first, second), strict=True):
        assert engine_call.output is not None
        assert call.prompt_ids == engine_call.prompt_ids and call.response_ids == engine_call.output.token_ids
        assert call.response_logprobs == engine_call.output.logprobs
        assert answer.usage.input_tokens == len(call.prompt_ids)
        assert answer.usage.output_tokens == len(call.response_ids)
        assert call.ledger_break is None and not call.tool_call_parse_error
    one, two = calls
    assert one.response_ids[-1] == tokenizer.eos_token_id
    head = one.prompt_ids + one.response_ids  # the ledger: turn two extends turn one's exact tokens
    assert two.prompt_ids[: len(head)] == head
    assert tokenizer.decode(two.prompt_ids[len(head) :]) == (
        "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "<tools>" in tokenizer.decode(one.prompt_ids) and one.messages[0]["content"] == "You add."
    assert two.messages[-1] == {"role": "tool", "tool_call_id": use.id, "content": "5", "name": "calc"}
    assert one.response_message is not None and one.response_message["content"] == "Let me compute."


async def test_streaming_and_not_give_the_same_tokens_and_text(tokenizer: Any, claude: Any) -> None:
    # multi-byte words (日本, 🙂, é) span several tokens: the stream must hold partial bytes back
    engine = EchoEngine(tokenizer, reply=lambda p, s: "日本 🙂 été naïve 🙂🙂 done STOP never sent")
    store = MemoryStore()
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        client = claude(attempt_url(proxy, att).removesuffix("/v1"))
        ask: Any = {"model": "m", "max_tokens": 64, "stop_sequences": ["STOP", "never"],
                    "messages": [{"role": "user", "content": "Say it."}], "extra_body": {"return_token_ids": True}}  # fmt: skip
        with anyio.fail_after(30):
            full = await client.messages.create(**ask)
            deltas: list[str] = []
            async with client.messages.stream(**ask) as events:
                async for event in events:
                    if event.type == "content_block_delta" and event.delta.type == "text_delta":
                        deltas.append(event.delta.text)
                    if event.type == "message_delta":
                        streamed_ids = (event.model_extra or {})["token_ids"]
                streamed = await events.get_final_message()
    text = "日本 🙂 été naïve 🙂🙂 done "
    assert full.content[0].text == streamed.content[0].text == "".join(deltas) == text
    assert len(deltas) > 1 and all("\ufffd" not in d for d in deltas)
    assert (full.stop_reason, full.stop_sequence) == (streamed.stop_reason, streamed.stop_sequence)
    assert (full.stop_reason, full.stop_sequence) == ("stop_sequence", "STOP")
    assert full.model_extra is not None and full.model_extra["token_ids"] == streamed_ids
    spans = await store.query_spans(att.rollout_id)
    assert [s.payload.response_ids for s in spans] == [streamed_ids, streamed_ids]  # type: ignore[union-attr]
    assert full.usage.output_tokens == streamed.usage.output_tokens == len(streamed_ids)


async def test_max_tokens_and_sampling_reach_the_engine(tokenizer: Any, claude: Any) -> None:
    engine = EchoEngine(tokenizer, reply=lambda p, s: "one two three four five six seven")
    async with running_proxy(engine) as proxy:
        client = claude(proxy.url)
        with anyio.fail_after(30):
            cut = await client.messages.create(
                model=proxy.model_name,
                max_tokens=3,
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    }
                ],
                extra_body={"temperature": 0.5, "top_k": 7},  # the client has no arguments for them
            )
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    used = engine.calls[0].sampling
    assert (used.max_tokens, used.temperature, used.top_k) == (3, 0.5, 7)
    assert tokenizer.decode(engine.calls[0].prompt_ids).endswith(
        "user\na\nb<|im_end|>\n<|im_start|>assistant\n"
    )


OK = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
BAD: list[tuple[Any, str]] = [
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 8, "messages": []}, "messages"),
    (
        {
            "model": "m",
            "max_tokens": 8,
            "messages": [
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}
            ],
        },
        "content must be a string or blocks",
    ),
    (
        {
            "model": "m",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}],
        },
        "prefill",
    ),
    (
        {
            "model": "m",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            "tool_choice": {"type": "tool", "name": "web_search"},
        },
        "names the tool 'web_search', which the request does not offer",
    ),
    (
        {
            "model": "m",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}],
            "tool_choice": {"type": "tool"},
        },
        'needs the tool\'s "name"',
    ),
    (
        {
            "model": "m",
            "max_tokens": 8,
            "messages": [
                {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "calc", "input": {}}]}
            ],
        },
        "tool_use blocks belong in assistant messages",
    ),
    (
        {
            "model": "m",
            "max_tokens": 8,
            "temperature": "0.5",
            "messages": [{"role": "user", "content": "hi"}],
        },
        "temperature",
    ),
    ([1, 2], "must be a JSON object"),
]


async def test_bad_input_gets_a_4xx_in_anthropics_shape(tokenizer: Any, claude: Any) -> None:
    store = MemoryStore()
    async with running_proxy(EchoEngine(tokenizer, max_context=64), store) as proxy:
        att = await new_attempt(store)
        url = attempt_url(proxy, att) + "/messages"
        async with httpx.AsyncClient(timeout=20) as http:
            with anyio.fail_after(30):
                answers = [await http.post(url, json=body) for body, _ in BAD]
                not_json = await http.post(url, content=b"{oops")
                too_long = await http.post(url, json={"model": "m", "max_tokens": 8,
                                                      "messages": [{"role": "user", "content": "word " * 200}]})  # fmt: skip
                unknown = await http.post(f"{proxy.url}/rollout/ro-nope/attempt/at-nope/v1/messages", json=OK)
                wrong_model = await http.post(f"{proxy.session_base_url}/messages", json={
                    "model": "gpt-4o", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        # the official client raises its typed errors from these bodies
        client = claude(proxy.url)
        with anyio.fail_after(30), pytest.raises(anthropic.BadRequestError, match="prefill"):
            await client.messages.create(model=proxy.model_name, max_tokens=8, messages=BAD[4][0]["messages"])
    for (_, needle), answer in zip(BAD, answers, strict=True):
        assert answer.status_code == 400, answer.text
        body = answer.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert needle in body["error"]["message"]
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "invalid_request_error"
    assert too_long.status_code == 400 and "maximum context length" in too_long.json()["error"]["message"]
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    assert (
        wrong_model.status_code == 404 and "'gpt-4o' does not exist" in wrong_model.json()["error"]["message"]
    )
    assert len(await store.query_spans(att.rollout_id)) == 1  # only the over-context call, flagged
    assert (await store.query_spans(att.rollout_id))[0].payload.error == "context_length_exceeded"  # type: ignore[union-attr]


async def test_the_anthropic_client_key_header_is_accepted(tokenizer: Any) -> None:
    async with running_proxy(EchoEngine(tokenizer), api_key="s3cret-key") as proxy:
        ask: Any = {
            "model": proxy.model_name,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}],
        }
        async with (
            anthropic.AsyncAnthropic(base_url=proxy.url, api_key="s3cret-key", max_retries=0) as good,
            anthropic.AsyncAnthropic(base_url=proxy.url, api_key="wrong", max_retries=0) as bad,
        ):
            with anyio.fail_after(30):
                answer = await good.messages.create(**ask)
                with pytest.raises(anthropic.AuthenticationError) as refused:
                    await bad.messages.create(**ask)
    assert answer.content and refused.value.status_code == 401
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


async def test_a_retry_with_the_same_idempotency_key_is_answered_once(tokenizer: Any) -> None:
    async with (
        running_proxy(EchoEngine(tokenizer), model_name="m") as proxy,
        httpx.AsyncClient(timeout=20) as http,
    ):
        headers = {"Idempotency-Key": "k-1", "X-Session-Id": "app-3"}
        with anyio.fail_after(30):
            a, b = [
                (await http.post(f"{proxy.url}/v1/messages", json=OK, headers=headers)).json() for _ in "ab"
            ]
            other = await http.post(f"{proxy.url}/v1/messages", json={**OK, "max_tokens": 9}, headers=headers)
    assert a == b and a["id"].startswith("msg_")
    assert other.status_code == 409 and other.json()["type"] == "error"
    rec = proxy.sessions.get("app-3")
    assert rec is not None and len(rec.calls) == 1


async def test_an_edited_assistant_turn_is_a_flagged_ledger_break(tokenizer: Any, claude: Any) -> None:
    engine, store = EchoEngine(tokenizer, reply=scripted(["Paris.", "Yes."])), MemoryStore()
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        client = claude(attempt_url(proxy, att).removesuffix("/v1"))
        messages: list[Any] = [{"role": "user", "content": "Capital of France?"}]
        with anyio.fail_after(30):
            first = await client.messages.create(model="m", max_tokens=16, messages=messages)
            assert first.content[0].text == "Paris."
            edited = [
                *messages,
                {"role": "assistant", "content": "Lyon."},
                {"role": "user", "content": "Sure?"},
            ]
            await client.messages.create(model="m", max_tokens=16, messages=edited)
    _, two = [s.payload for s in await store.query_spans(att.rollout_id)]
    assert isinstance(two, LLMCall) and two.ledger_break is not None and "differs" in two.ledger_break
    assert two.prompt_ids == engine.calls[1].prompt_ids  # a full render: still the exact prompt sent
    assert tokenizer.decode(two.prompt_ids).endswith(
        "Lyon.<|im_end|>\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n"
    )


THINK_CALL = (
    "<think>Add them.</think>\n\nLet me compute.\n"
    '<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
async def test_thinking_blocks_carry_the_models_exact_thought_back(
    tokenizer: Any, claude: Any, stream: bool
) -> None:
    engine, store = (
        EchoEngine(tokenizer, reply=scripted([THINK_CALL, "<think>Done.</think>It is 5."])),
        MemoryStore(),
    )
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        client = claude(attempt_url(proxy, att).removesuffix("/v1"))
        ask: Any = {"model": "claude-sonnet-4-5", "max_tokens": 64, "tools": TOOLS,
                    "thinking": {"type": "enabled", "budget_tokens": 1024}}  # fmt: skip
        messages: list[Any] = [{"role": "user", "content": "What is 2+3?"}]
        with anyio.fail_after(30):
            first = await _ask(client, stream, messages=messages, **ask)
            messages += [
                {"role": "assistant", "content": first.content},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": first.content[2].id, "content": "5"}],
                },
            ]
            second = await _ask(client, stream, messages=messages, **ask)
    assert [b.type for b in first.content] == ["thinking", "text", "tool_use"]
    assert first.content[0].thinking == "Add them." and first.content[0].signature.startswith(
        "agentloop-reasoning-v1:"
    )
    assert first.content[1].text == "Let me compute." and first.stop_reason == "tool_use"
    assert [b.type for b in second.content] == ["thinking", "text"] and second.content[1].text == "It is 5."
    one, two = [s.payload for s in await store.query_spans(att.rollout_id)]
    assert isinstance(one, LLMCall) and isinstance(two, LLMCall) and two.ledger_break is None
    assert two.prompt_ids[: len(one.prompt_ids) + len(one.response_ids)] == one.prompt_ids + one.response_ids
    assert one.model == "claude-sonnet-4-5"


async def test_claude_code_request_shapes_are_served(tokenizer: Any, claude: Any) -> None:
    engine = EchoEngine(tokenizer, reply=lambda p, s: "Title: adding")
    system: Any = [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
    tools: Any = [{**TOOLS[0], "cache_control": {"type": "ephemeral"}}, {"type": "web_search_20250305",
                  "name": "web_search", "max_uses": 5}]  # fmt: skip
    user: Any = [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?", "cache_control": {"type": "ephemeral"}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}]}]  # fmt: skip
    beta = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14", "X-Session-Id": "cc-1"}
    async with running_proxy(engine) as proxy:
        client = claude(proxy.url, default_headers=beta)
        with anyio.fail_after(30):
            counted = await client.messages.count_tokens(
                model="claude-sonnet-4-5", system=system, tools=tools, messages=user
            )
            answers = [
                await client.messages.create(
                    model=model,
                    max_tokens=16,
                    system=system,
                    tools=tools,
                    messages=user,
                    metadata={"user_id": "u-1"},
                    tool_choice=choice,
                )
                for model, choice in [
                    ("claude-sonnet-4-5", {"type": "auto"}),
                    ("claude-3-5-haiku-20241022", {"type": "any"}),  # the small fast model: served too
                    ("claude-sonnet-4-5", {"type": "tool", "name": "calc"}),
                    ("claude-sonnet-4-5", {"type": "none"}),
                ]
            ]
    rec = proxy.sessions.get("cc-1")
    assert rec is not None and [c.model for c in rec.calls] == [
        "claude-sonnet-4-5", "claude-3-5-haiku-20241022", "claude-sonnet-4-5", "claude-sonnet-4-5"]  # fmt: skip
    assert [a.model for a in answers][1] == "claude-3-5-haiku-20241022"
    assert counted.input_tokens == len(rec.calls[0].prompt_ids)  # a fresh conversation: the same render
    prompts = [tokenizer.decode(c.prompt_ids) for c in engine.calls]
    assert "You are Claude Code." in prompts[0] and "What is in this picture?\n[image omitted]" in prompts[0]
    assert '"name": "calc"' in prompts[0] and "web_search" not in prompts[0]
    assert '"name": "calc"' not in prompts[3]  # tool_choice none: no tools rendered


async def test_every_event_and_message_parses_with_the_anthropic_types(tokenizer: Any) -> None:
    """Strict validation (the client itself parses leniently): a thought, text and a tool call, streamed and not."""
    events_type: Any = TypeAdapter(RawMessageStreamEvent)
    engine = EchoEngine(tokenizer, reply=lambda p, s: THINK_CALL)
    body: Any = {"model": "claude-sonnet-4-5", "max_tokens": 64, "tools": TOOLS, "messages": [{"role": "user", "content": "2+3?"}],
                 "thinking": {"type": "enabled", "budget_tokens": 1024}}  # fmt: skip
    async with running_proxy(engine) as proxy, httpx.AsyncClient(timeout=20) as http:
        with anyio.fail_after(30):
            whole = await http.post(f"{proxy.url}/v1/messages", json=body)
            streamed = await http.post(f"{proxy.url}/v1/messages", json={**body, "stream": True})
            counted = await http.post(f"{proxy.url}/v1/messages/count_tokens", json=body)
    message = Message.model_validate(whole.json())
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    events = []
    for block in streamed.text.strip().split("\n\n"):
        name, data = block.split("\n", 1)
        event = events_type.validate_python(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {event.type}"
        events.append(event)
    assert [e.type for e in events][:2] == ["message_start", "content_block_start"]
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas == ["thinking_delta", "signature_delta", "text_delta", "input_json_delta"]
    assert MessageTokensCount.model_validate(counted.json()).input_tokens == message.usage.input_tokens
