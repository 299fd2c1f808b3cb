"""Several engine replicas behind one InferenceEngine: Ray actors, balanced by load, sticky per attempt.

    proxy ─► EngineReplicaPool.generate(prompt_ids, sampling, request_id="<routing key>/<unique>")
                 │ routing key seen before?  ─► the same replica (its prefix cache holds the turns)
                 │ else                      ─► the replica with the fewest requests in flight
                 └► EngineReplica (Ray actor: a TorchEngine on its own GPU, or on CPU)

Routing key: the part of ``request_id`` before its last ``/``. The proxy names its requests
``<attempt key>/req-<random>``, so every call of one attempt lands on the same replica (multi-turn
prefix reuse) while attempts spread over replicas. A request id without ``/`` is routed by load only.

``update_weights`` puts the weights into the Ray object store once (``ray.put``) and every replica
loads them from there, concurrently; the time it took is ``stats()["last_sync_s"]``. A trainer with
data-parallel ranks has a faster path (CUDA IPC / NCCL, no object store): trainer/distributed/weight_sync.py,
through ``EngineReplica.call`` and ``note_sync``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import structlog
import torch

from agentloop.cpu_binding import CpuBinding, bind_gpu_process, check_mode
from agentloop.engine._bursts import Answer, as_finished, labelled
from agentloop.engine.base import SamplingParams, TokenOutput
from agentloop.errors import EngineError

log = structlog.get_logger("agentloop.engine.replicas")

_MAX_STICKY = 100_000  # routing keys remembered (least recently used dropped first)


def routing_key(request_id: str | None) -> str | None:
    """The sticky key of a request id ``"<key>/<unique>"``; None when there is none."""
    if not request_id:
        return None
    key, sep, _ = request_id.rpartition("/")
    return key if sep and key else None


class EngineReplica:
    """One engine in a Ray actor (async): a TorchEngine built from ``model_path`` on ``device``."""

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        engine_kwargs: dict[str, Any] | None = None,
        cpu_binding: CpuBinding = "none",
    ) -> None:
        from agentloop.engine.factory import load_engine

        if device.startswith("cuda"):
            device = "cuda:0"  # Ray's CUDA_VISIBLE_DEVICES shows this actor its own GPU
            bind_gpu_process(cpu_binding)  # before the engine starts its thread, which inherits it
        self.model_path = model_path
        self.engine = load_engine(model_path, device=device, **(engine_kwargs or {}))
        self.requests = 0
        self.extensions: dict[str, Any] = {}  # state of functions run through ``call``

    def info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "max_context": self.engine.max_context,
            "weights_version": self.engine.weights_version,
            "weight_update_policy": getattr(self.engine, "weight_update_policy", None),
            "requests": self.requests,
        }

    async def start(self) -> None:
        await self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None
    ) -> TokenOutput:
        self.requests += 1
        return await self.engine.generate(prompt_ids, sampling, request_id=request_id)

    async def generate_many(
        self, requests: list[tuple[list[int], SamplingParams, str]]
    ) -> AsyncIterator[Answer]:
        """Run ``requests`` (prompt ids, sampling, request id) at once and yield ``(request_id, output
        or error)`` as each finishes: a Ray streaming generator, so a burst of requests costs one actor
        call instead of one each. An engine with ``generate_many`` (TorchEngine) gets the burst whole, so
        it admits it together. Closing the stream aborts what is still running."""
        self.requests += len(requests)
        if hasattr(self.engine, "generate_many"):
            stream = self.engine.generate_many(requests)
        else:
            stream = as_finished(
                [labelled(rid, self.engine.generate(p, s, request_id=rid)) for p, s, rid in requests]
            )
        async with contextlib.aclosing(stream) as answers:  # closing this stream closes the engine's now
            async for answer in answers:
                yield answer

    async def abort(self, request_id: str) -> bool:
        return bool(await self.engine.abort(request_id))

    async def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> int:
        return int(await self.engine.update_weights(named_tensors))

    def stats(self) -> dict[str, Any]:
        return {**self.engine.stats(), "requests": self.requests}

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(self, *args)`` (awaited when it is a coroutine function) in this replica: how a
        trainer loads weights by CUDA IPC or a broadcast (trainer/distributed/weight_sync.py) without agentloop
        importing the trainer, as vLLM's ``collective_rpc`` does. Blocking work belongs in a thread."""
        out = fn(self, *args)
        return await out if inspect.isawaitable(out) else out


class EngineReplicaPool:
    """An InferenceEngine over ``replicas`` (EngineReplica actor handles); see the module docstring."""

    def __init__(self, replicas: list[Any], tokenizer: Any = None, batch_submit: bool = True) -> None:
        import ray

        if not isinstance(replicas, list | tuple) or not replicas:
            raise ValueError(
                f"EngineReplicaPool needs a non-empty list of replica actor handles, got {replicas!r:.80}"
            )
        self.replicas = list(replicas)
        info = ray.get(self.replicas[0].info.remote())
        self._max_context = int(info["max_context"])
        self._model_path = str(info["model_path"])
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self._model_path)  # loaded here, not shipped over Ray
        self._tokenizer = tokenizer
        self._version = int(info["weights_version"])
        self._policy: str | None = info.get("weight_update_policy")
        self._inflight = [0] * len(self.replicas)
        self._routed = [0] * len(self.replicas)
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._owner: dict[str, int] = {}
        self._next = 0  # tie-break among equally loaded replicas: round robin
        # requests made in one event-loop tick go to their replica in one streaming call (_flush);
        # batch_submit=False makes one actor call per request (the A/B baseline in scale_bench)
        self.batch_submit = batch_submit
        self._pending: list[list[tuple[list[int], SamplingParams, str]]] = [[] for _ in self.replicas]
        self._waiters: dict[str, asyncio.Future[TokenOutput]] = {}
        self._streams: set[asyncio.Task[None]] = set()
        self._sync: dict[str, float] = {"last_sync_s": 0.0, "syncs": 0.0, "total_sync_s": 0.0}

    @classmethod
    def create(
        cls,
        model_path: str,
        replicas: int,
        device: str = "cpu",
        *,
        actor_options: Callable[[int], dict[str, Any]] | None = None,
        cpu_binding: CpuBinding = "none",
        **engine_kwargs: Any,
    ) -> EngineReplicaPool:
        """Start ``replicas`` EngineReplica actors (Ray must be initialised): one GPU each on CUDA,
        each pinned to CPUs as ``cpu_binding`` says (agentloop/cpu_binding.py)."""
        import ray

        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        check_mode(cpu_binding)  # here, not in each actor
        default = {"num_gpus": 1, "num_cpus": 0} if device.startswith("cuda") else {"num_cpus": 0}
        handles = [
            ray.remote(EngineReplica)
            .options(max_concurrency=1000, **(actor_options(i) if actor_options else default))
            .remote(model_path, device, engine_kwargs, cpu_binding)
            for i in range(replicas)
        ]
        # ray's stubs type actor-handle methods as plain functions, without .remote
        ray.get([h.start.remote() for h in handles])  # type: ignore[attr-defined]
        log.info("replicas.ready", replicas=replicas, device=device)
        return cls(handles)

    # ------------------------------------------------------------ InferenceEngine

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def weights_version(self) -> int:
        return self._version

    @property
    def weight_update_policy(self) -> str | None:
        """The replicas' weight update policy (the first replica's; they are built alike)."""
        return self._policy

    def pick(self, request_id: str | None) -> int:
        """The replica for ``request_id``: its routing key's replica, else the least loaded one."""
        key = routing_key(request_id)
        if key is not None and key in self._sticky:
            self._sticky.move_to_end(key)
            return self._sticky[key]
        n = len(self.replicas)
        order = [(self._next + i) % n for i in range(n)]
        idx = min(order, key=lambda i: self._inflight[i])
        self._next = (idx + 1) % n
        if key is not None:
            self._sticky[key] = idx
            if len(self._sticky) > _MAX_STICKY:
                self._sticky.popitem(last=False)
        return idx

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> TokenOutput:
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id must be a non-empty string or None, got {request_id!r}")
        if rid in self._owner:
            raise ValueError(f"request_id {rid!r} is already in flight; use a unique id per request")
        idx = self.pick(rid)
        self._inflight[idx] += 1
        self._routed[idx] += 1
        self._owner[rid] = idx
        try:
            if self.batch_submit:
                return await self._queue(idx, prompt_ids, sampling, rid)
            return await self.replicas[idx].generate.remote(prompt_ids, sampling, rid)  # type: ignore[no-any-return]
        except asyncio.CancelledError:
            if not self._unqueue(idx, rid):  # already sent: abort it on its replica
                await asyncio.shield(self._abort_on(idx, rid))
            raise
        finally:
            self._inflight[idx] -= 1
            self._owner.pop(rid, None)
            self._waiters.pop(rid, None)

    def _queue(
        self, idx: int, prompt_ids: list[int], sampling: SamplingParams, rid: str
    ) -> asyncio.Future[TokenOutput]:
        """Queue a request for replica ``idx``'s next flush (scheduled by the first of this tick)."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[TokenOutput] = loop.create_future()
        self._waiters[rid] = waiter
        pending = self._pending[idx]
        pending.append((prompt_ids, sampling, rid))
        if len(pending) == 1:
            loop.call_soon(self._flush, idx)
        return waiter

    def _unqueue(self, idx: int, rid: str) -> bool:
        """Take a request not sent yet out of replica ``idx``'s queue; False when it is not there."""
        queue = self._pending[idx]
        queued = next((r for r in queue if r[2] == rid), None)
        if queued is not None:
            queue.remove(queued)
        return queued is not None

    def _flush(self, idx: int) -> None:
        """Send replica ``idx`` the requests queued for it this tick, as one streaming call."""
        batch, self._pending[idx] = self._pending[idx], []
        if not batch:
            return
        stream = self.replicas[idx].generate_many.options(num_returns="streaming").remote(batch)
        task = asyncio.get_running_loop().create_task(self._collect(idx, stream, [r for _, _, r in batch]))
        self._streams.add(task)
        task.add_done_callback(self._streams.discard)

    async def _collect(self, idx: int, stream: Any, rids: list[str]) -> None:
        """Resolve each request's waiter as its result comes back; a broken stream fails the rest."""
        error: Exception | None = None
        try:
            async for ref in stream:
                rid, out = await ref
                waiter = self._waiters.get(rid)
                if waiter is None or waiter.done():
                    continue
                if isinstance(out, Exception):
                    waiter.set_exception(out)
                else:
                    waiter.set_result(out)
        except Exception as exc:  # the replica died or the stream broke
            error = exc
        for rid in rids:
            waiter = self._waiters.get(rid)
            if waiter is not None and not waiter.done():
                reason = f"{type(error).__name__}: {error}" if error else "its stream ended without a result"
                waiter.set_exception(EngineError(f"replica {idx} failed request {rid}: {reason}"))

    async def _abort_on(self, idx: int, request_id: str) -> bool:
        return bool(await self.replicas[idx].abort.remote(request_id))

    async def abort(self, request_id: str) -> bool:
        idx = self._owner.get(request_id)
        return False if idx is None else await self._abort_on(idx, request_id)

    async def update_weights(self, named_tensors: Mapping[str, torch.Tensor] | Any) -> int:
        """Put the weights into the object store once; every replica loads them. Returns the new version.

        ``named_tensors`` may already be an ObjectRef (e.g. what a trainer actor returned)."""
        import ray

        t0 = time.perf_counter()
        if isinstance(named_tensors, ray.ObjectRef):
            ref = named_tensors
        else:
            if not isinstance(named_tensors, Mapping) or not named_tensors:
                raise ValueError("update_weights expects a non-empty mapping of parameter name -> tensor")
            ref = ray.put(dict(named_tensors))
        versions = await asyncio.gather(*[r.update_weights.remote(ref) for r in self.replicas])
        return self.note_sync(versions, time.perf_counter() - t0)

    def note_sync(self, versions: list[int], seconds: float) -> int:
        """Record a weight sync that reached every replica (``versions``: each one's new version), as
        done by ``update_weights`` or by a trainer's direct path; returns the pool's new version."""
        if len(versions) != len(self.replicas):
            raise ValueError(
                f"note_sync needs one version per replica ({len(self.replicas)}), got {versions}"
            )
        if len(set(versions)) != 1:
            log.warning("replicas.version_skew", versions=versions)
        self._version = max(versions)
        self._sync["last_sync_s"] = seconds
        self._sync["syncs"] += 1
        self._sync["total_sync_s"] += seconds
        log.info("replicas.weights_synced", version=self._version, seconds=round(seconds, 4))
        return self._version

    def stats(self) -> dict[str, Any]:
        """Pool counters: requests routed to and in flight on each replica, weight-sync timings."""
        return {
            "replicas": len(self.replicas),
            "routed": list(self._routed),
            "in_flight": list(self._inflight),
            "sticky_keys": len(self._sticky),
            "weights_version": self._version,
            **self._sync,
        }

    async def replica_stats(self) -> list[dict[str, Any]]:
        """Each replica engine's own stats (one Ray call each)."""
        return list(await asyncio.gather(*[r.stats.remote() for r in self.replicas]))

    async def start(self) -> None:
        await asyncio.gather(*[r.start.remote() for r in self.replicas])

    async def stop(self) -> None:
        await asyncio.gather(*[r.stop.remote() for r in self.replicas])


__all__ = ["EngineReplica", "EngineReplicaPool", "routing_key"]
