"""Long contexts (issue 43): the model's own context by default, chunked prefill that equals one forward,
attention of a chunk without a mask over the whole context, the KV budget, and the prefix cache's
hit share in the engine's stats."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from agentloop.engine.base import SamplingParams
from agentloop.engine.models import context_limit
from agentloop.engine.torch import _attention
from agentloop.engine.torch._attention import chunk_attention
from agentloop.engine.torch._kv import PrefixCache, SlotKVCache
from agentloop.engine.torch.engine import TorchEngine
from agentloop.errors import ContextLengthExceededError
from tests.engine.conftest import EPS32, policy_logprobs

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _model_with_positions(tiny_model_dir: Path, positions: int) -> tuple[Any, Any]:
    """The tiny model's architecture and weights with ``positions`` positions (RoPE has no table)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    model.config.max_position_embeddings = positions
    return model.float().eval(), AutoTokenizer.from_pretrained(tiny_model_dir)


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (n,), generator=g).tolist()


# ---------------------------------------------------------------- the context limit


def test_the_default_context_is_the_models_own(tiny_model_dir: Path) -> None:
    model, tok = _model_with_positions(tiny_model_dir, 8192)  # SmolLM2's; the engines used to cap at 4096
    engine = TorchEngine(model, tok)
    assert engine.max_context == 8192 == context_limit(model.config)
    assert TorchEngine(tiny_model_dir).max_context == 2048  # the tiny model's config
    assert context_limit({"n_positions": 1024}) == 1024 and context_limit({}) is None


def test_a_context_above_the_models_limit_is_refused(tiny_model_dir: Path) -> None:
    model, tok = _model_with_positions(tiny_model_dir, 8192)
    with pytest.raises(ValueError, match=r"max_context \(8193\) is above the model's limit of 8192"):
        TorchEngine(model, tok, max_context=8193)
    with pytest.raises(ValueError, match="max_context must be an int >= 2"):
        TorchEngine(model, tok, max_context=1)
    assert TorchEngine(model, tok, max_context=1000).max_context == 1000


async def test_a_prompt_over_the_context_is_refused(tiny_model_dir: Path) -> None:
    engine = TorchEngine(tiny_model_dir, max_context=300, max_batch_size=2)
    try:
        with pytest.raises(ContextLengthExceededError, match="prompt has 300 tokens; the context holds 300"):
            await engine.generate(_ids(300, 0), GREEDY)
        out = await engine.generate(_ids(290, 0), GREEDY)  # 290 + 12 > 300: cut at the context
        assert out.finish_reason == "length" and len(out.token_ids) == 10
    finally:
        await engine.stop()


# ---------------------------------------------------------------- the KV budget


def test_nothing_is_preallocated_and_the_budget_bounds_the_context(tiny_model_dir: Path) -> None:
    model, tok = _model_with_positions(tiny_model_dir, 65536)
    engine = TorchEngine(model, tok, max_batch_size=32)
    stats = engine.stats()
    # 2 (K, V) x 2 layers x 2 KV heads x head_dim 16 x 4 bytes (fp32)
    assert stats["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4 == 512
    assert stats["kv_cache_rows"] == 1 and stats["kv_cache_bytes"] == 256 * 512  # one row of 256 positions
    full = 65536 * 512  # the full context of one sequence: 32 MiB
    with pytest.raises(
        ValueError, match=r"max_context: 65536 tokens of KV cache take 32.0 MiB.*lower max_context"
    ):
        TorchEngine(model, tok, max_context=65536, kv_cache_bytes=full - 1)
    capped = TorchEngine(model, tok, kv_cache_bytes=1000 * 512)  # the model's own limit, capped to the budget
    assert capped.max_context == 1000


async def test_requests_over_the_budget_wait_for_room_and_all_finish(tiny_model_dir: Path) -> None:
    """A budget of two full-reserve rows: four requests run two at a time (nothing fails), and the
    cache never holds more than the budget."""
    budget = 2 * 400 * 512
    engine = TorchEngine(tiny_model_dir, max_context=400, max_batch_size=8, kv_cache_bytes=budget)
    seen: list[int] = []
    decode = engine._runner.decode

    def watched(*args: Any, **kwargs: Any) -> Any:
        seen.append(engine._cache.nbytes + engine._prefix.tokens * 512)
        return decode(*args, **kwargs)

    engine._runner.decode = watched  # type: ignore[method-assign]
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)  # reserve 300 + 200 > 400: 400
        outs = await asyncio.gather(*[engine.generate(_ids(300, i), sp) for i in range(4)])
        assert all(o.finish_reason == "length" and len(o.token_ids) == 100 for o in outs)
        stats = engine.stats()
        assert 1.0 < stats["mean_decode_batch"] <= 2.0 and max(seen) <= budget
    finally:
        await engine.stop()


# ---------------------------------------------------------------- chunked prefill


@pytest.mark.parametrize(("p", "q"), [(0, 37), (1, 1), (250, 64), (700, 300)])
@pytest.mark.parametrize("cpu_kernel", [True, False])
def test_chunk_attention_equals_sdpa_with_the_full_mask(
    p: int, q: int, cpu_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New tokens at positions p..p+q-1 over p cached keys and their own, causally: the two-part CPU
    kernel and the full-mask fall-back (the GPU's path) against SDPA over repeated KV heads.

    Each output is a convex combination of value rows (|v| <= ~4.5 here), summed over p + q terms in
    blocks whose order differs between the kernels, plus the merge's 3 roundings: allowed
    ``(3 + sqrt(p + q)) * 8 ulps`` of the largest |v| (measured: under 1 ulp of it)."""
    if not cpu_kernel:
        monkeypatch.setattr(_attention, "_cpu_flash", None)
    g = torch.Generator().manual_seed(p + q)
    query = torch.randn(2, 4, q, 16, generator=g)
    key, value = torch.randn(2, 2, p + q, 16, generator=g), torch.randn(2, 2, p + q, 16, generator=g)
    out = chunk_attention(query, key, value, scaling=0.25)
    full = torch.ones(q, p + q, dtype=torch.bool).tril(p)
    ref = F.scaled_dot_product_attention(
        query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), attn_mask=full, scale=0.25
    )
    tol = (3 + math.sqrt(p + q)) * 8 * EPS32 * float(value.abs().max())
    torch.testing.assert_close(out, ref, atol=tol, rtol=0)


async def test_chunked_prefill_gives_the_tokens_and_logprobs_of_one_forward(
    tiny_model_dir: Path,
) -> None:
    """A 1500-token prompt in one forward and in chunks of 97 (16 forwards, each over the cache and its
    own tokens): the same greedy tokens, and logprobs within the contract's tolerance of the model's
    own full forward (conftest.policy_logprobs: 32 ulps of each position's largest logit) for both."""
    prompt = _ids(1500, 5)
    outs = []
    for chunk in (4096, 97):
        engine = TorchEngine(tiny_model_dir, max_batch_size=2, max_prefill_tokens=chunk)
        try:
            outs.append(await engine.generate(prompt, GREEDY))
            forwards = engine._runner.prefill_forwards
        finally:
            await engine.stop()
        assert forwards == math.ceil(1500 / chunk)
    whole, chunked = outs
    assert chunked.token_ids == whole.token_ids
    ref, tol = policy_logprobs(engine.model, prompt, whole.token_ids, temperature=0.0)
    for out in outs:
        assert out.logprobs is not None
        assert (torch.tensor(out.logprobs) - ref).abs().le(tol).all(), (out.logprobs, ref.tolist(), tol)


# ---------------------------------------------------------------- the prefix cache


async def test_the_prefix_cache_hit_share_is_reported(tiny_model_dir: Path) -> None:
    """A harness re-sends its long system prompt: turn 2 extends turn 1 (served from the cache up to
    turn 1's last token), a new attempt shares the system prompt only."""
    engine = TorchEngine(tiny_model_dir, max_batch_size=2, max_prefill_tokens=256)
    try:
        system = _ids(1200, 1)
        first = system + _ids(40, 2)
        turn1 = await engine.generate(first, GREEDY)
        second = first + turn1.token_ids + _ids(30, 3)
        turn2 = await engine.generate(second, GREEDY)
        other = system + _ids(50, 4)
        attempt2 = await engine.generate(other, GREEDY)
        stats = engine.stats()
    finally:
        await engine.stop()
    assert turn2.num_cached_prompt_tokens == len(first) + len(turn1.token_ids) - 1  # its last token has no KV
    assert attempt2.num_cached_prompt_tokens == len(system)
    hit = turn2.num_cached_prompt_tokens + attempt2.num_cached_prompt_tokens
    assert stats["prefix_cache_hit_tokens"] == hit
    assert stats["prefix_cache_hit_share"] == pytest.approx(hit / (len(first) + len(second) + len(other)))
    # turn 2's entry starts with turn 1's: turn 1's copy was dropped when turn 2's was stored
    assert stats["prefix_cache_entries"] == 2


def test_the_prefix_cache_keeps_one_entry_per_conversation_and_its_room() -> None:
    cache = SlotKVCache(1, 2, 1, 4, 4096, torch.float32, torch.device("cpu"))
    cache.ensure_capacity(3000)
    prefix = PrefixCache(max_entries=8)
    a = _ids(1000, 1)
    prefix.store(a[:400], cache, 0)
    prefix.store(a, cache, 0)  # extends the first: it replaces it
    assert len(prefix) == 1 and prefix.tokens == 1000
    prefix.store(_ids(700, 2), cache, 0, room_tokens=1500)  # 1000 + 700 > 1500: the older entry goes
    assert len(prefix) == 1 and prefix.tokens == 700
    assert prefix.lookup([*a[:500], 1, 2, 3], cache, 1, max_len=10_000) == 0  # evicted
    prefix.store(a, cache, 0, room_tokens=999)  # larger than its room: not kept
    assert prefix.tokens == 700


def test_the_trainer_config_key_sets_the_engines_context() -> None:
    from trainer import TrainerConfig
    from trainer.config._rollout import engine_kwargs

    cfg = TrainerConfig.from_dict({"actor_rollout_ref": {"rollout": {"max_model_len": 1024}}})
    assert engine_kwargs(cfg.actor_rollout_ref.rollout)["max_context"] == 1024
    assert "max_context" not in engine_kwargs(TrainerConfig.from_dict({}).actor_rollout_ref.rollout)


async def test_a_long_prompt_is_prefilled_between_the_running_requests_decode_steps(
    tiny_model_dir: Path,
) -> None:
    """A 1000-token prompt with max_prefill_tokens 100 gets one chunk per engine step while a running
    request goes on decoding; both answer what they answer alone. Aborting a prompt mid-prefill frees
    the engine."""
    engine = TorchEngine(tiny_model_dir, max_batch_size=4, max_prefill_tokens=100)
    events: list[str] = []
    chunk, decode = engine._runner.prefill_chunk, engine._runner.decode

    def chunk_seen(*args: Any, **kwargs: Any) -> Any:
        events.append("chunk")
        return chunk(*args, **kwargs)

    def decode_seen(*args: Any, **kwargs: Any) -> Any:
        events.append("decode")
        return decode(*args, **kwargs)

    engine._runner.prefill_chunk = chunk_seen  # type: ignore[method-assign]
    engine._runner.decode = decode_seen  # type: ignore[method-assign]
    short_sp = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    try:
        short = asyncio.ensure_future(engine.generate(_ids(20, 1), short_sp))
        while "decode" not in events:
            await asyncio.sleep(0.01)
        long = await engine.generate(_ids(1000, 2), GREEDY)
        short_out = await short
        first, last = events.index("chunk"), len(events) - events[::-1].index("chunk")
        assert events.count("chunk") == 10 and "decode" in events[first:last], events
        assert engine.stats()["chunked_prefills"] == 1
        aborted = asyncio.ensure_future(engine.generate(_ids(1500, 3), GREEDY))
        while events.count("chunk") < 12:
            await asyncio.sleep(0.01)
        aborted.cancel()
        with pytest.raises(asyncio.CancelledError):
            await aborted
        assert (await engine.generate(_ids(30, 4), GREEDY)).finish_reason == "length"
        assert engine.stats()["prefilling"] == 0 and engine.stats()["finished_abort"] == 1
    finally:
        await engine.stop()
    alone = TorchEngine(tiny_model_dir, max_batch_size=4, prefix_cache_entries=0)
    try:
        assert (await alone.generate(_ids(1000, 2), GREEDY)).token_ids == long.token_ids
        assert (await alone.generate(_ids(20, 1), short_sp)).token_ids == short_out.token_ids
    finally:
        await alone.stop()


@pytest.mark.parametrize("q", [1, 7])
def test_grouped_attention_without_a_mask_is_causal(q: int) -> None:
    """The model's own forward with no mask (a reference pass outside the engine): causal over the
    positions, for every query head of a KV head (folding them into the length would not be)."""
    from agentloop.engine.torch._attention import grouped_sdpa

    g = torch.Generator().manual_seed(q)
    query = torch.randn(1, 4, q, 16, generator=g)
    key, value = torch.randn(1, 2, q, 16, generator=g), torch.randn(1, 2, q, 16, generator=g)
    out, _ = grouped_sdpa(None, query, key, value, None, scaling=0.25)
    ref = F.scaled_dot_product_attention(
        query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), is_causal=q > 1, scale=0.25
    )
    tol = (3 + math.sqrt(q)) * 8 * EPS32 * float(value.abs().max())  # as in the chunk test above
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=tol, rtol=0)
