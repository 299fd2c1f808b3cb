"""EchoEngine: a small deterministic InferenceEngine for proxy tests (real tokenizer, no model).

It answers with scripted text (or seeded words), encoded by the real tokenizer and closed with the
end-of-turn id, like a chat model that stops on ``<|im_end|>``. It records every call so tests can
check the exact prompt ids the proxy built. It is a real engine for the proxy's purposes: the
proxy under test talks to it through the InferenceEngine contract only.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import torch

from agentloop.engine.base import SamplingParams, TokenOutput
from agentloop.errors import ContextLengthExceededError, EngineError

WORDS = ["alpha", "beta", "gamma", "delta", "été", "naïve", "日本", "🙂", "x", "42"]


@dataclass
class EngineCall:
    prompt_ids: list[int]
    sampling: SamplingParams
    output: TokenOutput | None = None


class EchoEngine:
    """Deterministic engine: ``reply(prompt_ids, sampling) -> str``, or seeded words by default."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        reply: Callable[[list[int], SamplingParams], str] | None = None,
        max_context: int = 2048,
        delay_s: float = 0.0,
        fail_with: BaseException | None = None,
        eos: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._reply = reply
        self._max_context = max_context
        self.delay_s = delay_s
        self.fail_with = fail_with
        self.eos = eos
        self.calls: list[EngineCall] = []
        self.aborted: list[str] = []
        self._eos_id = int(tokenizer.eos_token_id)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def weights_version(self) -> int:
        return 3

    def text_for(self, prompt_ids: list[int], sampling: SamplingParams) -> str:
        if self._reply is not None:
            return self._reply(prompt_ids, sampling)
        rng = random.Random(sampling.seed if sampling.seed is not None else random.random())
        return " ".join(rng.choice(WORDS) for _ in range(6))

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> TokenOutput:
        call = EngineCall(list(prompt_ids), sampling)
        self.calls.append(call)
        if self.delay_s:
            await anyio.sleep(self.delay_s)
        if self.fail_with is not None:
            raise self.fail_with
        if len(prompt_ids) >= self._max_context:
            raise ContextLengthExceededError(
                f"prompt of {len(prompt_ids)} tokens, context {self._max_context}"
            )
        ids = list(self._tokenizer.encode(self.text_for(prompt_ids, sampling), add_special_tokens=False))
        if self.eos:
            ids.append(self._eos_id)
        finish: Literal["stop", "length"] = "stop" if self.eos else "length"
        if len(ids) > sampling.max_tokens:
            ids, finish = ids[: sampling.max_tokens], "length"
        logprobs = [-0.25 * (1 + (t % 5)) for t in ids]
        call.output = TokenOutput(token_ids=ids, logprobs=logprobs, finish_reason=finish, weights_version=3)
        return call.output

    async def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> int:
        raise EngineError("EchoEngine has no weights")

    async def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True

    def stats(self) -> dict[str, Any]:
        return {"requests": len(self.calls)}

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
