"""What TorchEngine's engine thread admits within its KV budget, and the long prompt it prefills a
chunk per step.

The slot cache holds ``rows x capacity`` positions (``_kv.SlotKVCache``); a request may grow to its
``reserve`` (prompt + max_tokens, within max_context). A request is admitted when every running one
at its reserve still fits the budget (``kv_cache_bytes``), prefix-cache entries evicted first;
otherwise it waits. A prompt longer than ``max_prefill_tokens`` (after its prefix-cache hit) is
prefilled one chunk per engine step into a one-row cache of its own, between the running requests'
decode steps, and takes a slot with its first token. ``EngineThread`` inherits these methods.
"""

from __future__ import annotations

import collections
import time

import structlog
import torch

from agentloop.engine.torch._decode import ModelRunner
from agentloop.engine.torch._kv import PrefixCache, SlotKVCache, capacity_for, rows_for
from agentloop.engine.torch._request import Request

log = structlog.get_logger("agentloop.engine.torch.engine")


class KVAdmission:
    """Admission within the KV budget and the chunked long prompt; TorchEngine sets the state."""

    _cache: SlotKVCache
    _prefix: PrefixCache
    _runner: ModelRunner
    _kv_budget: int
    _kv_bytes_per_token: int
    _max_batch: int
    _max_context: int
    _max_prefill_tokens: int
    _running: list[Request]
    _chunking: Request | None
    _weights_version: int
    _stats: collections.Counter[str]
    _timers: dict[str, float]

    def _fail(self, req: Request, exc: BaseException) -> None:
        raise NotImplementedError  # EngineThread's

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        raise NotImplementedError  # EngineThread's

    def _update(self, reqs: list[Request], tokens: list[int], logprobs: list[float]) -> None:
        raise NotImplementedError  # EngineThread's

    def _room_for(self, new: list[Request]) -> bool:
        """Whether the KV cache can hold the running requests and ``new`` at their longest
        (``reserve``, allocated as ``capacity_for`` it), evicting prefix-cache entries to make room.
        A request alone always fits (the engine's max_context fits the budget)."""
        reqs = [*self._running, *self._held_chunking(), *new]
        longest = capacity_for(max(r.reserve for r in reqs), self._max_context)
        slots = rows_for(len(reqs), self._max_batch) * longest * self._kv_bytes_per_token
        if slots > self._kv_budget:
            return not (self._running or self._chunking) and len(new) == 1
        self._prefix.evict_to((self._kv_budget - slots) // self._kv_bytes_per_token)
        return True

    def _held_chunking(self) -> list[Request]:
        return [] if self._chunking is None else [self._chunking]

    def _kv_held(self) -> int:
        """Bytes of KV the slots and the long prompt being prefilled hold (the prefix cache aside)."""
        own = self._chunking.own_cache if self._chunking is not None else None
        return self._cache.nbytes + (own.nbytes if own is not None else 0)

    # ------------------------------------------------------------------ a long prompt, chunk by chunk
    def _start_chunking(self, req: Request) -> None:
        """Take a prompt longer than ``max_prefill_tokens`` (after its prefix-cache hit) out of the
        queue: it is prefilled one chunk per engine step, between the running requests' decode steps,
        into a one-row cache of its own (its slot comes when it has its first token)."""
        n = len(req.prompt_ids)
        own = SlotKVCache(
            self._cache.n_layers, 1, self._cache.n_kv, self._cache.head_dim, self._max_context,
            self._cache.dtype, self._cache.device,
        )  # fmt: skip
        own.fit(1, n + 1, n + 1)
        hit = self._prefix.lookup(req.prompt_ids, own, 0, max_len=n - 1)
        req.own_cache, req.prefilled, req.num_cached = own, hit, hit
        req.prefill_version = self._weights_version
        self._stats["cached_prompt_tokens"] += hit
        self._stats["prefix_cache_hit_tokens"] += hit
        self._stats["prefix_cache_hits"] += int(hit > 0)
        self._stats["chunked_prefills"] += 1
        self._chunking = req

    def _chunk_step(self) -> list[Request]:
        """Prefill the next chunk of the long prompt in progress; once it is done and a slot is free,
        move its keys and values into the slot and sample its first token. Returns it once admitted."""
        req = self._chunking
        if req is None or req.own_cache is None:
            return []
        n = len(req.prompt_ids)
        t0 = time.perf_counter()
        if req.prefilled < n:
            end = min(req.prefilled + self._max_prefill_tokens, n)
            try:
                req.logits = self._runner.prefill_chunk(req.own_cache, req.prompt_ids, req.prefilled, end)
            except Exception as exc:
                log.exception("engine.prefill_failed", request_id=req.request_id)
                self._chunking = None
                self._fail(req, exc)
                return []
            finally:
                self._timers["prefill_s"] += time.perf_counter() - t0
            req.prefilled = end
            if end < n:
                return []
        if len(self._running) >= self._max_batch or req.logits is None:
            return []  # a slot frees when a running request finishes
        own, self._chunking, req.own_cache = req.own_cache, None, None
        req.slot = len(self._running)
        self._running.append(req)
        self._fit_cache()
        self._cache.write(req.slot, own.K[:, 0], own.V[:, 0], n)
        req.kv_len = n
        self._stats["prompt_tokens"] += n
        self._stats["prefill_batches"] += 1
        tokens, logprobs = self._sample([req], req.logits)
        req.logits = None
        self._update([req], tokens, logprobs)
        return [req]

    def _fit_cache(self) -> None:
        """Grow the slot cache (if needed) for every running request's next position."""
        running = self._running
        need = max(max(r.kv_len, len(r.prompt_ids)) + 1 for r in running)
        self._cache.fit(len(running), need, capacity_for(max(r.reserve for r in running), self._max_context))
        self._prefix.evict_to((self._kv_budget - self._kv_held()) // self._kv_bytes_per_token)
