"""Proxy lifecycle (task group / start-stop / context manager), argument checks, template fast paths."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest

from agentloop.engine.base import SamplingParams, TokenOutput
from agentloop.proxy.chat import ChatTemplate
from agentloop.proxy.server import Proxy, ProxyState
from agentloop.store.memory import MemoryStore
from tests.proxy.conftest import attempt_url, new_attempt, running_proxy
from tests.proxy.engines import EchoEngine


async def test_serve_in_a_task_group_and_stop(tokenizer: Any) -> None:
    store = MemoryStore()
    proxy = Proxy(EchoEngine(tokenizer), store)
    with pytest.raises(RuntimeError, match="start"):
        _ = proxy.url
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            url = await tg.start(proxy.serve)
            assert url == proxy.url and proxy.state is ProxyState.RUNNING and proxy.port > 0
            assert proxy.url_template == f"{url}/rollout/{{rollout_id}}/attempt/{{attempt_id}}/v1"
            async with httpx.AsyncClient() as http:
                assert (await http.get(f"{url}/health")).json() == {"status": "ok"}
                r = await http.put(f"{url}/v1/chat/completions")
                assert r.status_code == 405 and "error" in r.json()
            await proxy.stop()
    assert proxy.state is ProxyState.STOPPED
    with pytest.raises(RuntimeError, match="starts once"):
        await proxy.serve()


async def test_context_manager_and_resource(tokenizer: Any) -> None:
    store = MemoryStore()
    async with Proxy(EchoEngine(tokenizer), store, model_name="tiny") as proxy:
        res = proxy.as_resource(sampling={"temperature": 0.0})
        assert res.model == "tiny" and res.url_template == proxy.url_template
        att = await new_attempt(store)
        assert res.resolve(att).base_url == attempt_url(proxy, att)
    with httpx.Client() as http, pytest.raises(httpx.ConnectError):
        http.get(f"{proxy.url}/health")


def test_constructor_checks_its_arguments(tokenizer: Any) -> None:
    engine, store = EchoEngine(tokenizer), MemoryStore()
    for kwargs, match in [({"port": 70000}, "port"), ({"max_body_bytes": 10}, "max_body_bytes"),
                          ({"engine_timeout_s": 0}, "timeouts"), ({"default_max_tokens": 0}, "default_max_tokens")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            Proxy(engine, store, **kwargs)
    with pytest.raises(TypeError, match="InferenceEngine"):
        Proxy(object(), store)  # type: ignore[arg-type]


async def test_llm_resource_sampling_defaults_apply_under_the_request(tokenizer: Any) -> None:
    engine, store = EchoEngine(tokenizer), MemoryStore()
    async with running_proxy(engine, store) as proxy, httpx.AsyncClient(timeout=10) as http:
        from agentloop.resources import Resources

        await store.add_resources(
            Resources(items={"llm": proxy.as_resource(sampling={"temperature": 0.2, "top_p": 0.5})})
        )
        url = attempt_url(proxy, await new_attempt(store))
        ok = {"messages": [{"role": "user", "content": "hi"}]}
        assert (
            await http.post(f"{url}/chat/completions", json={**ok, "temperature": 0.7})
        ).status_code == 200
    sampling: SamplingParams = engine.calls[0].sampling
    assert sampling.temperature == 0.7 and sampling.top_p == 0.5 and sampling.logprobs


async def test_bad_engine_output_is_503_not_500(tokenizer: Any) -> None:
    class OutOfVocab(EchoEngine):
        async def generate(
            self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None
        ) -> TokenOutput:
            return TokenOutput(token_ids=[10**9], logprobs=[0.0], finish_reason="stop")

    store = MemoryStore()
    async with running_proxy(OutOfVocab(tokenizer), store) as proxy, httpx.AsyncClient(timeout=10) as http:
        att = await new_attempt(store)
        r = await http.post(
            f"{attempt_url(proxy, att)}/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}]},
        )
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    assert await store.query_spans(att.rollout_id) == []


def test_template_encode_fast_path_matches_the_tokenizer(tokenizer: Any) -> None:
    template = ChatTemplate(tokenizer)
    msgs = [{"role": "user", "content": "héllo <tool_call> 日本 🙂"}, {"role": "assistant", "content": "ok"}]
    text = template.render(msgs, None, add_generation_prompt=True)
    assert text == tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert template.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    tricky = ["a<|im_end|>b", " <|im_end|> \n x", "<|im_start|><|im_start|>", "  lead\t<|endoftext|>trail  ",
              "<tool_call>{\"a\": 1}</tool_call>", "x" * 9000 + "<|im_end|>", "", "<|im_end", "日本🙂<|im_start|>é"]  # fmt: skip
    for piece_text in tricky * 2:  # the second round reads the piece cache
        assert template.encode(piece_text) == tokenizer.encode(piece_text, add_special_tokens=False), (
            piece_text
        )
    assert template.stop_token_ids[0] == tokenizer.eos_token_id


def test_the_proxy_raises_the_open_file_limit() -> None:
    """A low soft limit on open files (1024 is common) would stop the proxy accepting agents'
    connections at a few hundred agents a step; serving raises it to the hard limit."""
    import resource

    from agentloop.http_server import raise_open_file_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 256 if hard == resource.RLIM_INFINITY else min(256, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        now = raise_open_file_limit()
        expected = 1 << 16 if hard == resource.RLIM_INFINITY else min(hard, 1 << 16)
        assert now == expected == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert raise_open_file_limit() == expected  # idempotent
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
