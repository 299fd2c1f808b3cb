"""TorchEngine's forward passes: prefill (one long prompt in chunks, or a left-padded group of short
ones) and a static decode step.

The decode step reads its per-row inputs (last token, position, sampling settings and the row's
noise key) from preallocated device buffers filled with ONE host->device copy per kind (ints,
floats), runs one forward over slots ``0..B-1`` with a mask built on device from the positions,
samples the whole batch (agentloop.engine.torch._sampling) and returns ``(2, B)`` (token, logprob), read
back with ONE device->host copy. With ``cuda_graphs`` the step is captured per
``(batch bucket, kv-length bucket, sampling mode)`` and replayed, so a step costs one graph
launch instead of hundreds of kernel launches; padded rows write only into free slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog
import torch

from agentloop.engine.capture import graph_capture
from agentloop.engine.torch import _fused_sampling
from agentloop.engine.torch._attention import CHUNK_KW, cudnn_attention
from agentloop.engine.torch._cpu_decode import CpuDecoder, supports
from agentloop.engine.torch._kv import SlotKVCache
from agentloop.engine.torch._sampling import SampleMode, sample

log = structlog.get_logger(__name__)

DecodeRow = tuple[int, int, int, int, float, float]  # last token, position, top_k, noise key, temp, top_p
GraphKey = tuple[int, int, SampleMode, bool]  # batch bucket, kv-length bucket, sampling mode, greedy rows
_MIN_KV_BUCKET = 256


def _pow2_at_least(n: int, floor: int = 1) -> int:
    b = floor
    while b < n:
        b *= 2
    return b


def _batch_buckets(max_batch: int) -> list[int]:
    """Every batch size a decode step pads to (``min(_pow2_at_least(n), max_batch)``), largest first."""
    buckets, b = {max_batch}, 1
    while b < max_batch:
        buckets.add(b)
        b *= 2
    return sorted(buckets, reverse=True)


class ModelRunner:
    """Runs prefill and decode forwards of ``model`` over ``cache`` (see module docstring)."""

    def __init__(
        self, model: Any, cache: SlotKVCache, cache_kw: str, max_batch: int, max_context: int,
        device: torch.device, cuda_graphs: bool, cpu_decoder: bool = True, idle_capture: bool = True,
        chunk_attention: bool = False,
    ) -> None:  # fmt: skip
        self._model, self._cache, self._cache_kw = model, cache, cache_kw
        # the model attends through _attention.grouped_sdpa: a prefill chunk passes only its own mask
        self.chunk_attention = chunk_attention
        self.prefill_forwards = 0
        self._device = device
        self._max_batch = max_batch
        self.static_sampling = device.type == "cuda"  # no host sync inside a step: top-p by radix select
        self.cuda_graphs = bool(cuda_graphs) and self.static_sampling
        self.fused_sampling = _fused_sampling.available(device)  # greedy / plain modes in one kernel
        self.graph_shapes = self.cuda_graphs  # bucketed shapes; tests set it on CPU to check the padding
        self._ints = torch.zeros(4, max_batch, dtype=torch.long, device=device)  # ids, positions, top_k, key
        self._floats = torch.zeros(2, max_batch, dtype=torch.float32, device=device)  # temperature, top_p
        self._arange = torch.arange(max_context + 1, device=device)
        self._graphs: dict[GraphKey, tuple[Any, torch.Tensor]] = {}
        self._batch_buckets = _batch_buckets(max_batch)
        # (kv-length bucket, sampling mode, greedy rows) of every graph captured: the engine captures
        # their other batch buckets while idle (capture_missing), and again after the cache grew
        self._graph_kinds: set[tuple[int, SampleMode, bool]] = set()
        self._largest_batch = 0  # the largest batch bucket a step has captured or replayed
        self.idle_capture = idle_capture  # capture_missing may capture; off after a failed idle capture
        self._graph_generation = cache.generation
        self._pool: Any = None
        self._checked = False
        self.decoder: CpuDecoder | None = None  # the hand-written CPU decode step (_cpu_decode.py)
        if cpu_decoder and device.type == "cpu" and supports(model):
            self.decoder = CpuDecoder(model, cache, rows=max_batch)
        self.captures = 0
        self.idle_captures = 0  # of the captures, those made while the engine was idle
        self.replays = 0

    # ------------------------------------------------------------------ prefill
    def prefill(
        self,
        first_slot: int,
        prompts: Sequence[list[int]],
        cached: Sequence[int],
        chunk_tokens: int | None = None,
    ) -> torch.Tensor:
        """Prefill ``prompts[i][cached[i]:]`` into slots ``first_slot + i``; returns the last real
        position's logits ``(m, V)`` fp32. One prompt goes in chunks of at most ``chunk_tokens``
        (:meth:`_prefill_chunk`); several go in one left-padded forward (:meth:`_prefill_group`)."""
        self._cache.ensure_rows(first_slot + len(prompts))
        if len(prompts) > 1:
            return self._prefill_group(first_slot, prompts, cached)
        prompt, start = prompts[0], cached[0]
        step = max(1, chunk_tokens or len(prompt))
        while True:
            end = min(start + step, len(prompt))
            logits = self._prefill_chunk(first_slot, prompt, start, end)
            if end == len(prompt):
                return logits
            start = end

    def prefill_chunk(self, cache: SlotKVCache, prompt: list[int], start: int, end: int) -> torch.Tensor:
        """:meth:`_prefill_chunk` into row 0 of another cache (a long prompt's own, while the slot cache
        serves the running requests' decode steps)."""
        cache.ensure_rows(1)
        return self._prefill_chunk(0, prompt, start, end, cache)

    def _prefill_chunk(
        self, slot: int, prompt: list[int], start: int, end: int, cache: SlotKVCache | None = None
    ) -> torch.Tensor:
        """One forward of ``prompt[start:end]`` into ``slot``, attending to its first ``start``
        positions (already in the cache) and causally among the new tokens; the last one's logits
        ``(1, V)``. With the engine's attention (``chunk_attention``) there is no mask; otherwise it
        is the full ``(1, 1, q, end)``."""
        q = end - start
        ids_t = torch.tensor(prompt[start:end], dtype=torch.long).view(1, q).to(self._device)
        pos_t = self._arange[start:end].view(1, q)
        cache = cache or self._cache
        cache.set_prefill(slot, pos_t, end)
        extra: dict[str, Any] = {}
        if self.chunk_attention:  # a placeholder: _attention.CHUNK_KW says why
            mask = torch.zeros(1, 1, q, 0, dtype=torch.bool, device=self._device)
            extra[CHUNK_KW] = True
        else:
            mask = self._additive((self._arange[:end][None, :] <= pos_t[0][:, None])[None, None])
        out = self._model(input_ids=ids_t, position_ids=pos_t, attention_mask=mask, use_cache=True,
                          logits_to_keep=1, **{self._cache_kw: cache}, **extra)  # fmt: skip
        self.prefill_forwards += 1
        return out.logits[:, -1].float()

    def _prefill_group(
        self, first_slot: int, prompts: Sequence[list[int]], cached: Sequence[int]
    ) -> torch.Tensor:
        """One forward over ``prompts[i][cached[i]:]`` (left-padded) into slots ``first_slot + i``.
        Padding queries write only at positions ``>= len(prompt)`` of their own slot, which no real
        query attends to."""
        m = len(prompts)
        q = max(len(p) - c for p, c in zip(prompts, cached, strict=True))
        cap = self._cache.capacity
        ids: list[int] = []
        pos: list[int] = []
        for p, c in zip(prompts, cached, strict=True):
            pad = q - (len(p) - c)
            ids += [0] * pad + p[c:]
            pos += [min(len(p) + i, cap - 1) for i in range(pad)] + list(range(c, len(p)))
        ids_t = torch.tensor(ids, dtype=torch.long).view(m, q).to(self._device)
        pos_t = torch.tensor(pos, dtype=torch.long).view(m, q).to(self._device)
        kv_len = max(len(p) for p in prompts)
        self._cache.set_prefill(first_slot, pos_t, kv_len)
        mask = self._additive(
            (self._arange[:kv_len][None, None, :] <= pos_t[:, :, None])[:, None]
        )  # (m, 1, q, kv)
        out = self._model(input_ids=ids_t, position_ids=pos_t, attention_mask=mask, use_cache=True,
                          logits_to_keep=1, **{self._cache_kw: self._cache})  # fmt: skip
        self.prefill_forwards += 1
        return out.logits[:, -1].float()

    def _additive(self, mask: torch.Tensor) -> torch.Tensor:
        """A boolean mask as SDPA takes it best here: on a CPU additive in the model's dtype, made
        once per forward (SDPA would convert a boolean one in every layer); on a GPU as it is."""
        if self._device.type != "cpu":
            return mask
        return torch.zeros(mask.shape, dtype=self._cache.dtype).masked_fill_(~mask, float("-inf"))

    # ------------------------------------------------------------------ decode
    def decode(
        self, rows: Sequence[DecodeRow], mode: SampleMode, greedy_rows: bool
    ) -> tuple[list[int], list[float]]:
        """One decode step for slots ``0..len(rows)-1``; returns sampled ids and their logprobs."""
        n = len(rows)
        b = min(_pow2_at_least(n), self._max_batch) if self.graph_shapes else n
        self._cache.ensure_rows(b)  # the engine fits the cache first; a caller of the runner alone may not
        pad = b - n
        tok, pos, top_k, keys, temp, top_p = (list(c) for c in zip(*rows, strict=True))
        zeros = [0] * pad
        # Padding rows b > n hit slots n..b-1: free, or requests prefilled this very step. They write
        # at the last cache position, which is >= every slot's kv_len, so a real row overwrites it
        # before it ever attends to it (the invariant the prefill padding relies on too).
        junk = [self._cache.capacity - 1] * pad
        ints = torch.tensor([*tok, *zeros, *pos, *junk, *top_k, *zeros, *keys, *zeros], dtype=torch.long)
        floats = torch.tensor([*temp, *[0.0] * pad, *top_p, *[1.0] * pad], dtype=torch.float32)
        self._ints[:, :b].copy_(ints.view(4, b), non_blocking=True)  # one host->device copy per kind
        self._floats[:, :b].copy_(floats.view(2, b), non_blocking=True)
        need = max(pos) + 1
        if self.graph_shapes:
            kv_len = min(_pow2_at_least(need, _MIN_KV_BUCKET), self._cache.capacity)
            gkey: GraphKey = (b, kv_len, mode, greedy_rows)
            out = self._graph_step(gkey, n) if self.cuda_graphs else self._forward(*gkey)
        else:
            out = self._forward(b, need, mode, greedy_rows)
        res = out[:, :n].tolist()  # the one device->host copy (and sync) of the step
        return [int(t) for t in res[0]], res[1]

    def _forward(self, b: int, kv_len: int, mode: SampleMode, greedy_rows: bool) -> torch.Tensor:
        ids = self._ints[0, :b, None]  # (b, 1)
        pos = self._ints[1, :b, None]
        if self.decoder is not None:
            logits = self.decoder.forward(ids[:, 0], pos[:, 0], kv_len)
        else:
            self._cache.set_decode(pos[:, 0], kv_len)
            mask = (self._arange[:kv_len][None, :] <= pos)[:, None, None, :]  # (b, 1, 1, kv_len)
            out = self._model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                              logits_to_keep=1, **{self._cache_kw: self._cache})  # fmt: skip
            logits = out.logits[:, -1]  # (b, V), the head's dtype
        i, f = self._ints[:, :b], self._floats[:, :b]
        fused = self._fused_sample(logits, f[0], i[3], mode, greedy_rows)
        if fused is not None:
            tokens, logprobs = fused
        else:
            logits = logits.float()
            tokens, logprobs = sample(logits, f[0], i[2], f[1], i[3], mode, self.static_sampling, greedy_rows)
        return torch.stack([tokens.double(), logprobs.double()])  # (2, b)

    def _fused_sample(
        self, logits: torch.Tensor, temperature: torch.Tensor, key: torch.Tensor, mode: SampleMode,
        greedy_rows: bool,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """The one-kernel sampler where it serves ``mode``; None: use ``sample()``. A kernel that fails
        (no compiler for this GPU, say) turns it off for good instead of failing the step: the first call
        is a capture's eager warm-up or an eager step, never inside a capture."""
        if not self.fused_sampling or mode not in ("greedy", "plain"):
            return None
        try:
            return _fused_sampling.fused_sample(logits, temperature, key, mode, greedy_rows)
        except Exception as exc:
            log.warning("engine.fused_sampling_failed", error=f"{type(exc).__name__}: {exc}")
            self.fused_sampling = False
            return None

    # ------------------------------------------------------------------ CUDA graphs
    def _graph_step(self, key: GraphKey, n: int) -> torch.Tensor:
        self._drop_graphs_if_reallocated()
        self._largest_batch = max(self._largest_batch, key[0])
        entry = self._graphs.get(key)
        if entry is None:
            return self._capture(key, n)
        entry[0].replay()
        self.replays += 1
        return entry[1]

    def weights_changed(self) -> None:
        """The model's weights changed in place: refresh what was derived from them."""
        if self.decoder is not None:
            self.decoder.refresh()

    def missing_graphs(self) -> list[GraphKey]:
        """Decode graphs not captured yet that a step may need next: for each (kv-length bucket,
        sampling mode, greedy rows) captured before, every batch bucket up to the largest one a step
        has used so far, largest first. Kinds whose kv-length bucket the cache no longer produces
        (it grew past a bucket that was its capacity) are dropped."""
        self._drop_graphs_if_reallocated()
        cap = self._cache.capacity
        self._graph_kinds = {
            k for k in self._graph_kinds if k[0] == min(_pow2_at_least(k[0], _MIN_KV_BUCKET), cap)
        }
        buckets = [b for b in self._batch_buckets if b <= self._largest_batch]
        return [(b, *k) for k in sorted(self._graph_kinds) for b in buckets if (b, *k) not in self._graphs]

    def has_idle_work(self) -> bool:
        """Whether :meth:`capture_missing` would capture: idle captures on, the first graph checked,
        and one missing."""
        return self.cuda_graphs and self.idle_capture and self._checked and bool(self.missing_graphs())

    def capture_missing(self) -> bool:
        """Capture one of :meth:`missing_graphs` (the engine calls it while it has no request), so a
        burst of a new size replays a graph instead of capturing one between two of its steps (a
        capture, eager warm-up included, took ~190 ms on an H200, holding every running request). Every row is padding: all slots are free, and
        each writes only the last cache position (see ``decode``). True: one was captured."""
        if not self.has_idle_work():
            return False
        key = self.missing_graphs()[0]
        b = key[0]
        if self._cache.rows < b:  # the cache shrank while idle: its padding rows need their slots
            self._cache.ensure_rows(b)
            self._drop_graphs_if_reallocated()
        self._ints[:, :b].zero_()
        self._ints[1, :b].fill_(self._cache.capacity - 1)
        self._floats[:, :b].fill_(1.0)  # temperature 1, top-p 1
        self._capture(key, 0, speculative=True)
        return key in self._graphs

    def _drop_graphs_if_reallocated(self) -> None:
        if self._cache.generation != self._graph_generation:  # the cache was reallocated
            self.drop_graphs()

    def drop_graphs(self) -> None:
        self._graphs.clear()
        self._pool = None
        self._graph_generation = self._cache.generation

    def _capture(self, key: GraphKey, n: int, speculative: bool = False) -> torch.Tensor:
        """Warm up eagerly on a side stream (this IS the step's result: its cache writes are
        idempotent), capture, replay; the first capture is checked against the eager result.
        Captured with SDPA's cuDNN backend allowed (see ``cudnn_attention``). ``speculative``: an
        idle capture (``capture_missing``), skipped while a weight load holds the capture lock; its
        failure stops the idle captures and keeps the graphs already captured."""
        with cudnn_attention():
            return self._capture_step(key, n, speculative)

    def _capture_step(self, key: GraphKey, n: int, speculative: bool) -> torch.Tensor:
        stream = torch.cuda.Stream(self._device)
        stream.wait_stream(torch.cuda.current_stream(self._device))
        try:
            with torch.cuda.stream(stream):
                ref = self._forward(*key).clone()
        finally:  # a warm-up that failed midway must not leave kernels running beside the next step
            torch.cuda.current_stream(self._device).wait_stream(stream)
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # torch.cuda.graph() without its gc.collect() + empty_cache(): captures happen mid-serving;
            # graph_capture: no other thread of this process syncs the device meanwhile (capture.py)
            with graph_capture(wait=not speculative) as held:
                if not held:
                    return ref
                torch.cuda.synchronize(self._device)
                with torch.cuda.stream(stream):
                    graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                    try:
                        out = self._forward(*key)
                    finally:
                        graph.capture_end()
            graph.replay()
        except Exception as exc:  # never fail a request for a capture: stay eager from now on
            log.warning(
                "engine.cuda_graph_capture_failed", key=str(key), error=f"{type(exc).__name__}: {exc}",
                speculative=speculative,
            )  # fmt: skip
            if speculative:  # a graph no step asked for: keep the others, capture no more while idle
                self.idle_capture = False
                return ref
            self.cuda_graphs = self.graph_shapes = False
            self.drop_graphs()
            return ref
        self.captures += 1
        self.idle_captures += int(speculative)
        if not self._checked:
            same = (out[0, :n] == ref[0, :n]).float().mean().item()
            lp_err = (out[1, :n] - ref[1, :n]).abs().max().item()
            self._checked = True
            if same < 0.9 or lp_err > 0.1:
                log.error("engine.cuda_graph_mismatch", same_tokens=same, max_logprob_diff=lp_err)
                self.cuda_graphs = self.graph_shapes = False
                self.drop_graphs()
                return ref
        self._graphs[key] = (graph, out)
        self._graph_kinds.add(key[1:])
        log.info("engine.cuda_graph_captured", batch=key[0], kv_len=key[1], mode=key[2], greedy_rows=key[3])
        return out
