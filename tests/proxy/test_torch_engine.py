"""Token fidelity with the real TorchEngine and the tiny model: recorded ids are the engine's ids."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentloop.engine.base import SamplingParams
from agentloop.engine.torch.engine import TorchEngine
from agentloop.store.memory import MemoryStore
from agentloop.types import LLMCall
from tests.proxy.conftest import attempt_url, new_attempt, running_proxy

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a word up",
          "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]  # fmt: skip
# A proxied call and a direct one run the same forward in other shapes (batching, prefix reuse): each
# logit comes out of ~1150 fp32 products summed along the tiny model's path (2 layers x (4 x 64 + T +
# 2 x 64 + 128) + 64 in the head), typical error sqrt(1150) * eps * |logit|, |logit| <= 20 (T = 1.0);
# a log-prob moves by twice that
ENGINE_LOGPROB_ATOL = 2 * 1150**0.5 * 1.19e-7 * 20


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[TorchEngine]:
    eng = TorchEngine(tiny_model_dir, max_context=1024, max_batch_size=4)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


async def test_three_turns_record_exactly_what_the_engine_emitted(engine: TorchEngine, oai: Any) -> None:
    store = MemoryStore()
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        client = oai(attempt_url(proxy, att))
        messages: list[Any] = [{"role": "user", "content": "Look up the word 'cat'."}]
        with anyio.fail_after(60):
            for turn in range(3):
                r = await client.chat.completions.create(
                    model="tiny",
                    messages=messages,
                    tools=TOOLS,
                    seed=100 + turn,
                    temperature=1.0,
                    max_tokens=12,
                )  # type: ignore[arg-type]
                messages.append(r.choices[0].message.model_dump(exclude_none=True))
                if turn == 0:  # the tool result comes back as the tool would answer
                    messages.append(
                        {"role": "tool", "tool_call_id": "call_0", "content": '{"meaning": "a pet"}'}
                    )
                else:
                    messages.append({"role": "user", "content": f"And turn {turn + 2}?"})
    calls: list[LLMCall] = [s.payload for s in await store.query_spans(att.rollout_id)]  # type: ignore[misc]
    assert len(calls) == 3
    for turn, call in enumerate(calls):
        sampling = SamplingParams(**call.sampling)
        assert sampling.seed == 100 + turn and sampling.max_tokens == 12
        direct = await engine.generate(call.prompt_ids, sampling)  # same prompt ids, same seed
        assert call.response_ids == direct.token_ids
        assert call.response_logprobs == pytest.approx(direct.logprobs, abs=ENGINE_LOGPROB_ATOL)
        assert call.ledger_break is None and call.weights_version == engine.weights_version
    for prev, nxt in itertools.pairwise(calls):
        head = prev.prompt_ids + prev.response_ids
        assert nxt.prompt_ids[: len(head)] == head  # turn n+1 starts with turn n's prompt + response ids


async def test_streaming_and_non_streaming_give_the_same_tokens(engine: TorchEngine, oai: Any) -> None:
    store = MemoryStore()
    async with running_proxy(engine, store) as proxy:
        client = oai(attempt_url(proxy, await new_attempt(store)))
        kwargs: Any = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story."}], "seed": 5,
                       "temperature": 0.9, "max_tokens": 16, "extra_body": {"return_token_ids": True}}  # fmt: skip
        with anyio.fail_after(60):
            full = await client.chat.completions.create(**kwargs)
            chunks = [c async for c in await client.chat.completions.create(stream=True, **kwargs)]
    assert full.model_extra is not None
    streamed = [t for c in chunks for t in (c.model_extra or {}).get("token_ids", [])]
    assert streamed == full.model_extra["token_ids"] and len(streamed) > 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content


async def test_a_response_across_an_inflight_update_records_each_tokens_version(
    tiny_model_dir: Path, oai: Any
) -> None:
    """issue 20: the proxy stores which weights sampled each token, and the adapter gives the sample
    its oldest and newest version (the trainer's staleness and mixed-version counts read them)."""
    from agentloop.adapter import triplets_for_rollouts

    eng = TorchEngine(tiny_model_dir, max_context=1024, weight_update_policy="inflight")
    store = MemoryStore()
    name = "model.norm.weight"
    try:
        async with running_proxy(eng, store) as proxy:
            att = await new_attempt(store)
            client = oai(attempt_url(proxy, att))
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(
                        lambda: client.chat.completions.create(
                            model="tiny",
                            messages=[{"role": "user", "content": "Say a lot."}],
                            max_tokens=400,
                            temperature=1.0,
                            seed=1,  # its first 40 tokens hold no end-of-turn token
                        )
                    )
                    while eng.stats().get("generated_tokens", 0) < 3:
                        await anyio.sleep(0.002)
                    await eng.update_weights({name: eng.model.state_dict()[name] * 2})
        await store.update_attempt(att.rollout_id, att.attempt.attempt_id, status="succeeded")
        spans = await store.query_spans(att.rollout_id)
    finally:
        await eng.stop()
    call = next(s.payload for s in spans if isinstance(s.payload, LLMCall))
    versions = call.response_versions
    assert versions is not None and len(versions) == len(call.response_ids)
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    assert call.weights_version == 1
    (t,) = (await triplets_for_rollouts(store, [att.rollout_id])).triplets
    assert (t.metadata["weights_version"], t.metadata["newest_weights_version"]) == (0, 1)
