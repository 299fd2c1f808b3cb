"""The proxy works unchanged with the openai client (sync, async, streaming) and records each call."""

from __future__ import annotations

from typing import Any

import anyio
import openai
import pytest

from agentloop.client import async_openai_client, openai_client
from agentloop.context import RolloutContext, current_rollout
from agentloop.errors import RolloutContextError
from agentloop.resources import LLM
from agentloop.store.memory import MemoryStore
from agentloop.types import LLMCall
from tests.proxy.conftest import attempt_url, new_attempt, running_proxy
from tests.proxy.engines import EchoEngine

MESSAGES = [{"role": "user", "content": "Say something."}]


async def test_async_client_records_exact_tokens(tokenizer: Any, oai: Any) -> None:
    engine, store = EchoEngine(tokenizer), MemoryStore()
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        client = oai(attempt_url(proxy, att))
        with anyio.fail_after(20):
            resp = await client.chat.completions.create(
                model="m", messages=MESSAGES, seed=7, temperature=0.5, max_tokens=50,
                extra_body={"return_token_ids": True},
            )  # fmt: skip
    out = engine.calls[0].output
    assert out is not None
    assert resp.choices[0].message.content == engine.text_for([], engine.calls[0].sampling)
    assert resp.choices[0].finish_reason == "stop"
    assert resp.model_extra is not None and resp.model_extra["token_ids"] == out.token_ids
    assert resp.model_extra["prompt_token_ids"] == engine.calls[0].prompt_ids
    assert resp.usage is not None and resp.usage.completion_tokens == len(out.token_ids)
    spans = await store.query_spans(att.rollout_id)
    assert len(spans) == 1
    call = spans[0].payload
    assert isinstance(call, LLMCall)
    assert call.prompt_ids == engine.calls[0].prompt_ids
    assert tokenizer.decode(call.prompt_ids).endswith(
        "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert call.response_ids == out.token_ids and call.response_ids[-1] == tokenizer.eos_token_id
    assert call.response_logprobs == out.logprobs
    assert call.messages == MESSAGES and call.model == "m" and call.weights_version == 3
    assert call.sampling["seed"] == 7 and call.sampling["temperature"] == 0.5
    assert tokenizer.eos_token_id in call.sampling["stop_token_ids"]
    assert call.response_message == {"role": "assistant", "content": resp.choices[0].message.content}
    assert call.latency_s is not None and call.latency_s >= 0 and call.ledger_break is None


async def test_streaming_gives_the_same_tokens_and_text(tokenizer: Any, oai: Any) -> None:
    # multi-byte words (日本, 🙂, é) span several tokens: the stream must hold partial bytes back
    engine, store = EchoEngine(tokenizer, reply=lambda p, s: "日本 🙂 été naïve 🙂🙂 done"), MemoryStore()
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        client = oai(attempt_url(proxy, att))
        with anyio.fail_after(20):
            full = await client.chat.completions.create(
                model="m", messages=MESSAGES, seed=3, extra_body={"return_token_ids": True}
            )
            stream = await client.chat.completions.create(
                model="m", messages=MESSAGES, seed=3, stream=True, logprobs=True,
                stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
            )  # fmt: skip
            chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [t for c in chunks for t in (c.model_extra or {}).get("token_ids", [])]
    assert text == full.choices[0].message.content == "日本 🙂 été naïve 🙂🙂 done"
    assert all("\ufffd" not in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert full.model_extra is not None and ids == full.model_extra["token_ids"]
    assert (
        chunks[0].model_extra is not None
        and chunks[0].model_extra["prompt_token_ids"] == full.model_extra["prompt_token_ids"]
    )
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(ids)
    lp = [
        e.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert lp == full.model_extra["logprobs"]
    spans = await store.query_spans(att.rollout_id)
    assert [s.payload.response_ids for s in spans] == [ids, ids]  # type: ignore[union-attr]


async def test_sync_client_and_completions_and_models(tokenizer: Any) -> None:
    engine, store = EchoEngine(tokenizer), MemoryStore()
    async with running_proxy(engine, store, model_name="tiny") as proxy:
        att = await new_attempt(store)
        url = attempt_url(proxy, att)

        def sync_calls() -> tuple[Any, Any, Any, Any]:
            with openai.OpenAI(base_url=url, api_key="x", max_retries=0) as client:
                chat = client.chat.completions.create(model="m", messages=MESSAGES, seed=1)
                comp = client.completions.create(
                    model="m", prompt="Once upon", max_tokens=3, seed=1, logprobs=1
                )
                comp_ids = client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=50, seed=1)
                streamed = "".join(c.choices[0].text for c in client.completions.create(
                    model="m", prompt=[1, 2, 3], max_tokens=50, seed=1, stream=True) if c.choices)  # fmt: skip
                assert streamed == comp_ids.choices[0].text
                with_lp = client.chat.completions.create(model="m", messages=MESSAGES, seed=1, logprobs=True)
                assert with_lp.choices[0].logprobs is not None and with_lp.choices[0].logprobs.content
                lps = [e.logprob for e in with_lp.choices[0].logprobs.content]
                assert lps == engine.calls[-1].output.logprobs  # type: ignore[union-attr]
                return chat, comp, comp_ids, client.models.list()

        with anyio.fail_after(30):
            chat, comp, comp_ids, models = await anyio.to_thread.run_sync(sync_calls)
    assert chat.choices[0].message.content
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 3
    assert comp.choices[0].logprobs.token_logprobs == engine.calls[1].output.logprobs  # type: ignore[union-attr]
    assert engine.calls[1].prompt_ids == tokenizer.encode("Once upon", add_special_tokens=False)
    assert engine.calls[2].prompt_ids == [1, 2, 3] and comp_ids.choices[0].finish_reason == "stop"
    assert [m.id for m in models.data] == ["tiny"]
    spans = await store.query_spans(att.rollout_id)
    assert len(spans) == 5 and spans[2].payload.prompt_ids == [1, 2, 3]  # type: ignore[union-attr]


async def test_openai_client_helpers_use_the_rollout_context(tokenizer: Any) -> None:
    engine, store = EchoEngine(tokenizer), MemoryStore()
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        llm = proxy.as_resource("m").resolve(att)
        token = current_rollout.set(RolloutContext(rollout=att, store=store, llm=llm))
        try:
            client = async_openai_client(max_retries=0)
            assert str(client.base_url).rstrip("/") == attempt_url(proxy, att)
            with anyio.fail_after(20):
                await client.chat.completions.create(model="m", messages=MESSAGES)
            await client.close()
            with openai_client(proxy.as_resource("m")) as sync:  # a ProxyLLM resolves against the context
                assert str(sync.base_url).rstrip("/") == attempt_url(proxy, att)
        finally:
            current_rollout.reset(token)
    assert len(await store.query_spans(att.rollout_id)) == 1
    with pytest.raises(RolloutContextError, match="inside a rollout"):
        openai_client()
    with pytest.raises(RolloutContextError, match="ProxyLLM outside a rollout"):
        async_openai_client(proxy.as_resource("m"))
    with openai_client(LLM(base_url="http://127.0.0.1:1/v1", model="m")) as plain:
        assert str(plain.base_url).startswith("http://127.0.0.1:1/v1")
    with pytest.raises(TypeError, match=r"al\.LLM"):
        openai_client("http://x")  # type: ignore[arg-type]


async def test_sessions_record_calls_and_take_a_reward(tokenizer: Any, oai: Any) -> None:
    engine = EchoEngine(tokenizer)
    async with running_proxy(engine) as proxy:
        client = oai(proxy.session_base_url)
        with anyio.fail_after(20):
            raw = await client.chat.completions.with_raw_response.create(
                model=proxy.model_name, messages=MESSAGES
            )
            sid = raw.headers["x-session-id"]
            first = raw.parse()
            follow = [*MESSAGES, {"role": "assistant", "content": first.choices[0].message.content},
                      {"role": "user", "content": "more"}]  # fmt: skip
            await client.chat.completions.create(
                model=proxy.model_name, messages=follow, extra_headers={"X-Session-Id": sid}
            )
            http = client._client  # the httpx client the openai client uses
            ok = await http.post(f"{proxy.session_base_url}/sessions/{sid}/reward", json={"value": 1.5})
            missing = await http.post(
                f"{proxy.session_base_url}/sessions/se-nope/reward", json={"value": 1.0}
            )
            bad = await http.post(f"{proxy.session_base_url}/sessions/{sid}/reward", json={"value": "high"})
            got = await http.get(f"{proxy.session_base_url}/sessions/{sid}")
    assert sid.startswith("se-") and ok.status_code == 200 and ok.json()["num_calls"] == 2
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "value"
    rec = proxy.sessions.get(sid)
    assert rec is not None and [r.value for r in rec.rewards] == [1.5]
    one, two = rec.calls
    assert two.prompt_ids[: len(one.prompt_ids) + len(one.response_ids)] == one.prompt_ids + one.response_ids
    assert two.ledger_break is None
    assert got.json()["calls"][1]["prompt_ids"] == two.prompt_ids


@pytest.mark.parametrize("enforce", [False, True])
async def test_an_enforced_resource_sampling_wins_over_the_request(
    tokenizer: Any, oai: Any, enforce: bool
) -> None:
    """The trainer's validation resource (enforce_sampling) is greedy whatever temperature the agent sends;
    a plain resource's sampling is only a default the request overrides."""
    from agentloop.resources import Resources

    engine, store = EchoEngine(tokenizer), MemoryStore()
    async with running_proxy(engine, store) as proxy:
        sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
        resource = proxy.as_resource("m", sampling, enforce_sampling=enforce)
        await store.add_resources(Resources(items={"llm": resource}))
        att = await new_attempt(store)
        client = oai(attempt_url(proxy, att))
        with anyio.fail_after(20):
            await client.chat.completions.create(
                model="m", messages=MESSAGES, seed=4, temperature=0.9, top_p=0.5, max_tokens=8
            )
    used = engine.calls[0].sampling
    assert used.seed == 4  # never enforced
    if enforce:
        assert (used.temperature, used.top_p, used.top_k) == (0.0, 1.0, 0)
    else:
        assert (used.temperature, used.top_p) == (0.9, 0.5)
