"""VLLMEngine: vLLM's ``AsyncLLM`` (v1) behind the token-level ``InferenceEngine`` contract.

Token ids in (``TokensPrompt``, no text round trip), token ids and per-token logprobs out.

Logprobs: base.py wants the sampling policy's, ``log_softmax(logits / T)[token]`` (raw logits when
``T = 0``; top-k / top-p not renormalised), which the trainer recomputes at each sample's temperature.
vLLM 0.26 offers four ``logprobs_mode``s (``vllm/config/model.py``): ``raw_*`` are taken before any
processing (no temperature), ``processed_*`` after temperature AND the top-k / top-p mask
(``TopKTopPSampler.forward_native`` in ``vllm/v1/sample/ops/topk_topp_sampler.py`` masks, then takes
``log_softmax``); none stops after temperature. We run ``processed_logprobs``:

- ``top_p == 1`` and ``top_k == 0``: exactly ``log_softmax(logits / T)``; a greedy request is
  divided by 1 (``Sampler.apply_temperature``), or, in an all-greedy batch, not divided at all,
  so it gets the raw logits' (``vllm/v1/sample/sampler.py``);
- ``top_p < 1`` or ``top_k > 0``: renormalised over the kept tokens, i.e. higher than the policy's by
  ``-log(kept mass)`` (at most ``-log(top_p)`` for top-p alone: 0.105 at 0.9; unbounded for top-k).
  The first such request logs ``engine.vllm_logprobs_renormalised``. Rollout correction (truncated
  IS) then sees a bias; sample with top-p/top-k off, or recompute old log-probs in the trainer;
- ``0 < T < 0.01``: vLLM raises the temperature to 0.01 (and warns), for the token and the logprob.

Prefix caching is on (vLLM caches whole KV blocks, so a next turn reuses the previous turn's prompt and
response rounded down to the block size). Requests ask for ``FINAL_ONLY`` outputs (one message per
request). With ``live_stats=True`` a vLLM stat logger keeps per-step counters (generated tokens while
requests run, decode steps, batch sizes); without it tokens are counted when a request finishes.

AsyncLLM binds its sockets and output task to one event loop, so it lives on a private loop in a
background thread and every public method hops there: the engine works from any event loop (each
test's, the proxy's, a Ray actor's) and cancelling the awaiting task aborts the request in vLLM.

Weight updates: the new tensors are packed into one flat CUDA buffer in the engine's dtype, on the
GPU they come from (the trainer's: the engine's own when colocated, another GPU of the host when
split; CPU tensors go to the engine's GPU), and handed to vLLM's worker as a CUDA IPC handle through
``collective_rpc`` into ``AgentloopWorkerExtension`` (vLLM's ``worker_extension_cls``), which views
the buffer and calls ``model.load_weights`` (Hugging Face names, fused qkv / gate_up handled by
vLLM). ``weight_update_policy="drain"`` pauses the scheduler until in-flight requests finish on the
old weights (``pause_generation(mode="wait")``); ``"abort"`` ends them at once (finish_reason
``"abort"`` with their partial tokens); ``"inflight"`` aborts them too and then resumes each one
(a partial rollout: its prompt plus the tokens it has go back in, so nothing already generated is
lost and nobody waits for the slowest request), the tokens labelled with the version that sampled
them (``TokenOutput.token_versions``). The prefix cache is cleared with the old weights either way.
The weights version moves on the engine loop (where each request reads it when it finishes) before
generation resumes, so a request served by the new weights never carries the old version.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import importlib.util
import json
import os
import pickle
import threading
import time
import uuid
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar, cast

import structlog
import torch

from agentloop.engine.base import (
    WEIGHT_UPDATE_POLICIES,
    FinishReason,
    SamplingParams,
    TokenOutput,
    WeightUpdatePolicy,
    check_named_tensors,
    check_prompt,
    check_sampling,
)
from agentloop.engine.models import context_limit
from agentloop.errors import EngineError

log = structlog.get_logger(__name__)
T = TypeVar("T")

_VLLM_MISSING = "backend='vllm' needs vLLM, which is not installed: pip install -e '.[vllm]' in a clone of agentloop (the vllm extra; no release is on PyPI)"
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def _param_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of a Hugging Face folder, read from safetensors headers only."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                shapes[k] = tuple(st.get_slice(k).get_shape())
    if not shapes:
        raise EngineError(f"{model_dir} holds no *.safetensors weights; vLLM needs a safetensors checkpoint")
    return shapes


class AgentloopWorkerExtension:
    """Mixed into vLLM's GPU worker (``worker_extension_cls``); runs inside the engine-core process."""

    def agentloop_load_packed(self, payload: bytes) -> int:
        """Load weights from a packed CUDA IPC buffer; returns how many tensors were loaded."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        meta = pickle.loads(payload)
        args = list(meta["handle"])
        # rebuild on the GPU the buffer lives on, in this process's numbering: the worker's own GPU
        # when colocated, another visible GPU when the trainer sits there (the load then copies
        # GPU to GPU); device indices differ between processes with different CUDA_VISIBLE_DEVICES
        args[6] = _local_device_index(meta.get("device_uuid"), self.device.index)  # type: ignore[attr-defined]
        flat = rebuild_cuda_tensor(*args)
        weights = [
            (name, flat[off : off + n].view(shape))
            for name, off, n, shape in zip(
                meta["names"], meta["offsets"], meta["numels"], meta["shapes"], strict=True
            )
        ]
        self.model_runner.get_model().load_weights(weights=weights)  # type: ignore[attr-defined]
        torch.cuda.synchronize()  # the sender frees the buffer once this call returns
        del weights, flat
        return len(meta["names"])

    def agentloop_param_sum(self, name: str) -> float:
        """Sum of one vLLM parameter (vLLM's own, possibly fused, name); used by tests."""
        params = dict(self.model_runner.get_model().named_parameters())  # type: ignore[attr-defined]
        return float(params[name].float().sum())


def _stat_logger_factory(engine: VLLMEngine) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Counters(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, *a: Any, **k: Any) -> None:
            engine._record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return _Counters


class VLLMEngine:
    """The InferenceEngine contract on vLLM's AsyncLLM (see module docstring)."""

    def __init__(
        self,
        model: str | Path,
        tokenizer: Any = None,
        *,
        dtype: str = "auto",
        max_context: int | None = None,
        max_batch_size: int = 256,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = False,
        enable_prefix_caching: bool = True,
        enable_sleep_mode: bool = False,
        weight_update_policy: WeightUpdatePolicy = "drain",
        live_stats: bool = False,
        seed: int = 0,
        **vllm_kwargs: Any,
    ) -> None:
        path = _checked_folder(model, weight_update_policy, gpu_memory_utilization, max_batch_size)
        from transformers import AutoTokenizer

        cfg = json.loads((path / "config.json").read_text())
        limit = context_limit(cfg)
        if max_context is not None and limit is not None and max_context > limit:
            raise ValueError(
                f"max_context ({max_context}) is above the model's limit of {limit} positions "
                f"(its config's max_position_embeddings); pass at most {limit}, or None for the model's own"
            )
        self._max_context = int(max_context or limit or 4096)  # None: the model's own, as vLLM's default
        if self._max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {max_context}")
        self._path = path
        self._tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
        self._vocab_size = int(cfg["vocab_size"])
        self._param_shapes, self._tied_aliases = _accepted_shapes(path, cfg)
        self._eos_ids = _eos_ids(path, cfg, self._tokenizer)
        self._policy = weight_update_policy
        self._live_stats = live_stats
        self._sleep_mode = enable_sleep_mode
        self._engine_args = dict(
            model=str(path),
            dtype=dtype,
            max_model_len=self._max_context,
            max_num_seqs=max_batch_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            enable_sleep_mode=enable_sleep_mode,
            logprobs_mode="processed_logprobs",  # after temperature (module docstring)
            max_logprobs=1,
            seed=seed,
            generation_config="vllm",
            worker_extension_cls=f"{__name__}.AgentloopWorkerExtension",
            disable_log_stats=True,
            **vllm_kwargs,
        )
        self._init_run_state()

    def _init_run_state(self) -> None:
        """What the engine holds once started: vLLM, its loop and thread, the requests in flight,
        counters and the weights version."""
        self._llm: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._ready: concurrent.futures.Future[None] | None = None
        self._inflight: set[str] = set()
        self._live: dict[str, str] = {}  # request id -> vLLM's id of its running segment (engine loop)
        self._preempted: dict[str, bool] = {}  # requests an "inflight" update aborted, to resume
        self._resumed: asyncio.Event | None = None  # created on the engine loop (_resumed_event)
        self._stats = collections.Counter[str]()
        self._waiting = 0
        self._weights_version = 0
        self._warned_renormalised = False
        self.last_update: dict[str, float] = {}

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
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face parameter names -> shapes that ``update_weights`` accepts."""
        return dict(self._param_shapes)

    async def start(self) -> None:
        """Start the engine thread and vLLM (idempotent; ``generate`` calls it too). Takes seconds."""
        with self._start_lock:
            if self._ready is None:
                os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # CUDA may be up here
                loop = asyncio.new_event_loop()
                self._loop = loop
                self._thread = threading.Thread(target=loop.run_forever, name="agentloop-vllm", daemon=True)
                self._thread.start()
                self._ready = asyncio.run_coroutine_threadsafe(self._create(), loop)
            ready = self._ready
        if ready.done() and ready.exception() is None:
            return
        try:
            await asyncio.wrap_future(ready)
        except BaseException:
            await self.stop()
            raise

    async def _create(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        t0 = time.perf_counter()
        loggers = [_stat_logger_factory(self)] if self._live_stats else None
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._engine_args), stat_loggers=loggers)
        log.info(
            "engine.start", backend="vllm", model=str(self._path), init_s=round(time.perf_counter() - t0, 2)
        )

    async def stop(self) -> None:
        """Shut vLLM down; in-flight requests end with finish_reason ``"abort"`` or an EngineError."""
        with self._start_lock:
            loop, thread, ready = self._loop, self._thread, self._ready
            self._loop = self._thread = self._ready = None
        if loop is None or thread is None:
            return
        if ready is not None:
            await asyncio.to_thread(lambda: concurrent.futures.wait([ready]))
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_shutdown(llm), loop))
        loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join)
        loop.close()
        log.info("engine.stop", backend="vllm")

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
        if sampling.logprobs and sampling.temperature > 0 and (sampling.top_p < 1.0 or sampling.top_k > 0):
            self._warn_renormalised(sampling)
        self._inflight.add(rid)
        try:
            await self.start()
            return await self._on_loop(self._generate(prompt, sampling, rid))
        finally:
            self._inflight.discard(rid)

    async def abort(self, request_id: str) -> bool:
        """End a waiting or running request with finish_reason ``"abort"``; True when it was found."""
        if request_id not in self._inflight or self._llm is None:
            return False
        await self._on_loop(self._abort(request_id))
        return True

    async def _abort(self, request_id: str) -> None:
        """On the engine loop: abort the request's running segment; it is not resumed."""
        self._preempted.pop(request_id, None)
        await self._llm.abort(self._live.get(request_id, request_id))

    async def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> int:
        """Load ``named_tensors`` (Hugging Face names, a subset of the checkpoint) without a restart."""
        check_named_tensors(named_tensors, self._param_shapes)
        await self.start()
        t0 = time.perf_counter()
        tensors = {k: v for k, v in named_tensors.items() if k not in self._tied_aliases}
        if not tensors:  # only a tied alias: nothing to load, the version still moves
            self._weights_version += 1
            return self._weights_version
        packed, meta = await asyncio.to_thread(_pack, tensors, self._model_dtype())
        t1 = time.perf_counter()
        payload = pickle.dumps(meta)
        try:
            version = await self._on_loop(self._load(payload))
        except Exception as exc:
            raise EngineError(f"weight update failed: {type(exc).__name__}: {exc}") from exc
        finally:
            del packed
        t2 = time.perf_counter()
        self.last_update = {
            "pack_s": t1 - t0,
            "load_s": t2 - t1,
            "total_s": t2 - t0,
            "bytes": float(meta["bytes"]),
            "tensors": float(len(meta["names"])),
        }
        log.info("engine.weights_updated", version=version, **self.last_update)
        return version

    async def sleep(self, level: int = 1) -> None:
        """Free GPU memory (level 1: offload weights, drop KV cache); needs ``enable_sleep_mode``."""
        if not self._sleep_mode:
            raise EngineError("sleep() needs VLLMEngine(..., enable_sleep_mode=True)")
        await self._on_loop(self._llm.sleep(level))

    async def wake_up(self) -> None:
        """Undo ``sleep()``."""
        if not self._sleep_mode:
            raise EngineError("wake_up() needs VLLMEngine(..., enable_sleep_mode=True)")
        await self._on_loop(self._llm.wake_up())

    async def param_sum(self, vllm_name: str) -> float:
        """Sum of one of vLLM's own parameters (e.g. ``model.norm.weight``), read in the worker."""
        (value,) = await self._on_loop(self._llm.collective_rpc("agentloop_param_sum", args=(vllm_name,)))
        return float(value)

    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = dict(self._stats)
        steps = s.get("decode_steps", 0)
        s["mean_decode_batch"] = s.get("decode_rows", 0) / steps if steps else 0.0
        s.update(
            running=len(self._inflight | set(self._live)),
            waiting=self._waiting if self._inflight else 0,
            weights_version=self._weights_version,
        )
        return s

    def reset_stats(self) -> None:
        """Zero the counters (tests share one engine)."""
        self._stats.clear()

    # ------------------------------------------------------------------ engine-loop side
    def _on_loop(self, coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        if self._loop is None:
            coro.close()
            raise EngineError("the vLLM engine is stopped; call await engine.start()")
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _record(self, sched: Any, it: Any) -> None:
        if it is not None and it.num_generation_tokens:
            self._stats["generated_tokens"] += it.num_generation_tokens
            self._stats["decode_steps"] += 1
            self._stats["decode_rows"] += it.num_generation_tokens
        if sched is not None:
            self._waiting = int(sched.num_waiting_reqs)

    def _vllm_sampling(self, prompt_len: int, sp: SamplingParams) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        stop_ids = list(sp.stop_token_ids) + ([] if sp.ignore_eos else self._eos_ids)
        return VSamplingParams(
            n=1,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            seed=sp.seed,
            max_tokens=min(sp.max_tokens, self._max_context - prompt_len),
            stop_token_ids=sorted(set(stop_ids)),
            stop=list(sp.stop) or None,
            include_stop_str_in_output=True,
            ignore_eos=sp.ignore_eos,
            logprobs=0 if sp.logprobs else None,
            detokenize=bool(sp.stop),  # only stop strings need text
            skip_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def _generate(self, prompt: list[int], sp: SamplingParams, rid: str) -> TokenOutput:
        """One request; under ``weight_update_policy="inflight"`` a request that a weight update
        pre-empted is resumed (a partial rollout): its prompt plus the tokens it already has go back
        in with the remaining ``max_tokens``, and every segment's tokens carry the version that
        sampled them. A resumed segment draws from a fresh random stream (vLLM seeds per request)."""
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        cached = 0
        self._stats["requests"] += 1
        self._stats["prompt_tokens"] += len(prompt)
        segment = 0
        try:
            while True:
                vid = rid if segment == 0 else f"{rid}#resume{segment}"
                remaining = sp.model_copy(update={"max_tokens": sp.max_tokens - len(tokens)})
                ids, lps, reason, hit = await self._segment(prompt + tokens, remaining, rid, vid)
                tokens += ids
                logprobs += lps or []
                versions += [self._weights_version] * len(ids)  # read as the segment ends (see _load)
                cached = hit if segment == 0 else cached
                resume = reason == "abort" and self._preempted.pop(rid, False) and len(tokens) < sp.max_tokens
                if not resume or len(prompt) + len(tokens) >= self._max_context:
                    break
                segment += 1
                self._stats["resumed"] += 1
                await self._resumed_event().wait()
        finally:  # an update may have marked it just as it finished
            self._preempted.pop(rid, None)
        self._stats[f"finished_{reason}"] += 1
        if not self._live_stats:
            self._stats["generated_tokens"] += len(tokens)
        self._stats["cached_prompt_tokens"] += cached
        self._stats["prefix_cache_hits"] += int(cached > 0)
        return TokenOutput(
            token_ids=tokens,
            logprobs=logprobs if sp.logprobs else None,
            finish_reason=reason,
            weights_version=self._weights_version,
            num_cached_prompt_tokens=cached,
            token_versions=versions,
        )

    async def _segment(
        self, prompt: list[int], sp: SamplingParams, rid: str, vid: str
    ) -> tuple[list[int], list[float] | None, FinishReason, int]:
        """Run ``prompt`` once in vLLM as request ``vid``: tokens, logprobs, finish reason, cached tokens."""
        from vllm.inputs import TokensPrompt

        vsp = self._vllm_sampling(len(prompt), sp)
        final = None
        self._live[rid] = vid
        try:
            async for out in self._llm.generate(TokensPrompt(prompt_token_ids=prompt), vsp, request_id=vid):
                final = out
        except asyncio.CancelledError:
            self._stats["finished_abort"] += 1
            raise
        except Exception as exc:
            self._stats["failed"] += 1
            raise EngineError(f"vLLM failed request {rid}: {type(exc).__name__}: {exc}") from exc
        finally:
            self._live.pop(rid, None)
        if final is None or not final.outputs:
            self._stats["failed"] += 1
            raise EngineError(f"vLLM returned no output for request {rid}")
        o = final.outputs[0]
        ids = list(o.token_ids)
        reason = cast(FinishReason, _FINISH.get(str(o.finish_reason), "stop"))
        logprobs = None
        if sp.logprobs:
            logprobs = [float(d[t].logprob) for t, d in zip(ids, o.logprobs or [], strict=False)]
            if len(logprobs) != len(ids):
                raise EngineError(f"vLLM returned {len(logprobs)} logprobs for {len(ids)} tokens ({rid})")
        return ids, logprobs, reason, int(final.num_cached_tokens or 0)

    def _resumed_event(self) -> asyncio.Event:
        """Set while generation runs; cleared by ``_load`` between its pause and its resume."""
        if self._resumed is None:
            self._resumed = asyncio.Event()
            self._resumed.set()
        return self._resumed

    async def _load(self, payload: bytes) -> int:
        """On the engine loop: pause generation, load the packed weights, bump the version, clear the
        prefix cache, resume; returns the new version. The bump comes before ``resume_generation``
        and on this loop, where ``_generate`` reads the version as a request finishes: a request
        that runs on the new weights cannot be labelled with the old version (bumped after the
        resume, a fast one could). A request that finished on the old weights reads the version
        when its final output reaches it: ``pause_generation`` returns once the engine is idle plus
        20 ms for those outputs to be delivered, and the load is a round trip to the worker after
        that, so it reads the old one. A failed load leaves the version alone and still resumes."""
        mode = "wait" if self._policy == "drain" else "abort"
        resumed = self._resumed_event()
        if self._policy == "inflight":  # the running requests go back in after the load (_generate)
            self._preempted.update(dict.fromkeys(self._live, True))
        resumed.clear()
        await self._llm.pause_generation(mode=mode, clear_cache=True)
        try:
            await self._llm.collective_rpc("agentloop_load_packed", args=(payload,))
            self._weights_version += 1  # the weights are in: from now on, requests carry the new version
            await self._llm.reset_prefix_cache()
        finally:
            await self._llm.resume_generation()
            resumed.set()
        return self._weights_version

    def _warn_renormalised(self, sampling: SamplingParams) -> None:
        """Once per engine: a top-p / top-k request gets renormalised logprobs (module docstring)."""
        if self._warned_renormalised:
            return
        self._warned_renormalised = True
        log.warning(
            "engine.vllm_logprobs_renormalised", top_p=sampling.top_p, top_k=sampling.top_k,
            detail="vLLM reports top-p/top-k logprobs renormalised over the kept tokens: higher than "
            "the sampling policy's log_softmax(logits / T) by -log(kept mass); sample with top_p=1, "
            "top_k=0 or recompute old log-probs in the trainer",
        )  # fmt: skip

    # ------------------------------------------------------------------ helpers
    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype vLLM holds the weights in (what ``update_weights`` casts to)."""
        return self._model_dtype()

    def _model_dtype(self) -> torch.dtype:
        if self._llm is not None:
            return self._llm.model_config.dtype
        return torch.bfloat16


def _checked_folder(
    model: str | Path,
    weight_update_policy: WeightUpdatePolicy,
    gpu_memory_utilization: float,
    max_batch_size: int,
) -> Path:
    """The model's local folder, once vLLM is installed and the arguments are in range (else an
    EngineError or ValueError saying which)."""
    if importlib.util.find_spec("vllm") is None:
        raise EngineError(_VLLM_MISSING)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"model must be a local Hugging Face folder with config.json, got {str(model)!r}")
    if weight_update_policy not in WEIGHT_UPDATE_POLICIES:
        raise ValueError(
            f"weight_update_policy must be one of {WEIGHT_UPDATE_POLICIES}, got {weight_update_policy!r}"
        )
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    return path


def _accepted_shapes(path: Path, cfg: dict[str, Any]) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """The parameter shapes ``update_weights`` accepts, and the names among them that are aliases of a
    tied embedding (accepted, not sent to vLLM)."""
    shapes = _param_shapes(path)
    tied: set[str] = set()
    if cfg.get("tie_word_embeddings") and "lm_head.weight" not in shapes:
        embed = next((v for k, v in shapes.items() if k.endswith("embed_tokens.weight")), None)
        if embed is not None:  # trainers send the tied head too; it is accepted and not sent to vLLM
            shapes["lm_head.weight"] = embed
            tied = {"lm_head.weight"}
    return shapes, tied


def _eos_ids(path: Path, cfg: dict[str, Any], tokenizer: Any) -> list[int]:
    """The tokens that end a sequence (sorted): the generation config's (else the model config's) and
    the tokenizer's."""
    eos: set[int] = set()
    gen = path / "generation_config.json"
    gen_eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else cfg.get("eos_token_id")
    eos.update([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return sorted(eos)


def _pack(
    named_tensors: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, dict[str, Any]]:
    """One flat CUDA buffer holding every tensor in ``dtype``, and its IPC handle + layout."""
    from torch.multiprocessing.reductions import reduce_tensor

    names, offsets, numels, shapes = [], [], [], []
    total = 0
    for name, t in named_tensors.items():
        names.append(name)
        offsets.append(total)
        numels.append(t.numel())
        shapes.append(tuple(t.shape))
        total += t.numel()
    device = next((t.device for t in named_tensors.values() if t.is_cuda), torch.device("cuda"))
    flat = torch.empty(total, dtype=dtype, device=device)
    with torch.no_grad():
        for off, n, t in zip(offsets, numels, named_tensors.values(), strict=True):
            flat[off : off + n].copy_(t.detach().reshape(-1), non_blocking=True)
    torch.cuda.current_stream(device).synchronize()
    _, handle = reduce_tensor(flat)
    meta = dict(handle=handle, names=names, offsets=offsets, numels=numels, shapes=shapes, bytes=flat.nbytes)
    meta["device_uuid"] = str(torch.cuda.get_device_properties(flat.device).uuid)
    return flat, meta


def _local_device_index(uuid: str | None, default: int) -> int:
    """This process's index of the GPU with ``uuid``; ``default`` when it is not visible here."""
    if uuid is not None:
        for i in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(i).uuid) == uuid:
                return i
    return default


async def _shutdown(llm: Any) -> None:
    llm.shutdown()


def logprob_gap(
    engine_logprobs: list[float] | torch.Tensor, reference_logprobs: list[float] | torch.Tensor
) -> dict[str, float]:
    """|engine - reference| over the sampled tokens of one response: mean, max and the ratio gap
    ``mean(exp(engine - reference) - 1)`` (what an importance weight would correct)."""
    e = torch.as_tensor(engine_logprobs, dtype=torch.float64)
    r = torch.as_tensor(reference_logprobs, dtype=torch.float64)
    if e.shape != r.shape or e.ndim != 1 or e.numel() == 0:
        raise ValueError(
            f"logprob_gap needs two non-empty 1-D sequences of one length, got {e.shape} and {r.shape}"
        )
    d = e - r
    return {
        "mean_abs": float(d.abs().mean()),
        "max_abs": float(d.abs().max()),
        "mean": float(d.mean()),
        "ratio_mean_abs": float((d.exp() - 1).abs().mean()),
    }


def reference_logprobs(
    model: Any, prompt_ids: list[int], token_ids: list[int], temperature: float = 1.0
) -> list[float]:
    """The trainer's view of the sampling policy (base.py): ``log_softmax(logits / temperature)`` of
    the model's logits (bf16 autocast on CUDA, as the actor computes them; raw logits when
    ``temperature`` is 0) at each response position, gathered at the response tokens. Pass the
    temperature the response was sampled at."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy, raw logits), got {temperature}")
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(token_ids)], device=device)
    with (
        torch.no_grad(),
        torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"),
    ):
        logits = model(input_ids=ids).logits[0]
    p = len(prompt_ids)
    scores = logits[p - 1 : -1].float()  # (n, V)
    if temperature > 0:
        scores = scores / temperature
    lp = scores.log_softmax(-1)
    return lp.gather(1, torch.tensor(token_ids, device=device)[:, None])[:, 0].tolist()
