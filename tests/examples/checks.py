"""Checks shared by the example tests: triplets and merged samples agree token for token with the spans."""

from __future__ import annotations

from typing import Any

from agentloop.adapter import merge_turns, triplets_for_rollouts
from agentloop.types import LLMCall


async def check_exact_tokens(store: Any, rollout_ids: list[str]) -> dict[str, int]:
    """Every triplet equals its LLMCall span; merged samples keep model tokens (mask 1) exactly as
    generated and mask (0) only prompt-side tokens. Returns counts for further checks."""
    result = await triplets_for_rollouts(store, rollout_ids)
    calls = [
        s.payload
        for rid in rollout_ids
        for s in await store.query_spans(rid)
        if isinstance(s.payload, LLMCall)
    ]
    usable = [c for c in calls if c.prompt_ids and c.response_ids and not c.error]
    assert len(result.triplets) == len(usable)
    for t, c in zip(result.triplets, usable, strict=True):
        assert t.prompt_ids == c.prompt_ids and t.response_ids == c.response_ids
        assert t.response_logprobs == c.response_logprobs
    samples = merge_turns(result.triplets)
    model_tokens = [
        tok for s in samples for tok, m in zip(s.response_ids, s.response_mask or [], strict=True) if m == 1
    ]
    assert model_tokens == [tok for c in usable for tok in c.response_ids]
    masked = sum(len(s.response_ids) - sum(s.response_mask or []) for s in samples)
    return {"calls": len(usable), "samples": len(samples), "masked": masked}
