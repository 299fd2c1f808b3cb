"""TorchEngine: the default engine, any transformers causal LM on CPU (fp32) or CUDA (bf16).

Continuous batching with a slot KV cache: every running request owns one row ("slot") of a
preallocated cache ``(n_layers, max_batch_size, n_kv_heads, capacity, head_dim)``; running
requests are kept compact in slots ``0..n-1`` so a decode step reads a view, never a copy.
One engine step (run by a dedicated thread, so the asyncio side never blocks on a forward):

1. ``_schedule()``  admit waiting requests into free slots and prefill them in left-padded groups
   of at most ``max_prefill_tokens`` (each reusing the longest cached prefix of a recently finished
   request; requests of a group that repeat a prompt, GRPO's n samples, copy one prefill's KV),
   sampling their first tokens together;
2. ``_execute()``   one batched decode forward + sampling of all older running requests
   (agentloop.engine._decode: static device buffers, a mask built on device, one host->device copy
   in and one device->host copy out; on CUDA replayed from captured CUDA graphs);
3. ``_update()``    append, finish on eos / stop ids / stop strings / max_tokens / context limit,
   resolve the caller's future.

Sampling (agentloop.engine._sampling) is batched and batch-invariant: Gumbel-max with noise hashed
from ``(seed, step, token)``, so no per-request generator and no per-request kernels. Every path
(the prefill's first token, eager or CPU-decoder or CUDA-graph decode steps, prompts shared within a
prefill group) samples through it, so every logprob is the sampling policy's (base.py), per row.

Why not transformers' own continuous batching (``generate_batch`` / ``ContinuousBatchingManager``,
transformers 5.24): it samples the whole batch with one ``torch.multinomial`` on the global RNG
(no per-request seed, so a request's tokens depend on its batch-mates), its logprobs are taken
after its logits processors, top-p/top-k masks included (renormalised; our contract, base.py, wants
``log_softmax(logits / T)`` without renormalisation, raw logits for greedy rows), sampling
settings are per manager rather than per request, and it has no stop strings or abort-with-partial
output. The model forward itself is transformers' (we pass our own cache object, a 4D mask and
position ids), except a CPU decode step of a Llama-family model, which agentloop.engine._cpu_decode
writes out with fused, MKL-packed projections (its docstring says why and what it measured).

Weight updates (``weight_update_policy``): ``"drain"`` (default) stops admitting requests, lets
in-flight ones finish on the old weights, then loads the new ones, so every response comes from
one weights version; ``"abort"`` ends in-flight requests at once with finish_reason ``"abort"``
(their partial tokens are returned); ``"inflight"`` loads the new weights between two decode steps
and lets running requests go on (a partial rollout that is never interrupted): nobody waits for the
slowest request, a response may span versions, and ``TokenOutput.token_versions`` says which
version sampled each token. Every logprob is still that of the weights that sampled the token, so
the trainer's rollout correction stays exact; a request's keys/values written before the update are
the old weights' (not recomputed: the cost would be a prefill per running request, and the
behaviour log-probs already describe what was sampled). Every policy clears the prefix cache.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import queue
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import anyio
import structlog
import torch

from agentloop.engine._attention import avoid_cudnn_attention, use_grouped_sdpa
from agentloop.engine._decode import DecodeRow, ModelRunner
from agentloop.engine._kv import PrefixCache, SlotKVCache
from agentloop.engine._sampling import row_key, sample, sample_mode
from agentloop.engine.base import (
    WEIGHT_UPDATE_POLICIES,
    SamplingParams,
    TokenOutput,
    WeightUpdatePolicy,
    check_named_tensors,
    check_prompt,
    check_sampling,
)
from agentloop.errors import EngineError

log = structlog.get_logger(__name__)

GIL_SWITCH_INTERVAL_S = 0.0002  # see shorten_gil_switch_interval
IDLE_CAPTURE_AFTER_S = 0.05  # no request for this long: the engine captures a missing decode graph


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future[TokenOutput]
    loop: asyncio.AbstractEventLoop
    seed: int
    end_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the weights version that sampled each token
    prefill_version: int = -1  # the weights version that wrote the prompt's keys/values
    kv_len: int = 0  # tokens whose keys/values are in the cache
    slot: int = -1
    num_cached: int = 0
    added_at: float = field(default_factory=time.monotonic)
    warned: bool = False
    finished: bool = False  # the engine thread answered it (the loop may not have run the answer yet)


class TorchEngine:
    """Continuous-batching engine over a transformers causal LM (see module docstring).

    ``cuda_graphs`` (CUDA only; ignored on CPU): replay the decode step from CUDA graphs captured
    lazily per (batch bucket 1, 2, 4, ..., kv-length bucket, sampling mode); a capture that fails
    or disagrees with the eager step turns them off with a warning. ``idle_graph_capture``: once a
    (kv-length bucket, sampling mode) has a graph, capture its other batch buckets while the engine
    has no request (after ``IDLE_CAPTURE_AFTER_S`` of quiet), so later bursts of other sizes do
    not stop their running requests for a capture. ``cpu_decoder`` (CPU only):
    decode Llama-family models with the fused, MKL-packed step of ``_cpu_decode.py`` instead of
    transformers' forward (other models always use transformers'); it holds fused, packed copies of
    the weights (about 2.4x their size). ``max_prefill_tokens``: most
    (padded) tokens one batched prefill forward takes. ``stall_warning_s``: a request older than
    this is logged with its state (``engine.slow_request``), and failed if the engine no longer holds it.
    ``clock``: the monotonic seconds that request ages are measured in (tests pass a fake one).
    """

    def __init__(
        self,
        model: str | Path | Any,
        tokenizer: Any = None,
        *,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        max_batch_size: int = 32,
        max_context: int | None = None,
        prefix_cache_entries: int = 16,
        weight_update_policy: WeightUpdatePolicy = "drain",
        cuda_graphs: bool = True,
        idle_graph_capture: bool = True,
        cpu_decoder: bool = True,
        max_prefill_tokens: int = 8192,
        stall_warning_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if weight_update_policy not in WEIGHT_UPDATE_POLICIES:
            raise ValueError(
                f"weight_update_policy must be one of {WEIGHT_UPDATE_POLICIES}, got {weight_update_policy!r}"
            )
        dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
        if isinstance(model, str | Path):
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(model)
            model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa")
        model = cast(Any, model)
        if tokenizer is None:
            raise ValueError("a preloaded model needs its tokenizer: TorchEngine(model, tokenizer)")
        self._model = model.to(device=device, dtype=dtype).eval()
        self.grouped_attention = use_grouped_sdpa(self._model)  # no per-head copies of the KV cache
        self._tokenizer = tokenizer
        self._device = torch.device(device)
        cfg = model.config
        limit = int(getattr(cfg, "max_position_embeddings", 0) or 4096)
        self._max_context = min(int(max_context or 4096), limit)
        if self._max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {max_context}")
        self._vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self._max_batch = max_batch_size
        self._policy = weight_update_policy
        self._cache = SlotKVCache.for_model(model, max_batch_size, self._max_context, dtype, self._device)
        self._prefix = PrefixCache(max_entries=prefix_cache_entries)
        self._cache_kw = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self._max_prefill_tokens = max_prefill_tokens
        self._idle_graph_capture = idle_graph_capture
        self._stall_warning_s = stall_warning_s
        self._clock = clock
        self._next_watch = 0.0
        self._runner = ModelRunner(
            self._model,
            self._cache,
            self._cache_kw,
            max_batch_size,
            self._max_context,
            self._device,
            cuda_graphs,
            cpu_decoder,
        )
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(int(tokenizer.eos_token_id))
        self._eos_ids = frozenset(eos_ids)
        self._param_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        self._weights_version = 0
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._inflight: dict[str, _Request] = {}
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._updates: list[
            tuple[dict[str, torch.Tensor], asyncio.Future[int], asyncio.AbstractEventLoop]
        ] = []
        self._stats = collections.Counter[str]()
        # seconds of the engine thread: steps in all, admission (prefill + first tokens), decode
        # forwards, bookkeeping after a decode (append, finish, slot moves, prefix-cache stores)
        self._timers = {"step_s": 0.0, "schedule_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0, "update_s": 0.0}
        self._timers["idle_capture_s"] = 0.0  # outside the steps: graph captures while idle

    # ------------------------------------------------------------------ public surface
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def weights_version(self) -> int:
        return self._weights_version

    @property
    def model(self) -> Any:
        return self._model

    async def start(self) -> None:
        """Start the engine thread (idempotent; ``generate`` calls it too)."""
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                if self._device.type == "cpu":
                    free_openmp_pool_of_this_thread()
                if self._device.type == "cuda":  # steps of a few ms: a 5 ms wait for the GIL shows
                    shorten_gil_switch_interval()
                    avoid_cudnn_attention()  # a cuDNN plan per new prefill shape: 50-700 ms each
                self._thread = threading.Thread(target=self._loop, name="agentloop-torch-engine", daemon=True)
                self._thread.start()

    async def stop(self) -> None:
        """Stop the thread; waiting and running requests end with finish_reason ``"abort"``."""
        thread = self._thread
        if thread is None:
            return
        self._inbox.put(("stop", None))
        await anyio.to_thread.run_sync(thread.join)
        self._thread = None

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams | None = None, request_id: str | None = None
    ) -> TokenOutput:
        """Generate a response to ``prompt_ids``; cancelling the await aborts the request."""
        sampling = check_sampling(sampling)
        prompt = check_prompt(prompt_ids, self._vocab_size, self._max_context)
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id must be a non-empty string or None, got {request_id!r}")
        if rid in self._inflight:
            raise ValueError(f"request_id {rid!r} is already in flight; use a unique id per request")
        loop = asyncio.get_running_loop()
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        end_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self._eos_ids)
        req = _Request(
            rid, prompt, sampling, loop.create_future(), loop, seed, end_ids, added_at=self._clock()
        )
        await self.start()
        self._inflight[rid] = req
        self._inbox.put(("add", req))
        try:
            return await req.future
        except asyncio.CancelledError:
            self._inbox.put(("abort", rid))
            raise
        finally:
            self._inflight.pop(rid, None)

    async def abort(self, request_id: str) -> bool:
        """End a waiting or running request with finish_reason ``"abort"``; True when it was found."""
        if request_id not in self._inflight:
            return False
        self._inbox.put(("abort", request_id))
        return True

    async def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> int:
        """Load ``named_tensors`` (a subset of the model's state dict) between decode steps."""
        check_named_tensors(named_tensors, self._param_shapes)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        await self.start()
        self._inbox.put(("update", (dict(named_tensors), fut, loop)))
        return await fut

    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = dict(self._stats)
        steps = s.get("decode_steps", 0)
        s["mean_decode_batch"] = s.get("decode_rows", 0) / steps if steps else 0.0
        s["decode_ms_per_step"] = 1e3 * self._timers["decode_s"] / steps if steps else 0.0
        s.update(self._timers)
        s.update(cuda_graphs=self._runner.cuda_graphs, graph_captures=self._runner.captures,
                 idle_graph_captures=self._runner.idle_captures, graph_replays=self._runner.replays)  # fmt: skip
        s.update(
            running=len(self._running), waiting=len(self._waiting), weights_version=self._weights_version
        )
        return s

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        log.info(
            "engine.start", device=str(self._device), max_batch=self._max_batch, max_context=self._max_context
        )
        with torch.inference_mode():
            while True:
                busy = bool(self._running or self._waiting or self._updates)
                cmds: list[tuple[str, Any]] = []
                idle_work = not busy and self._has_idle_work()
                try:
                    if not busy:  # idle: wake up for the watchdog, or after a quiet spell for idle work
                        cmds.append(self._inbox.get(timeout=IDLE_CAPTURE_AFTER_S if idle_work else 1.0))
                    while True:
                        cmds.append(self._inbox.get_nowait())
                except queue.Empty:
                    if idle_work and not cmds:
                        self._idle_capture()
                if any(c[0] == "stop" for c in cmds):
                    self._shutdown(cmds)
                    return
                for kind, arg in cmds:
                    self._command(kind, arg)
                self._step()
                now = self._clock()
                if now >= self._next_watch:
                    self._next_watch = now + min(1.0, self._stall_warning_s / 2)
                    self._watch(now)

    def _has_idle_work(self) -> bool:
        return self._idle_graph_capture and self._runner.cuda_graphs and bool(self._runner.missing_graphs())

    def _idle_capture(self) -> None:
        """Capture one decode graph a later burst may need (the inbox is read again after each)."""
        t0 = time.perf_counter()
        try:
            self._runner.capture_missing()
        except (
            Exception
        ):  # a failed capture turns graphs off in the runner; this is its eager warm-up failing
            log.exception("engine.idle_capture_failed")
            self._idle_graph_capture = False
        finally:
            self._timers["idle_capture_s"] += time.perf_counter() - t0

    def _watch(self, now: float) -> None:
        """The watchdog: log requests older than ``stall_warning_s`` with their state, and fail any
        the engine no longer holds (neither waiting nor running) so that no caller waits forever."""
        held = {id(r) for r in (*self._waiting, *self._running)}
        for req in list(self._inflight.values()):
            age = now - req.added_at
            if age < self._stall_warning_s or req.future.done() or req.finished:
                continue  # finished: its answer is queued on a busy event loop, not lost
            if id(req) not in held and not self._inbox.qsize():
                log.error("engine.request_lost", request_id=req.request_id, age_s=round(age, 1))
                self._stats["lost"] += 1
                err = EngineError(f"the engine lost track of request {req.request_id} after {age:.0f} s")
                req.loop.call_soon_threadsafe(_resolve, req.future, None, err)
            elif not req.warned:
                req.warned = True
                log.warning(
                    "engine.slow_request", request_id=req.request_id, age_s=round(age, 1),
                    state="running" if req.slot >= 0 else "waiting", slot=req.slot, kv_len=req.kv_len,
                    generated=len(req.output_ids), max_tokens=req.sampling.max_tokens,
                    waiting=len(self._waiting), running=len(self._running), updates=len(self._updates),
                )  # fmt: skip

    def _command(self, kind: str, arg: Any) -> None:
        if kind == "add":
            self._waiting.append(arg)
            self._stats["requests"] += 1
        elif kind == "update":
            self._updates.append(arg)
            if self._policy == "abort":
                for req in reversed(self._running):  # last slot first: nothing moves
                    self._finish(req, "abort")
        elif kind == "abort":
            for req in [*self._waiting, *self._running]:
                if req.request_id == arg:
                    self._finish(req, "abort")

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            self._step_once()
        finally:
            self._timers["step_s"] += time.perf_counter() - t0

    def _step_once(self) -> None:
        if self._updates and (self._policy == "inflight" or not self._running):
            self._apply_updates()
        t0 = time.perf_counter()
        new = set(self._schedule()) if not self._updates else set()
        self._timers["schedule_s"] += time.perf_counter() - t0
        old = [r for r in self._running if r not in new]
        if old:
            try:
                tokens, logprobs = self._execute(old)
            except Exception as exc:  # never hang a caller: fail the batch, keep serving
                log.exception("engine.decode_failed", batch=len(old))
                for req in reversed(old):  # last slot first: nothing moves
                    self._fail(req, exc)
                return
            t1 = time.perf_counter()
            self._update(old, tokens, logprobs)
            self._timers["update_s"] += time.perf_counter() - t1

    def _schedule(self) -> list[_Request]:
        """Admit waiting requests while slots are free; prefill them in groups, sample first tokens."""
        admitted: list[_Request] = []
        while self._waiting and len(self._running) < self._max_batch:
            group = [self._waiting.popleft()]
            longest = len(group[0].prompt_ids)
            while self._waiting and len(self._running) + len(group) < self._max_batch:
                longest_next = max(longest, len(self._waiting[0].prompt_ids))
                if longest_next * (len(group) + 1) > self._max_prefill_tokens:
                    break
                group.append(self._waiting.popleft())
                longest = longest_next
            admitted += self._admit(group)
        return admitted

    def _admit(self, group: list[_Request]) -> list[_Request]:
        """Give ``group`` consecutive slots and prefill it; when the batched prefill fails, retry
        one by one so only the faulty request fails."""
        group = _first_of_each_prompt_first(group)
        first = len(self._running)
        for i, req in enumerate(group):
            req.slot = first + i
            self._running.append(req)
        try:
            logits = self._prefill(group)
        except Exception as exc:
            if len(group) == 1:
                log.exception("engine.prefill_failed", request_id=group[0].request_id)
                self._fail(group[0], exc)
                return []
            for req in reversed(group):  # last slot first: nothing moves
                self._release(req)
            return [r for req in group for r in self._admit([req])]
        tokens, logprobs = self._sample(group, logits)
        self._update(group, tokens, logprobs)
        return group

    def _prefill(self, group: list[_Request]) -> torch.Tensor:
        """Prefill ``group`` (ordered by :func:`_first_of_each_prompt_first`, in consecutive slots);
        returns each request's next-token logits. Requests repeating an earlier prompt of the group
        (a GRPO group's n samples) are not computed: they get a copy of its KV and its logits row."""
        first_index: dict[tuple[int, ...], int] = {}
        for i, req in enumerate(group):
            first_index.setdefault(tuple(req.prompt_ids), i)
        unique = group[: len(first_index)]
        cached = []
        for req in unique:
            prompt = req.prompt_ids
            hit = self._prefix.lookup(prompt, self._cache, req.slot, max_len=len(prompt) - 1)
            req.num_cached = hit
            cached.append(hit)
            self._stats["cached_prompt_tokens"] += hit
            self._stats["prefix_cache_hits"] += int(hit > 0)
        self._cache.ensure_capacity(max(len(r.prompt_ids) for r in group) + 1)
        t0 = time.perf_counter()
        logits = self._runner.prefill(unique[0].slot, [r.prompt_ids for r in unique], cached)
        rows = [first_index[tuple(req.prompt_ids)] for req in group]
        for req, row in zip(group[len(unique) :], rows[len(unique) :], strict=True):
            self._cache.move(group[row].slot, req.slot, len(req.prompt_ids))
            req.num_cached = len(req.prompt_ids)
            self._stats["cached_prompt_tokens"] += len(req.prompt_ids)
            self._stats["shared_prompt_prefills"] += 1
        for req in group:
            req.kv_len = len(req.prompt_ids)
            req.prefill_version = self._weights_version
            self._stats["prompt_tokens"] += len(req.prompt_ids)
        self._stats["prefill_batches"] += 1
        self._timers["prefill_s"] += time.perf_counter() - t0
        return logits if len(unique) == len(group) else logits[rows]

    def _sample(self, reqs: list[_Request], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Sample the first token of freshly prefilled requests (one batched call, one sync)."""
        sps = [r.sampling for r in reqs]
        mode = sample_mode([p.temperature for p in sps], [p.top_k for p in sps], [p.top_p for p in sps])
        dev = logits.device
        tokens, logprobs = sample(
            logits,
            torch.tensor([p.temperature for p in sps], device=dev),
            torch.tensor([p.top_k for p in sps], device=dev),
            torch.tensor([p.top_p for p in sps], device=dev),
            torch.tensor([row_key(r.seed, len(r.output_ids)) for r in reqs], device=dev),
            mode,
            exact_static=dev.type == "cuda",  # no host syncs on a GPU
            greedy_rows=any(p.temperature <= 0 for p in sps),
        )
        res = torch.stack([tokens.double(), logprobs.double()]).tolist()
        return [int(t) for t in res[0]], res[1]

    def _execute(self, reqs: list[_Request]) -> tuple[list[int], list[float]]:
        """One batched decode step for ``reqs`` (all in slots 0..n-1); returns tokens and logprobs."""
        n = len(reqs)
        reqs.sort(key=lambda r: r.slot)
        assert reqs[0].slot == 0 and reqs[-1].slot == n - 1, "decode rows must be the compact slots 0..n-1"
        self._cache.ensure_capacity(max(r.kv_len for r in reqs) + 1)
        rows: list[DecodeRow] = []
        for r in reqs:
            sp = r.sampling
            key = row_key(r.seed, len(r.output_ids))
            rows.append((r.output_ids[-1], r.kv_len, sp.top_k, key, sp.temperature, sp.top_p))
        temps = [row[4] for row in rows]
        mode = sample_mode(temps, [row[2] for row in rows], [row[5] for row in rows])
        t0 = time.perf_counter()
        tokens, logprobs = self._runner.decode(rows, mode, any(t <= 0 for t in temps))
        self._timers["decode_s"] += time.perf_counter() - t0
        for r in reqs:
            r.kv_len += 1
        self._stats["decode_steps"] += 1
        self._stats["decode_rows"] += n
        return tokens, logprobs

    def _update(self, reqs: list[_Request], tokens: list[int], logprobs: list[float]) -> None:
        """Append each request's sampled token and finish the requests that are done."""
        done: list[tuple[_Request, Literal["stop", "length"]]] = []
        for req, tok, lp in zip(reqs, tokens, logprobs, strict=True):
            req.output_ids.append(tok)
            req.logprobs.append(lp)
            req.versions.append(self._weights_version)
            self._stats["generated_tokens"] += 1
            reason = self._finish_reason(req, tok)
            if reason is not None:
                done.append((req, reason))
        # highest slot first, so releasing never moves a slot that is about to finish too; only the
        # last prefix_cache_entries go to the LRU (storing the others would only be evicted again)
        done.sort(key=lambda d: -d[0].slot)
        skip = len(done) - self._prefix.max_entries
        for i, (req, reason) in enumerate(done):
            self._finish(req, reason, store=i >= skip)

    def _finish_reason(self, req: _Request, tok: int) -> Literal["stop", "length"] | None:
        sp = req.sampling
        if tok in req.end_ids:
            return "stop"
        if sp.stop:
            longest = max(len(s) for s in sp.stop)
            tail = self._tokenizer.decode(req.output_ids[-(longest + 4) :])
            if any(s in tail for s in sp.stop):
                return "stop"
        if (
            len(req.output_ids) >= sp.max_tokens
            or len(req.prompt_ids) + len(req.output_ids) >= self._max_context
        ):
            return "length"
        return None

    def _release(self, req: _Request) -> None:
        """Take ``req`` out of the waiting queue or its slot, keeping the slots compact."""
        if req in self._waiting:
            self._waiting.remove(req)
            return
        if req not in self._running:
            return
        self._running.remove(req)
        last = len(self._running)  # slots are 0..last now; move the request in the last slot to the hole
        if req.slot != last:
            mover = next(r for r in self._running if r.slot == last)
            self._cache.move(last, req.slot, mover.kv_len)
            mover.slot = req.slot
        req.slot = -1

    def _finish(self, req: _Request, reason: Literal["stop", "length", "abort"], store: bool = True) -> None:
        # keys/values written by older weights (an "inflight" update) never enter the prefix cache
        store = store and req.prefill_version == self._weights_version
        if store and req.slot >= 0 and reason != "abort" and req.kv_len > 0:
            self._prefix.store((req.prompt_ids + req.output_ids)[: req.kv_len], self._cache, req.slot)
        self._release(req)
        self._stats[f"finished_{reason}"] += 1
        sp = req.sampling
        out = TokenOutput(
            token_ids=list(req.output_ids),
            logprobs=list(req.logprobs) if sp.logprobs else None,
            finish_reason=reason,
            weights_version=self._weights_version,
            num_cached_prompt_tokens=req.num_cached,
            token_versions=list(req.versions),
        )
        req.finished = True
        req.loop.call_soon_threadsafe(_resolve, req.future, out, None)

    def _fail(self, req: _Request, exc: BaseException) -> None:
        self._release(req)
        self._stats["failed"] += 1
        err = EngineError(f"engine step failed for request {req.request_id}: {type(exc).__name__}: {exc}")
        req.finished = True
        req.loop.call_soon_threadsafe(_resolve, req.future, None, err)

    def _apply_updates(self) -> None:
        for tensors, fut, loop in self._updates:
            try:
                params = dict(self._model.named_parameters(remove_duplicate=False))
                params.update(dict(self._model.named_buffers()))
                for name, t in tensors.items():
                    params[name].copy_(t.to(device=params[name].device, dtype=params[name].dtype))
                self._runner.weights_changed()
                self._weights_version += 1
                self._prefix.clear()
                log.info("engine.weights_updated", version=self._weights_version, tensors=len(tensors))
                loop.call_soon_threadsafe(_resolve, fut, self._weights_version, None)
            except Exception as exc:
                loop.call_soon_threadsafe(_resolve, fut, None, EngineError(f"weight update failed: {exc}"))
        self._updates.clear()

    def _shutdown(self, cmds: list[tuple[str, Any]]) -> None:
        for kind, arg in cmds:
            if kind == "add":
                self._waiting.append(arg)
            elif kind == "update":
                self._updates.append(arg)
        for req in [*self._waiting, *self._running]:
            self._finish(req, "abort")
        for _, fut, loop in self._updates:
            loop.call_soon_threadsafe(
                _resolve, fut, None, EngineError("engine stopped before the weight update")
            )
        self._updates.clear()
        log.info("engine.stop")


def _first_of_each_prompt_first(group: list[_Request]) -> list[_Request]:
    """``group`` with the first request of each distinct prompt first (in order), then the requests
    that repeat one of them: the prefill computes only the first part (see ``TorchEngine._prefill``)."""
    seen: set[tuple[int, ...]] = set()
    firsts: list[_Request] = []
    repeats: list[_Request] = []
    for req in group:
        key = tuple(req.prompt_ids)
        (repeats if key in seen else firsts).append(req)
        seen.add(key)
    return firsts + repeats


def shorten_gil_switch_interval() -> None:
    """Lower the interpreter's GIL switch interval to ``GIL_SWITCH_INTERVAL_S`` (never raise it).

    Why: the engine thread drops the GIL inside every torch call and must take it back after, while
    the event loop thread (the proxy parsing, templating and recording 128 agents' calls) holds it.
    A thread that wants the GIL asks the holder to let go only after the switch interval, 5 ms by
    default: a decode step of a few ms then waits several times that for the GIL at each torch call,
    and the GPU idles. At 0.2 ms the engine thread waits at most that long per hand-off, and the
    event loop loses only the cost of the extra switches. It is process-wide (``sys.setswitchinterval``).
    """
    if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        log.info("engine.gil_switch_interval", seconds=GIL_SWITCH_INTERVAL_S)


def free_openmp_pool_of_this_thread() -> None:
    """Free the calling thread's OpenMP worker pool (``omp_pause_resource_all(omp_pause_hard)``).

    Why: the engine thread runs every forward. With libgomp, while another thread (the one that
    loaded the model) still owns a worker pool, the process has more OpenMP threads than cores, and
    libgomp stops spin-waiting: each of the ~500 parallel regions of a forward then wakes sleeping
    workers. Measured on the 2-core dev machine, SmolLM2 fp32 at batch 32: a decode forward in the
    engine thread takes ~230 ms with the caller's pool alive and ~150 ms once it is freed (as fast
    as on the main thread). A pool the caller needs again is simply re-created.
    """
    import ctypes

    names = sorted(Path(torch.__file__).parent.joinpath("lib").glob("libgomp*.so*"))
    for name in [*map(str, names), "libgomp.so.1", "libiomp5.so"]:
        try:
            pause = ctypes.CDLL(name).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        pause(2)  # omp_pause_hard; returns non-zero (and does nothing) inside a parallel region
        return


def _resolve(fut: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)
