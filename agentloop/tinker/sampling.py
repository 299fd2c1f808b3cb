"""Sampling for the Tinker API on one engine (``TorchEngine``) of the served base model.

A sampling client samples one *snapshot* of weights: the base model, or a training model's
adapters as they were at ``save_weights_for_sampler``. The engine holds one set of weights at a
time; requests of the snapshot it holds run together (the engine batches them), and a request of
another snapshot waits until those finish, then the engine takes that snapshot's merged weights
(``engine.update_weights``: the same path the trainer pushes new weights by). An RL loop samples
the latest snapshot only, so it swaps once per step.

Tinker's ``SamplingParams`` map onto the engine's: ``top_k=-1`` is no top-k; ``stop=None`` stops at
the end-of-sequence token, ``[]`` not even there (``ignore_eos``); ``max_tokens=None`` is the rest
of the context. Sampled logprobs are the engine's, ``log_softmax(logits / temperature)``; prompt
logprobs are computed in one forward of the engine's model at temperature 1 (NaN for the first token).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from agentloop.engine.base import SamplingParams as EngineSampling
from agentloop.tinker._proto import encode_sample_response
from agentloop.tinker.wire import SampleRequest, SamplingParams, WireError

__all__ = ["Sampler", "Snapshot", "engine_sampling"]

BASE = "base"


@dataclass(frozen=True)
class Snapshot:
    """Weights to sample: ``key`` names them; ``materialize`` makes the full state dict (None: base)."""

    key: str
    base_model: str
    materialize: Callable[[], Awaitable[dict[str, torch.Tensor]]] | None = None
    model_path: str | None = None


def engine_sampling(p: SamplingParams, prompt_len: int, max_context: int, seed: int | None) -> EngineSampling:
    """Tinker's sampling parameters as the engine's (module docstring); WireError when they do not fit."""
    room = max_context - prompt_len
    if room < 1:
        raise WireError(f"the prompt has {prompt_len} tokens; this model's context is {max_context}")
    max_tokens = room if p.max_tokens is None else p.max_tokens
    if max_tokens > room:
        raise WireError(
            f"max_tokens={max_tokens} with a {prompt_len}-token prompt exceeds the context of {max_context} tokens"
        )
    stop = [p.stop] if isinstance(p.stop, str) else p.stop
    strings = [s for s in stop or [] if isinstance(s, str)]
    ids = [s for s in stop or [] if isinstance(s, int)]
    return EngineSampling(
        temperature=p.temperature, top_p=p.top_p, top_k=max(p.top_k, 0), max_tokens=max_tokens,
        stop=strings, stop_token_ids=ids, seed=seed, logprobs=True, ignore_eos=stop is not None and not stop,
    )  # fmt: skip


class Sampler:
    """The engine and which snapshot it holds (module docstring)."""

    def __init__(self, engine: Any, max_context: int) -> None:
        self.engine, self.max_context = engine, max_context
        self._current = BASE
        self._active = 0
        self._cond = asyncio.Condition()
        self._base: dict[str, torch.Tensor] | None = None

    @contextlib.asynccontextmanager
    async def _holding(self, snap: Snapshot) -> AsyncIterator[None]:
        async with self._cond:
            while self._current != snap.key:
                if self._active:
                    await self._cond.wait()
                    continue
                if self._base is None:  # the engine starts on the base weights: keep them for later
                    self._base = {k: v.detach().clone() for k, v in self.engine.model.state_dict().items()}
                weights = self._base if snap.materialize is None else await snap.materialize()
                await self.engine.update_weights(weights)
                self._current = snap.key
            self._active += 1
        try:
            yield
        finally:
            async with self._cond:
                self._active -= 1
                self._cond.notify_all()

    async def sample(self, snap: Snapshot, req: SampleRequest) -> tuple[bytes, int]:
        """The ``SampleResponse`` message for ``req`` on ``snap``, and how many sequences it holds."""
        for name, value in (
            ("topk_prompt_logprobs", req.topk_prompt_logprobs),
            ("topk_sample_logprobs", req.topk_sample_logprobs),
            ("prompt_alt_tokens_k", req.prompt_alt_tokens_k),
        ):
            if value:
                raise WireError(f"{name} is not served by agentloop tinker; leave it at 0")
        if req.target_prompt_logprobs is not None:
            raise WireError("target_prompt_logprobs is not served by agentloop tinker")
        prompt = req.prompt.tokens()
        if not prompt:
            raise WireError("the prompt has no tokens")
        vocab = int(self.engine.model.get_input_embeddings().weight.shape[0])
        if max(prompt) >= vocab:
            raise WireError(f"the prompt holds token ids outside [0, {vocab})")
        p = req.sampling_params
        seeds = [None if p.seed is None else p.seed + i for i in range(req.num_samples)]
        params = [engine_sampling(p, len(prompt), self.max_context, s) for s in seeds]
        async with self._holding(snap):
            rid = uuid.uuid4().hex[:12]
            reqs = [(list(prompt), sp, f"tinker-{rid}-{i}") for i, sp in enumerate(params)]
            outs: dict[str, Any] = {}
            async with contextlib.aclosing(self.engine.generate_many(reqs)) as answers:
                async for request_id, out in answers:
                    if isinstance(out, BaseException):
                        raise WireError(f"the engine refused the request: {out}")
                    outs[request_id] = out
            prompt_lps = (
                await self._prompt_logprobs(prompt, req.prompt_logprobs_last_n)
                if req.prompt_logprobs
                else None
            )
        sequences = []
        for _, _, request_id in reqs:
            out = outs[request_id]
            stop = "length" if out.finish_reason == "length" else "stop"
            sequences.append(
                (stop, list(out.token_ids), list(out.logprobs) if out.logprobs is not None else None)
            )
        return encode_sample_response(sequences, prompt_lps), len(sequences)

    async def _prompt_logprobs(self, prompt: list[int], last_n: int | None) -> list[float]:
        model = self.engine.model

        def run() -> list[float]:
            with torch.no_grad():
                device = next(model.parameters()).device
                ids = torch.tensor([prompt], device=device)
                logits = model(input_ids=ids).logits[0, :-1].float()  # (T-1, V)
                lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
            out = [math.nan, *lp.cpu().tolist()]
            if last_n is not None:
                if not 1 <= last_n <= len(prompt) - 1:
                    raise WireError(f"prompt_logprobs_last_n must be in [1, {len(prompt) - 1}], got {last_n}")
                out[: len(prompt) - last_n] = [math.nan] * (len(prompt) - last_n)
            return out

        return await anyio.to_thread.run_sync(run)
