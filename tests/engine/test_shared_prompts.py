"""TorchEngine prefills a prompt once for all the requests of one admission group that repeat it
(GRPO's n samples of a prompt), and their outputs are those of requests run alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anyio

from agentloop.engine.base import SamplingParams
from tests.engine.conftest import make_engine

SAMPLED = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)


async def test_requests_with_the_same_prompt_are_prefilled_once(
    tiny_model_dir: Path, chat_prompt: list[int]
) -> None:
    other = [*chat_prompt[:-4], 300, 301, *chat_prompt[-4:]]
    prompts = [chat_prompt, other, chat_prompt, chat_prompt, other, chat_prompt]
    engine = make_engine("torch", tiny_model_dir, max_batch_size=8)  # AGENTLOOP_TEST_DEVICE picks the device
    reference = make_engine("torch", tiny_model_dir, max_batch_size=8, prefix_cache_entries=0)
    try:
        with anyio.fail_after(60):
            long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            blocker = asyncio.ensure_future(engine.generate([5, 6, 7, 8], long))
            while engine.stats().get("generated_tokens", 0) < 2:
                await asyncio.sleep(0.005)
            # a pending update (drain policy) holds admissions until the blocker ends, so the six
            # requests below are admitted together, as one prefill group
            name = "model.norm.weight"
            update = asyncio.ensure_future(
                engine.update_weights({name: engine.model.state_dict()[name].clone()})
            )
            outs = await asyncio.gather(
                *[engine.generate(p, SAMPLED.model_copy(update={"seed": i})) for i, p in enumerate(prompts)]
            )
            await asyncio.gather(blocker, update)
            alone = [
                await reference.generate(p, SAMPLED.model_copy(update={"seed": i}))
                for i, p in enumerate(prompts)
            ]
    finally:
        await engine.stop()
        await reference.stop()
    stats = engine.stats()
    assert stats["shared_prompt_prefills"] == 4  # chat_prompt x 4 and other x 2: two prompts computed
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    for o, a in zip(outs, alone, strict=True):
        assert max(abs(x - y) for x, y in zip(o.logprobs, a.logprobs, strict=True)) < 1e-4
    assert len({tuple(outs[i].token_ids) for i in (0, 2, 3, 5)}) > 1  # each repeat samples on its own
    assert sorted(o.num_cached_prompt_tokens for o in outs) == [0, 0, *[len(chat_prompt)] * 3, len(other)]
