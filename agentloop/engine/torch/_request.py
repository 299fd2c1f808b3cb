"""A generate call as TorchEngine's engine thread holds it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch

from agentloop.engine.base import SamplingParams, TokenOutput
from agentloop.engine.torch._kv import SlotKVCache


@dataclass(eq=False)
class Request:
    """One generate call as the engine thread holds it."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future[TokenOutput]
    loop: asyncio.AbstractEventLoop
    seed: int
    end_ids: frozenset[int]
    reserve: int = 0  # most positions it may hold: min(prompt + max_tokens, max_context)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the weights version that sampled each token
    prefill_version: int = -1  # the weights version that wrote the prompt's keys/values
    kv_len: int = 0  # tokens whose keys/values are in the cache
    # a long prompt prefilled a chunk per engine step (EngineThread._chunk_step) goes into a cache of
    # its own first: its first ``prefilled`` tokens are there; ``logits`` are its last chunk's
    own_cache: SlotKVCache | None = None
    prefilled: int = 0
    logits: torch.Tensor | None = None
    slot: int = -1
    num_cached: int = 0
    added_at: float = field(default_factory=time.monotonic)
    warned: bool = False
    finished: bool = False  # the engine thread answered it (the loop may not have run the answer yet)
