"""The OpenAI Responses API on the proxy, through the official ``openai`` client
(``client.responses.create``, streamed and not): function-call conversations record the engine's
exact token ids and extend the token ledger, per attempt and per session; bad input gets a 4xx in
OpenAI's error shape."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import openai
import pytest

from agentloop.proxy.server import Proxy
from agentloop.store.memory import MemoryStore
from agentloop.types import LLMCall
from tests.proxy.conftest import attempt_url, new_attempt, running_proxy
from tests.proxy.engines import EchoEngine

TOOLS: Any = [{"type": "function", "name": "calc", "description": "evaluate arithmetic",
               "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}]  # fmt: skip
CALL_TEXT = 'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call>'


def scripted(replies: list[str]) -> Any:
    it = iter(replies)
    return lambda prompt_ids, sampling: next(it)


async def _ask(client: openai.AsyncOpenAI, stream: bool, **kwargs: Any) -> tuple[Any, list[Any]]:
    """The response (from ``response.completed`` when streamed) and the stream's events."""
    if not stream:
        return await client.responses.create(**kwargs), []
    events = [e async for e in await client.responses.create(stream=True, **kwargs)]
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events[-1].response, events


async def _recorded(proxy: Proxy, store: MemoryStore, where: str, rollout_id: str) -> list[LLMCall]:
    if where == "session":
        rec = proxy.sessions.get("app-9")
        assert rec is not None
        return list(rec.calls)
    return [s.payload for s in await store.query_spans(rollout_id)]  # type: ignore[misc]


@pytest.mark.parametrize("where", ["attempt", "session"])
@pytest.mark.parametrize("stream", [False, True])
async def test_two_turn_function_call_conversation_records_exact_tokens(
    tokenizer: Any, oai: Any, stream: bool, where: str
) -> None:
    engine, store = EchoEngine(tokenizer, reply=scripted([CALL_TEXT, "It is 5."])), MemoryStore()
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        base = attempt_url(proxy, att) if where == "attempt" else proxy.session_base_url
        client = oai(base, default_headers={"X-Session-Id": "app-9"})
        items: list[Any] = [{"role": "user", "content": "What is 2+3?"}]
        ask = {"model": proxy.model_name, "instructions": "You add.", "tools": TOOLS}
        with anyio.fail_after(30):
            first, events = await _ask(client, stream, input=items, **ask)
            assert [o.type for o in first.output] == ["message", "function_call"]
            assert first.output_text == "Let me compute." and first.status == "completed"
            call = first.output[1]
            assert call.name == "calc" and json.loads(call.arguments) == {"expr": "2+3"}
            items += [*first.output, {"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
            second, _ = await _ask(client, stream, input=items, **ask)
    assert second.output_text == "It is 5." and [o.type for o in second.output] == ["message"]
    if stream:
        kinds = [e.type for e in events]
        assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
        assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
        assert done == [call.arguments]
    calls = await _recorded(proxy, store, where, att.rollout_id)
    assert len(calls) == 2
    for rec, engine_call, answer in zip(calls, engine.calls, (first, second), strict=True):
        assert engine_call.output is not None
        assert rec.prompt_ids == engine_call.prompt_ids and rec.response_ids == engine_call.output.token_ids
        assert rec.response_logprobs == engine_call.output.logprobs
        assert answer.usage.input_tokens == len(rec.prompt_ids)
        assert answer.usage.output_tokens == len(rec.response_ids)
        assert rec.ledger_break is None and not rec.tool_call_parse_error
    one, two = calls
    head = one.prompt_ids + one.response_ids  # the ledger: turn two extends turn one's exact tokens
    assert two.prompt_ids[: len(head)] == head
    assert tokenizer.decode(two.prompt_ids[len(head) :]) == (
        "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "<tools>" in tokenizer.decode(one.prompt_ids) and one.messages[0] == {
        "role": "system",
        "content": "You add.",
    }
    assert two.messages[-1] == {"role": "tool", "tool_call_id": call.call_id, "content": "5", "name": "calc"}


async def test_streaming_and_not_give_the_same_tokens_and_text(tokenizer: Any, oai: Any) -> None:
    # multi-byte words (日本, 🙂, é) span several tokens: the stream must hold partial bytes back
    engine, store = EchoEngine(tokenizer, reply=lambda p, s: "日本 🙂 été naïve 🙂🙂 done"), MemoryStore()
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        client = oai(attempt_url(proxy, att))
        ask: Any = {"model": "m", "input": "Say it.", "extra_body": {"return_token_ids": True}}
        with anyio.fail_after(30):
            full, _ = await _ask(client, False, **ask)
            streamed, events = await _ask(client, True, **ask)
            async with client.responses.stream(model="m", input="Say it.") as helper:  # the SDK's accumulator
                accumulated = await helper.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    text = "日本 🙂 été naïve 🙂🙂 done"
    assert full.output_text == streamed.output_text == "".join(deltas) == accumulated.output_text == text
    assert len(deltas) > 1 and all("\ufffd" not in d for d in deltas)
    assert full.model_extra["token_ids"] == streamed.model_extra["token_ids"]
    assert full.model_extra["prompt_token_ids"] == streamed.model_extra["prompt_token_ids"]
    spans = await store.query_spans(att.rollout_id)
    ids = full.model_extra["token_ids"]
    assert [s.payload.response_ids for s in spans] == [ids, ids, ids]  # type: ignore[union-attr]
    assert full.usage.output_tokens == streamed.usage.output_tokens == len(ids)


async def test_max_output_tokens_gives_an_incomplete_response(tokenizer: Any, oai: Any) -> None:
    engine = EchoEngine(tokenizer, reply=lambda p, s: "one two three four five six seven")
    async with running_proxy(engine) as proxy:
        client = oai(proxy.session_base_url)
        with anyio.fail_after(30):
            cut, _ = await _ask(
                client, False, model=proxy.model_name, input="hi", max_output_tokens=3, temperature=0.5
            )
            streamed, events = await _ask(
                client, True, model=proxy.model_name, input="hi", max_output_tokens=3
            )
    assert cut.status == streamed.status == "incomplete" and events[-1].type == "response.incomplete"
    assert cut.incomplete_details is not None and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage is not None and cut.usage.output_tokens == 3
    assert (engine.calls[0].sampling.max_tokens, engine.calls[0].sampling.temperature) == (3, 0.5)


OK: Any = {"model": "m", "input": "hi"}
BAD: list[tuple[Any, str, str | None]] = [
    ({"model": "m"}, "input: Field required", "input"),
    (
        {**OK, "previous_response_id": "resp_1"},
        "Previous response with id 'resp_1' not found",
        "previous_response_id",
    ),
    ({**OK, "conversation": "conv_1"}, "conversation is not supported", "conversation"),
    ({**OK, "background": True}, "background responses are not supported", "background"),
    ({**OK, "tools": [{"type": "function"}]}, "needs a non-empty string 'name'", "tools.0.name"),
    ({**OK, "tools": [{"type": "namespace", "name": "ns"}]}, "needs a list 'tools'", "tools.0.tools"),
    (
        {"model": "m", "input": [{"type": "function_call_output", "call_id": "c"}]},
        "needs 'output'",
        "input.0.output",
    ),
    (
        {"model": "m", "input": [{"role": "user", "content": [{"type": "input_video", "video_url": "x"}]}]},
        "'input_video' are not supported",
        "input.0.content.0",
    ),
    (
        {"model": "m", "input": [{"type": "function_call", "name": "calc", "arguments": "{}"}]},
        "needs 'call_id'",
        "input.0.call_id",
    ),
    (
        {"model": "m", "input": [{"type": "item_reference", "id": "fc_1"}]},
        "names no output item",
        "input.0.id",
    ),
    ({"model": "m", "input": []}, "input is empty", "input"),
    ({**OK, "tool_choice": {"type": "file_search"}}, "forces the tool 'file_search'", "tool_choice"),
    ({**OK, "tool_choice": {"type": "nonsense"}}, "forces the tool 'nonsense'", "tool_choice"),
    ({**OK, "tool_choice": {"name": "calc"}}, "tool_choice must be", "tool_choice"),
    ({**OK, "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
]


async def test_bad_input_gets_a_4xx_in_openais_shape(tokenizer: Any, oai: Any) -> None:
    store = MemoryStore()
    async with running_proxy(EchoEngine(tokenizer, max_context=64), store) as proxy:
        att = await new_attempt(store)
        url = attempt_url(proxy, att) + "/responses"
        async with httpx.AsyncClient(timeout=20) as http:
            with anyio.fail_after(30):
                answers = [await http.post(url, json=body) for body, _, _ in BAD]
                too_long = await http.post(url, json={"model": "m", "input": "word " * 200})
                unknown = await http.post(
                    f"{proxy.url}/rollout/ro-nope/attempt/at-nope/v1/responses", json=OK
                )
        client = oai(proxy.session_base_url)  # the official client raises its typed errors from these bodies
        with anyio.fail_after(30), pytest.raises(openai.BadRequestError, match="resp_1' not found"):
            await client.responses.create(model=proxy.model_name, input="hi", previous_response_id="resp_1")
    for (_, needle, param), answer in zip(BAD, answers, strict=True):
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and needle in error["message"], error
        assert error["param"] == param, error
    assert answers[1].json()["error"]["code"] == "previous_response_not_found"
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    spans = await store.query_spans(att.rollout_id)  # only the over-context call, flagged
    assert [s.payload.error for s in spans] == ["context_length_exceeded"]  # type: ignore[union-attr]


async def test_a_retry_with_the_same_idempotency_key_is_answered_once(tokenizer: Any) -> None:
    async with (
        running_proxy(EchoEngine(tokenizer), model_name="m") as proxy,
        httpx.AsyncClient(timeout=20) as http,
    ):
        headers = {"Idempotency-Key": "k-1", "X-Session-Id": "app-3"}
        with anyio.fail_after(30):
            a, b = [
                (await http.post(f"{proxy.url}/v1/responses", json=OK, headers=headers)).json() for _ in "ab"
            ]
            other = await http.post(f"{proxy.url}/v1/responses", json={**OK, "input": "bye"}, headers=headers)
    assert a == b and a["id"].startswith("resp_")
    assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_key_reused"
    rec = proxy.sessions.get("app-3")
    assert rec is not None and len(rec.calls) == 1
