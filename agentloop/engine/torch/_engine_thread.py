"""The engine thread's side of TorchEngine: its loop, scheduling, prefill, decode steps and answers.

``EngineThread`` holds the methods the dedicated thread runs (engine.py's docstring describes
one step; what it admits within the KV budget, and the long prompt it prefills a chunk per step, are
``_admission.KVAdmission``'s); ``TorchEngine`` inherits them and owns the state they work on, set up in its
``__init__``. The asyncio side only puts commands into ``_inbox`` and awaits each request's future,
which this thread resolves with ``resolve`` through the request's own event loop.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import time
from collections.abc import Callable
from typing import Any, Literal

import structlog
import torch

from agentloop.engine.base import TokenOutput, WeightUpdatePolicy
from agentloop.engine.torch._admission import KVAdmission
from agentloop.engine.torch._decode import DecodeRow, ModelRunner
from agentloop.engine.torch._kv import PrefixCache, SlotKVCache
from agentloop.engine.torch._request import Request
from agentloop.engine.torch._sampling import row_key, sample, sample_mode
from agentloop.errors import EngineError
from agentloop.event_loop import call_soon_from_thread

log = structlog.get_logger("agentloop.engine.torch.engine")

# no request for this long: the engine captures a missing decode graph. Long enough that an agent's
# next call after a tool rarely meets a capture (~190 ms on an H200), short next to a training step
IDLE_CAPTURE_AFTER_S = 0.5


class EngineThread(KVAdmission):
    """The engine thread's methods; TorchEngine sets the state below in its ``__init__``."""

    _model: Any
    _tokenizer: Any
    _device: torch.device
    _max_batch: int
    _max_context: int
    _max_prefill_tokens: int
    _kv_budget: int
    _kv_bytes_per_token: int
    _policy: WeightUpdatePolicy
    _cache: SlotKVCache
    _prefix: PrefixCache
    _runner: ModelRunner
    _stall_warning_s: float
    _clock: Callable[[], float]
    _next_watch: float
    _weights_version: int
    _inbox: queue.SimpleQueue[tuple[str, Any]]
    _inflight: dict[str, Request]
    _waiting: collections.deque[Request]
    _running: list[Request]
    _chunking: Request | None
    _updates: list[tuple[dict[str, torch.Tensor], asyncio.Future[int], asyncio.AbstractEventLoop]]
    _stats: collections.Counter[str]
    _timers: dict[str, float]

    def _loop(self) -> None:
        log.info(
            "engine.start", device=str(self._device), max_batch=self._max_batch, max_context=self._max_context
        )
        with torch.inference_mode():
            while True:
                busy = bool(self._running or self._waiting or self._updates or self._chunking)
                cmds: list[tuple[str, Any]] = []
                idle_work = not busy and self._runner.has_idle_work()
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

    def _idle_capture(self) -> None:
        """Capture one decode graph a later burst may need (the inbox is read again after each)."""
        t0 = time.perf_counter()
        try:
            self._runner.capture_missing()
        except Exception:  # the eager warm-up failed (a failed capture is handled in the runner)
            log.exception("engine.idle_capture_failed")
            self._runner.idle_capture = False
        finally:
            self._timers["idle_capture_s"] += time.perf_counter() - t0

    def _watch(self, now: float) -> None:
        """The watchdog: log requests older than ``stall_warning_s`` with their state, and fail any
        the engine no longer holds (neither waiting nor running) so that no caller waits forever."""
        held = {id(r) for r in (*self._waiting, *self._running, *self._held_chunking())}
        for req in list(self._inflight.values()):
            age = now - req.added_at
            if age < self._stall_warning_s or req.future.done() or req.finished:
                continue  # finished: its answer is queued on a busy event loop, not lost
            if id(req) not in held and not self._inbox.qsize():
                log.error("engine.request_lost", request_id=req.request_id, age_s=round(age, 1))
                self._stats["lost"] += 1
                err = EngineError(f"the engine lost track of request {req.request_id} after {age:.0f} s")
                deliver(req.loop, req.future, None, err)
            elif not req.warned:
                req.warned = True
                log.warning(
                    "engine.slow_request", request_id=req.request_id, age_s=round(age, 1),
                    state=_state(req, self._chunking), slot=req.slot, kv_len=req.kv_len, prefilled=req.prefilled,
                    generated=len(req.output_ids), max_tokens=req.sampling.max_tokens,
                    waiting=len(self._waiting), running=len(self._running), updates=len(self._updates),
                )  # fmt: skip

    def _command(self, kind: str, arg: Any) -> None:
        if kind == "add":  # a burst (generate_many) or one request, admitted together
            self._waiting.extend(arg)
            self._stats["requests"] += len(arg)
        elif kind == "update":
            self._updates.append(arg)
            if self._policy == "abort":
                for req in reversed(self._running):  # last slot first: nothing moves
                    self._finish(req, "abort")
        elif kind == "abort":
            for req in [*self._waiting, *self._running, *self._held_chunking()]:
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

    def _schedule(self) -> list[Request]:
        """Admit waiting requests while slots and the KV budget allow (first come, first served);
        prefill them in groups, sample their first tokens."""
        admitted = self._chunk_step()
        while self._waiting and len(self._running) < self._max_batch and self._room_for([self._waiting[0]]):
            head = self._waiting[0]
            long = len(head.prompt_ids) > self._max_prefill_tokens
            if long and len(head.prompt_ids) - self._prefix.match(head.prompt_ids) > self._max_prefill_tokens:
                if self._chunking is not None:
                    break  # one long prompt at a time; the others wait behind it (first come, first served)
                self._start_chunking(self._waiting.popleft())
                continue
            group = [self._waiting.popleft()]
            longest = len(group[0].prompt_ids)
            while self._waiting and len(self._running) + len(group) < self._max_batch:
                longest_next = max(longest, len(self._waiting[0].prompt_ids))
                if longest_next * (len(group) + 1) > self._max_prefill_tokens:
                    break
                if not self._room_for([*group, self._waiting[0]]):
                    break
                group.append(self._waiting.popleft())
                longest = longest_next
            admitted += self._admit(group)
        idle = not (self._running or self._waiting or self._chunking)
        if idle and self._cache.nbytes > self._kv_budget // 4:
            self._cache.reset()  # idle: give back what a long request grew (kept while it is small)
        return admitted

    def _admit(self, group: list[Request]) -> list[Request]:
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

    def _prefill(self, group: list[Request]) -> torch.Tensor:
        """Prefill ``group`` (ordered by :func:`_first_of_each_prompt_first`, in consecutive slots);
        returns each request's next-token logits. Requests repeating an earlier prompt of the group
        (a GRPO group's n samples) are not computed: they get a copy of its KV and its logits row."""
        first_index: dict[tuple[int, ...], int] = {}
        for i, req in enumerate(group):
            first_index.setdefault(tuple(req.prompt_ids), i)
        unique = group[: len(first_index)]
        self._fit_cache()
        cached = []
        for req in unique:
            prompt = req.prompt_ids
            hit = self._prefix.lookup(prompt, self._cache, req.slot, max_len=len(prompt) - 1)
            req.num_cached = hit
            cached.append(hit)
            self._stats["cached_prompt_tokens"] += hit
            self._stats["prefix_cache_hit_tokens"] += hit
            self._stats["prefix_cache_hits"] += int(hit > 0)
        t0 = time.perf_counter()
        logits = self._runner.prefill(
            unique[0].slot, [r.prompt_ids for r in unique], cached, chunk_tokens=self._max_prefill_tokens
        )
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

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> tuple[list[int], list[float]]:
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

    def _execute(self, reqs: list[Request]) -> tuple[list[int], list[float]]:
        """One batched decode step for ``reqs`` (all in slots 0..n-1); returns tokens and logprobs."""
        n = len(reqs)
        reqs.sort(key=lambda r: r.slot)
        assert reqs[0].slot == 0 and reqs[-1].slot == n - 1, "decode rows must be the compact slots 0..n-1"
        self._fit_cache()
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

    def _update(self, reqs: list[Request], tokens: list[int], logprobs: list[float]) -> None:
        """Append each request's sampled token and finish the requests that are done."""
        done: list[tuple[Request, Literal["stop", "length"]]] = []
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

    def _finish_reason(self, req: Request, tok: int) -> Literal["stop", "length"] | None:
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

    def _release(self, req: Request) -> None:
        """Take ``req`` out of the waiting queue or its slot, keeping the slots compact."""
        if req in self._waiting:
            self._waiting.remove(req)
            return
        if req is self._chunking:
            self._chunking, req.own_cache, req.logits = None, None, None
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

    def _finish(self, req: Request, reason: Literal["stop", "length", "abort"], store: bool = True) -> None:
        # keys/values written by older weights (an "inflight" update) never enter the prefix cache
        store = store and req.prefill_version == self._weights_version
        if store and req.slot >= 0 and reason != "abort" and req.kv_len > 0:
            room = (self._kv_budget - self._kv_held()) // self._kv_bytes_per_token
            self._prefix.store((req.prompt_ids + req.output_ids)[: req.kv_len], self._cache, req.slot, room)
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
        deliver(req.loop, req.future, out, None)

    def _fail(self, req: Request, exc: BaseException) -> None:
        self._release(req)
        self._stats["failed"] += 1
        err = EngineError(f"engine step failed for request {req.request_id}: {type(exc).__name__}: {exc}")
        req.finished = True
        deliver(req.loop, req.future, None, err)

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
                if self._chunking is not None:  # not started yet as far as its caller knows: begin again
                    self._chunking.prefilled = self._chunking.num_cached = 0
                    self._chunking.prefill_version = self._weights_version
                log.info("engine.weights_updated", version=self._weights_version, tensors=len(tensors))
                deliver(loop, fut, self._weights_version, None)
            except Exception as exc:
                deliver(loop, fut, None, EngineError(f"weight update failed: {exc}"))
        self._updates.clear()

    def _shutdown(self, cmds: list[tuple[str, Any]]) -> None:
        for kind, arg in cmds:  # taken as usual, then everything is aborted and every update failed
            self._command(kind, arg)
        for req in [*self._waiting, *self._running, *self._held_chunking()]:
            self._finish(req, "abort")
        for _, fut, loop in self._updates:
            deliver(loop, fut, None, EngineError("engine stopped before the weight update"))
        self._updates.clear()
        log.info("engine.stop")


def _first_of_each_prompt_first(group: list[Request]) -> list[Request]:
    """``group`` with the first request of each distinct prompt first (in order), then the requests
    that repeat one of them: the prefill computes only the first part (see ``EngineThread._prefill``)."""
    seen: set[tuple[int, ...]] = set()
    firsts: list[Request] = []
    repeats: list[Request] = []
    for req in group:
        key = tuple(req.prompt_ids)
        (repeats if key in seen else firsts).append(req)
        seen.add(key)
    return firsts + repeats


def deliver(
    loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], value: Any, exc: BaseException | None
) -> None:
    """Hand a result to its caller's event loop. A loop already closed (its program stopped, e.g. a
    SIGTERM while requests were in flight) has nobody left to tell: the answer is dropped, and the engine
    thread goes on serving the others instead of dying of "Event loop is closed"."""
    if not call_soon_from_thread(loop, resolve, fut, value, exc):
        log.debug("engine.caller_loop_closed")


def resolve(fut: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


def _state(req: Request, chunking: Request | None) -> str:
    return "prefilling" if req is chunking else "running" if req.slot >= 0 else "waiting"
