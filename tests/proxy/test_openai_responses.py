"""The OpenAI Responses API on the proxy, through the official ``openai`` client
(``client.responses.create``, streamed and not): function-call conversations record the engine's
exact token ids and extend the token ledger, per attempt and per session; bad input gets a 4xx in
OpenAI's error shape."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

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


# ---------------------------------------------------------------- what Codex CLI sends

CODEX = json.loads((Path(__file__).parent / "data" / "codex_0_169_requests.json").read_text())
EVENTS: Any = TypeAdapter(ResponseStreamEvent)


async def _stream_strict(http: httpx.AsyncClient, url: str, body: Any) -> tuple[Any, list[Any]]:
    """POST a streamed request as Codex does and validate every event with the openai client's types
    (a wrong field fails here, where the client itself would parse leniently); the final response too."""
    answer = await http.post(url, json={**body, "stream": True})
    assert answer.status_code == 200, answer.text
    events = []
    for block in answer.text.strip().split("\n\n"):
        name, data = block.split("\n", 1)
        event = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {event.type}"
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    Response.model_validate(final.model_dump())
    return final, events


@pytest.mark.parametrize("request_name", ["fallback", "gpt-5.5"])
async def test_codex_requests_are_served(tokenizer: Any, request_name: str) -> None:
    body = CODEX[request_name]
    engine, store = EchoEngine(tokenizer, reply=lambda p, s: "Done.", max_context=32768), MemoryStore()
    async with running_proxy(engine, store) as proxy, httpx.AsyncClient(timeout=30) as http:
        att = await new_attempt(store)
        with anyio.fail_after(30):
            final, _events = await _stream_strict(http, attempt_url(proxy, att) + "/responses", body)
    assert final.status == "completed" and final.output_text == "Done." and final.model == body["model"]
    assert final.store is False and [t.type for t in final.tools] == [t["type"] for t in body["tools"]]
    (call,) = [s.payload for s in await store.query_spans(att.rollout_id)]
    assert isinstance(call, LLMCall)
    prompt = tokenizer.decode(call.prompt_ids)
    assert '"name": "exec_command"' in prompt and "web_search" not in prompt
    if request_name == "fallback":  # a thought, an exec_command call, a namespaced call
        assert '"name": "multi_agent_v1__close_agent"' in prompt
        assert "<think>Let me list files first.</think>" in prompt
        assert [c["function"]["name"] for m in call.messages for c in m.get("tool_calls", [])] == [
            "exec_command",
            "multi_agent_v1__close_agent",
        ]
    else:  # a custom (free-form) apply_patch call and its output
        (patch,) = [
            c
            for m in call.messages
            for c in m.get("tool_calls", [])
            if c["function"]["name"] == "apply_patch"
        ]
        assert json.loads(patch["function"]["arguments"])["input"].startswith("*** Begin Patch")
        assert call.messages[-1]["role"] == "tool" and call.messages[-1]["name"] == "apply_patch"


CODEX_TURNS = [
    '<think>Look around first.</think>\n<tool_call>\n{"name": "multi_agent_v1__close_agent", '
    '"arguments": {"target": "a1"}}\n</tool_call>',
    'Patching.\n<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n'
    '*** Add File: a.txt\\n+hi\\n*** End Patch\\n"}}\n</tool_call>',
    '<tool_call>\n{"name": "local_shell", "arguments": {"command": ["cat", "a.txt"]}}\n</tool_call>',
    '<tool_call>\n{"name": "tool_search", "arguments": {"query": "calendar"}}\n</tool_call>',
    '<tool_call>\n{"name": "calendar__create_event", "arguments": {"title": "standup"}}\n</tool_call>',
    "<think>All done.</think>\n\nCreated a.txt and the event.",
]
FOUND: Any = [{"type": "namespace", "name": "calendar", "description": "Calendar tools.", "tools": [
    {"type": "function", "name": "create_event", "description": "Create an event.",
     "parameters": {"type": "object", "properties": {"title": {"type": "string"}}}}]}]  # fmt: skip


def _codex_output(item: Any) -> Any:
    """What Codex sends after running a call item (its output item)."""
    if item.type == "custom_tool_call":
        return {"type": "custom_tool_call_output", "call_id": item.call_id, "output": "Success."}
    if item.type == "tool_search_call":
        return {"type": "tool_search_output", "call_id": item.call_id, "execution": "client", "status": "completed",
                "tools": FOUND}  # fmt: skip
    return {"type": "function_call_output", "call_id": item.call_id, "output": "ok"}


async def test_a_codex_style_session_keeps_the_exact_tokens_across_every_tool_kind(tokenizer: Any) -> None:
    tools = [
        *CODEX["fallback"]["tools"],
        *(t for t in CODEX["gpt-5.5"]["tools"] if t["type"] in ("custom", "tool_search")),
    ]
    body: Any = {
        **CODEX["fallback"],
        "tools": [*tools, {"type": "local_shell"}, {"type": "image_generation"}],
    }
    items: list[Any] = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Do it."}]}
    ]
    engine, store = EchoEngine(tokenizer, reply=scripted(CODEX_TURNS), max_context=32768), MemoryStore()
    answers = []
    async with running_proxy(engine, store) as proxy, httpx.AsyncClient(timeout=30) as http:
        att = await new_attempt(store)
        with anyio.fail_after(60):
            for _ in CODEX_TURNS:  # the whole conversation every time, store: false (what Codex does)
                final, _events = await _stream_strict(
                    http, attempt_url(proxy, att) + "/responses", {**body, "input": items}
                )
                answers.append(final)
                items += [o.model_dump(exclude_none=True) for o in final.output]
                items += [_codex_output(o) for o in final.output if o.type not in ("message", "reasoning")]
    kinds = [[o.type for o in a.output] for a in answers]
    assert kinds == [["reasoning", "function_call"], ["message", "custom_tool_call"], ["local_shell_call"],
                     ["tool_search_call"], ["function_call"], ["reasoning", "message"]]  # fmt: skip
    close, patch, shell, search, event, last = (a.output[-1] for a in answers)
    assert (close.namespace, close.name, json.loads(close.arguments)) == (
        "multi_agent_v1",
        "close_agent",
        {"target": "a1"},
    )
    assert patch.input == "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"
    assert shell.action.command == ["cat", "a.txt"] and search.arguments == {"query": "calendar"}
    assert (event.namespace, event.name) == ("calendar", "create_event")  # a tool tool_search found
    assert answers[0].output[0].content[0].text == "Look around first." and last.content[0].text.startswith(
        "Created"
    )
    assert answers[0].usage.output_tokens_details.reasoning_tokens > 0
    calls = [s.payload for s in await store.query_spans(att.rollout_id)]
    assert len(calls) == len(CODEX_TURNS)
    for before, after in itertools.pairwise(calls):  # every turn extends the one before, token for token
        assert isinstance(before, LLMCall) and isinstance(after, LLMCall) and after.ledger_break is None
        head = before.prompt_ids + before.response_ids
        assert after.prompt_ids[: len(head)] == head
    for call, engine_call in zip(calls, engine.calls, strict=True):
        assert engine_call.output is not None and call.response_ids == engine_call.output.token_ids  # type: ignore[union-attr]
    found = tokenizer.decode(calls[4].prompt_ids)  # type: ignore[union-attr]
    assert '{"name": "calendar__create_event"' in found and "image_generation" not in found


async def test_previous_response_id_continues_a_kept_response(tokenizer: Any, oai: Any) -> None:
    engine, store = (
        EchoEngine(tokenizer, reply=scripted([CALL_TEXT, "It is 5.", "Hi.", "Hello."])),
        MemoryStore(),
    )
    async with running_proxy(engine, store) as proxy:
        att, other = await new_attempt(store), await new_attempt(store)
        client, elsewhere = oai(attempt_url(proxy, att)), oai(attempt_url(proxy, other))
        ask = {"model": proxy.model_name, "instructions": "You add.", "tools": TOOLS}
        with anyio.fail_after(30):
            first = await client.responses.create(input="What is 2+3?", **ask)
            call = first.output[1]
            second = await client.responses.create(
                previous_response_id=first.id, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                       "output": "5"}], **ask)  # fmt: skip
            unkept = await client.responses.create(model="m", input="hi", store=False)
            with pytest.raises(openai.BadRequestError, match="not found") as not_kept:
                await client.responses.create(model="m", input="again", previous_response_id=unkept.id)
            with pytest.raises(openai.BadRequestError, match="not found"):  # another attempt's response
                await elsewhere.responses.create(model="m", input="x", previous_response_id=first.id)
            by_reference = await client.responses.create(
                model="m", input=[{"role": "user", "content": "2+3?"}, {"type": "item_reference", "id": call.id},
                                  {"type": "function_call_output", "call_id": call.call_id, "output": "5"}])  # fmt: skip
    assert second.output_text == "It is 5." and second.previous_response_id == first.id
    assert not_kept.value.code == "previous_response_not_found" and unkept.store is False
    one, two, *_ = [s.payload for s in await store.query_spans(att.rollout_id)]
    assert isinstance(one, LLMCall) and isinstance(two, LLMCall) and two.ledger_break is None
    assert two.prompt_ids[: len(one.prompt_ids) + len(one.response_ids)] == one.prompt_ids + one.response_ids
    assert [m["role"] for m in two.messages] == ["system", "user", "assistant", "tool"]
    assert by_reference.output_text == "Hello."
    recorded = [s.payload for s in await store.query_spans(att.rollout_id)][-1]
    assert isinstance(recorded, LLMCall) and recorded.messages[1]["tool_calls"][0]["id"] == call.call_id


async def test_hosted_tools_and_media_are_left_out_with_a_placeholder(tokenizer: Any, oai: Any) -> None:
    engine = EchoEngine(tokenizer, reply=lambda p, s: "A cat.")
    async with running_proxy(engine) as proxy:
        client = oai(proxy.session_base_url)
        with anyio.fail_after(30):
            answer = await client.responses.create(
                model=proxy.model_name,
                tools=[
                    *TOOLS,
                    {"type": "web_search"},
                    {"type": "image_generation"},
                    {"type": "file_search", "vector_store_ids": ["vs_1"]},
                ],
                tool_choice={
                    "type": "allowed_tools",
                    "mode": "auto",
                    "tools": [{"type": "function", "name": "calc"}],
                },
                input=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "What is this?"},
                            {"type": "input_image", "image_url": "data:image/png;base64,AA"},
                        ],
                    }
                ],
                reasoning={"effort": "low", "summary": "auto"},
                include=["reasoning.encrypted_content"],
                text={"verbosity": "low"},
            )
    prompt = tokenizer.decode(engine.calls[0].prompt_ids)
    assert (
        answer.output_text == "A cat." and answer.reasoning is not None and answer.reasoning.effort == "low"
    )
    assert "What is this?[image omitted]" in prompt and '"name": "calc"' in prompt
    assert "web_search" not in prompt and "image_generation" not in prompt and "file_search" not in prompt


async def test_codex_session_id_header_keeps_a_served_codex_thread_in_one_session(
    tokenizer: Any, oai: Any
) -> None:
    engine = EchoEngine(tokenizer, reply=scripted(["Hi.", "Bye."]))
    async with running_proxy(engine) as proxy:
        client = oai(proxy.session_base_url, default_headers={"session-id": "01a22592-2d37-7891"})
        items: list[Any] = [{"role": "user", "content": "hello"}]
        with anyio.fail_after(30):
            first = await client.responses.create(model=proxy.model_name, input=items, store=False)
            items += [o.model_dump(exclude_none=True) for o in first.output] + [
                {"role": "user", "content": "bye"}
            ]
            await client.responses.create(model=proxy.model_name, input=items, store=False)
    rec = proxy.sessions.get("01a22592-2d37-7891")
    assert rec is not None and len(rec.calls) == 2 and rec.calls[1].ledger_break is None
    one, two = rec.calls
    assert two.prompt_ids[: len(one.prompt_ids) + len(one.response_ids)] == one.prompt_ids + one.response_ids
