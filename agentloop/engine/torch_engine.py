"""TorchEngine: the default engine, any transformers causal LM on CPU (fp32) or CUDA (bf16).

Continuous batching with a slot KV cache: every running request owns one row ("slot") of a
preallocated per-layer cache ``(max_batch_size, n_kv_heads, capacity, head_dim)``; running
requests are kept compact in slots ``0..n-1`` so a decode step reads a view, never a copy.
One engine step (run by a dedicated thread, so the asyncio side never blocks on a forward):

1. ``_schedule()``  admit waiting requests into free slots and prefill them one by one
   (reusing the longest cached prefix of a recently finished request);
2. ``_execute()``   one batched decode forward of all older running requests (a 4D mask hides
   each row's unused cache positions; positions are per row);
3. ``_update()``    sample with each request's own ``torch.Generator``, append, finish on
   eos / stop ids / stop strings / max_tokens / context limit, resolve the caller's future.

Why not transformers' own continuous batching (``generate_batch`` / ``ContinuousBatchingManager``,
transformers 5.24): it samples the whole batch with one ``torch.multinomial`` on the global RNG
(no per-request seed, so a request's tokens depend on its batch-mates), its logprobs are taken
after temperature/top-p processing (our contract, base.py, wants raw-logit log-softmax), sampling
settings are per manager rather than per request, and it has no stop strings or abort-with-partial
output. The model forward itself is still transformers': we only pass our own cache object, a 4D
mask and position ids.

Weight updates (``weight_update_policy``): ``"drain"`` (default) stops admitting requests, lets
in-flight ones finish on the old weights, then loads the new ones, so every response comes from
one weights version; ``"abort"`` ends in-flight requests at once with finish_reason ``"abort"``
(their partial tokens are returned). Either way the prefix cache is cleared.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import queue
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import anyio
import structlog
import torch

from agentloop.engine._kv import PrefixCache, SlotKVCache
from agentloop.engine._sampling import sample_batch
from agentloop.engine.base import SamplingParams, TokenOutput
from agentloop.errors import ContextLengthExceededError, EngineError

log = structlog.get_logger(__name__)


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future[TokenOutput]
    loop: asyncio.AbstractEventLoop
    generator: torch.Generator
    end_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    kv_len: int = 0  # tokens whose keys/values are in the cache
    slot: int = -1
    num_cached: int = 0


class TorchEngine:
    """Continuous-batching engine over a transformers causal LM (see module docstring)."""

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
        weight_update_policy: Literal["drain", "abort"] = "drain",
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if weight_update_policy not in ("drain", "abort"):
            raise ValueError(f"weight_update_policy must be 'drain' or 'abort', got {weight_update_policy!r}")
        dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
        if isinstance(model, str | Path):
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(model)
            model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa")
        model = cast(Any, model)
        if tokenizer is None:
            raise ValueError("a preloaded model needs its tokenizer: TorchEngine(model, tokenizer)")
        self._model = model.to(device=device, dtype=dtype).eval()
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
        sampling = self._check_sampling(sampling)
        prompt = self._check_prompt(prompt_ids)
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id must be a non-empty string or None, got {request_id!r}")
        if rid in self._inflight:
            raise ValueError(f"request_id {rid!r} is already in flight; use a unique id per request")
        loop = asyncio.get_running_loop()
        gen = torch.Generator()
        gen.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
        end_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self._eos_ids)
        req = _Request(rid, prompt, sampling, loop.create_future(), loop, gen, end_ids)
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
        if not isinstance(named_tensors, Mapping) or not named_tensors:
            raise ValueError("update_weights expects a non-empty mapping of parameter name -> tensor")
        unknown = sorted(k for k in named_tensors if k not in self._param_shapes)
        if unknown:
            raise ValueError(
                f"update_weights got {len(unknown)} unknown parameter name(s), e.g. {unknown[:3]}; "
                f"expected names of the model's state_dict such as {next(iter(self._param_shapes))!r}"
            )
        for k, t in named_tensors.items():
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != self._param_shapes[k]:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"update_weights: {k!r} must be a tensor of shape {self._param_shapes[k]}, got {got}"
                )
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        await self.start()
        self._inbox.put(("update", (dict(named_tensors), fut, loop)))
        return await fut

    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = dict(self._stats)
        steps = s.get("decode_steps", 0)
        s["mean_decode_batch"] = s.get("decode_rows", 0) / steps if steps else 0.0
        s.update(
            running=len(self._running), waiting=len(self._waiting), weights_version=self._weights_version
        )
        return s

    # ------------------------------------------------------------------ validation
    @staticmethod
    def _check_sampling(sampling: Any) -> SamplingParams:
        if sampling is None:
            return SamplingParams.model_validate({})
        if isinstance(sampling, Mapping):
            return SamplingParams.model_validate(sampling)
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams or a dict, got {type(sampling).__name__}")
        return sampling

    def _check_prompt(self, prompt_ids: Any) -> list[int]:
        if not isinstance(prompt_ids, list | tuple) or not prompt_ids:
            raise ValueError(
                f"prompt_ids must be a non-empty list of token ids, got {type(prompt_ids).__name__}"
            )
        for i, t in enumerate(prompt_ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self._vocab_size:
                raise ValueError(f"prompt_ids[{i}] must be an int in [0, {self._vocab_size}), got {t!r}")
        if len(prompt_ids) + 1 > self._max_context:
            raise ContextLengthExceededError(
                f"prompt has {len(prompt_ids)} tokens; the context holds {self._max_context} "
                f"(prompt + at least 1 generated token); shorten the prompt"
            )
        return list(prompt_ids)

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        log.info(
            "engine.start", device=str(self._device), max_batch=self._max_batch, max_context=self._max_context
        )
        with torch.inference_mode():
            while True:
                busy = bool(self._running or self._waiting or self._updates)
                try:
                    cmds = [] if busy else [self._inbox.get()]
                    while True:
                        cmds.append(self._inbox.get_nowait())
                except queue.Empty:
                    pass
                if any(c[0] == "stop" for c in cmds):
                    self._shutdown(cmds)
                    return
                for kind, arg in cmds:
                    self._command(kind, arg)
                self._step()

    def _command(self, kind: str, arg: Any) -> None:
        if kind == "add":
            self._waiting.append(arg)
            self._stats["requests"] += 1
        elif kind == "update":
            self._updates.append(arg)
            if self._policy == "abort":
                for req in list(self._running):
                    self._finish(req, "abort")
        elif kind == "abort":
            for req in [*self._waiting, *self._running]:
                if req.request_id == arg:
                    self._finish(req, "abort")

    def _step(self) -> None:
        if self._updates and not self._running:
            self._apply_updates()
        new = self._schedule() if not self._updates else []
        old = [r for r in self._running if r not in new]
        if old:
            try:
                logits = self._execute(old)
            except Exception as exc:  # never hang a caller: fail the batch, keep serving
                log.exception("engine.decode_failed", batch=len(old))
                for req in old:
                    self._fail(req, exc)
                return
            self._update(old, logits)

    def _schedule(self) -> list[_Request]:
        """Admit waiting requests while slots are free; prefill each and sample its first token."""
        admitted: list[_Request] = []
        while self._waiting and len(self._running) < self._max_batch:
            req = self._waiting.popleft()
            req.slot = len(self._running)
            self._running.append(req)
            try:
                logits = self._prefill(req)
            except Exception as exc:
                log.exception("engine.prefill_failed", request_id=req.request_id)
                self._fail(req, exc)
                continue
            admitted.append(req)
            self._update([req], logits)
        return admitted

    def _prefill(self, req: _Request) -> torch.Tensor:
        prompt = req.prompt_ids
        cached = self._prefix.lookup(prompt, self._cache, req.slot, max_len=len(prompt) - 1)
        req.num_cached = cached
        self._stats["prompt_tokens"] += len(prompt)
        self._stats["cached_prompt_tokens"] += cached
        self._stats["prefix_cache_hits"] += int(cached > 0)
        ids = torch.tensor([prompt[cached:]], device=self._device)
        pos = torch.arange(cached, len(prompt), device=self._device)[None]
        self._cache.ensure_capacity(len(prompt) + 1)
        mask = self._cache.set_prefill(req.slot, cached, len(prompt) - cached)
        out = self._model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                          logits_to_keep=1, **{self._cache_kw: self._cache})  # fmt: skip
        req.kv_len = len(prompt)
        return out.logits[:, -1].float()  # (1, V)

    def _execute(self, reqs: list[_Request]) -> torch.Tensor:
        """One batched decode forward for ``reqs`` (all in slots 0..n-1); returns (n, V) logits."""
        n = len(reqs)
        reqs.sort(key=lambda r: r.slot)
        assert [r.slot for r in reqs] == list(range(n)), "decode rows must be the compact slots 0..n-1"
        ids = torch.tensor([[r.output_ids[-1]] for r in reqs], device=self._device)
        pos = torch.tensor([[r.kv_len] for r in reqs], device=self._device)
        self._cache.ensure_capacity(max(r.kv_len for r in reqs) + 1)
        mask = self._cache.set_decode(pos[:, 0])
        out = self._model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                          logits_to_keep=1, **{self._cache_kw: self._cache})  # fmt: skip
        for r in reqs:
            r.kv_len += 1
        self._stats["decode_steps"] += 1
        self._stats["decode_rows"] += n
        return out.logits[:, -1].float()

    def _update(self, reqs: list[_Request], logits: torch.Tensor) -> None:
        """Sample one token per request, append it, and finish the requests that are done."""
        tokens, logprobs = sample_batch(logits, [r.sampling for r in reqs], [r.generator for r in reqs])
        for req, tok, lp in zip(reqs, tokens, logprobs, strict=True):
            req.output_ids.append(tok)
            req.logprobs.append(lp)
            self._stats["generated_tokens"] += 1
            reason = self._finish_reason(req, tok)
            if reason is not None:
                self._finish(req, reason)

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

    def _finish(self, req: _Request, reason: Literal["stop", "length", "abort"]) -> None:
        if req.slot >= 0 and reason != "abort" and req.kv_len > 0:
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
        )
        req.loop.call_soon_threadsafe(_resolve, req.future, out, None)

    def _fail(self, req: _Request, exc: BaseException) -> None:
        self._release(req)
        self._stats["failed"] += 1
        err = EngineError(f"engine step failed for request {req.request_id}: {type(exc).__name__}: {exc}")
        req.loop.call_soon_threadsafe(_resolve, req.future, None, err)

    def _apply_updates(self) -> None:
        for tensors, fut, loop in self._updates:
            try:
                params = dict(self._model.named_parameters(remove_duplicate=False))
                params.update(dict(self._model.named_buffers()))
                for name, t in tensors.items():
                    params[name].copy_(t.to(device=params[name].device, dtype=params[name].dtype))
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


def _resolve(fut: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)
