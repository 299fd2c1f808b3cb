"""TorchEngine: the default engine, any transformers causal LM on CPU (fp32) or CUDA (bf16).

Continuous batching with a slot KV cache: every running request owns one row ("slot") of a
preallocated cache ``(n_layers, max_batch_size, n_kv_heads, capacity, head_dim)``; running
requests are kept compact in slots ``0..n-1`` so a decode step reads a view, never a copy.
One engine step (run by a dedicated thread, so the asyncio side never blocks on a forward; its
methods are agentloop.engine.torch._engine_thread's):

1. ``_schedule()``  admit waiting requests into free slots and prefill them in left-padded groups
   of at most ``max_prefill_tokens`` (each reusing the longest cached prefix of a recently finished
   request; requests of a group that repeat a prompt, GRPO's n samples, copy one prefill's KV),
   sampling their first tokens together; a longer prompt gets one chunk of its prefill per step;
2. ``_execute()``   one batched decode forward + sampling of all older running requests
   (agentloop.engine.torch._decode: static device buffers, a mask built on device, one host->device copy
   in and one device->host copy out; on CUDA replayed from captured CUDA graphs);
3. ``_update()``    append, finish on eos / stop ids / stop strings / max_tokens / context limit,
   resolve the caller's future.

Sampling (agentloop.engine.torch._sampling) is batched and batch-invariant: Gumbel-max with noise hashed
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
position ids), except a CPU decode step of a Llama-family model, which agentloop.engine.torch._cpu_decode
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
import contextlib
import queue
import random
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import anyio
import structlog
import torch

from agentloop.engine._bursts import Answer, as_finished, labelled
from agentloop.engine.base import (
    WEIGHT_UPDATE_POLICIES,
    SamplingParams,
    TokenOutput,
    WeightUpdatePolicy,
    check_named_tensors,
    check_prompt,
    check_sampling,
)
from agentloop.engine.models import cache_argument, context_limit
from agentloop.engine.torch._attention import avoid_cudnn_attention, use_grouped_sdpa
from agentloop.engine.torch._decode import ModelRunner
from agentloop.engine.torch._engine_thread import EngineThread, Request
from agentloop.engine.torch._kv import PrefixCache, SlotKVCache, default_kv_budget, kv_shape
from agentloop.engine.torch._thread_settings import (
    free_openmp_pool_of_this_thread,
    shorten_gil_switch_interval,
)

log = structlog.get_logger(__name__)


class TorchEngine(EngineThread):
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
    (padded) tokens one batched prefill forward takes. A prompt longer than that (after its
    prefix-cache hit) is prefilled alone, one chunk of this many tokens per engine step, between the
    running requests' decode steps, into a cache of its own until its first token (then it takes a
    slot); each chunk attends to what is cached and causally to itself with no mask over the whole
    context (``_attention.chunk_attention``). ``max_context``: most tokens (prompt + response) of one
    sequence; None: the model's own limit (``max_position_embeddings``); above it is refused.
    ``kv_cache_bytes``: the most the KV cache (the running requests' slots and the prefix cache's
    copies) may hold; None: half the memory free when the engine is built. Nothing is preallocated:
    slots grow with the running requests and their lengths. A request is admitted when the cache can
    hold every running request at its longest (prompt + max_tokens, within max_context), evicting
    prefix-cache entries first; otherwise it waits for a running one to finish. A full-context
    sequence must fit: an explicit ``max_context`` over the budget is refused, the model's own limit
    is capped to it with a warning (``engine.context_capped``). ``stall_warning_s``: a request older than
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
        kv_cache_bytes: int | None = None,
        stall_warning_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        _check_limits(max_batch_size, max_prefill_tokens, kv_cache_bytes, weight_update_policy)
        dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
        if isinstance(model, str | Path):
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(model)
            model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa")
        model = cast(Any, model)
        if tokenizer is None:
            raise ValueError("a preloaded model needs its tokenizer: TorchEngine(model, tokenizer)")
        self._model = model.to(device=device, dtype=dtype).eval()
        # no per-head copies of the KV cache, and prefill chunks without a mask over the whole context
        self.grouped_attention = use_grouped_sdpa(self._model)
        self._tokenizer = tokenizer
        self._device = torch.device(device)
        self._vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self._max_batch = max_batch_size
        self._policy = weight_update_policy
        n_layers, n_kv, head_dim = kv_shape(model.config)
        self._kv_bytes_per_token = 2 * n_layers * n_kv * head_dim * torch.empty(0, dtype=dtype).element_size()
        self._kv_budget = (
            int(kv_cache_bytes) if kv_cache_bytes is not None else default_kv_budget(self._device)
        )
        self._max_context = self._context(max_context, context_limit(model.config))
        self._cache = SlotKVCache.for_model(model, max_batch_size, self._max_context, dtype, self._device)
        self._prefix = PrefixCache(max_entries=prefix_cache_entries)
        self._cache_kw = cache_argument(model)
        self._max_prefill_tokens = max_prefill_tokens
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
            idle_graph_capture,
            chunk_attention=self.grouped_attention,
        )
        self._eos_ids = _eos_ids(model, tokenizer)
        self._param_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        self._init_run_state()

    def _init_run_state(self) -> None:
        """The engine thread's state: the weights version, the inbox, the requests by stage, the
        pending weight updates, counters and timers."""
        self._weights_version = 0
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._inflight: dict[str, Request] = {}
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._chunking: Request | None = None
        self._updates: list[
            tuple[dict[str, torch.Tensor], asyncio.Future[int], asyncio.AbstractEventLoop]
        ] = []
        self._stats = collections.Counter[str]()
        # seconds of the engine thread: steps in all, admission (prefill + first tokens), decode
        # forwards, bookkeeping after a decode (append, finish, slot moves, prefix-cache stores)
        self._timers = {"step_s": 0.0, "schedule_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0, "update_s": 0.0}
        self._timers["idle_capture_s"] = 0.0  # outside the steps: graph captures while idle

    def _context(self, asked: int | None, limit: int | None) -> int:
        """The engine's context: ``asked``, or the model's own limit; checked against the KV budget."""
        if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 2):
            raise ValueError(f"max_context must be an int >= 2, got {asked!r}")
        if asked is not None and limit is not None and asked > limit:
            raise ValueError(
                f"max_context ({asked}) is above the model's limit of {limit} positions "
                f"(its config's max_position_embeddings); pass at most {limit}, or None for the model's own"
            )
        if limit is None and asked is None:
            log.warning("engine.context_limit_unknown", assumed=4096, hint="pass max_context")
        context = asked or limit or 4096
        bpt = self._kv_bytes_per_token
        fits = self._kv_budget // bpt
        if context > fits:
            need = f"{context} tokens of KV cache take {_size(context * bpt)} ({bpt} bytes per token)"
            if asked is not None:
                raise ValueError(
                    f"max_context: {need}, more than the KV budget of {_size(self._kv_budget)} "
                    f"(kv_cache_bytes; default: half the memory free); lower max_context or raise kv_cache_bytes"
                )
            log.warning(
                "engine.context_capped", model_limit=context, max_context=fits, reason=need,
                kv_budget=_size(self._kv_budget), hint="free memory, or pass max_context / kv_cache_bytes",
            )  # fmt: skip
            context = fits
        if context < 2:
            raise ValueError(
                f"the KV budget of {self._kv_budget} bytes holds {fits} tokens; raise kv_cache_bytes"
            )
        return context

    # ------------------------------------------------------------------ public surface
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def weight_update_policy(self) -> WeightUpdatePolicy:
        """How this engine takes new weights with requests in flight (set when it is built)."""
        return self._policy

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
        req = self._new_request(prompt_ids, sampling, request_id)
        await self._submit([req])
        return await self._result(req)

    async def generate_many(
        self, requests: Sequence[tuple[list[int], SamplingParams | None, str]]
    ) -> AsyncGenerator[Answer, None]:
        """Run ``requests`` (prompt ids, sampling, request id) as one burst and yield ``(request_id,
        output or error)`` as each finishes. The engine thread receives the burst in one command, so it
        admits it together (one prefill while slots and ``max_prefill_tokens`` allow) rather than
        starting on the first few while the rest are still being queued. A request that fails
        validation yields its error first (the others are already running); closing the iterator aborts
        what is still running."""
        reqs: list[Request] = []
        errors: list[Answer] = []
        ids: set[str] = set()
        for prompt_ids, sampling, rid in requests:
            try:
                if rid in ids:
                    raise ValueError(f"request_id {rid!r} is already in flight; use a unique id per request")
                reqs.append(self._new_request(prompt_ids, sampling, rid))
                ids.add(rid)
            except Exception as exc:  # invalid input: this request's error, the others run
                errors.append((rid, exc))
        if reqs:  # registered and sent before anything is yielded: no other call runs in between
            await self._submit(reqs)
        tasks = [asyncio.ensure_future(labelled(r.request_id, self._result(r))) for r in reqs]
        try:
            for failed in errors:
                yield failed
            async with contextlib.aclosing(as_finished(tasks)) as answers:
                async for answer in answers:
                    yield answer
        finally:  # closed early: abort what still runs, also a request whose task has not started yet
            for req in reqs:
                if not req.future.done():
                    self._inbox.put(("abort", req.request_id))
                if self._inflight.get(req.request_id) is req:
                    del self._inflight[req.request_id]

    def _new_request(
        self, prompt_ids: list[int], sampling: SamplingParams | None, request_id: str | None
    ) -> Request:
        """A validated request, not yet in flight (ValueError or TypeError on bad input)."""
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
        reserve = min(len(prompt) + sampling.max_tokens, self._max_context)  # its longest: what it may hold
        return Request(
            rid, prompt, sampling, loop.create_future(), loop, seed, end_ids, reserve=reserve,
            added_at=self._clock(),
        )  # fmt: skip

    async def _submit(self, reqs: list[Request]) -> None:
        """Put validated ``reqs`` in flight: the engine thread gets them in one command."""
        await self.start()
        for req in reqs:
            self._inflight[req.request_id] = req
        self._inbox.put(("add", reqs))

    async def _result(self, req: Request) -> TokenOutput:
        """Await ``req``'s answer; cancelling aborts it in the engine."""
        try:
            return await req.future
        except asyncio.CancelledError:
            self._inbox.put(("abort", req.request_id))
            raise
        finally:
            self._inflight.pop(req.request_id, None)

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
        prompt = s.get("prompt_tokens", 0)
        # the share of prompt tokens not computed: from the prefix cache (earlier calls' KV), and in all
        # (also the repeats of a prompt within one prefill group, GRPO's n samples)
        s["prefix_cache_hit_share"] = s.get("prefix_cache_hit_tokens", 0) / prompt if prompt else 0.0
        s["cached_prompt_share"] = s.get("cached_prompt_tokens", 0) / prompt if prompt else 0.0
        s.update(self._timers)
        s.update(
            kv_bytes_per_token=self._kv_bytes_per_token, kv_budget_bytes=self._kv_budget,
            kv_cache_bytes=self._cache.nbytes, kv_cache_rows=self._cache.rows,
            kv_cache_capacity=self._cache.capacity, prefix_cache_entries=len(self._prefix),
            prefix_cache_tokens=self._prefix.tokens, max_context=self._max_context,
        )  # fmt: skip
        s.update(cuda_graphs=self._runner.cuda_graphs, graph_captures=self._runner.captures,
                 idle_graph_captures=self._runner.idle_captures, graph_replays=self._runner.replays)  # fmt: skip
        s.update(
            running=len(self._running),
            waiting=len(self._waiting),
            prefilling=int(self._chunking is not None),
            weights_version=self._weights_version,
        )
        return s


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _check_limits(
    max_batch_size: int,
    max_prefill_tokens: int,
    kv_cache_bytes: int | None,
    weight_update_policy: WeightUpdatePolicy,
) -> None:
    """``TorchEngine``'s sizes and policy: a ValueError naming the one out of range."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    if max_prefill_tokens < 1:
        raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
    if kv_cache_bytes is not None and kv_cache_bytes < 1:
        raise ValueError(
            f"kv_cache_bytes must be >= 1 (or None for half the free memory), got {kv_cache_bytes}"
        )
    if weight_update_policy not in WEIGHT_UPDATE_POLICIES:
        raise ValueError(
            f"weight_update_policy must be one of {WEIGHT_UPDATE_POLICIES}, got {weight_update_policy!r}"
        )


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """The tokens that end a sequence: the model's generation config's and the tokenizer's."""
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(int(tokenizer.eos_token_id))
    return frozenset(eos_ids)
