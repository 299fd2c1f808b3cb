"""Bad input -> 400 with an OpenAI error body; 401/404/409/413; engine failures -> 503; nothing hangs."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest

from agentloop.errors import EngineError, RequestAbortedError
from agentloop.proxy.tool_parser import parse_tool_calls
from agentloop.store.memory import MemoryStore
from agentloop.types import AttemptStatus, LLMCall, RolloutConfig
from tests.proxy.conftest import attempt_url, new_attempt, running_proxy
from tests.proxy.engines import EchoEngine

OK = [{"role": "user", "content": "hi"}]
BAD_BODIES: list[tuple[Any, str | None]] = [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content.0"),
    ({"messages": OK, "temperature": "hot"}, "temperature"),
    ({"messages": OK, "temperature": -1}, "temperature"),
    ({"messages": OK, "n": 2}, "n"),
    ({"messages": OK, "max_tokens": 0}, "max_tokens"),
    ({"messages": OK, "max_completion_tokens": -5}, "max_completion_tokens"),
    ({"messages": OK, "max_tokens": "10"}, "max_tokens"),
    ({"messages": OK, "stop": [""]}, "stop"),
    ({"messages": OK, "stream": "yes"}, "stream"),
    ({"messages": OK, "tools": [{"type": "function"}]}, "tools.0.function"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]}, "messages.0.tool_calls"),
    (["not", "an", "object"], None),
]  # fmt: skip


async def test_bad_input_matrix_gets_400_with_an_openai_error_body(tokenizer: Any) -> None:
    engine, store = EchoEngine(tokenizer), MemoryStore()
    async with running_proxy(engine, store) as proxy, httpx.AsyncClient(timeout=10) as http:
        url = attempt_url(proxy, await new_attempt(store))
        with anyio.fail_after(30):
            for body, param in BAD_BODIES:
                r = await http.post(f"{url}/chat/completions", json=body)
                assert r.status_code == 400, (body, r.text)
                err = r.json()["error"]
                assert (
                    set(err) == {"message", "type", "param", "code"}
                    and err["type"] == "invalid_request_error"
                )
                assert err["param"] == param, (body, err)
            r = await http.post(
                f"{url}/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
            )
            assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
            for body in (
                {"prompt": [1, 10**9]},
                {"prompt": ["a", "b"]},
                {"prompt": ""},
                {"prompt": "x", "echo": True},
            ):
                r = await http.post(f"{url}/completions", json=body)
                assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (
                    body,
                    r.text,
                )
            r = await http.get(f"{url}/nothing-here")
            assert r.status_code == 404 and "error" in r.json()
    assert engine.calls == []  # nothing bad reached the engine


async def test_unknown_and_stale_attempts_get_404_and_409(tokenizer: Any) -> None:
    engine, store = EchoEngine(tokenizer), MemoryStore()
    async with running_proxy(engine, store) as proxy, httpx.AsyncClient(timeout=10) as http:
        template = proxy.url_template
        await store.enqueue_rollout({"q": 1}, config=RolloutConfig(max_attempts=2))
        first = await store.dequeue_rollout("w")
        assert first is not None
        rid, aid = first.rollout_id, first.attempt.attempt_id
        cases = [
            (template.format(rollout_id="ro-unknown", attempt_id=aid), 404),
            (template.format(rollout_id=rid, attempt_id="at-unknown"), 404),
        ]
        for base, status in cases:
            r = await http.post(f"{base}/chat/completions", json={"messages": OK})
            assert r.status_code == status and r.json()["error"]["type"] == "not_found_error"
        await store.update_attempt(rid, aid, status=AttemptStatus.FAILED)  # requeued: attempt 2 supersedes 1
        r = await http.post(
            f"{template.format(rollout_id=rid, attempt_id=aid)}/chat/completions", json={"messages": OK}
        )
        assert r.status_code == 409 and "failed" in r.json()["error"]["message"]
        second = await store.dequeue_rollout("w")
        assert second is not None
        second_url = template.format(rollout_id=rid, attempt_id=second.attempt.attempt_id)
        assert (await http.post(f"{second_url}/chat/completions", json={"messages": OK})).status_code == 200
        await store.update_attempt(rid, second.attempt.attempt_id, status=AttemptStatus.SUCCEEDED)
        r = await http.post(f"{second_url}/chat/completions", json={"messages": OK})
        assert r.status_code == 409 and r.json()["error"]["code"] == "stale_attempt"
        assert (await http.get(f"{second_url}/models")).status_code == 409
    assert len(engine.calls) == 1


async def test_context_length_exceeded_is_400_and_recorded(tokenizer: Any) -> None:
    engine, store = EchoEngine(tokenizer, max_context=64), MemoryStore()
    async with running_proxy(engine, store) as proxy, httpx.AsyncClient(timeout=10) as http:
        att = await new_attempt(store)
        long = [{"role": "user", "content": "word " * 200}]
        r = await http.post(f"{attempt_url(proxy, att)}/chat/completions", json={"messages": long})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    (span,) = await store.query_spans(att.rollout_id)
    assert isinstance(span.payload, LLMCall) and span.payload.error == "context_length_exceeded"
    assert len(span.payload.prompt_ids) > 64 and span.payload.response_ids == []
    assert engine.calls == []


@pytest.mark.parametrize(
    ("failure", "code"),
    [(EngineError("GPU fell off"), "engine_error"), (RequestAbortedError("weights changed"), "request_aborted"),
     (RuntimeError("bug"), "engine_error")],
)  # fmt: skip
async def test_engine_failures_are_503(tokenizer: Any, failure: BaseException, code: str) -> None:
    engine, store = EchoEngine(tokenizer, fail_with=failure), MemoryStore()
    async with running_proxy(engine, store) as proxy, httpx.AsyncClient(timeout=10) as http:
        att = await new_attempt(store)
        r = await http.post(
            f"{attempt_url(proxy, att)}/chat/completions", json={"messages": OK, "stream": True}
        )
    assert r.status_code == 503 and r.json()["error"]["code"] == code
    assert await store.query_spans(att.rollout_id) == []


async def test_a_hanging_engine_times_out_with_503_and_is_aborted(tokenizer: Any) -> None:
    engine, store = EchoEngine(tokenizer, delay_s=30), MemoryStore()
    async with (
        running_proxy(engine, store, engine_timeout_s=0.3) as proxy,
        httpx.AsyncClient(timeout=10) as http,
    ):
        att = await new_attempt(store)
        with anyio.fail_after(5):
            r = await http.post(f"{attempt_url(proxy, att)}/chat/completions", json={"messages": OK})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_timeout"
    assert len(engine.aborted) == 1


class HangingStore(MemoryStore):
    """A store that stops answering one kind of call (a store server that hangs)."""

    def __init__(self, hang: str) -> None:
        super().__init__()
        self.hang = hang

    async def get_rollout_attempt(self, rollout_id: str, attempt_id: str) -> Any:
        if self.hang == "get_rollout_attempt":
            await anyio.sleep_forever()
        return await super().get_rollout_attempt(rollout_id, attempt_id)

    async def add_span(self, span: Any) -> Any:
        if self.hang == "add_span":
            await anyio.sleep_forever()
        return await super().add_span(span)


@pytest.mark.parametrize("hang", ["get_rollout_attempt", "add_span"])
async def test_a_hanging_store_times_out_with_503(tokenizer: Any, hang: str) -> None:
    engine, store = EchoEngine(tokenizer), HangingStore(hang)
    async with running_proxy(engine, store, store_timeout_s=0.3) as proxy:
        att = await new_attempt(store)
        async with httpx.AsyncClient(timeout=10) as client:
            with anyio.fail_after(10):
                r = await client.post(attempt_url(proxy, att) + "/chat/completions", json={"messages": OK})
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert (
        error["type"] == "store_error" and "did not answer" in error["message"] and "0.3s" in error["message"]
    )
    # no generation for an unchecked attempt
    assert len(engine.calls) == (0 if hang == "get_rollout_attempt" else 1)


async def test_auth_and_body_limit(tokenizer: Any) -> None:
    engine, store = EchoEngine(tokenizer), MemoryStore()
    async with running_proxy(engine, store, api_key="s3cret", max_body_bytes=4096) as proxy:
        url = attempt_url(proxy, await new_attempt(store))
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.post(f"{url}/chat/completions", json={"messages": OK})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            r = await http.post(
                f"{url}/chat/completions", json={"messages": OK}, headers={"Authorization": "Bearer nope"}
            )
            assert r.status_code == 401
            assert (await http.get(f"{url}/models")).status_code == 401
            auth = {"Authorization": "Bearer s3cret"}
            big = {"messages": [{"role": "user", "content": "x" * 10_000}]}
            r = await http.post(f"{url}/chat/completions", json=big, headers=auth)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

            async def chunked() -> Any:  # no content-length: the limit holds while reading
                for _ in range(10):
                    yield b" " * 1000

            r = await http.post(f"{url}/chat/completions", content=chunked(), headers=auth)
            assert r.status_code == 413
            r = await http.post(f"{url}/chat/completions", json={"messages": OK}, headers=auth)
            assert r.status_code == 200
        assert proxy.as_resource("m").api_key == "s3cret"


def test_tool_call_parsing_good_and_malformed() -> None:
    good = parse_tool_calls('Let me check.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "1+1"}}\n</tool_call>'
                            '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>')  # fmt: skip
    assert good.error is None and good.content == "Let me check."
    assert [c["function"]["name"] for c in good.tool_calls] == ["calc", "now"]
    assert good.tool_calls[0]["function"]["arguments"] == '{"expr": "1+1"}' and good.tool_calls[0][
        "id"
    ].startswith("call_")
    assert len({c["id"] for c in good.tool_calls}) == 2
    plain = parse_tool_calls("no calls here")
    assert plain.content == "no calls here" and plain.tool_calls == [] and plain.error is None
    for bad in ('<tool_call>{"name": "calc", "arguments": {</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
                '<tool_call>{"name": "calc"}', '<tool_call>["calc"]</tool_call>',
                '<tool_call>{"name": "f", "arguments": 3}</tool_call>'):  # fmt: skip
        out = parse_tool_calls(bad)
        assert out.error is not None and out.content == bad and out.tool_calls == [], bad


async def test_a_malformed_tool_call_stays_text_and_is_flagged(tokenizer: Any) -> None:
    bad = '<tool_call>{"name": "calc", "arguments": {"expr": </tool_call>'
    engine, store = EchoEngine(tokenizer, reply=lambda p, s: bad), MemoryStore()
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    async with running_proxy(engine, store) as proxy, httpx.AsyncClient(timeout=10) as http:
        att = await new_attempt(store)
        r = await http.post(
            f"{attempt_url(proxy, att)}/chat/completions",
            json={"messages": OK, "tools": tools},
            headers={"X-Return-Token-Ids": "true"},  # the header asks for the ids like return_token_ids does
        )
    choice = r.json()["choices"][0]
    assert r.json()["token_ids"] == engine.calls[0].output.token_ids  # type: ignore[union-attr]
    assert (
        r.status_code == 200 and choice["message"]["content"] == bad and "tool_calls" not in choice["message"]
    )
    assert choice["finish_reason"] == "stop"
    (span,) = await store.query_spans(att.rollout_id)
    assert isinstance(span.payload, LLMCall) and span.payload.tool_call_parse_error
