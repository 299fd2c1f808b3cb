"""The InferenceEngine contract, checked against the tiny model of SmolLM2's shape on CPU fp32."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from agentloop.engine.base import InferenceEngine, SamplingParams
from agentloop.errors import ContextLengthExceededError, EngineError
from tests.engine.conftest import make_engine, policy_logprobs

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _variants(prompt: list[int], n: int) -> list[list[int]]:
    """n distinct prompts of different lengths (so batching really pads)."""
    return [prompt[: len(prompt) - (i % 5)] + [1000 + 7 * i] * (i % 3) for i in range(n)]


async def test_is_an_inference_engine(engine: Any) -> None:
    assert isinstance(engine, InferenceEngine)
    assert engine.max_context == 512
    assert engine.tokenizer.eos_token == "<|im_end|>"
    assert engine.weights_version == 0


async def test_same_seed_same_tokens(engine: Any, chat_prompt: list[int]) -> None:
    sp = SamplingParams(temperature=1.0, top_p=0.95, top_k=40, max_tokens=32, seed=7, ignore_eos=True)
    with anyio.fail_after(30):
        a = await engine.generate(chat_prompt, sp)
        b = await engine.generate(chat_prompt, sp)
        c = await engine.generate(chat_prompt, sp.model_copy(update={"seed": 8}))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 32
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert c.token_ids != a.token_ids


async def test_batched_equals_alone(engine: Any, chat_prompt: list[int]) -> None:
    """Greedy and seeded sampled requests give the same tokens alone or batched. Sampling itself is
    batch-invariant (TorchEngine: Gumbel-max with noise hashed from (seed, step, token)); the
    logits still differ by float noise across batch shapes, which flips a sampled token only when
    two perturbed scores nearly tie (the tiny model's peaked logits make that vanishingly rare)."""
    prompts = _variants(chat_prompt, 12)
    seeded = SamplingParams(temperature=0.8, max_tokens=24, seed=3, ignore_eos=True)
    with anyio.fail_after(60):
        alone = [await engine.generate(p, GREEDY) for p in prompts[:4]]
        alone_sampled = await engine.generate(prompts[5], seeded)
        batched = await asyncio.gather(
            *[engine.generate(p, GREEDY) for p in prompts], engine.generate(prompts[5], seeded)
        )
    assert [o.token_ids for o in batched[:4]] == [o.token_ids for o in alone]
    assert batched[-1].token_ids == alone_sampled.token_ids
    assert engine.stats()["decode_steps"] > 0


async def test_logprobs_match_a_plain_forward(
    engine: Any, engine_kind: str, chat_prompt: list[int], tiny_model_dir: Path
) -> None:
    """Every sampled token's logprob is the sampling policy's (base.py): ``log_softmax(logits / T)``
    of the model's own full forward, raw logits for a greedy request; one batch mixes the three.
    vLLM renormalises a top-k request's logprobs over the top-k set (vllm_engine.py says why)."""
    from transformers import AutoModelForCausalLM

    sp = SamplingParams(temperature=1.3, max_tokens=16, seed=1, ignore_eos=True)
    top_k = SamplingParams(temperature=0.7, top_k=20, max_tokens=16, seed=2, ignore_eos=True)
    with anyio.fail_after(30):
        outs = await asyncio.gather(*[engine.generate(chat_prompt, p) for p in (sp, top_k, GREEDY)])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for params, out in zip((sp, top_k, GREEDY), outs, strict=True):
        renormalised = params.top_k if engine_kind == "vllm" else 0
        ref, tol = policy_logprobs(model, chat_prompt, out.token_ids, params.temperature, renormalised)
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        err = (torch.tensor(out.logprobs) - ref).abs()
        assert bool((err <= tol).all()), (params, err.max(), tol.min())  # tol: see policy_logprobs
    out = outs[0]
    no_lp = await engine.generate(chat_prompt, sp.model_copy(update={"logprobs": False}))
    assert no_lp.logprobs is None and no_lp.token_ids == out.token_ids


async def test_stop_token_ids_and_eos(engine: Any, chat_prompt: list[int]) -> None:
    with anyio.fail_after(30):
        ref = await engine.generate(chat_prompt, GREEDY)
        stop_id = ref.token_ids[5]
        first = ref.token_ids.index(stop_id)
        out = await engine.generate(chat_prompt, GREEDY.model_copy(update={"stop_token_ids": [stop_id]}))
    assert out.finish_reason == "stop"
    assert out.token_ids == ref.token_ids[: first + 1]


async def test_stop_strings(engine: Any, chat_prompt: list[int]) -> None:
    tok = engine.tokenizer
    with anyio.fail_after(30):
        ref = await engine.generate(chat_prompt, GREEDY)
        stop = tok.decode(ref.token_ids[6:8])
        out = await engine.generate(chat_prompt, GREEDY.model_copy(update={"stop": [stop]}))
    assert out.finish_reason == "stop"
    assert stop in tok.decode(out.token_ids)
    assert stop not in tok.decode(out.token_ids[:-1])
    assert out.token_ids == ref.token_ids[: len(out.token_ids)]


async def test_max_tokens_gives_length(engine: Any, chat_prompt: list[int]) -> None:
    with anyio.fail_after(30):
        out = await engine.generate(chat_prompt, GREEDY.model_copy(update={"max_tokens": 5}))
    assert out.finish_reason == "length" and len(out.token_ids) == 5


async def test_abort_and_cancel(engine: Any, chat_prompt: list[int]) -> None:
    long = SamplingParams(temperature=1.0, max_tokens=400, ignore_eos=True)
    with anyio.fail_after(30):
        task = asyncio.ensure_future(engine.generate(chat_prompt, long, request_id="r-abort"))
        while engine.stats().get("generated_tokens", 0) < 3:
            await asyncio.sleep(0.01)
        assert await engine.abort("r-abort") is True
        out = await task
        assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 400
        assert await engine.abort("no-such-request") is False
        # cancelling the awaiting task aborts the request inside the engine
        # cancel as soon as it produces tokens (a fixed sleep let a GPU finish all 400 first)
        before = engine.stats().get("generated_tokens", 0)
        task = asyncio.ensure_future(engine.generate(chat_prompt, long, request_id="r-cancel"))
        while engine.stats().get("generated_tokens", 0) <= before:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while engine.stats()["running"]:
            await asyncio.sleep(0.01)
    assert engine.stats()["finished_abort"] == 2


async def test_update_weights(engine: Any, chat_prompt: list[int]) -> None:
    name = "model.embed_tokens.weight"
    weight = engine.model.state_dict()[name]
    with anyio.fail_after(30):
        before = await engine.generate(chat_prompt, GREEDY)
        version = await engine.update_weights({name: torch.randn_like(weight)})
        after = await engine.generate(chat_prompt, GREEDY)
    assert version == 1 == engine.weights_version == after.weights_version
    assert before.weights_version == 0
    assert after.token_ids != before.token_ids
    assert after.num_cached_prompt_tokens == 0  # the prefix cache was cleared with the old weights
    with pytest.raises(ValueError, match="unknown parameter"):
        await engine.update_weights({"model.nope.weight": weight})
    with pytest.raises(ValueError, match="shape"):
        await engine.update_weights({name: weight[:3]})
    assert engine.weights_version == 1


async def test_update_weights_drains_in_flight_requests(engine: Any, chat_prompt: list[int]) -> None:
    name = "model.norm.weight"
    with anyio.fail_after(30):
        running = asyncio.ensure_future(
            engine.generate(chat_prompt, GREEDY.model_copy(update={"max_tokens": 60}))
        )
        while engine.stats().get("generated_tokens", 0) < 2:
            await asyncio.sleep(0.005)
        version = await engine.update_weights({name: engine.model.state_dict()[name] * 2})
        out = await running
    assert out.finish_reason == "length" and len(out.token_ids) == 60
    assert out.weights_version == 0 and version == 1


async def test_update_weights_abort_policy(tiny_model_dir: Path, chat_prompt: list[int]) -> None:
    eng = make_engine("torch", tiny_model_dir, weight_update_policy="abort")
    assert eng.weight_update_policy == "abort"
    name = "model.norm.weight"
    try:
        with anyio.fail_after(30):
            running = asyncio.ensure_future(
                eng.generate(chat_prompt, SamplingParams(max_tokens=400, ignore_eos=True))
            )
            while eng.stats().get("generated_tokens", 0) < 2:
                await asyncio.sleep(0.005)
            assert await eng.update_weights({name: eng.model.state_dict()[name] * 2}) == 1
            out = await running
        assert out.finish_reason == "abort" and out.weights_version in (0, 1) and len(out.token_ids) < 400
    finally:
        await eng.stop()


async def test_update_weights_inflight_policy(
    engine_kind: str, tiny_model_dir: Path, chat_prompt: list[int]
) -> None:
    """issue 20: the running request goes on with the new weights (TorchEngine: between two decode
    steps; vLLM: aborted, then resumed with the tokens it has), nobody waits for it, and each token
    says which version sampled it."""
    from safetensors.torch import load_file

    eng = make_engine(engine_kind, tiny_model_dir, weight_update_policy="inflight")
    assert eng.weight_update_policy == "inflight"
    sp = SamplingParams(temperature=1.0, max_tokens=300, ignore_eos=True, seed=11)
    name = "model.norm.weight"
    norm = load_file(str(tiny_model_dir / "model.safetensors"))[name]
    try:
        with anyio.fail_after(60):
            ref = await eng.generate(chat_prompt, sp)  # undisturbed, same seed
            running = asyncio.ensure_future(eng.generate(chat_prompt, sp))
            while eng.stats().get("generated_tokens", 0) < len(ref.token_ids) + 3:
                await asyncio.sleep(0.002)
            assert await eng.update_weights({name: norm * 2}) == 1
            assert not running.done()  # "drain" would have waited for it
            out = await running
            follow_up = await eng.generate(chat_prompt + out.token_ids, GREEDY)
    finally:
        await eng.stop()
    assert out.finish_reason == "length" and len(out.token_ids) == 300 and out.weights_version == 1
    versions = out.token_versions
    assert versions is not None and len(versions) == 300 and versions == sorted(versions)
    k = versions.index(1)  # the first token the new weights sampled
    assert 3 <= k < 300
    assert out.token_ids[:k] == ref.token_ids[:k]  # same seed, same weights: same tokens
    assert out.logprobs is not None and ref.logprobs is not None
    assert out.logprobs[:k] == pytest.approx(ref.logprobs[:k], abs=1e-4)
    # logits doubled: the token or its logprob changes from the first new-weights step on
    assert (out.token_ids[k], round(out.logprobs[k], 4)) != (ref.token_ids[k], round(ref.logprobs[k], 4))
    if engine_kind == "torch":  # its keys/values from the old weights never serve a later request
        assert follow_up.num_cached_prompt_tokens == 0
    else:  # a resumed vLLM request recomputed its prompt and tokens on the new weights
        assert follow_up.finish_reason == "length"


async def test_context_length(engine: Any) -> None:
    with pytest.raises(ContextLengthExceededError, match="512"):
        await engine.generate([5] * 512, GREEDY)
    with anyio.fail_after(30):
        out = await engine.generate([5] * 500, GREEDY.model_copy(update={"max_tokens": 100}))
    assert out.finish_reason == "length" and len(out.token_ids) == 12  # 500 + 12 == max_context


@pytest.mark.parametrize(
    "prompt", [[], [-1], [49152], ["a"], [True], "hello", [1.0], None], ids=lambda p: repr(p)[:12]
)
async def test_bad_prompts(engine: Any, prompt: Any) -> None:
    with pytest.raises(ValueError, match="prompt_ids"):
        await engine.generate(prompt, GREEDY)


async def test_bad_sampling_and_ids(engine: Any, chat_prompt: list[int]) -> None:
    with pytest.raises(TypeError, match="SamplingParams"):
        await engine.generate(chat_prompt, 0.5)
    with pytest.raises(ValueError):
        await engine.generate(chat_prompt, {"temperature": -1})
    with pytest.raises(ValueError, match="request_id"):
        await engine.generate(chat_prompt, GREEDY, request_id="")
    with anyio.fail_after(30):
        first = asyncio.ensure_future(engine.generate(chat_prompt, GREEDY, request_id="dup"))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="already in flight"):
            await engine.generate(chat_prompt, GREEDY, request_id="dup")
        assert (await first).finish_reason == "length"


async def test_32_concurrent_requests_all_finish(engine: Any, chat_prompt: list[int]) -> None:
    prompts = _variants(chat_prompt, 32)
    with anyio.fail_after(60):
        outs = await asyncio.gather(
            *[
                engine.generate(p, SamplingParams(max_tokens=8 + i % 9, seed=i, ignore_eos=True))
                for i, p in enumerate(prompts)
            ]
        )
    assert [len(o.token_ids) for o in outs] == [8 + i % 9 for i in range(32)]
    stats = engine.stats()
    assert (
        stats["running"] == 0
        and stats["waiting"] == 0
        and stats["generated_tokens"] >= sum(8 + i % 9 for i in range(32))
    )
    assert stats["mean_decode_batch"] > 1


async def test_prefix_reuse_for_the_next_turn(
    engine: Any, engine_kind: str, chat_prompt: list[int], tiny_model_dir: Path
) -> None:
    with anyio.fail_after(30):
        turn1 = await engine.generate(chat_prompt, GREEDY)
        turn2_prompt = chat_prompt + turn1.token_ids + [198, 1, 4093, 198, 28, 2, 198]
        turn2 = await engine.generate(turn2_prompt, GREEDY)
    assert turn2.num_cached_prompt_tokens == len(chat_prompt) + len(turn1.token_ids) - 1
    fresh = make_engine(engine_kind, tiny_model_dir)
    try:
        with anyio.fail_after(30):
            ref = await fresh.generate(turn2_prompt, GREEDY)
        assert ref.num_cached_prompt_tokens == 0 and ref.token_ids == turn2.token_ids
    finally:
        await fresh.stop()


async def test_a_failing_step_fails_only_its_requests(engine: Any, chat_prompt: list[int]) -> None:
    """A fault inside the model forward (injected with a hook on the input embeddings, which the
    prefill and every decode path call) ends the request with EngineError; the engine keeps serving."""
    poison = 777

    def hook(module: Any, args: Any) -> None:
        if bool((args[0] == poison).any()):
            raise RuntimeError("injected fault")

    handle = engine.model.get_input_embeddings().register_forward_pre_hook(hook)
    try:
        with anyio.fail_after(30):
            with pytest.raises(EngineError, match="injected fault"):
                await engine.generate([*chat_prompt, poison], GREEDY)
        first = (await engine.generate(chat_prompt, GREEDY.model_copy(update={"max_tokens": 1}))).token_ids[0]
        assert first not in chat_prompt
        poison = first  # now the prefill passes and the first decode step (fed `first`) fails
        with anyio.fail_after(30), pytest.raises(EngineError, match="injected fault"):
            await engine.generate(chat_prompt, GREEDY.model_copy(update={"max_tokens": 3}))
    finally:
        handle.remove()
    with anyio.fail_after(30):
        out = await engine.generate(chat_prompt, GREEDY)
    assert out.finish_reason == "length" and engine.stats()["failed"] >= 1
